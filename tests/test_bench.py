"""``ddplab bench collectives``: real collectives across real torchrun processes, every result
checked, one MLflow run, the support matrix; bad arguments are one line."""

from __future__ import annotations

import csv
import datetime
import io
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddplab.bench import collectives as bc
from ddplab.bench.ops import OPS, Op
from ddplab.bench.run import BenchError, parse_size
from tests.conftest import NO_CCL, ddplab, job_env, runs

ALL_OPS = list(OPS)


def _csv(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(path.read_text())))


# ---- unit ----

@pytest.mark.parametrize("text,value", [("1K", 1024), ("64M", 64 << 20), ("256mb", 256 << 20),
                                        ("4096", 4096), ("1G", 1 << 30)])
def test_sizes_are_1024_based(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "1X", "-1K", "0", "5G", "1.5M"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(BenchError, match="--sizes"):
        parse_size(text)


def test_busbw_factors_are_nccl_tests_ones():
    n = 4
    assert OPS["all_reduce"].factor(n) == pytest.approx(1.5)
    for name in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        assert OPS[name].factor(n) == pytest.approx(0.75), name
    for name in ("broadcast", "reduce", "send_recv"):
        assert OPS[name].factor(n) == 1.0, name


def test_a_wrong_result_is_caught_not_timed():
    """An op whose check fails is reported as "wrong result" and never timed."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        good = OPS["all_reduce"]
        plan = bc.Plan(["gloo"], [good], [1024], torch.float32, "cpu", 5, 1, 0.1)
        bench = bc.Bench(plan, 0, 1, 30)
        broken = Op("all_reduce", lambda c: (good.build(c)[0], lambda: False), good.factor)
        assert bench.measure("gloo", torch.device("cpu"), broken, 1024) == "wrong result"
        r = bench.measure("gloo", torch.device("cpu"), good, 1024)
        assert isinstance(r, bc.Result) and r.ok and r.size == 1024 and 3 <= r.iters <= 5
        assert r.p95_s >= r.p50_s > 0
    finally:
        dist.destroy_process_group()


# ---- real processes ----

@pytest.mark.distributed
def test_two_ranks_every_op_checked_one_run(tmp_path, store):
    out = ddplab(["bench", "collectives", "--backend", "gloo", "--sizes", "1K,64K",
                  "--iters", "5", "--out", "files", "--page", "two"], tmp_path,
                 job_env(store, **NO_CCL), nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _csv(tmp_path / "files" / "results.csv")
    sized = [op for op in ALL_OPS if op != "barrier"]
    assert sorted((r["op"], int(r["size_bytes"])) for r in rows) == sorted(
        [(op, s) for op in sized for s in (1024, 65536)] + [("barrier", 0)])
    for r in rows:
        assert r["correct"] == "True" and r["backend"] == "gloo" and r["device"] == "cpu"
        factor = OPS[r["op"]].factor(2)
        assert float(r["busbw_GBps"]) == pytest.approx(float(r["algbw_GBps"]) * factor, abs=2e-4)
        assert float(r["p95_ms"]) >= float(r["p50_ms"]) > 0
    support = {(r["backend"], r["device"], r["op"]): r for r in _csv(tmp_path / "files" / "support.csv")}
    assert all(support[("gloo", "cpu", op)]["works"] == "True" for op in ALL_OPS)
    assert "does not import" in support[("ccl", "cpu", "all_reduce")]["why_not"]
    assert support[("nccl", "cuda", "barrier")]["works"] == "False"
    assert "support matrix" in out.stdout and "gloo/cpu" in out.stdout

    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.tags["ddplab.kind"] == "bench-collectives"
    assert run.data.params["world_size"] == "2" and run.data.tags["ddplab.support.gloo.cpu"] == "10/10 ops"
    from mlflow import MlflowClient

    client = MlflowClient(store)
    history = client.get_metric_history(run.info.run_id, "gloo/cpu/all_reduce/busbw_GBps")
    assert sorted(m.step for m in history) == [1024, 65536]
    names = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"results.csv", "support.csv", "support.md", "busbw.png"} <= names

    # --page: the same table and matrix as a stamped results page, the plot beside it.
    page = (tmp_path / "docs" / "results" / "two.md").read_text()
    stamp = dict(re.findall(r"^\| (measured|commit|machine|command) \| (.+) \|$", page, re.M))
    assert re.match(r"\d+ cores \(", stamp["machine"]) and stamp["commit"] != "unknown"
    assert stamp["command"].startswith("`torchrun x2: ddplab bench collectives --backend gloo")
    p50 = {(r["op"], r["size_bytes"]): float(r["p50_ms"]) for r in rows}
    line = next(x for x in page.splitlines() if re.match(r"\s*gloo\s+cpu\s+all_reduce\s+64K\b", x))
    assert float(line.split()[5]) == pytest.approx(p50[("all_reduce", "65536")], abs=1e-3)
    assert "gloo/cpu" in page and "(two/busbw.png)" in page
    assert (tmp_path / "docs" / "results" / "two" / "busbw.png").stat().st_size > 1000


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int32", "float64"])
def test_three_ranks_each_dtype_comes_out_right(tmp_path, store, dtype):
    out = ddplab(["bench", "collectives", "--sizes", "3K", "--iters", "3", "--dtype", dtype,
                  "--no-support", "--no-tracking", "--out", "."], tmp_path, job_env(store), nproc=3)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _csv(tmp_path / "results.csv")
    assert {r["op"] for r in rows} == set(ALL_OPS) and all(r["correct"] == "True" for r in rows)
    assert runs(store) == []  # --no-tracking: nothing recorded


@pytest.mark.distributed
def test_the_issue_command_as_typed(tmp_path, store):
    out = ddplab(["bench", "collectives", "--backend", "gloo", "--ops", "all_reduce",
                  "--sizes", "1M,64M"], tmp_path, job_env(store), nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert " 64M " in out.stdout and "all_reduce" in out.stdout
    (run,) = runs(store)
    assert run.data.params["sizes"] == f"{1 << 20},{64 << 20}"


@pytest.mark.parametrize("args,needle", [
    (["--backend", "ccl"], "--backend: 'ccl' cannot run here"),
    (["--backend", "nccl"], "--backend: 'nccl' cannot run here"),
    (["--backend", "foo"], "--backend: 'foo' is not one of"),
    (["--ops", "allreduce,bogus"], "--ops: 'bogus' is not one of"),
    (["--sizes", "12Q"], "--sizes: '12Q' is not a size"),
    (["--iters", "0"], "--iters: got 0"),
    (["--page", "My Page"], "--page: got 'My Page'"),
    # A hostile pass: a file given as --out failed the benchmark at its end (FileExistsError).
    (["--out", "results.txt"], "--out: got 'results.txt'; results.txt is a file"),
])
def test_bad_arguments_are_one_line(tmp_path, store, args, needle):
    if "nccl" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: nccl can run")
    (tmp_path / "results.txt").write_text("a file, not a folder")
    out = ddplab(["bench", "collectives", *args], tmp_path, job_env(store, **NO_CCL))
    assert out.returncode == 2
    assert needle in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_unreachable_server_is_one_line_before_measuring(tmp_path):
    out = ddplab(["bench", "collectives", "--sizes", "1K"], tmp_path,
                 job_env("http://127.0.0.1:9"))
    assert out.returncode == 1
    assert "127.0.0.1:9" in out.stderr and "Traceback" not in out.stderr
    assert "p50" not in out.stderr


def test_the_cli_names_match_the_implementation():
    """The CLI parses with light constants (no torch import); they must be what runs."""
    from ddplab.bench import DTYPE_NAMES, OP_NAMES

    assert OP_NAMES == tuple(OPS) and set(DTYPE_NAMES) == set(bc.DTYPES)
