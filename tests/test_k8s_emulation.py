"""Container tier: the jobs in k8s/ run their pods the way the operators run them.

No Kubernetes API server can run here, so these tests EMULATE the operators with the real images
on a Docker network: the MLflow Deployment's container with the Service's names as aliases, then
one container per replica, named and resolvable as the operator names the pods, with the env,
Secrets and ConfigMaps the operator injects, the manifest's ConfigMap mounted as files, its
emptyDirs, its securityContext's user, read-only root and dropped capabilities, and each
container's image and args exactly as written in the manifest.

- PyTorchJob (kubeflow/trainer release-1.9): `<job>-master-0` / `<job>-worker-<i>` with
  MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE,
  PET_MASTER_ADDR, PET_MASTER_PORT. The job must end as one FINISHED run of the right size.
- Elastic PyTorchJob: no Master, so only PYTHONUNBUFFERED and the elastic env
  (PET_RDZV_ENDPOINT=`<job>-worker-0:<port>`, PET_RDZV_BACKEND, PET_NNODES=`min:max`,
  PET_MAX_RESTARTS); the PVC is a directory shared by the pods. A worker is killed mid-run and
  restarted as restartPolicy OnFailure restarts it (same pod name and address).
- TrainJob (Kubeflow Trainer v2.3.0, pkg/runtime/framework/plugins/{torch,mpi}, run as a
  JobSet): the TrainJob's trainer (numNodes, numProcPerNode, image, command, args, env) laid
  over the runtime's trainer job; pods `<job>-<replicatedJob>-0-<i>` resolvable as
  `<pod>.<job>` (JobSet's subdomain). Torch: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the
  Job's completion index), PET_MASTER_ADDR `<job>-node-0-0.<job>`, PET_MASTER_PORT 29400. MPI:
  the Secret `<job>-mpi-ssh-auth` (a P-521 key) at sshAuthMountPath in every pod, the hostfile
  ConfigMap `<job>-mpi-hostfile` (`<job>-node-0-<i>.<job> slots=N`) at /etc/mpi and the
  OMPI_MCA_* env in the launcher, started after the nodes (dependsOn Ready).
- MPIJob (kubeflow/mpi-operator v0.8, pkg/controller/mpi_job_controller.go): the job's ssh
  Secret (a P-521 key made here as the operator makes it) at sshAuthMountPath with the files
  id_rsa, id_rsa.pub and authorized_keys; the hostfile ConfigMap at /etc/mpi; the launcher's
  OMPI_MCA_* env; workers resolvable as `<job>-worker-<i>.<job>-worker.<ns>.svc`; running
  workers deleted when the launcher ends (cleanPodPolicy Running); and a worker with a host key
  that is not the job's must be refused.
"""

from __future__ import annotations

import base64
import copy
import json
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.helpers.containers import remove, sh

# One worker runs this whole module under CI's `-n 2 --dist loadgroup`: its module-scoped
# fixture (a cluster's stack, the images) is started once, not once per worker.
pytestmark = [pytest.mark.container, pytest.mark.xdist_group("k8s")]
K8S = REPO / "k8s"
sys.path.insert(0, str(REPO / "docker" / "mlflow"))
from make_secrets import k8s_manifests  # noqa: E402 - what `make k8s-secrets` creates


def generated_secrets() -> dict[str, dict[str, str]]:
    """`make k8s-secrets`'s Secrets, decoded as the kubelet hands them to pods."""
    return {s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in s["data"].items()}
            for s in json.loads(k8s_manifests("ddplab"))["items"]}


SECRETS = generated_secrets()
LOGIN = f"{SECRETS['mlflow-credentials']['username']}:{SECRETS['mlflow-credentials']['password']}"


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def env_of(container: dict) -> dict[str, str]:
    """The container's env as the kubelet sets it: values, and secretKeyRefs from SECRETS (an
    optional one that is missing is left out; a required one would keep the pod from starting)."""
    env = {}
    for e in container.get("env", []):
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref is None:
            env[e["name"]] = e.get("value", "")
        elif ref["key"] in SECRETS.get(ref["name"], {}):
            env[e["name"]] = SECRETS[ref["name"]][ref["key"]]
        else:
            assert ref.get("optional"), f"{e['name']}: Secret {ref} is not made by make k8s-secrets"
    return env


def write_volume(v: dict, sources: dict[str, dict[str, str]], d: Path) -> None:
    """A ConfigMap or Secret volume as the kubelet writes it: the listed items (or every key),
    each with its item mode, else the volume's defaultMode, else 0644."""
    src = v.get("configMap") or v["secret"]
    data = sources[src.get("name") or src["secretName"]]
    d.mkdir(exist_ok=True)
    for item in src.get("items") or [{"key": k, "path": k} for k in data]:
        f = d / item["path"]
        f.write_text(data[item["key"]])
        f.chmod(item.get("mode", src.get("defaultMode", 0o644)))


def docker_flags(pod: dict, container: dict, sources: dict[str, dict[str, str]],
                 tmp: Path) -> list[str]:
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
    cpu = str(container.get("resources", {}).get("limits", {}).get("cpu", ""))
    if cpu:  # the kubelet's limit is a CFS quota, as --cpus makes it (ddplab reads it)
        flags += ["--cpus", str(int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu))]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "configMap" in v or "secret" in v:
            d = tmp / f"{container['name']}-{m['name']}-{uuid.uuid4().hex[:6]}"
            write_volume(v, sources, d)
            flags += ["-v", f"{d}:{m['mountPath']}:ro"]  # the kubelet mounts both read-only
        elif v.get("emptyDir", {}).get("medium") == "Memory" and m["mountPath"] == "/dev/shm":
            flags += ["--shm-size", v["emptyDir"].get("sizeLimit", "64Mi").replace("Gi", "g")]
        elif "persistentVolumeClaim" in v:
            # One directory per claim, shared by every pod that mounts it (ReadWriteMany).
            d = tmp / f"pvc-{v['persistentVolumeClaim']['claimName']}"
            d.mkdir(exist_ok=True)
            d.chmod(0o777)
            flags += ["-v", f"{d}:{m['mountPath']}"]
        elif "emptyDir" in v:
            # uid 10001 with group 0 owns the kubelet's emptyDirs (fsGroup 0): a writable tmpfs.
            flags += ["--tmpfs", f"{m['mountPath']}:rw,mode=1777"]
        else:
            raise AssertionError(f"emulation does not know volume {v}")
    return flags


def operator_env(job: dict, role: str, index: int, port: int) -> dict[str, str]:
    """The training operator v1.9's env for a replica (kubeflow/trainer v1.9.4,
    pkg/controller.v1/pytorch/envvar.go)."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    name, nproc = job["metadata"]["name"], job["spec"]["nprocPerNode"]
    nnodes = sum(s["replicas"] for s in specs.values())
    rank = index if role == "master" else index + 1
    master = f"{name}-master-0"
    return {"MASTER_ADDR": master, "MASTER_PORT": str(port), "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(nnodes * int(nproc)),
            "RANK": str(rank), "PET_NNODES": str(nnodes), "PET_NODE_RANK": str(rank),
            "PET_NPROC_PER_NODE": nproc, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The cluster's network and its tracking stack (10-mlflow.yaml), started once for every
    job of this module, as one cluster serves many jobs; each test finds its job's run by the
    job's pods (the run's ddplab.hosts)."""
    net = f"ddplab-emu-{uuid.uuid4().hex[:6]}"
    assert sh(["docker", "network", "create", net]).returncode == 0
    started: list[str] = []
    try:
        yield net, start_mlflow(net, started, tmp_path_factory.mktemp("tracking"))
    finally:
        remove(*started)
        sh(["docker", "network", "rm", net])


@pytest.fixture
def cluster(stack):
    """(network, this test's pods, MLflow's URL); the pods go when the test ends."""
    net, base = stack
    started: list[str] = []
    yield net, started, base
    remove(*started)


def state(container: str) -> dict:
    return json.loads(sh(["docker", "inspect", container]).stdout)[0]["State"]


def run(net: str, started: list[str], name: str, aliases: list[str], flags: list[str],
        image: str, args: list[str], env: dict[str, str]) -> None:
    cmd = ["docker", "run", "-d", "--name", name, "--hostname", name.split(".")[0],
           "--network", net]
    for a in aliases:
        cmd += ["--network-alias", a]
    for k, v in env.items():
        cmd += ["-e", f"{k}={v}"]
    started.append(name)  # removed when the test ends even if it was created but did not start
    out = sh([*cmd, *flags, image, *args])
    assert out.returncode == 0, out.stderr


def start_mlflow(net: str, started: list[str], tmp: Path) -> str:
    """The tracking stack of 10-mlflow.yaml: the PostgreSQL StatefulSet's pod (its claim a
    directory), then, once it is ready, the MLflow Deployment's, both with the Secrets of
    `make k8s-secrets` as files; the Services' DNS names point at them. Returns MLflow's URL."""
    docs = load("10-mlflow.yaml")
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    pod = copy.deepcopy(sts["spec"]["template"]["spec"])
    pod["volumes"] += [{"name": t["metadata"]["name"], "persistentVolumeClaim": {
        "claimName": f"{t['metadata']['name']}-postgres-0"}} for t in sts["spec"]["volumeClaimTemplates"]]
    pc = pod["containers"][0]
    db = f"{net}-postgres-0"
    run(net, started, db, ["postgres", "postgres.ddplab", "postgres.ddplab.svc"],
        docker_flags(pod, pc, SECRETS, tmp), pc["image"], pc.get("args", []), env_of(pc))
    ready = pc["readinessProbe"]["exec"]["command"]
    deadline = time.monotonic() + 120
    while sh(["docker", "exec", db, *ready]).returncode and time.monotonic() < deadline:
        time.sleep(1)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    mc = pod["containers"][0]
    name = f"{net}-mlflow"
    run(net, started, name, ["mlflow", "mlflow.ddplab", "mlflow.ddplab.svc"],
        [*docker_flags(pod, mc, SECRETS, tmp), "-p", "127.0.0.1::5000"], mc["image"], [], env_of(mc))
    port = sh(["docker", "port", name, "5000"]).stdout.split(":")[-1].strip()
    return f"http://127.0.0.1:{port}"


def search_runs(base: str) -> list[dict] | None:
    """Every run the server holds, newest first (a script's run has an experiment of its own);
    None while the server does not answer."""
    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(f"{base}/api/2.0/mlflow/{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Host": "mlflow.ddplab.svc:5000",
                                              "Authorization": "Basic " + base64.b64encode(
                                                  LOGIN.encode()).decode()})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    try:
        ids = [e["experiment_id"] for e in post("experiments/search", {"max_results": 100})["experiments"]]
        return post("runs/search", {"experiment_ids": ids}).get("runs", [])
    except OSError:
        return None


def job_runs(base: str, hosts: list[str]) -> list[dict] | None:
    """The runs of the job on these pods (their hostnames in the run's ddplab.hosts)."""
    found = search_runs(base)
    return None if found is None else [
        r for r in found if set(tags_of(r).get("ddplab.hosts", "").split(",")) & set(hosts)]


def wait_for_run(base: str, pods: list[str], hosts: list[str],
                 until=lambda run: run["info"]["status"] != "RUNNING",
                 timeout: float = 600) -> list[dict] | None:
    """The job's runs (on ``hosts``) once the first one satisfies ``until``, or when every pod
    in ``pods`` has ended."""
    deadline, found = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        found = job_runs(base, hosts)
        if found and until(found[0]):
            break
        if not any(state(c)["Running"] for c in pods):
            break  # every pod ended: no point waiting for the run
        time.sleep(3)
    return found


def logs(pods: list[str]) -> str:
    return "\n".join(line for c in pods for line in sh(["docker", "logs", c]).stderr.splitlines()
                     if "ddplab" in line or "Error" in line)[-4000:]


def exit_codes(pods: list[str], timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(state(c)["Running"] for c in pods) and time.monotonic() < deadline:
        time.sleep(2)
    return [state(c)["ExitCode"] for c in pods]


def tags_of(run_: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run_["data"]["tags"]}


# The jobs' length is not what these tests check (the pods are): the ConfigMap's quickstart is
# shortened as a user would edit it, 6,144 -> 1,536 training samples (a quarter of the steps;
# the elastic job still checkpoints at step 20 of 72 and resumes from it).
SHORTER = {"train_samples: 6144": "train_samples: 1536", "eval_samples: 1024": "eval_samples: 512"}


def experiment_sources() -> dict[str, dict[str, str]]:
    """The ConfigMaps of 20-experiment.yaml (its experiment SHORTER) and the cluster's
    Secrets, by name."""
    maps = {d["metadata"]["name"]: dict(d["data"]) for d in load("20-experiment.yaml")}
    text = maps["ddplab-experiment"]["experiment.yaml"]
    for long, short in SHORTER.items():
        assert long in text, f"20-experiment.yaml no longer has {long!r}"
        text = text.replace(long, short)
    maps["ddplab-experiment"]["experiment.yaml"] = text
    return {**SECRETS, **maps}


def test_cpu_pytorchjob_pods_run_as_the_operator_runs_them(cluster, tmp_path):
    net, started, base = cluster
    (job,) = load("30-pytorchjob-cpu.yaml")
    name = job["metadata"]["name"]
    for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
        pod = spec["template"]["spec"]
        (c,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
        job_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "pytorchjob-port")
        for i in range(spec["replicas"]):
            pod_name = f"{name}-{role.lower()}-{i}"
            env = {**env_of(c), **operator_env(job, role.lower(), i, job_port)}
            run(net, started, pod_name, [pod_name],
                docker_flags(pod, c, experiment_sources(), tmp_path), c["image"], c["args"], env)

    pods = list(started)
    found = wait_for_run(base, pods, pods)
    assert found and len(found) == 1, logs(pods)
    tags = tags_of(found[0])
    assert found[0]["info"]["status"] == "FINISHED", logs(pods)
    nnodes = sum(s["replicas"] for s in job["spec"]["pytorchReplicaSpecs"].values())
    assert tags["ddplab.world_size"] == str(nnodes * int(job["spec"]["nprocPerNode"]))
    assert (tags["ddplab.launcher"], tags["ddplab.nnodes"]) == ("torchrun", str(nnodes))
    assert sorted(tags["ddplab.hosts"].split(",")) == sorted(
        f"{name}-{r.lower()}-0" for r in job["spec"]["pytorchReplicaSpecs"])
    # 2 pods x 2 ranks on ddplab's ccl, not the gloo fallback the manifest allows
    assert tags["ddplab.backend"] == "ccl", tags["ddplab.backend_reason"]
    assert exit_codes(pods) == [0] * len(pods)


TRAINER_PORT = 29400  # kubeflow/trainer v2.3.0 constants.ContainerTrainerPort


def trainjob_pods(job: dict, runtime: dict,
                  sources: dict[str, dict[str, str]]) -> list[tuple[str, dict, dict, dict[str, str]]]:
    """(pod name, pod spec, "node" container, env) of every pod, nodes first (an MPI launcher
    dependsOn them being Ready), as JobSet and Trainer v2.3's torch or MPI plugin make them from
    a TrainJob and its TrainingRuntime. The MPI plugin's ssh Secret and hostfile ConfigMap are
    added to ``sources``."""
    name, trainer = job["metadata"]["name"], job["spec"].get("trainer", {})
    policy = runtime["spec"]["mlPolicy"]
    nodes = trainer.get("numNodes", policy.get("numNodes", 1))
    mpi = policy.get("mpi")
    if mpi:
        slots = trainer.get("numProcPerNode", mpi.get("numProcPerNode", 1))
        sources[f"{name}-mpi-ssh-auth"] = operator_ssh_secret()  # the same P-521 key as v1's
        sources[f"{name}-mpi-hostfile"] = {"hostfile": "".join(
            f"{name}-node-0-{i}.{name} slots={slots}\n" for i in range(nodes))}
    out = []
    jobs = {rj["name"]: rj for rj in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    for rj_name in [n for n in ("node", "launcher") if n in jobs]:
        rj = jobs[rj_name]
        pod = copy.deepcopy(rj["template"]["spec"]["template"]["spec"])
        (c,) = [c for c in pod["containers"] if c["name"] == "node"]
        ancestor = rj["template"].get("metadata", {}).get("labels", {}).get(
            "trainer.kubeflow.org/trainjob-ancestor-step") == "trainer"
        if ancestor:  # the TrainJob's trainer replaces the runtime's
            for key in ("image", "command", "args"):
                if key in trainer:
                    c[key] = trainer[key]
            c["env"] = c.get("env", []) + trainer.get("env", [])
        env = env_of(c)
        if mpi:
            pod["volumes"].append({"name": "mpi-ssh-auth", "secret": {
                "secretName": f"{name}-mpi-ssh-auth", "defaultMode": 0o640, "items": [
                    {"key": "ssh-privatekey", "path": "id_rsa"},
                    {"key": "ssh-publickey", "path": "id_rsa.pub"},
                    {"key": "ssh-publickey", "path": "authorized_keys"}]}})
            c.setdefault("volumeMounts", []).append(
                {"name": "mpi-ssh-auth", "mountPath": mpi["sshAuthMountPath"]})
            if rj_name == "launcher":
                pod["volumes"].append({"name": "mpi-hostfile", "configMap": {
                    "name": f"{name}-mpi-hostfile",
                    "items": [{"key": "hostfile", "path": "hostfile", "mode": 0o444}]}})
                c["volumeMounts"].append({"name": "mpi-hostfile", "mountPath": "/etc/mpi"})
                env |= {"OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile",
                        "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
                        "OMPI_MCA_orte_set_default_slots": str(slots),
                        "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10"}
        elif ancestor:  # the torch plugin
            env |= {"PET_NNODES": str(nodes),
                    "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
                    "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
                    "PET_MASTER_PORT": str(TRAINER_PORT)}
        count = nodes if rj_name == "node" else rj.get("replicas", 1)
        out += [(f"{name}-{rj_name}-0-{i}", pod, c,
                 {**env, "PET_NODE_RANK": str(i)} if "PET_NNODES" in env else env)
                for i in range(count)]
    return out


def test_trainer_v2_trainjobs_run_as_the_trainer_runs_them(cluster, tmp_path):
    """EMULATED Trainer v2 (no API server here), one tracking stack for three TrainJobs against
    the shipped runtimes, one after another: the CPU job (the quickstart, 2 nodes x 2 ranks on
    ddplab's ccl), the script job (an unedited torchrun script on 2 nodes) and the MPI job
    (Open MPI's launcher over ssh, 2 nodes x 2 slots). Each ends as ONE FINISHED run with both
    nodes' system metrics."""
    net, started, base = cluster
    runtimes = {r["metadata"]["name"]: r for f in ("00-runtime-cpu.yaml", "mpi/runtime-mpi.yaml")
                for r in load(f"trainer-v2/{f}") if r["kind"] == "TrainingRuntime"}
    expect = {"10-trainjob-cpu.yaml": ("torchrun", "ccl", "4"),
              "20-trainjob-script.yaml": ("torchrun", None, "2"),
              "mpi/runtime-mpi.yaml": ("openmpi", "", "4")}
    for file, (launcher, backend, world) in expect.items():
        (job,) = [d for d in load(f"trainer-v2/{file}") if d["kind"] == "TrainJob"]
        name = job["metadata"]["name"]
        sources = experiment_sources()
        pods = []
        for pod_name, pod, c, env in trainjob_pods(job, runtimes[job["spec"]["runtimeRef"]["name"]],
                                                   sources):
            run(net, started, pod_name, [pod_name, f"{pod_name}.{name}"],
                docker_flags(pod, c, sources, tmp_path), c["image"], c["args"], env)
            pods.append(pod_name)
        ends = [p for p in pods if "-launcher-" in p] or pods  # MPI's nodes serve until deleted
        assert exit_codes(ends, timeout=600) == [0] * len(ends), logs(pods)
        found = job_runs(base, [p for p in pods if "-node-" in p])
        assert found and len(found) == 1, logs(pods)
        run_ = found[0]
        tags = tags_of(run_)
        assert run_["info"]["status"] == "FINISHED", logs(pods)
        assert (tags["ddplab.launcher"], tags["ddplab.world_size"]) == (launcher, world)
        assert sorted(tags["ddplab.hosts"].split(",")) == [f"{name}-node-0-{i}" for i in range(2)]
        if backend:
            assert tags["ddplab.backend"] == backend, tags["ddplab.backend_reason"]
        elif backend is None:
            assert tags["ddplab.mode"] == "script", tags
        metrics = {m["key"] for m in run_["data"]["metrics"]}
        for node in range(2):
            assert any(k.startswith(f"system/node{node}/cpu_utilization") for k in metrics), metrics
        remove(*pods)  # the JobSet ends: its pods go before the next TrainJob's start
        for pod_name in pods:
            started.remove(pod_name)


def elastic_env(job: dict, port: int) -> dict[str, str]:
    """The training operator v1.9's env for an elastic job without a Master (its
    ElasticEnvVarGenerator; MASTER_*/RANK/WORLD_SIZE come only with a Master replica)."""
    ep, name = job["spec"]["elasticPolicy"], job["metadata"]["name"]
    return {"PYTHONUNBUFFERED": "1",
            "PET_RDZV_ENDPOINT": f"{ep.get('rdzvHost', name + '-worker-0')}:{ep.get('rdzvPort', port)}",
            "PET_RDZV_BACKEND": ep.get("rdzvBackend", "c10d"),
            "PET_NNODES": f"{ep['minReplicas']}:{ep['maxReplicas']}",
            "PET_MAX_RESTARTS": str(ep["maxRestarts"])}


def test_elastic_pytorchjob_recovers_from_a_lost_worker_into_the_same_run(cluster, tmp_path):
    """worker-1 is SIGKILLed once the first checkpoint is on the PVC. worker-0 hosts the c10d
    rendezvous (the operator's endpoint), so its agent restarts the group; the restarted
    worker-1 joins again; the group resumes the newest checkpoint into the SAME MLflow run."""
    net, started, base = cluster
    (job,) = [d for d in load("elastic/pytorchjob-elastic.yaml") if d["kind"] == "PyTorchJob"]
    name = job["metadata"]["name"]
    spec = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    pod = spec["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == "pytorchjob-port")
    for i in range(spec["replicas"]):
        pod_name = f"{name}-worker-{i}"
        run(net, started, pod_name, [pod_name],
            docker_flags(pod, c, experiment_sources(), tmp_path), c["image"], c["args"],
            {**env_of(c), **elastic_env(job, port)})
    pods = list(started)

    (claim,) = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                if "persistentVolumeClaim" in v]
    deadline = time.monotonic() + 600
    while not list((tmp_path / f"pvc-{claim}").rglob("step-*.pt")):
        assert time.monotonic() < deadline and all(state(p)["Running"] for p in pods), logs(pods)
        time.sleep(1)
    victim = pods[1]
    assert sh(["docker", "kill", victim]).returncode == 0
    assert sh(["docker", "start", victim]).returncode == 0  # the kubelet's OnFailure restart

    found = wait_for_run(base, pods, pods, until=lambda r: r["info"]["status"] == "FINISHED",
                         timeout=900)
    assert found and len(found) == 1, logs(pods)
    assert found[0]["info"]["status"] == "FINISHED", logs(pods)
    tags = tags_of(found[0])
    assert tags["ddplab.resumed_from"] != "none", "the group did not resume the checkpoint"
    assert tags["ddplab.launcher"] == "torchrun"
    assert exit_codes(pods) == [0] * len(pods), logs(pods)


def operator_ssh_secret() -> dict[str, str]:
    """The Secret `<job>-ssh` as mpi-operator's newSSHAuthSecret makes it: a P-521 ECDSA key in
    PEM ("EC PRIVATE KEY") and its public half in authorized_keys form."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP521R1())
    private = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH).decode()
    return {"ssh-privatekey": private, "ssh-publickey": public + "\n"}


def mpi_operator_pod(job: dict, role: str, config: str) -> tuple[dict, dict, dict[str, str]]:
    """A replica's pod spec, main container and env after the MPI operator's additions."""
    spec = job["spec"]
    name = job["metadata"]["name"]
    pod = copy.deepcopy(spec["mpiReplicaSpecs"][role]["template"]["spec"])
    c = pod["containers"][0]
    pod.setdefault("volumes", []).append({"name": "ssh-auth", "secret": {
        "secretName": f"{name}-ssh", "items": [
            {"key": "ssh-privatekey", "path": "id_rsa"},
            {"key": "ssh-publickey", "path": "id_rsa.pub"},
            {"key": "ssh-publickey", "path": "authorized_keys"}]}})
    c.setdefault("volumeMounts", []).append(
        {"name": "ssh-auth", "mountPath": spec.get("sshAuthMountPath", "/root/.ssh")})
    env = {**env_of(c), "K_MPI_JOB_ROLE": role.lower()}
    if role == "Launcher":
        pod["volumes"].append({"name": "mpi-job-config", "configMap": {"name": config, "items": [
            {"key": "hostfile", "path": "hostfile", "mode": 0o444},
            {"key": "discover_hosts.sh", "path": "discover_hosts.sh", "mode": 0o555}]}})
        c["volumeMounts"].append({"name": "mpi-job-config", "mountPath": "/etc/mpi"})
        env |= {"OMPI_MCA_orte_keep_fqdn_hostnames": "true",
                "OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile",
                "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
                "OMPI_MCA_orte_set_default_slots": str(spec.get("slotsPerWorker", 1)),
                "NVIDIA_VISIBLE_DEVICES": "", "NVIDIA_DRIVER_CAPABILITIES": ""}
    return pod, c, env


def test_mpijob_pods_run_as_the_mpi_operator_runs_them(cluster, tmp_path):
    """The launcher starts FIRST (launcherCreationPolicy AtStartup's order, the harder one: the
    workers' names do not resolve yet), so its bounded waits for DNS and sshd are exercised."""
    net, started, base = cluster
    (job,) = load("mpi/mpijob-cpu.yaml")
    name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
    slots = job["spec"].get("slotsPerWorker", 1)
    nworkers = job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]
    fqdns = [f"{name}-worker-{i}.{name}-worker.{ns}.svc" for i in range(nworkers)]
    sources = {**experiment_sources(), f"{name}-ssh": operator_ssh_secret(),
               f"{name}-config": {"hostfile": "".join(f"{h} slots={slots}\n" for h in fqdns),
                                  "discover_hosts.sh": "#!/bin/sh\n"}}

    pod, c, env = mpi_operator_pod(job, "Launcher", f"{name}-config")
    run(net, started, f"{name}-launcher", [f"{name}-launcher"],
        docker_flags(pod, c, sources, tmp_path), c["image"], c["args"], env)
    pod, c, env = mpi_operator_pod(job, "Worker", f"{name}-config")
    for i, fqdn in enumerate(fqdns):
        pod_name = f"{name}-worker-{i}"
        run(net, started, pod_name, [fqdn, f"{pod_name}.{name}-worker", f"{fqdn}.cluster.local"],
            docker_flags(pod, c, sources, tmp_path), c["image"], c["args"], env)

    launcher, workers = started[0], started[1:]
    found = wait_for_run(base, [launcher], workers)
    code = exit_codes([launcher], timeout=180)
    for w in workers:  # cleanPodPolicy Running: the operator deletes the running workers
        assert state(w)["Running"], f"worker {w} ended before the launcher: {logs([w])}"
    assert found and len(found) == 1, logs(started)
    tags = tags_of(found[0])
    assert found[0]["info"]["status"] == "FINISHED", logs(started)
    assert tags["ddplab.world_size"] == str(nworkers * slots)
    assert (tags["ddplab.launcher"], tags["ddplab.nnodes"]) == ("openmpi", str(nworkers))
    # The workers' CPU limit (2) over their 2 slots: auto leaves oneCCL's worker no core.
    assert (tags["ddplab.backend"], tags["ddplab.backend_requested"]) == ("gloo", "auto")
    assert "each rank has 1 core(s)" in tags["ddplab.backend_reason"], tags["ddplab.backend_reason"]
    assert sorted(tags["ddplab.hosts"].split(",")) == [f"{name}-worker-{i}" for i in range(nworkers)]
    assert code == [0], logs([launcher])


def test_mpijob_launcher_refuses_a_worker_whose_host_key_is_not_the_jobs(cluster, tmp_path):
    """The teeth of the trust rule: the worker accepts the job's key (authorized_keys is the
    job's) but presents another host key, as an impostor would. The launcher must refuse it
    (StrictHostKeyChecking=yes), so mpirun fails and the launcher exits non-zero."""
    net, started, _ = cluster
    (job,) = load("mpi/mpijob-cpu.yaml")
    name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
    job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = 1
    fqdn = f"{name}-worker-0.{name}-worker.{ns}.svc"
    secret = operator_ssh_secret()
    impostor = {**operator_ssh_secret(), "ssh-publickey": secret["ssh-publickey"]}
    config = {f"{name}-config": {"hostfile": f"{fqdn} slots=1\n", "discover_hosts.sh": ""}}

    pod, c, env = mpi_operator_pod(job, "Worker", f"{name}-config")
    run(net, started, f"{name}-worker-0", [fqdn],
        docker_flags(pod, c, {**experiment_sources(), f"{name}-ssh": impostor}, tmp_path),
        c["image"], c["args"], env)
    pod, c, env = mpi_operator_pod(job, "Launcher", f"{name}-config")
    run(net, started, f"{name}-launcher", [f"{name}-launcher"],
        docker_flags(pod, c, {**experiment_sources(), f"{name}-ssh": secret, **config}, tmp_path),
        c["image"], c["args"], env)
    launcher = started[-1]
    assert exit_codes([launcher], timeout=180) != [0]
    out = sh(["docker", "logs", launcher]).stderr
    assert "Host key verification failed" in out or "REMOTE HOST IDENTIFICATION HAS CHANGED" in out, \
        out[-3000:]
