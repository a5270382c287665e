"""Unit: the Kubernetes manifests, without a cluster.

PyTorchJob and MPIJob objects validate against the real CRDs in tests/data/crds (made
strict: an unknown field is an error, where the API server would silently prune it); pod
templates and plain objects against Kubernetes' own schema (kubernetes-validate); then the
operators' own rules.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.conftest import REPO

# Unchanged upstream copies; their sources, versions and license: tests/data/crds/README.md.
SCHEMAS = REPO / "tests" / "data" / "crds"
K8S_VERSION = "1.30"
MANIFESTS = sorted(p for p in (REPO / "k8s").rglob("*.yaml") if p.name != "kustomization.yaml")


def objects() -> list[tuple[Path, dict]]:
    return [(p, d) for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def crd_validate(obj: dict, name: str, version: str) -> None:
    """jsonschema.validate against the CRD's schema made strict: the most relevant error
    (``best_match``), as jsonschema.validate raises it."""
    error = jsonschema.exceptions.best_match(_crd_validator(name, version).iter_errors(obj))
    if error is not None:
        raise error


@functools.cache
def _crd_validator(name: str, version: str) -> jsonschema.protocols.Validator:
    """Each CRD read and its schema checked once per worker (libyaml where PyYAML has it): the
    files are up to 1 MB, and reading and checking one took 2 to 5 s of make test each time."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((SCHEMAS / name).read_text(), Loader=loader)
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = strict(v["schema"]["openAPIV3Schema"])
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def strict(node: object) -> object:
    """additionalProperties: false wherever the schema lists properties and does not say to
    keep unknown fields, so a misspelt key fails here instead of vanishing in the cluster."""
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node and not node.get(
                "x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for value in node.values():
            strict(value)
    elif isinstance(node, list):
        for value in node:
            strict(value)
    return node


CRDS = {
    ("kubeflow.org/v1", "PyTorchJob"): ("kubeflow.org_pytorchjobs.yaml", "v1", "pytorchReplicaSpecs"),
    ("kubeflow.org/v2beta1", "MPIJob"): ("kubeflow.org_mpijobs.yaml", "v2beta1", "mpiReplicaSpecs"),
    # Kubeflow Trainer v2: a TrainJob names a runtime; the runtime holds the pods (a JobSet).
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): ("trainer.kubeflow.org_trainjobs.yaml", "v1alpha1", ""),
    ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"): (
        "trainer.kubeflow.org_trainingruntimes.yaml", "v1alpha1", "template"),
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): (
        "trainer.kubeflow.org_clustertrainingruntimes.yaml", "v1alpha1", "template"),
}


def pod_specs(obj: dict) -> list[dict]:
    """The pod specs a custom resource holds (a TrainJob: none, its runtime has them)."""
    where = CRDS[(obj["apiVersion"], obj["kind"])][2]
    if not where:
        return []
    if where == "template":  # a runtime: JobSet replicatedJobs -> Job -> pod
        return [rj["template"]["spec"]["template"]["spec"]
                for rj in obj["spec"]["template"]["spec"]["replicatedJobs"]]
    return [spec["template"]["spec"] for spec in obj["spec"][where].values()]


def test_there_are_manifests_and_each_parses():
    assert MANIFESTS and all(d.get("apiVersion") and d.get("kind") for _, d in objects())


def test_top_level_applies_in_order_namespace_first():
    top = sorted((REPO / "k8s").glob("*.yaml"))
    first = yaml.safe_load(top[0].read_text())
    assert first["kind"] == "Namespace"
    assert all(d["metadata"].get("namespace", "ddplab") == "ddplab" for _, d in objects())


@pytest.mark.parametrize("path, obj", [(p, d) for p, d in objects()
                                       if (d["apiVersion"], d["kind"]) in CRDS],
                         ids=lambda x: x.name if isinstance(x, Path) else x["kind"])
def test_custom_resources_validate_against_the_real_crds(path, obj):
    file, version, _ = CRDS[(obj["apiVersion"], obj["kind"])]
    crd_validate(obj, file, version)


@pytest.mark.parametrize("path, obj", [(p, d) for p, d in objects()],
                         ids=lambda x: x.name if isinstance(x, Path) else x["kind"])
def test_pods_and_plain_objects_validate_against_kubernetes(path, obj):
    key = (obj["apiVersion"], obj["kind"])
    if key not in CRDS:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        return
    for spec in pod_specs(obj):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": spec}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_the_typo_check_has_teeth():
    (obj,) = [d for _, d in objects() if d["kind"] == "PyTorchJob"][:1]
    bad = copy.deepcopy(obj)
    bad["spec"]["nprocPerNod"] = "2"
    with pytest.raises(jsonschema.ValidationError, match="nprocPerNod"):
        crd_validate(bad, "kubeflow.org_pytorchjobs.yaml", "v1")


def pytorchjobs() -> list[dict]:
    return [d for _, d in objects() if d["kind"] == "PyTorchJob"]


@pytest.mark.parametrize("job", pytorchjobs(), ids=lambda j: j["metadata"]["name"])
def test_pytorchjob_operator_rules(job):
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) <= {"Master", "Worker"} and "Worker" in specs
    if "Master" in specs:
        assert specs["Master"]["replicas"] == 1
    assert isinstance(job["spec"].get("nprocPerNode", "auto"), str)
    for spec in specs.values():
        pod = spec["template"]["spec"]
        (main,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
        assert "command" not in main, "keep the image's entrypoint (it loads oneCCL's environment)"
        assert main["args"][:2] == ["torchrun", "-m"] or main["args"][0] == "torchrun"
        mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
        shm = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
        assert shm["emptyDir"]["medium"] == "Memory"
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert main["securityContext"]["allowPrivilegeEscalation"] is False
        assert main["resources"]["limits"] and main["resources"]["requests"]
        env = {e["name"]: e.get("value") for e in main["env"]}
        assert env["MLFLOW_TRACKING_URI"].startswith("http://mlflow.ddplab.svc:5000")


def mpijobs() -> list[dict]:
    return [d for _, d in objects() if d["kind"] == "MPIJob"]


@pytest.mark.parametrize("job", mpijobs(), ids=lambda j: j["metadata"]["name"])
def test_mpijob_operator_rules(job):
    """mpi-operator v0.8: exactly one Launcher and the Workers; it adds its ssh Secret, hostfile
    and env to each pod's FIRST container; ddplab (DDPLAB_SSH_AUTH) must look for the key where
    it is mounted."""
    spec = job["spec"]
    specs = spec["mpiReplicaSpecs"]
    assert set(specs) == {"Launcher", "Worker"} and specs["Launcher"]["replicas"] == 1
    assert spec.get("mpiImplementation", "OpenMPI") == "OpenMPI"
    auth = spec.get("sshAuthMountPath", "/root/.ssh")
    for role, rs in specs.items():
        pod = rs["template"]["spec"]
        main = pod["containers"][0]
        assert main["image"].startswith("ddplab/openmpi:") and "command" not in main
        args = main["args"]
        assert args[:3] == ["ddplab", "mpi", "launch" if role == "Launcher" else "worker"]
        env = {e["name"]: e.get("value") for e in main.get("env", [])}
        assert env.get("DDPLAB_SSH_AUTH") == auth, "not where the operator mounts the key"
        mounts = [m["mountPath"] for m in main.get("volumeMounts", [])]
        assert not {auth, "/etc/mpi"} & set(mounts), "the operator mounts these paths itself"
        assert pod["securityContext"]["runAsNonRoot"] is True and auth != "/root/.ssh"
        assert main["securityContext"]["allowPrivilegeEscalation"] is False
        assert main["resources"]["limits"] and main["resources"]["requests"]
    worker = specs["Worker"]["template"]["spec"]
    (port,) = worker["containers"][0]["ports"]
    assert port["containerPort"] == 2222  # ddplab mpi's --ssh-port default
    assert worker["containers"][0]["readinessProbe"]["tcpSocket"]["port"] in (2222, port["name"])
    mounts = {m["mountPath"]: m["name"] for m in worker["containers"][0]["volumeMounts"]}
    shm = next(v for v in worker["volumes"] if v["name"] == mounts["/dev/shm"])
    assert shm["emptyDir"]["medium"] == "Memory"


def tracked_containers() -> list[dict]:
    """The containers that run ranks or launch them: they need MLFLOW_TRACKING_URI."""
    keys = {"PyTorchJob": "pytorchReplicaSpecs", "MPIJob": "mpiReplicaSpecs"}
    return [spec["template"]["spec"]["containers"][0] for job in pytorchjobs() + mpijobs()
            for role, spec in job["spec"][keys[job["kind"]]].items() if role != "Worker"
            or job["kind"] == "PyTorchJob"]


def test_mlflow_allows_the_host_header_jobs_send():
    (dep,) = [d for _, d in objects() if d["kind"] == "Deployment" and d["metadata"]["name"] == "mlflow"]
    env = {e["name"]: e["value"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    allowed = env["MLFLOW_ALLOWED_HOSTS"].split(",")
    assert len(tracked_containers()) >= len(pytorchjobs()) + len(mpijobs())
    for c in tracked_containers():
        uri = {e["name"]: e.get("value") for e in c["env"]}["MLFLOW_TRACKING_URI"]
        assert uri.split("//", 1)[1].rstrip("/") in allowed
    assert env["MLFLOW_HEALTH_HOST"] in allowed


def test_experiment_configmap_is_the_quickstart_verbatim():
    (cm,) = [d for _, d in objects() if d["kind"] == "ConfigMap"
             and d["metadata"]["name"] == "ddplab-experiment"]
    assert cm["data"]["experiment.yaml"] == (REPO / "experiments" / "quickstart.yaml").read_text()


def test_the_generated_secrets_validate_against_kubernetes():
    """`make k8s-secrets` pipes these into `kubectl create -f -`."""
    sys.path.insert(0, str(REPO / "docker" / "mlflow"))
    from make_secrets import k8s_manifests

    for secret in json.loads(k8s_manifests("ddplab"))["items"]:
        kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
        assert secret["metadata"]["namespace"] == "ddplab"


def test_make_k8s_secrets_twice_with_a_fake_kubectl_creates_once_then_keeps(tmp_path):
    """No Kubernetes API server runs here, so a fake `kubectl` (a script on PATH keeping the
    Secrets it was given in a folder) stands in for one: the README's `make k8s-secrets &&
    kubectl apply -f k8s/` must work on a fresh cluster and again on the same one."""
    fake = tmp_path / "bin" / "kubectl"
    fake.parent.mkdir()
    fake.write_text(f"""#!/bin/sh
echo "$*" >> {tmp_path}/calls
case "$*" in
  *"get secret mlflow-server"*) test -f {tmp_path}/created ;;
  "create -f -") cat > {tmp_path}/created ;;
  "apply -f k8s/00-namespace.yaml") exit 0 ;;
  *) exit 9 ;;
esac
""")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    for _ in range(2):
        out = subprocess.run(["make", "-s", "k8s-secrets"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
    assert "mlflow-server exists in namespace ddplab: kept" in out.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls.count("create -f -") == 1 and calls[0] == "apply -f k8s/00-namespace.yaml"
    made = yaml.safe_load((tmp_path / "created").read_text())
    assert {i["metadata"]["name"] for i in made["items"]} == {"mlflow-server", "mlflow-credentials"}


# ---- Kubeflow Trainer v2 (k8s/trainer-v2/) ----

V2 = REPO / "k8s" / "trainer-v2"


def v2_objects(kind: str) -> list[dict]:
    return [d for p, d in objects() if V2 in p.parents and d["kind"] == kind]


def test_the_v2_typo_check_has_teeth():
    """A misspelt TrainJob field fails the strict v2.3.0 schema (the API server would drop it)."""
    job = copy.deepcopy(v2_objects("TrainJob")[0])
    job["spec"]["trainer"]["numProcsPerNode"] = 2
    with pytest.raises(jsonschema.ValidationError, match="numProcsPerNode"):
        crd_validate(job, "trainer.kubeflow.org_trainjobs.yaml", "v1alpha1")


def test_every_trainjob_names_a_runtime_shipped_beside_it_with_its_layout():
    runtimes = {r["metadata"]["name"]: r for r in v2_objects("TrainingRuntime")}
    jobs = v2_objects("TrainJob")
    assert {j["metadata"]["name"] for j in jobs} >= {"ddplab-cpu", "ddplab-script", "ddplab-gpu",
                                                    "ddplab-mpi"}
    for job in jobs:
        ref = job["spec"]["runtimeRef"]
        assert ref["kind"] == "TrainingRuntime" and ref["name"] in runtimes
        policy = runtimes[ref["name"]]["spec"]["mlPolicy"]
        assert ("torch" in policy) != ("mpi" in policy)
        assert job["spec"]["trainer"]["numNodes"] >= 1 and job["metadata"]["namespace"] == "ddplab"


@pytest.mark.parametrize("runtime", v2_objects("TrainingRuntime"), ids=lambda r: r["metadata"]["name"])
def test_trainer_v2_runtime_rules(runtime):
    """What Trainer's controller expects (the torch plugin injects PET_* into the container named
    "node" of the replicated job "node"; the MPI plugin wants a launcher job), and the v1 jobs'
    security posture and tracking wiring."""
    policy = runtime["spec"]["mlPolicy"]
    jobs = {rj["name"]: rj for rj in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    assert "node" in jobs and ("launcher" in jobs) == ("mpi" in policy)
    assert "numProcPerNode" not in policy.get("torch", {}), "removed from the torch policy in v2.2"
    for name, rj in jobs.items():
        pod = rj["template"]["spec"]["template"]["spec"]
        (main,) = [c for c in pod["containers"] if c["name"] == "node"]
        assert "command" not in main, "keep the image's entrypoint (it loads oneCCL's environment)"
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert main["securityContext"]["allowPrivilegeEscalation"] is False
        assert main["resources"]["limits"] and main["resources"]["requests"]
        env = {e["name"]: e.get("value") for e in main.get("env", [])}
        runs_ranks = "torch" in policy or name == "launcher"
        if runs_ranks:
            assert env["MLFLOW_TRACKING_URI"] == "http://mlflow.ddplab.svc:5000"
            assert {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"} <= set(env)
        if "mpi" in policy:
            assert env["DDPLAB_SSH_AUTH"] == policy["mpi"]["sshAuthMountPath"]
            assert main["args"][:3] == ["ddplab", "mpi", "launch" if name == "launcher" else "worker"]
        else:
            assert main["args"][:4] == ["torchrun", "-m", "ddplab", "train"]


@pytest.mark.parametrize("crds, applies, says", [
    (["trainjobs.trainer.kubeflow.org"], ["k8s/00-namespace.yaml", "k8s/trainer-v2/"], "Trainer v2"),
    (["pytorchjobs.kubeflow.org"], ["k8s/"], "the v1 training operator"),
    (["trainjobs.trainer.kubeflow.org", "pytorchjobs.kubeflow.org"],
     ["k8s/00-namespace.yaml", "k8s/trainer-v2/"], "v1 is in maintenance"),
    ([], [], "install Kubeflow Trainer v2.3.0 with JobSet"),
], ids=["v2 only", "v1 only", "both", "neither"])
def test_make_k8s_apply_picks_the_operator_the_cluster_runs_with_a_stand_in_kubectl(
        tmp_path, crds, applies, says):
    """No API server runs here: a stand-in `kubectl` (a script on PATH) answers `get crd` for
    the CRDs this case's cluster has and records what it is asked to apply."""
    fake = tmp_path / "bin" / "kubectl"
    fake.parent.mkdir()
    have = " ".join(crds)
    fake.write_text(f"""#!/bin/sh
echo "$*" >> {tmp_path}/calls
case "$*" in
  "get crd "*) for c in {have}; do [ "$3" = "$c" ] && exit 0; done; exit 1 ;;
  "apply -f "*) exit 0 ;;
  "label namespace ddplab pod-security.kubernetes.io/enforce=restricted --overwrite") exit 0 ;;
  *) exit 9 ;;
esac
""")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    out = subprocess.run(["make", "-s", "k8s-apply"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines()
    applied = [a for c in calls if c.startswith("apply") for a in c.split()[1:] if a != "-f"]
    assert says in out.stdout + out.stderr
    if not applies:
        said = [line for line in out.stderr.splitlines() if line.startswith("k8s-apply")]
        assert out.returncode != 0 and applied == [] and len(said) == 1
        return
    assert out.returncode == 0, out.stderr
    assert [a for a in applied if a in applies] == applies and applied[-1] == applies[-1]
    # Trainer v2's pods meet the restricted profile: enforced on its namespace (baseline stays
    # for the v1 operator, whose init container does not meet it).
    assert any(c.startswith("label namespace ddplab") for c in calls) == ("Trainer v2" in says
                                                                          or "v1 is" in says)


def test_make_k8s_apply_applies_a_rendered_copy_with_a_stand_in_kubectl(tmp_path):
    """`make k8s-render`'s copy (images from your registry) applied as `make k8s-apply` applies
    k8s/: its v2 part too (`kubectl apply -f build/k8s/`, which it once said, applies only
    the v1 set; a v2-only cluster refuses its PyTorchJob). A stand-in kubectl, as above."""
    rendered = tmp_path / "rendered"
    shutil.copytree(REPO / "k8s", rendered)
    fake = tmp_path / "bin" / "kubectl"
    fake.parent.mkdir()
    fake.write_text(f"""#!/bin/sh
echo "$*" >> {tmp_path}/calls
case "$*" in
  "get crd trainjobs.trainer.kubeflow.org") exit 0 ;;
  "get crd "*) exit 1 ;;
  "apply -f "*) exit 0 ;;
  "label "*) exit 0 ;;
  *) exit 9 ;;
esac
""")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    out = subprocess.run(["make", "-s", "k8s-apply", f"K8S_DIR={rendered}"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    applied = [a for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("apply")
               for a in c.split()[1:] if a != "-f"]
    assert applied == [f"{rendered}/{f}" for f in ("00-namespace.yaml", "10-mlflow.yaml",
                                                  "20-experiment.yaml", "trainer-v2/")], applied
    missing = subprocess.run(["make", "-s", "k8s-apply", f"K8S_DIR={tmp_path / 'none'}"], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "has no 00-namespace.yaml" in missing.stderr
