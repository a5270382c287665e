"""Unit: backend resolution (incl. the ccl path), CPU thread layout, oneCCL defaults."""

import sys

import pytest

from ddplab.config import DistConfig
from ddplab.distributed import choice, cpu, group, oneccl
from ddplab.launchers.detect import LaunchEnv
from tests.conftest import STAND_INS

NONE = {"gloo": (True, "built in"), "nccl": (False, "no CUDA"), "ccl": (False, "no bindings"),
        "mpi": (False, "no MPI")}
CCL = {**NONE, "ccl": (True, "bindings 2.7.0")}
GPU = {**NONE, "nccl": (True, "built in")}


@pytest.mark.parametrize("requested, device, table, name, requested_tag", [
    ("auto", "cpu", NONE, "gloo", "auto"),
    ("auto", "cpu", CCL, "ccl", "auto"),
    ("auto", "cuda", GPU, "nccl", "auto"),
    ("gloo", "cpu", CCL, "gloo", "gloo"),
    ("ccl", "cpu", CCL, "ccl", "ccl"),
])
def test_resolution(requested, device, table, name, requested_tag):
    picked = choice.resolve(requested, device, False, table)
    assert (picked.name, picked.requested, picked.fell_back) == (name, requested_tag, False)


def test_auto_records_why_it_did_not_pick_ccl():
    assert "no bindings" in choice.resolve("auto", "cpu", False, NONE).reason


def test_explicit_ccl_without_bindings_fails_clearly():
    with pytest.raises(choice.BackendError, match=r"'ccl' is not available: no bindings.*"
                       r"allow_backend_fallback=true"):
        choice.resolve("ccl", "cpu", False, NONE)


def test_explicit_ccl_without_bindings_falls_back_when_allowed():
    picked = choice.resolve("ccl", "cpu", True, NONE)
    assert (picked.name, picked.requested, picked.fell_back) == ("gloo", "ccl", True)
    assert "fallback to gloo" in picked.reason and "no bindings" in picked.reason


def test_nccl_on_cpu_is_refused():
    with pytest.raises(choice.BackendError, match="nccl needs dist.device cuda"):
        choice.resolve("nccl", "cpu", False, GPU)


def test_real_import_of_the_stand_in_bindings_registers_ccl(monkeypatch):
    """Uses tests/stand_ins (a STAND-IN for oneccl_bindings_for_pytorch; gloo underneath)."""
    monkeypatch.syspath_prepend(str(STAND_INS))
    monkeypatch.delitem(sys.modules, "oneccl_bindings_for_pytorch", raising=False)
    table = choice.available("cpu")
    assert table["ccl"][0] and "0.0+stand-in" in table["ccl"][1]
    assert choice.resolve("auto", "cpu", False, table).name == "ccl"


def test_without_bindings_the_table_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "oneccl_bindings_for_pytorch", None)  # import fails
    monkeypatch.setenv("DDPLAB_CCL_HOME", "/nonexistent")  # and ddplab's own is not built
    ok, why = choice.available("cpu")["ccl"]
    assert not ok and "does not import" in why


@pytest.mark.parametrize("threads, local_world, cores, bk, workers, expected", [
    ("auto", 2, 8, "gloo", "1", 4),
    ("auto", 2, 8, "ccl", "1", 3),      # one core per rank left for oneCCL's worker
    ("auto", 2, 2, "ccl", "1", 1),      # never below one
    ("auto", 4, 2, "gloo", "1", 1),
    (6, 2, 8, "gloo", "1", 6),          # explicit wins
    ("auto", 1, 16, "ccl", "2", 14),
])
def test_threads_per_rank(threads, local_world, cores, bk, workers, expected):
    cfg = DistConfig(threads_per_rank=threads)
    env = {"CCL_WORKER_COUNT": workers}
    assert cpu.threads_per_rank(cfg, local_world, cores, bk, env) == expected


def test_core_blocks_are_disjoint_and_cover():
    cores = list(range(8))
    blocks = [cpu.core_block(cores, r, 4) for r in range(4)]
    assert blocks == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cpu.core_block([0], 1, 2) == [0]  # too few cores: share them


def test_ccl_defaults_respect_user_values(tmp_path):
    lib = tmp_path / "opt" / "mpi" / "libfabric" / "lib"
    lib.mkdir(parents=True)
    (lib / "libfabric.so").touch()
    le = LaunchEnv("torchrun", 3, 4, 1, 2, 1, "n0", 29500)
    out = oneccl.ccl_env_defaults(le, str(tmp_path), {"CCL_WORKER_COUNT": "2"})
    assert "CCL_WORKER_COUNT" not in out  # the user's value stays
    assert out["CCL_ATL_TRANSPORT"] == "ofi" and out["FI_PROVIDER"] == "tcp"
    assert out["CCL_OFI_LIBRARY_PATH"] == str(lib / "libfabric.so")
    assert out["FI_PROVIDER_PATH"] == str(lib / "prov")
    assert (out["CCL_LOCAL_RANK"], out["CCL_LOCAL_SIZE"]) == ("0", "1")  # 2 nodes: see test_ccl


def test_ccl_defaults_single_node_without_package_libfabric():
    out = oneccl.ccl_env_defaults(LaunchEnv("none", 0, 1, 0, 1, 0, "127.0.0.1", 29500), None, {})
    assert "FI_PROVIDER" not in out and "CCL_OFI_LIBRARY_PATH" not in out


@pytest.mark.parametrize("text, expected", [("max 100000", None), ("150000 100000", 1.5),
                                            ("50000 100000", 0.5)])
def test_cgroup_quota(tmp_path, text, expected):
    f = tmp_path / "cpu.max"
    f.write_text(text + "\n")
    assert cpu.cpu_quota(f) == expected
    assert cpu.cpu_quota(tmp_path / "absent") is None


def test_a_oneccl_failure_at_start_is_not_blamed_on_missing_peers(monkeypatch):
    """oneCCL can fail to open its transport within seconds (seen once in ~50 jobs here:
    "failed to initialize ATL", libfabric found no provider). That error text, as ddplab's ccl
    raised it, must not be reported as a 600 s wait for peers that never came; a store timeout
    still is."""
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "43367")
    le = LaunchEnv("torchrun", 1, 2, 1, 2, 0, "localhost", 43367)
    ccl = RuntimeError("oneCCL: atl_ofi_comm.cpp:1413 init_transport: EXCEPTION: failed to "
                       "initialize ATL")
    said = group.init_failure(ccl, le, 600)
    assert "ccl backend did not start" in said and "failed to initialize ATL" in said
    assert "waited" not in said and "never came" not in said
    store = RuntimeError("Timed out after 601 seconds waiting for clients. 1/2 clients joined.")
    said = group.init_failure(store, le, 600)
    assert "waited 600s (dist.timeout_s) for rank 0's store at localhost:43367" in said
    # Refused within seconds (a peer's stale address): no "waited 600s" it did not wait.
    refused = RuntimeError("Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: "
                           "SO_ERROR: Connection refused, remote=[127.0.0.1]:55720")
    said = group.init_failure(refused, le, 600, 4.2)
    assert said == (f"rank 1 of 2 could not reach rank 0's store at localhost:43367 (MASTER_ADDR:"
                    f"MASTER_PORT) and the other ranks (RuntimeError: {refused}), after 4s of "
                    "dist.timeout_s 600s"), said
    # Every rank met at the store, one never joined oneCCL's communicator: not "its store".
    joined = RuntimeError("ccl (ddplab): oneCCL's communicator of 2 ranks was not made within "
                          "600 s: a rank did not join it (it failed or was stopped during set-up)")
    said = group.init_failure(joined, le, 600)
    assert said == f"rank 1 of 2: {joined}"
