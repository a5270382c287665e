"""Unit: the arithmetic every quoted figure rests on: the steady throughput of a run, the
study table's speedup and efficiency, which run of a repeat counts, and which delivery
failures are permanent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddplab.study import table
from ddplab.tracking import spool
from ddplab.training.summary import RunStats


def test_steady_throughput_pools_the_log_intervals_after_the_first():
    """All samples over all step time, not a mean of the intervals' rates: a 2-sample
    interval at an epoch's end (rate 50) weighed as much as a 128-sample one (427)."""
    stats = RunStats(intervals=[(100.0, 10.0, True), (128.0, 0.3, True), (2.0, 0.04, True)])
    assert stats.steady_samples_per_s() == pytest.approx(130 / 0.34)  # (a slow first left out)
    # the profiler's steps (slower) are not the job's pace, unless there is nothing else
    profiled = RunStats(intervals=[(100.0, 10.0, True), (128.0, 3.0, False), (128.0, 0.3, True)])
    assert profiled.steady_samples_per_s() == pytest.approx(128 / 0.3)
    assert RunStats(intervals=[(1.0, 9.0, True), (128.0, 3.0, False)]).steady_samples_per_s() \
        == pytest.approx(128 / 3.0)


def test_one_interval_is_its_own_figure_and_none_gives_no_rate():
    assert RunStats(intervals=[(80.0, 1.0, True)]).steady_samples_per_s() == 80.0
    assert RunStats().steady_samples_per_s() is None  # no step timed: no rate, not 0.0


def _run(variant, repeat, status, start, speed=None, world="1", threads="1", device="cpu"):
    tags = {"ddplab.variant": variant, "ddplab.repeat": str(repeat), "ddplab.world_size": world,
            "ddplab.threads_per_rank": threads, "ddplab.device": device,
            "ddplab.backend": "gloo", "ddplab.launcher": "torchrun"}
    metrics = {"perf/samples_per_s": speed} if speed is not None else {}
    return SimpleNamespace(info=SimpleNamespace(status=status, start_time=start, end_time=start + 1000,
                                                run_id=f"{variant}{repeat}{start}"),
                           data=SimpleNamespace(tags=tags, metrics=metrics, params={}))


def test_a_repeat_counts_once_its_finished_run_over_a_newer_failed_attempt():
    runs = [_run("a", 0, "FAILED", 1), _run("a", 0, "FINISHED", 2, 100.0),
            _run("a", 0, "FAILED", 3), _run("a", 1, "FAILED", 4), _run("a", 1, "FAILED", 5)]
    kept = table.latest_per_job(runs)["a"]
    assert sorted((r.data.tags["ddplab.repeat"], r.info.start_time) for r in kept) == [("0", 2), ("1", 5)]


def test_speedup_is_the_ratio_of_medians_and_efficiency_divides_by_resources():
    runs = [_run("base", r, "FINISHED", r, s, world="1", threads="2") for r, s in enumerate((100, 110, 90))]
    runs += [_run("wide", r, "FINISHED", 10 + r, s, world="4", threads="1") for r, s in enumerate((300, 320))]
    runs += [_run("gpu", 0, "FINISHED", 20, 800.0, world="2", threads="8", device="cuda")]
    rows = {r.variant: r for r in table.table(None, runs, ["base", "wide", "gpu"], "base", 0.0)}
    assert rows["base"].throughput_median == 100 and rows["base"].speedup == 1.0
    assert rows["wide"].speedup == pytest.approx(310 / 100)
    assert rows["wide"].efficiency == pytest.approx(3.1 / (4 / 2))  # ranks x threads on CPU
    assert rows["gpu"].resources == 2  # GPUs, not threads, on CUDA
    assert rows["gpu"].efficiency == pytest.approx(8.0 / (2 / 2))


class _Refused(Exception):
    def __init__(self, status):
        super().__init__(f"HTTP {status}")
        self.status = status

    def get_http_status_code(self):
        return self.status


@pytest.mark.parametrize("status, permanent", [(400, True), (413, True), (422, True),
                                               (401, False), (403, False), (404, False),
                                               (429, False), (500, False), (503, False)])
def test_only_a_refusal_of_the_record_itself_is_permanent(status, permanent):
    """A bad record is set aside; auth, a missing route, overload or a server error is retried."""
    assert spool._is_permanent(_Refused(status)) is permanent
    assert spool._is_permanent(spool.Invalid("torn line")) is True


def test_a_study_report_warns_of_a_run_whose_straggler_set_its_pace():
    """A straggler named in a counted run (ddplab.straggler) becomes a WARNING note of the study
    report (report.md, report.html's warnings on top), naming the variant, repeat and run; a
    superseded attempt's straggler is not the counted run's and says nothing."""
    from types import SimpleNamespace

    from ddplab.study.table import straggler_warnings

    def child(run_id, variant, repeat, start, status="FINISHED", straggler=""):
        tags = {"ddplab.variant": variant, "ddplab.repeat": repeat}
        if straggler:
            tags["ddplab.straggler"] = straggler
        return SimpleNamespace(data=SimpleNamespace(tags=tags),
                               info=SimpleNamespace(run_id=run_id, status=status, start_time=start))
    named = "rank 1 (host n2) is a straggler: 1.45x the others' median work per step"
    children = [child("r1", "2x1", "0", 1, status="FAILED", straggler="rank 0 (host n1) is a straggler"),
                child("r2", "2x1", "0", 2, straggler=named), child("r3", "1x2", "0", 3)]
    assert straggler_warnings(children) == [f"WARNING: 2x1 (repeat 0, run r2): {named}."]
    assert straggler_warnings([child("r3", "1x2", "0", 3)]) == []
