"""Unit: measured figures live in docs/results/ pages stamped by the benchmark that wrote them
(date, commit, machine, command), and the docs link to pages that exist."""

import re
import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import results  # noqa: E402 - the benchmarks' own helper


def test_a_page_says_when_where_on_what_and_how_it_was_measured(tmp_path):
    page = results.write("demo", "A demo", "| a | b |\n|---|---|\n| 1 | 2 |",
                         argv=[str(REPO / "benchmarks" / "bench_core.py"), "--reps", "3"],
                         folder=tmp_path)
    text = page.read_text()
    stamp = dict(re.findall(r"^\| (measured|commit|machine|command) \| (.+) \|$", text, re.M))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", stamp["measured"])
    assert re.match(r"[0-9a-f]{10}", stamp["commit"])
    assert re.match(r"\d+ cores \(", stamp["machine"])
    assert stamp["command"] == "`python benchmarks/bench_core.py --reps 3`"
    assert text.rstrip().endswith("| 1 | 2 |")


def test_a_gpu_machines_page_names_its_device_fake_gpu(tmp_path, monkeypatch):
    """No GPU here: torch's device queries answer as on the H200 whose pages left it out."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    text = results.write("demo", "A demo", "body", argv=["benchmarks/bench_peers.py"],
                         folder=tmp_path).read_text()
    assert re.search(r"^\| machine \| 1 x NVIDIA H200, \d+ cores \(", text, re.M)


def test_every_results_page_the_docs_link_to_exists():
    linked = {m for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]
              for m in re.findall(r"\(((?:docs/)?results/[\w.-]+\.md)\)", doc.read_text())}
    missing = [m for m in linked if not (REPO / "docs" / m.removeprefix("docs/")).is_file()]
    assert not missing, missing


def test_a_page_name_goes_to_the_checkouts_docs_results_and_a_bad_one_is_refused(tmp_path):
    import pytest

    from ddplab import pages
    from ddplab.config import ConfigError

    (tmp_path / ".git").mkdir()
    deep = tmp_path / "experiments" / "studies"
    deep.mkdir(parents=True)
    assert pages.path_for("ch09", deep) == tmp_path / "docs" / "results" / "ch09.md"
    for bad in ("", "../x", "a/b", "Upper", "-x", "x" * 81):
        with pytest.raises(ConfigError, match="--page: got"):
            pages.path_for(bad, deep)


def test_every_results_page_is_linked_from_the_docs():
    """A page nobody links to is a figure nobody finds (or one left behind)."""
    text = "".join(doc.read_text() for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")])
    orphans = [p.name for p in (REPO / "docs" / "results").glob("*.md")
               if f"results/{p.name})" not in text]
    assert not orphans, orphans


def test_a_page_that_is_a_symbolic_link_is_not_written_through(tmp_path):
    """A page or its plots' folder linked elsewhere (outside the checkout) is refused in one
    line; the file the link points at stays as it was."""
    import pytest

    from ddplab.config import ConfigError

    outside = tmp_path / "outside.md"
    outside.write_text("not yours")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "demo.md").symlink_to(outside)
    with pytest.raises(ConfigError, match=r"demo.md is a symbolic link \(to .*outside.md\)"):
        results.write("demo", "A demo", "body", argv=["bench.py"], folder=tmp_path / "results")
    assert outside.read_text() == "not yours"
