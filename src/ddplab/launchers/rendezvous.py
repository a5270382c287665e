"""``ddplab launch``: start torchrun on one node of a multi-node job once its peers are there.

For nodes that start together under one DNS name and no fixed roles (compose replicas, a
headless service):

    ddplab launch --nnodes 2 --nproc-per-node 1 --peers node -- experiments/quickstart.yaml

1. waits, bounded, until ``--peers`` resolves to ``--nnodes`` addresses (no rendezvous before
   DNS is ready);
2. the lowest address hosts torchrun's c10d rendezvous store; every other node waits, bounded,
   until that port answers;
3. pins GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, FI_TCP_IFACE and CCL_KVS_IFACE to the interface
   that carries this node's peer address, unless they are set (the wrong-interface trap);
4. optionally shapes that interface with ``tc netem`` (NET_DELAY_MS, NET_RATE_MBIT);
5. execs ``torchrun --rdzv-backend c10d ... -m ddplab train EXPERIMENT ...``, advertising this
   node's address (``--local-addr``), so every peer can reach the master without its hostname.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from ..errors import BadInput
from ..log import logger
from ..poll import poll
from .detect import LaunchError
from .tether import LAUNCHER_ENV

T = TypeVar("T")

IFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "FI_TCP_IFACE", "CCL_KVS_IFACE")


@dataclass(frozen=True)
class Plan:
    host: str
    """Address of the node that hosts the rendezvous store (the lowest peer address)."""
    me: str
    """This node's address among the peers."""
    iface: str
    """The interface that carries ``me``."""

    @property
    def is_host(self) -> bool:
        return self.host == self.me


def resolve_all(name: str) -> list[str]:
    """Every IPv4 address ``name`` resolves to, lowest first; [] while it does not resolve."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    # AF_INET: (host, port), the host a str (the stub's union also holds IPv6's int fields)
    return sorted({str(i[4][0]) for i in infos}, key=ipaddress.ip_address)


def local_addresses() -> dict[str, str]:
    """IPv4 address -> interface name, for this machine (or container)."""
    import psutil

    return {a.address: name for name, addrs in psutil.net_if_addrs().items()
            for a in addrs if a.family == socket.AF_INET}


def plan(peers: list[str], local: Mapping[str, str]) -> Plan:
    mine = [ip for ip in peers if ip in local]
    if len(mine) != 1:
        raise LaunchError(f"this node's addresses {sorted(local)} match {len(mine)} of the peer "
                          f"addresses {peers}; expected exactly one")
    # Numeric order, not text: "172.20.0.10" sorts before "172.20.0.4" as a string.
    host = min(peers, key=ipaddress.ip_address)
    return Plan(host=host, me=mine[0], iface=local[mine[0]])


def interface_env(iface: str, env: Mapping[str, str]) -> dict[str, str]:
    """The interface variables to set: only those the user has not set."""
    return {k: iface for k in IFACE_VARS if not env.get(k)}


def netem_command(iface: str, delay_ms: float, rate_mbit: float) -> list[str] | None:
    if delay_ms <= 0 and rate_mbit <= 0:
        return None
    cmd = ["tc", "qdisc", "replace", "dev", iface, "root", "netem"]
    if delay_ms > 0:
        cmd += ["delay", f"{delay_ms}ms"]
    if rate_mbit > 0:
        cmd += ["rate", f"{rate_mbit}mbit"]
    return cmd


def shape_link(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode == 0:
        return
    why = out.stderr.strip()
    if "qdisc kind is unknown" in why:
        why += ": the host kernel has no netem (load it on the host: modprobe sch_netem)"
    elif "Operation not permitted" in why:
        why += ": the container needs the NET_ADMIN capability (compose: cap_add)"
    raise LaunchError(f"NET_DELAY_MS/NET_RATE_MBIT: `{' '.join(cmd)}` failed: {why}")


def wait_for(check: Callable[[], T | None], timeout_s: float, what: Callable[[], str],
             interval_s: float = 1.0) -> T:
    """Poll ``check`` until it returns something truthy; a clear error after ``timeout_s``
    (``what`` describes the state at that moment)."""
    result = poll(check, timeout_s, interval_s)
    if not result:
        raise LaunchError(f"timed out after {timeout_s:.0f}s waiting for {what()}")
    return result


def wait_for_peers(name: str, nnodes: int, timeout_s: float) -> list[str]:
    seen: list[str] = []

    def ready() -> list[str] | None:
        seen[:] = resolve_all(name)
        return list(seen) if len(seen) == nnodes else None

    return wait_for(ready, timeout_s, lambda: f"{nnodes} addresses for '{name}' (resolved "
                    f"{len(seen)}: {seen}); are all {nnodes} nodes started?")


def port_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def torchrun_argv(a: argparse.Namespace, p: Plan) -> list[str]:
    from .targets import NodeTorchrun

    target = NodeTorchrun(a.nnodes, a.nproc_per_node, f"{p.host}:{a.rdzv_port}", a.rdzv_id,
                          p.is_host, a.wait_timeout, p.me, a.max_restarts)
    return target.argv(["-m", "ddplab", "train", *a.train_args])


def from_env(kind: type[int] | type[float], env_name: str) -> Callable[[str], int | float]:
    """An argparse type for an option whose default comes from ``$env_name``: argparse converts
    string defaults with it only when the command runs, so a bad variable is one usage line
    naming it (exit 2), and other commands never read it."""
    def convert(text: str) -> int | float:
        value: int | float | None
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value < (1 if kind is int else 0):
            low = "an integer >= 1" if kind is int else "a number >= 0"
            raise argparse.ArgumentTypeError(f"{text!r} (from the option or ${env_name}) is not {low}")
        return value
    convert.__name__ = kind.__name__  # what argparse names in its message
    return convert


def port(text: str) -> int:
    """A TCP port a node can listen on (argparse's type: a bad one is one usage line, exit 2)."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1 to 65535)")
    return int(text)


def parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = os.environ
    p = sub.add_parser("launch", help="multi-node: wait for peers, then torchrun this node's ranks",
                       description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--nnodes", type=from_env(int, "NNODES"), default=e.get("NNODES", "2"),
                   help="nodes in the job (default $NNODES or 2)")
    p.add_argument("--nproc-per-node", type=from_env(int, "NPROC_PER_NODE"),
                   default=e.get("NPROC_PER_NODE", "1"),
                   help="ranks on this node (default $NPROC_PER_NODE or 1)")
    p.add_argument("--peers", default=e.get("DDPLAB_PEERS", "node"),
                   help="DNS name that resolves to every node (default $DDPLAB_PEERS or 'node')")
    p.add_argument("--rdzv-port", type=port, default=29400)
    p.add_argument("--rdzv-id", default=e.get("DDPLAB_JOB_ID", "ddplab"))
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--wait-timeout", type=from_env(float, "DDPLAB_WAIT_TIMEOUT"),
                   default=e.get("DDPLAB_WAIT_TIMEOUT", "180"),
                   help="seconds to wait for peers and the rendezvous port (default 180)")
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="-- EXPERIMENT.yaml [--set key=value ...] (what ddplab train takes)")


def train_args(argv: list[str]) -> list[str]:
    """What follows ``--``: the arguments of ``ddplab train`` (an experiment is required)."""
    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not argv:
        raise BadInput("give the experiment after --, e.g. -- "
                       "experiments/quickstart.yaml")
    return argv


def launch(a: argparse.Namespace) -> int:
    a.train_args = train_args(a.train_args)
    if a.nnodes < 1 or a.nproc_per_node < 1:
        raise LaunchError(f"--nnodes {a.nnodes} / --nproc-per-node {a.nproc_per_node}: must be >= 1")
    say = logger("launch").info
    say(f"waiting for {a.nnodes} node(s) named '{a.peers}' (at most {a.wait_timeout:.0f}s)")
    p = plan(wait_for_peers(a.peers, a.nnodes, a.wait_timeout), local_addresses())
    os.environ.update(interface_env(p.iface, os.environ))
    # torch 2.5-2.7 caches the rendezvous's shared TCPStore address after the first round, so a
    # restarted node waits forever for the next round's MASTER_ADDR (pytorch#135712, #147064):
    # a fresh store per round keeps --max-restarts working.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    shaping = netem_command(p.iface, float(os.environ.get("NET_DELAY_MS", "0") or 0),
                            float(os.environ.get("NET_RATE_MBIT", "0") or 0))
    if shaping:
        shape_link(shaping)
        say(f"network shaped: {' '.join(shaping)}")
    if not p.is_host:
        wait_for(lambda: port_answers(p.host, a.rdzv_port), a.wait_timeout,
                 lambda: f"the rendezvous at {p.host}:{a.rdzv_port} to answer")
    say(f"node {p.me} on {p.iface}; rendezvous {p.host}:{a.rdzv_port} "
        f"({'hosted here' if p.is_host else 'answers'})")
    argv = torchrun_argv(a, p)
    os.environ.pop(LAUNCHER_ENV, None)  # (torchrun is the ranks' parent here, not a ddplab run)
    os.execv(argv[0], argv)
    return 0  # not reached
