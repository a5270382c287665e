"""Unit: ddplab launch's planning (pure parts) and its bounded waits, on real sockets."""

import argparse
import socket

import pytest

from ddplab.launchers.detect import LaunchError
from ddplab.launchers.rendezvous import (
    Plan,
    interface_env,
    netem_command,
    plan,
    port_answers,
    resolve_all,
    torchrun_argv,
    wait_for,
    wait_for_peers,
)


def test_lowest_address_hosts_and_interface_is_found():
    # Unsorted, and "172.20.0.10" < "172.20.0.9" as text: the numerically lowest must host.
    peers = ["172.20.0.10", "172.20.0.9", "172.20.0.11"]
    local = {"127.0.0.1": "lo", "172.20.0.10": "eth0"}
    p = plan(peers, local)
    assert (p.host, p.me, p.iface, p.is_host) == ("172.20.0.9", "172.20.0.10", "eth0", False)
    assert plan(peers, {"172.20.0.9": "eth1"}).is_host
    assert not plan(list(reversed(peers)), {"172.20.0.11": "eth0"}).is_host


def test_a_node_that_is_not_among_the_peers_is_an_error():
    with pytest.raises(LaunchError, match="match 0 of the peer addresses"):
        plan(["10.0.0.2", "10.0.0.3"], {"127.0.0.1": "lo"})


def test_resolution_sorts_numerically_and_tolerates_unknown_names():
    assert resolve_all("localhost") == ["127.0.0.1"]
    assert resolve_all("no-such-host.invalid") == []


def test_interface_pinning_respects_user_values():
    out = interface_env("eth0", {"NCCL_SOCKET_IFNAME": "ib0"})
    assert out == {"GLOO_SOCKET_IFNAME": "eth0", "FI_TCP_IFACE": "eth0", "CCL_KVS_IFACE": "eth0"}


@pytest.mark.parametrize("delay, rate, expected", [
    (0, 0, None),
    (5, 0, ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", "5ms"]),
    (2.5, 100, ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", "2.5ms",
                "rate", "100mbit"]),
])
def test_netem_command(delay, rate, expected):
    assert netem_command("eth0", delay, rate) == expected


def test_waits_are_bounded_and_say_what_they_waited_for():
    with pytest.raises(LaunchError, match=r"timed out after 1s waiting for 2 addresses for "
                       r"'no-such-host.invalid' \(resolved 0"):
        wait_for_peers("no-such-host.invalid", 2, timeout_s=1)
    assert wait_for(lambda: 7, 1, lambda: "x") == 7


def test_port_probe_on_real_sockets():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert port_answers("127.0.0.1", port)
    assert not port_answers("127.0.0.1", port)  # closed now


def test_torchrun_command_line():
    a = argparse.Namespace(nnodes=3, nproc_per_node=2, rdzv_port=29400, rdzv_id="j",
                           wait_timeout=60.0, max_restarts=0,
                           train_args=["experiments/quickstart.yaml", "--set", "train.epochs=1"])
    argv = torchrun_argv(a, Plan("10.0.0.2", "10.0.0.5", "eth0"))
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert "--rdzv-endpoint=10.0.0.2:29400" in argv and "--local-addr=10.0.0.5" in argv
    assert "--rdzv-conf=is_host=false,join_timeout=60" in argv
    assert argv[-6:] == ["-m", "ddplab", "train", "experiments/quickstart.yaml", "--set",
                         "train.epochs=1"]


def test_link_shaping_failures_say_what_is_missing(monkeypatch):
    import subprocess

    from ddplab.launchers import rendezvous

    def fake_tc(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 2, "", "Error: Specified qdisc kind is unknown.")

    monkeypatch.setattr(rendezvous.subprocess, "run", fake_tc)
    with pytest.raises(LaunchError, match="modprobe sch_netem"):
        rendezvous.shape_link(["tc", "qdisc", "replace", "dev", "eth0", "root", "netem"])
