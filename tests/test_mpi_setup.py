"""Unit: ddplab mpi's pure parts (hostfile, operator keys, the mpirun line, interface pinning)."""

import argparse
import os
import socket

import pytest

from ddplab.doctor import ssh_options
from ddplab.launchers.detect import LaunchError
from ddplab.launchers.mpi import (
    main,
    mpirun_argv,
    operator_keys,
    operator_ssh_options,
    peer_network,
    read_hostfile,
)
from ddplab.launchers.rendezvous import local_addresses

OPERATOR_HOSTFILE = ("ddplab-mpi-worker-0.ddplab-mpi-worker.ddplab.svc slots=2\n"
                     "ddplab-mpi-worker-1.ddplab-mpi-worker.ddplab.svc slots=2\n")


def test_the_mpi_operators_hostfile_is_read(tmp_path):
    f = tmp_path / "hostfile"
    f.write_text("# made by the operator\n\n" + OPERATOR_HOSTFILE + "bare-host  # one slot\n")
    assert read_hostfile(f) == [("ddplab-mpi-worker-0.ddplab-mpi-worker.ddplab.svc", 2),
                                ("ddplab-mpi-worker-1.ddplab-mpi-worker.ddplab.svc", 2),
                                ("bare-host", 1)]


@pytest.mark.parametrize("text, message", [
    ("", "lists no hosts"),
    ("a slots=two\n", r"hostfile:1: slots='two'; expected a whole number >= 1"),
    ("a slots=2\nb slots=0\n", r"hostfile:2: slots='0'"),
])
def test_a_bad_hostfile_names_the_line_and_the_value(tmp_path, text, message):
    f = tmp_path / "hostfile"
    f.write_text(text)
    with pytest.raises(LaunchError, match=message):
        read_hostfile(f)
    with pytest.raises(LaunchError, match="no hostfile at .*/etc/mpi/hostfile"):
        read_hostfile(tmp_path / "missing")


def test_operator_keys_need_the_secrets_three_files(tmp_path):
    (tmp_path / "id_rsa").write_text("-----BEGIN EC PRIVATE KEY-----\n")
    with pytest.raises(LaunchError, match="missing .*id_rsa.pub, .*authorized_keys; it must be "
                                          "the MPIJob's spec.sshAuthMountPath"):
        operator_keys(tmp_path)
    (tmp_path / "id_rsa.pub").write_text("ecdsa-sha2-nistp521 AAAAkey comment\n")
    (tmp_path / "authorized_keys").write_text("ecdsa-sha2-nistp521 AAAAkey\n")
    assert operator_keys(tmp_path) == (tmp_path / "id_rsa", "ecdsa-sha2-nistp521 AAAAkey")


def operator_secret(d, public="ecdsa-sha2-nistp521 AAAAkey"):
    d.mkdir()
    (d / "id_rsa").write_text("-----BEGIN EC PRIVATE KEY-----\nsecret\n")
    (d / "id_rsa.pub").write_text(public + "\n")
    (d / "authorized_keys").write_text(public + "\n")
    return d


def test_operator_ssh_options_trust_only_the_jobs_key_for_the_hostfiles_hosts(tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    auth = operator_secret(tmp_path / "auth")
    opts = operator_ssh_options(auth, ["w0.svc", "w1.svc"], 2222,
                                {"OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10"})
    assert opts[:2] == ["-o", "ConnectionAttempts=10"]  # the operator's first: ssh keeps it
    assert "StrictHostKeyChecking=yes" in opts and "-p" in opts and opts[opts.index("-p") + 1] == "2222"
    known = next(o.split("=", 1)[1] for o in opts if o.startswith("UserKnownHostsFile="))
    with open(known) as f:
        assert f.read() == ("[w0.svc]:2222 ecdsa-sha2-nistp521 AAAAkey\n"
                            "[w1.svc]:2222 ecdsa-sha2-nistp521 AAAAkey\n")
    key = opts[opts.index("-i") + 1]
    assert os.stat(key).st_mode & 0o777 == 0o600  # ssh refuses a readable private key
    with open(key) as f:
        assert f.read() == (auth / "id_rsa").read_text()


def test_doctor_checks_ssh_with_the_launchers_options_under_the_operator(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    auth = operator_secret(tmp_path / "auth")
    env = {"OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10"}
    assert ssh_options(["w0"], env) == ["-o", "ConnectionAttempts=10"]
    under_operator = ssh_options(["w0"], {**env, "DDPLAB_SSH_AUTH": str(auth)})
    assert under_operator == operator_ssh_options(auth, ["w0"], 2222, env)


def test_the_worker_refuses_keys_it_could_rewrite(tmp_path):
    """sshd's StrictModes is off under the operator; this check stands in for what it guards."""
    for name in ("id_rsa", "id_rsa.pub", "authorized_keys"):
        (tmp_path / name).write_text("x\n")
    a = argparse.Namespace(mpi_command="worker", ssh_auth=str(tmp_path), ssh_port=2222)
    with pytest.raises(LaunchError, match="authorized_keys is writable by this user"):
        main(a)


def test_mpirun_line_pins_the_network_and_forwards_the_environment():
    a = argparse.Namespace(slots=2, master_port=29500, train_args=["x.yaml"])
    argv = mpirun_argv(a, ["w0.svc", "w1.svc"], ["-p", "2222", "-o", "X=1"], "10.1.0.0/16",
                       {"MLFLOW_TRACKING_URI": "http://m", "UNRELATED": "1"})
    line = " ".join(argv)
    assert argv[:3] == ["mpirun", "-np", "4"] and "--host w0.svc:2,w1.svc:2" in line
    assert "--mca plm_rsh_args -p 2222 -o X=1" in line
    assert "--mca plm_rsh_no_tree_spawn 1" in line
    assert "--mca btl_tcp_if_include 10.1.0.0/16 --mca oob_tcp_if_include 10.1.0.0/16" in line
    assert "-x MASTER_ADDR=w0.svc" in line and "-x MLFLOW_TRACKING_URI" in line
    assert "UNRELATED" not in line and argv[-2:] == ["train", "x.yaml"]


def test_peer_network_is_the_cidr_of_the_interface_that_reaches_the_peer():
    """On this machine's real interfaces: a peer on a local network gives that network's CIDR."""
    mine = next((ip for ip in local_addresses() if not ip.startswith("127.")), None)
    if mine is None:
        pytest.fail("this machine has no non-loopback IPv4 address")
    cidr = peer_network(mine)
    import ipaddress

    assert ipaddress.ip_address(mine) in ipaddress.ip_network(cidr)


def test_peer_network_falls_back_to_the_route_interface_for_point_to_point_addresses():
    """A peer on no local network (as in /32 pod networks) gives the name of the interface the
    route leaves by; with no route at all the error says so."""
    import ipaddress

    import psutil

    nets = [ipaddress.ip_interface(f"{a.address}/{a.netmask}").network
            for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and a.netmask]
    # The documentation ranges (RFC 5737), whichever is not a network of this machine.
    peer = next(ip for ip in ("203.0.113.7", "198.51.100.7", "192.0.2.7")
                if not any(ipaddress.ip_address(ip) in n for n in nets))
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
    except OSError:  # no default route here
        with pytest.raises(LaunchError, match="no interface of this machine reaches"):
            peer_network(peer)
        return
    assert peer_network(peer) in set(local_addresses().values())
