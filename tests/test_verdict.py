"""Unit: the study's verdict on made-up results (report rows), alarms included."""

from __future__ import annotations

from ddplab.study.verdict import judge
from tests.helpers.study import row, with_ratios


def test_a_clear_gain_is_faster_and_names_the_best():
    v = judge(with_ratios([row("1x2", 1000, 980, 1020), row("2x1", 1200, 1180, 1230)], "1x2"), "1x2")
    assert v.best == "2x1"
    assert v.lines == ["2x1 is 1.20x 1x2, faster (range 1.16-1.26) over 3 repeat(s); accuracy equal."]
    assert v.warnings == []


def test_overlapping_repeats_are_within_noise_and_a_small_ratio_too():
    rows = with_ratios([row("a", 1000, 900, 1100), row("b", 1080, 950, 1150),
                        row("c", 1030, 1025, 1035)], "a")
    v = judge(rows, "a")
    assert "b is 1.08x a, within noise" in v.lines[0] and "c is 1.03x a, within noise" in v.lines[1]


def test_four_times_at_equal_resources_raises_the_alarm():
    rows = with_ratios([row("base", 300, 250, 350), row("same", 1225, 1200, 1250)], "base")
    v = judge(rows, "base")
    assert any("efficiency 4.08 with the same resources" in w for w in v.warnings)
    assert "faster" in v.lines[0]  # the numbers say so; the warning says not to believe them


def test_a_layout_winning_back_its_exposed_communication_is_no_alarm():
    """1 rank x 2 threads against 2 gloo ranks on 2 cores: 1.3x is what the ranks' exposed
    communication costs them, not a busy machine."""
    v = judge(with_ratios([row("2r-1t", 1000, 990, 1010), row("1r-2t", 1300, 1290, 1310)], "2r-1t"),
              "2r-1t")
    assert v.warnings == [] and "faster" in v.lines[0]


def test_bf16_outrunning_fp32_on_the_same_cores_is_no_alarm():
    """Other arithmetic may be faster on the same cores (bf16 units); only the same arithmetic
    on the same cores cannot be 1.6x faster."""
    rows = with_ratios([row("fp32", 100, 99, 101), row("bf16", 160, 159, 161, precision="bf16"),
                        row("again", 160, 159, 161)], "fp32")
    v = judge(rows, "fp32")
    assert [w.split(":")[0] for w in v.warnings] == ["again"]


def test_wide_spread_fallback_failures_and_one_epoch_are_flagged():
    rows = with_ratios([row("a", 1000, 700, 1100), row("b", 1000, 990, 1010, backend="gloo (asked ccl)",
                                                       failed=1)], "a")
    v = judge(rows, "a", single_epoch=True)
    text = " | ".join(v.warnings)
    assert "a: its repeats spread 40%" in text and "b: ran on gloo (asked ccl)" in text
    assert "b: 1 of 3 runs failed" in text and "one epoch only" in text


def test_slower_and_an_accuracy_change_are_said():
    rows = with_ratios([row("a", 1000, 990, 1010), row("b", 700, 690, 710, accuracy=0.90)], "a")
    assert judge(rows, "a").lines == ["b is 0.70x a, slower (range 0.68-0.72) over 3 repeat(s); "
                                      "accuracy -0.050."]


def test_the_repeats_counted_are_those_behind_the_median():
    """A repeat that diverged (nan) or logged nothing is left out of the median: the line does
    not claim it among the repeats compared."""
    import dataclasses

    b = dataclasses.replace(row("b", 1200, 1180, 1230, runs=4), not_finite=1)
    c = dataclasses.replace(row("c", 1210, 1190, 1240, runs=4, failed=1), unlogged=1)
    v = judge(with_ratios([row("a", 1000, 980, 1020), b, c], "a"), "a")
    assert "over 3 repeat(s)" in v.lines[0] and "over 2 repeat(s)" in v.lines[1]


def test_an_mfu_above_the_peak_is_a_warning_not_a_figure():
    """A study's report showed 293.6% MFU without a word: the CPU peak measured at the job's
    start on a busy machine was 3x too low."""
    import dataclasses

    rows = with_ratios([row("a", 1000, 990, 1010), row("b", 1010, 1000, 1020)], "a")
    rows = [dataclasses.replace(rows[0], mfu=2.936), dataclasses.replace(rows[1], mfu=0.4)]
    v = judge(rows, "a")
    assert [w for w in v.warnings if "mfu" in w] == [
        "a: perf/mfu 294%, above the peak: the peak measured at its start was low (a busy "
        "machine?); its MFU says nothing"]
