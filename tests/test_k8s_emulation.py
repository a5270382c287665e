"""Container tier: the CPU PyTorchJob's pods run the way the training operator runs them.

No Kubernetes API server can run here, so this EMULATES the operator (kubeflow/trainer
release-1.9) with the real images on a Docker network: the MLflow Deployment's container with
the Service's names as aliases, then one container per replica of k8s/30-pytorchjob-cpu.yaml,
named and resolvable as `<job>-master-0` / `<job>-worker-0`, with the env the operator injects
(MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE,
PET_MASTER_ADDR, PET_MASTER_PORT), the ConfigMap mounted as files, the emptyDirs, the
securityContext's user and read-only root, and the container's image and args exactly as
written in the manifest. The job must end as one FINISHED run of the right world size.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.container
K8S = REPO / "k8s"


def sh(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def docker_flags(pod: dict, container: dict, configmaps: dict[str, dict], tmp: Path) -> list[str]:
    """What the kubelet would give the container, in docker run flags."""
    flags: list[str] = []
    sc = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    if "runAsUser" in sc:
        flags += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', 0)}"]
    if sc.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    if sc.get("capabilities", {}).get("drop") == ["ALL"]:
        flags += ["--cap-drop", "ALL"]
    if sc.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "configMap" in v:
            d = tmp / f"cm-{v['configMap']['name']}"
            d.mkdir(exist_ok=True)
            for key, text in configmaps[v["configMap"]["name"]]["data"].items():
                (d / key).write_text(text)
            flags += ["-v", f"{d}:{m['mountPath']}:ro"]
        elif v.get("emptyDir", {}).get("medium") == "Memory" and m["mountPath"] == "/dev/shm":
            flags += ["--shm-size", v["emptyDir"].get("sizeLimit", "64Mi").replace("Gi", "g")]
        elif "emptyDir" in v:
            # uid 10001 with group 0 owns the kubelet's emptyDirs (fsGroup 0): a writable tmpfs.
            flags += ["--tmpfs", f"{m['mountPath']}:rw,mode=1777"]
        else:
            raise AssertionError(f"emulation does not know volume {v}")
    return flags


def operator_env(job: dict, role: str, index: int, port: int) -> dict[str, str]:
    """The training operator v1.9's env for a replica (reference.md, 'Kubeflow PyTorchJob')."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    name, nproc = job["metadata"]["name"], job["spec"]["nprocPerNode"]
    nnodes = sum(s["replicas"] for s in specs.values())
    rank = index if role == "master" else index + 1
    master = f"{name}-master-0"
    return {"MASTER_ADDR": master, "MASTER_PORT": str(port), "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(nnodes * int(nproc)),
            "RANK": str(rank), "PET_NNODES": str(nnodes), "PET_NODE_RANK": str(rank),
            "PET_NPROC_PER_NODE": nproc, "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def cluster(tmp_path):
    net = f"ddplab-emu-{uuid.uuid4().hex[:6]}"
    assert sh(["docker", "network", "create", net]).returncode == 0
    started: list[str] = []
    yield net, started
    for c in started:
        sh(["docker", "rm", "-f", c])
    sh(["docker", "network", "rm", net])


def running(container: str) -> bool:
    return json.loads(sh(["docker", "inspect", container]).stdout)[0]["State"]["Running"]


def run(net: str, started: list[str], name: str, aliases: list[str], flags: list[str],
        image: str, args: list[str], env: dict[str, str]) -> None:
    cmd = ["docker", "run", "-d", "--name", name, "--hostname", name, "--network", net]
    for a in aliases:
        cmd += ["--network-alias", a]
    for k, v in env.items():
        cmd += ["-e", f"{k}={v}"]
    out = sh([*cmd, *flags, image, *args])
    assert out.returncode == 0, out.stderr
    started.append(name)


def test_cpu_pytorchjob_pods_run_as_the_operator_runs_them(cluster, tmp_path):
    net, started = cluster
    configmaps = {d["metadata"]["name"]: d for d in load("20-experiment.yaml")}
    dep = next(d for d in load("10-mlflow.yaml") if d["kind"] == "Deployment")
    mlflow_pod = dep["spec"]["template"]["spec"]
    mc = mlflow_pod["containers"][0]
    # The Service's DNS names point at the Deployment's pod.
    run(net, started, f"{net}-mlflow", ["mlflow", "mlflow.ddplab", "mlflow.ddplab.svc"],
        [*docker_flags({**mlflow_pod, "volumes": []}, {**mc, "volumeMounts": []}, {}, tmp_path),
         "--tmpfs", "/mlflow:rw,mode=1777", "--tmpfs", "/tmp:rw,mode=1777",
         "--tmpfs", "/home/mlflow:rw,mode=1777", "-p", "127.0.0.1::5000"],
        mc["image"], [], env_of(mc))
    port = sh(["docker", "port", f"{net}-mlflow", "5000"]).stdout.split(":")[-1].strip()
    base = f"http://127.0.0.1:{port}"

    (job,) = load("30-pytorchjob-cpu.yaml")
    name = job["metadata"]["name"]
    for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
        pod = spec["template"]["spec"]
        (c,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
        job_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "pytorchjob-port")
        for i in range(spec["replicas"]):
            pod_name = f"{name}-{role.lower()}-{i}"
            env = {**env_of(c), **operator_env(job, role.lower(), i, job_port)}
            run(net, started, pod_name, [pod_name], docker_flags(pod, c, configmaps, tmp_path),
                c["image"], c["args"], env)

    deadline, found = time.monotonic() + 600, None
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(f"{base}/api/2.0/mlflow/runs/search",
                                         data=json.dumps({"experiment_ids": ["1"]}).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "Host": "mlflow.ddplab.svc:5000"})
            with urllib.request.urlopen(req, timeout=10) as r:
                found = json.loads(r.read()).get("runs", [])
        except OSError:
            found = None
        if found and found[0]["info"]["status"] != "RUNNING":
            break
        if not any(running(c) for c in started[1:]):
            break  # every pod ended: no point waiting for the run
        time.sleep(3)
    logs = "\n".join(line for c in started[1:] for line in sh(["docker", "logs", c]).stderr.splitlines()
                     if "ddplab" in line or "Error" in line)
    assert found and len(found) == 1, logs[-4000:]
    run_ = found[0]
    tags = {t["key"]: t["value"] for t in run_["data"]["tags"]}
    assert run_["info"]["status"] == "FINISHED", logs[-4000:]
    nnodes = sum(s["replicas"] for s in job["spec"]["pytorchReplicaSpecs"].values())
    assert tags["ddplab.world_size"] == str(nnodes * int(job["spec"]["nprocPerNode"]))
    assert (tags["ddplab.launcher"], tags["ddplab.nnodes"]) == ("torchrun", str(nnodes))
    assert sorted(tags["ddplab.hosts"].split(",")) == sorted(
        f"{name}-{r.lower()}-0" for r in job["spec"]["pytorchReplicaSpecs"])
    exits = [json.loads(sh(["docker", "inspect", c]).stdout)[0]["State"] for c in started[1:]]
    deadline = time.monotonic() + 120
    while any(s["Running"] for s in exits) and time.monotonic() < deadline:
        time.sleep(2)
        exits = [json.loads(sh(["docker", "inspect", c]).stdout)[0]["State"] for c in started[1:]]
    assert [s["ExitCode"] for s in exits] == [0] * len(exits)
