#!/usr/bin/env bash
# `make k8s-apply`: apply the manifests for the training operator this cluster runs.
#   Kubeflow Trainer v2 (CRD trainjobs.trainer.kubeflow.org): the shared namespace, MLflow and
#     experiment (k8s/00-20), then k8s/trainer-v2/ (runtimes, then TrainJobs).
#   the v1 training operator (CRD pytorchjobs.kubeflow.org): k8s/ (what `kubectl apply -f k8s/`
#     applies).
# Both installed: Trainer v2 (v1 is in maintenance). Neither: one line saying what to install.
# The manifests: k8s/, or the copy `make k8s-render` wrote (K8S_DIR=build/k8s).
set -euo pipefail
cd "$(dirname "$0")/.."
d=${K8S_DIR:-k8s}
[ -f "$d/00-namespace.yaml" ] || { echo "k8s-apply: error: K8S_DIR=$d has no 00-namespace.yaml: k8s, or build/k8s after make k8s-render" >&2; exit 2; }
has() { kubectl get crd "$1" >/dev/null 2>&1; }
if has trainjobs.trainer.kubeflow.org; then
  why="CRD trainjobs.trainer.kubeflow.org found"
  has pytorchjobs.kubeflow.org && why="$why (pytorchjobs.kubeflow.org too: v1 is in maintenance; \`kubectl apply -f $d/\` applies it)"
  echo "k8s-apply: Kubeflow Trainer v2: $why: applying $d/00-20 and $d/trainer-v2/"
  kubectl apply -f "$d/00-namespace.yaml" -f "$d/10-mlflow.yaml" -f "$d/20-experiment.yaml"
  # Trainer v2's pods meet the restricted profile (the namespace enforces baseline for the v1
  # operator's init container): enforced here.
  kubectl label namespace ddplab pod-security.kubernetes.io/enforce=restricted --overwrite
  kubectl apply -f "$d/trainer-v2/"
elif has pytorchjobs.kubeflow.org; then
  echo "k8s-apply: the v1 training operator: CRD pytorchjobs.kubeflow.org found, trainjobs.trainer.kubeflow.org not: applying $d/"
  kubectl apply -f "$d/"
else
  echo "k8s-apply: error: this cluster has neither Kubeflow Trainer v2 (CRD trainjobs.trainer.kubeflow.org) nor the v1 training operator (pytorchjobs.kubeflow.org): install Kubeflow Trainer v2.3.0 with JobSet (docs/kubernetes.md, \"Which operator\")" >&2
  exit 1
fi
