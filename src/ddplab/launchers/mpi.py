"""Open MPI across containers: per-job ssh keys, bounded waits, then ``mpirun``.

    ddplab mpi worker                       # on every worker: sshd with a host key made now
    ddplab mpi launch --nnodes 2 --slots 1 --peers worker -- experiments/quickstart.yaml

The worker and the launcher meet in a shared directory (``--keys-dir``, a job-private volume):

- the launcher makes a job nonce and a per-job user key, writes ``jobs/<nonce>/id.pub`` and
  then announces the nonce in ``current`` (an older announcement, left by an earlier job on a
  reused volume, is ignored by workers started after it);
- each worker waits (bounded) for the announcement, installs the launcher's key as its only
  authorized key (``~/.ssh`` 0700, StrictModes on), generates its own ed25519 host key, starts a
  non-root ``sshd`` on ``--ssh-port`` (2222) and publishes ``jobs/<nonce>/hosts/<address>.pub``;
- the launcher waits (bounded) until every worker's host key is published and its sshd answers,
  writes a ``known_hosts`` with exactly those keys and runs ``mpirun`` with
  ``StrictHostKeyChecking=yes`` (a host whose key was not published for this job is refused),
  forwarding SIGTERM/SIGINT to it; when it ends it writes ``jobs/<nonce>/done`` and the workers
  stop their sshd and exit, so ``docker compose up`` returns.

Under the MPI operator (Kubernetes MPIJob v2beta1) the operator has already made the job's key
(a Secret mounted at ``sshAuthMountPath``) and the hostfile (``/etc/mpi/hostfile``); with
``--ssh-auth DIR`` or ``$DDPLAB_SSH_AUTH`` (that mount path) both commands use them instead of
``--keys-dir`` (and ``ddplab doctor`` checks ssh with the launcher's options):

- the worker serves the operator's ``authorized_keys`` and uses the job's private key as its
  host key (a copy, 0600), so the host key is as per-job and as secret as the user key;
- the launcher reads the hostfile, waits (bounded) until every worker's name resolves and its
  sshd answers (the operator may start it first), trusts exactly ``[worker]:port`` with the
  job's public key (``StrictHostKeyChecking=yes``; never ``no``) and runs ``mpirun``.

No key is ever baked into an image, and ``mpirun`` runs as the image's non-root user.
The equivalent of the book's chapter 11 line
``mpirun -x MASTER_ADDR -x MASTER_PORT --np 16 --host machine1:8,machine2:8 ...``
is what ``launch`` builds, with the addresses it found.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path

from ..credentials import CREDENTIALS
from ..log import logger
from ..poll import poll
from .detect import LaunchError
from .rendezvous import (
    from_env,
    local_addresses,
    plan,
    port,
    port_answers,
    train_args,
    wait_for,
    wait_for_peers,
)

# What ranks on the workers need from the launcher's environment (ssh sessions start clean).
FORWARD = ("PATH", "LD_PRELOAD", "HOME", "PYTHONUNBUFFERED", "DDPLAB_IMAGE", "DDPLAB_GIT_SHA",
           "DDPLAB_SET", "DDPLAB_UI_URL", "DDPLAB_NODES_ON_HOST", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID",
           *CREDENTIALS,
           "CCL_ATL_TRANSPORT", "CCL_WORKER_COUNT", "CCL_ATL_SHM", "GLOO_SOCKET_IFNAME",
           "NCCL_SOCKET_IFNAME", "FI_TCP_IFACE", "CCL_KVS_IFACE", "FI_PROVIDER")

SSHD_CONFIG = """\
Port {port}
ListenAddress 0.0.0.0
HostKey {host_key}
PidFile {run_dir}/sshd.pid
AuthorizedKeysFile {authorized}
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin no
UsePAM no
StrictModes {strict}
AllowUsers {user}
PrintMotd no
LogLevel ERROR
"""


def say(text: str) -> None:
    logger("mpi").info(text)


def keygen(path: Path, comment: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    path.with_suffix(".pub").unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True)


def known_hosts(keys_dir: Path, addresses: list[str], port: int) -> str:
    """``[addr]:port keytype key`` for exactly the hosts of this job."""
    lines = []
    for addr in addresses:
        keytype, key = (keys_dir / "hosts" / f"{addr}.pub").read_text().split()[:2]
        lines.append(f"[{addr}]:{port} {keytype} {key}")
    return "\n".join(lines) + "\n"


def ssh_options(key: Path, known: Path, port: int) -> list[str]:
    return ["-p", str(port), "-i", str(key), "-o", "IdentitiesOnly=yes",
            "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known}",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ConnectionAttempts=5"]


def peer_network(peer: str) -> str:
    """What Open MPI's TCP traffic to ``peer`` (an IPv4 address) is pinned to (the wrong-interface
    trap): the CIDR of this machine's interface on the peer's network, which holds across
    containers whose interface names differ; where no interface shares a network with the peer
    (point-to-point pod networks give each pod a /32), the name of the interface the route to
    the peer leaves by, which every pod of a Kubernetes job names alike (eth0)."""
    import ipaddress

    import psutil

    target = ipaddress.ip_address(peer)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))  # no packet is sent: this only asks the kernel for the route
            source = s.getsockname()[0]
    except OSError:
        source = None
    by_route: str | None = None
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family != socket.AF_INET or not addr.netmask:
                continue
            net = ipaddress.ip_interface(f"{addr.address}/{addr.netmask}").network
            if target in net and not net.is_loopback:
                return str(net)
            by_route = name if addr.address == source else by_route
    if by_route:
        return by_route
    raise LaunchError(f"no interface of this machine reaches worker {peer}")


def mpirun_argv(a: argparse.Namespace, hosts: list[str], ssh_opts: list[str], network: str,
                env: dict[str, str]) -> list[str]:
    from .targets import MpirunHosts

    target = MpirunHosts(hosts, a.slots, ssh_opts, network, a.master_port,
                         [name for name in FORWARD if name in env])
    return target.argv(["-m", "ddplab", "train", *a.train_args])


def current_job(keys: Path, newer_than: float) -> str | None:
    """The nonce of the job the launcher announced after ``newer_than`` (stale ones ignored)."""
    marker = keys / "current"
    try:
        if marker.stat().st_mtime >= newer_than:
            return marker.read_text().strip() or None
    except FileNotFoundError:
        pass
    return None


def private_dir(name: str) -> Path:
    """A 0700 directory of this user's for sshd's and ssh's files (in the writable $TMPDIR)."""
    d = Path(os.environ.get("TMPDIR", "/tmp")) / name
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    d.chmod(0o700)
    return d


def private_copy(src: Path, dst: Path) -> Path:
    """``src`` copied to a 0600 file: ssh and sshd refuse a private key others could read."""
    dst.unlink(missing_ok=True)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(src.read_bytes())
    return dst


def sshd_argv(run_dir: Path, port: int, host_key: Path, authorized: Path,
              strict: bool) -> list[str]:
    """A non-root sshd in the foreground, logging to stderr, for this user only."""
    import getpass

    cfg = run_dir / "sshd_config"
    cfg.write_text(SSHD_CONFIG.format(port=port, host_key=host_key, run_dir=run_dir,
                                      authorized=authorized, strict="yes" if strict else "no",
                                      user=getpass.getuser()))
    return ["/usr/sbin/sshd", "-D", "-e", "-f", str(cfg)]


def worker(a: argparse.Namespace) -> int:
    if a.ssh_auth:
        return operator_worker(a)
    import psutil

    # Compose starts the workers before the launcher (depends_on), so the launcher's
    # announcement is newer than this process; one left by an earlier job is older.
    born = psutil.Process().create_time() - 1.0
    keys = Path(a.keys_dir)
    me = plan(wait_for_peers(a.peers, a.nnodes, a.wait_timeout), local_addresses()).me
    say(f"worker {me}: waiting for the launcher to announce a job in {keys}")
    nonce = wait_for(lambda: current_job(keys, born), a.wait_timeout,
                     lambda: f"a job announced in {keys}/current")
    job = keys / "jobs" / str(nonce)
    run_dir = private_dir("ddplab-sshd")
    host_key = run_dir / "ssh_host_ed25519_key"
    keygen(host_key, f"ddplab-worker-{me}")
    ssh_dir = Path.home() / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    ssh_dir.chmod(0o700)
    auth = ssh_dir / "authorized_keys"
    auth.write_text((job / "id.pub").read_text())
    auth.chmod(0o600)
    sshd = subprocess.Popen(sshd_argv(run_dir, a.ssh_port, host_key, auth, strict=True))
    (job / "hosts").mkdir(parents=True, exist_ok=True)
    tmp = job / "hosts" / f".{me}.pub"
    shutil.copyfile(host_key.with_suffix(".pub"), tmp)
    os.replace(tmp, job / "hosts" / f"{me}.pub")
    say(f"worker {me}: sshd on port {a.ssh_port} for job {nonce}; host key published")
    poll(lambda: sshd.poll() is not None or (job / "done").exists(), math.inf)
    if sshd.poll() is None:
        sshd.terminate()
        sshd.wait(timeout=30)
        say(f"worker {me}: job {nonce} ended ({(job / 'done').read_text().strip()}); stopping")
        return 0
    return sshd.returncode or 1


def operator_keys(auth: Path) -> tuple[Path, str]:
    """The MPI operator's job key in its Secret mount: (private key, ``type base64`` public)."""
    files = [auth / n for n in ("id_rsa", "id_rsa.pub", "authorized_keys")]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise LaunchError(f"--ssh-auth {auth}: missing {', '.join(missing)}; it must be the "
                          "MPIJob's spec.sshAuthMountPath, where the MPI operator mounts the job's "
                          "ssh Secret")
    return files[0], " ".join(files[1].read_text().split()[:2])


def operator_worker(a: argparse.Namespace) -> int:
    auth = Path(a.ssh_auth)
    private, _ = operator_keys(auth)
    authorized = auth / "authorized_keys"
    # sshd's StrictModes would judge the kubelet's Secret directories (their modes are the
    # kubelet's, not ours); what it protects is that no process here can change the keys.
    if os.access(authorized, os.W_OK):
        raise LaunchError(f"{authorized} is writable by this user; mount the MPI operator's "
                          "ssh Secret read-only (as the operator does)")
    run_dir = private_dir("ddplab-sshd")
    host_key = private_copy(private, run_dir / "ssh_host_key")
    say(f"worker {os.uname().nodename}: sshd on port {a.ssh_port} with the MPI operator's job key")
    argv = sshd_argv(run_dir, a.ssh_port, host_key, authorized, strict=False)
    os.execv(argv[0], argv)  # sshd is the pod's process: the kubelet's signals reach it
    return 1  # not reached


def run_forwarding_signals(argv: list[str]) -> int:
    """Run ``argv`` as a child, passing SIGTERM/SIGINT on, so mpirun cleans up its ranks."""
    child = subprocess.Popen(argv)

    def forward(signum: int, frame: object) -> None:
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    return child.wait()


def _wait_for_worker(h: str, job: Path, a: argparse.Namespace) -> None:
    """Until worker ``h`` has sent its host key for ``job`` and its sshd answers."""
    wait_for(lambda: (job / "hosts" / f"{h}.pub").exists() and port_answers(h, a.ssh_port),
             a.wait_timeout, lambda: f"worker {h}'s host key and sshd on port {a.ssh_port}")


def _wait_for_sshd(h: str, a: argparse.Namespace) -> None:
    """Until worker ``h`` resolves and its sshd answers."""
    wait_for(lambda: port_answers(h, a.ssh_port), a.wait_timeout,
             lambda: f"worker {h} to resolve and its sshd to answer on port {a.ssh_port}")


def launch(a: argparse.Namespace) -> int:
    a.train_args = train_args(a.train_args)
    if a.ssh_auth:
        return operator_launch(a)
    keys = Path(a.keys_dir)
    hosts = wait_for_peers(a.peers, a.nnodes, a.wait_timeout)
    nonce = uuid.uuid4().hex
    job = keys / "jobs" / nonce
    job.mkdir(parents=True)
    key = Path.home() / ".ssh" / "ddplab_job_ed25519"
    keygen(key, f"ddplab-launcher-{nonce}")
    shutil.copyfile(key.with_suffix(".pub"), job / "id.pub")
    (keys / ".current").write_text(nonce)
    os.replace(keys / ".current", keys / "current")  # announce only once id.pub is complete
    say(f"job {nonce} announced; waiting for {len(hosts)} worker(s)")
    for h in hosts:
        _wait_for_worker(h, job, a)
    known = key.parent / "ddplab_known_hosts"
    known.write_text(known_hosts(job, hosts, a.ssh_port))
    rc = run_mpirun(a, hosts, ssh_options(key, known, a.ssh_port), hosts[0])
    (job / "done").write_text(f"mpirun exit code {rc}")
    return rc


def run_mpirun(a: argparse.Namespace, hosts: list[str], ssh_opts: list[str], first_ip: str) -> int:
    argv = mpirun_argv(a, hosts, ssh_opts, peer_network(first_ip), dict(os.environ))
    say(f"{len(hosts)} worker(s) ready: {' '.join(argv[:6])} ...")
    rc = run_forwarding_signals(argv)
    say(f"mpirun exited with {rc}")
    return rc


def read_hostfile(path: Path) -> list[tuple[str, int]]:
    """``host [slots=N]`` lines (comments and blank lines skipped), as Open MPI reads them."""
    if not path.is_file():
        raise LaunchError(f"no hostfile at {path} (the MPI operator mounts one at /etc/mpi/hostfile "
                          "and names it in OMPI_MCA_orte_default_hostfile)")
    entries = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        words = line.split("#")[0].split()
        if not words:
            continue
        opts = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        slots = opts.get("slots", "1")
        if not slots.isdigit() or int(slots) < 1:
            raise LaunchError(f"{path}:{n}: slots={slots!r}; expected a whole number >= 1")
        entries.append((words[0], int(slots)))
    if not entries:
        raise LaunchError(f"{path} lists no hosts")
    return entries


def operator_ssh_options(auth: Path, hosts: list[str], port: int,
                         env: Mapping[str, str]) -> list[str]:
    """ssh options that log in with the job's key and accept, as host key of exactly ``hosts``,
    only the job's public key; the operator's own ``OMPI_MCA_plm_rsh_args`` come first (ssh
    keeps the first value it is given for an option)."""
    private, public = operator_keys(auth)
    run_dir = private_dir("ddplab-ssh")
    key = private_copy(private, run_dir / "id_job")
    known = run_dir / "known_hosts"
    known.write_text("".join(f"[{h}]:{port} {public}\n" for h in hosts))
    return [*shlex.split(env.get("OMPI_MCA_plm_rsh_args", "")), *ssh_options(key, known, port)]


def operator_launch(a: argparse.Namespace) -> int:
    """mpirun over the MPI operator's hostfile, trusting only the job's own key as host key."""
    entries = read_hostfile(Path(a.hostfile))
    hosts = [h for h, _ in entries]
    slots = {n for _, n in entries}
    if len(slots) != 1:
        raise LaunchError(f"{a.hostfile}: the workers' slots differ ({sorted(slots)}); ddplab "
                          "places the same number of ranks on each")
    a.slots = slots.pop()
    opts = operator_ssh_options(Path(a.ssh_auth), hosts, a.ssh_port, os.environ)
    say(f"waiting for {len(hosts)} worker(s) of {a.hostfile} to resolve and answer on port "
        f"{a.ssh_port}")
    for h in hosts:
        _wait_for_sshd(h, a)
    return run_mpirun(a, hosts, opts, socket.gethostbyname(hosts[0]))


def parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = os.environ
    m = sub.add_parser("mpi", help="Open MPI across containers: ssh workers and the mpirun launcher")
    ms = m.add_subparsers(dest="mpi_command", required=True)
    for name in ("worker", "launch"):
        p = ms.add_parser(name)
        p.add_argument("--nnodes", type=from_env(int, "NNODES"), default=e.get("NNODES", "2"))
        p.add_argument("--peers", default=e.get("DDPLAB_PEERS", "worker"),
                       help="DNS name that resolves to every worker")
        p.add_argument("--keys-dir", default=e.get("DDPLAB_KEYS_DIR", "/ssh"),
                       help="job-private directory shared by the launcher and the workers")
        p.add_argument("--ssh-port", type=from_env(int, "DDPLAB_SSH_PORT"),
                       default=e.get("DDPLAB_SSH_PORT", "2222"))
        p.add_argument("--wait-timeout", type=from_env(float, "DDPLAB_WAIT_TIMEOUT"),
                       default=e.get("DDPLAB_WAIT_TIMEOUT", "180"))
        p.add_argument("--ssh-auth", default=e.get("DDPLAB_SSH_AUTH", ""), metavar="DIR",
                       help="under the MPI operator: its spec.sshAuthMountPath; the job key it "
                            "mounts there replaces --keys-dir (and the hostfile, --nnodes/--peers)")
    launch_p = ms.choices["launch"]
    launch_p.add_argument("--slots", type=from_env(int, "SLOTS"), default=e.get("SLOTS", "1"),
                          help="ranks per worker (under the MPI operator: the hostfile's slots)")
    launch_p.add_argument("--hostfile",
                          default=e.get("OMPI_MCA_orte_default_hostfile", "/etc/mpi/hostfile"),
                          help="with --ssh-auth: the operator's hostfile")
    launch_p.add_argument("--master-port", type=port, default=29500)
    launch_p.add_argument("train_args", nargs=argparse.REMAINDER,
                          help="-- EXPERIMENT.yaml [--set key=value ...]")


def main(a: argparse.Namespace) -> int:
    return worker(a) if a.mpi_command == "worker" else launch(a)
