"""A study's rows as the files a reader opens: report.md, report.html (its template in
``templates/``, the plots inline, sized for MLflow's artifact pane), results.csv, and the table
printed on the console.
"""

from __future__ import annotations

import base64
import csv
import io
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .spec import better
from .table import COLUMNS, THROUGHPUT, Row, fmt, is_throughput

HEADS = ("variant", "runs ok/all", "samples/s median [min-max]", "speedup", "efficiency", "MFU",
         "eval acc", "eval loss", "train loss", "samples/s", "time to target s", "wall s",
         "model state MB (max rank)", "backend, launcher")
"""The heads for throughput; another compared metric's replace its three (heads())."""


def heads(metric: str = THROUGHPUT, mode: str = "max") -> tuple[str, ...]:
    """The table's heads: a compared metric other than throughput is its own column, named and
    with its direction ("val/loss median [min-max], lower is better"), then its change vs the
    baseline; speedup and efficiency are throughput's alone."""
    if is_throughput(metric):
        return HEADS
    return (HEADS[0], HEADS[1], f"{metric} median [min-max], {better(mode)}", "vs baseline",
            "", *HEADS[5:])


def _numeric(metric: str, mode: str) -> set[str]:
    return set(heads(metric, mode)[1:-1]) - {""}  # (all but the name and what ran)


def _cells(r: Row) -> list[str]:
    spread = (f"{fmt(r.throughput_median)} [{fmt(r.throughput_min)}-{fmt(r.throughput_max)}]"
              if r.throughput_median is not None else "-")
    wall = fmt(r.wall_time_s)  # (as the console: "5" beside a compared wall time of 4.935)
    # (a tiny model's 0.03% is not "0.0%")
    mfu = "-" if r.mfu is None else f"{r.mfu:.1%}" if r.mfu >= 0.01 else f"{r.mfu * 100:.2g}%"
    if is_throughput(r.metric):
        ratio, efficiency = fmt(r.speedup), fmt(r.efficiency)
    else:
        ratio, efficiency = (f"{r.change:+.1%}" if r.change is not None else "-"), "-"
    return [r.variant, f"{r.runs - r.failed}/{r.runs}", spread, ratio,
            efficiency, mfu, fmt(r.eval_accuracy), fmt(r.eval_loss), fmt(r.train_loss),
            fmt(r.samples_per_s), fmt(r.time_to_target_s), wall, fmt(r.model_state_mb),
            f"{r.backend}, {r.launcher}"]


def _figure(rows: list[Row]) -> tuple[str, str]:
    return (rows[0].metric, rows[0].metric_mode) if rows else (THROUGHPUT, "max")


def grid(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """The table's heads and cells, without the columns no variant has a value in (no target
    accuracy: no "time to target"; no efficiency but for throughput), so it stays narrow enough
    for MLflow's artifact pane."""
    names = heads(*_figure(rows))
    cells = [_cells(r) for r in rows]
    keep = [i for i in range(len(names)) if i == 0 or any(c[i] != "-" for c in cells)]
    return [names[i] for i in keep], [[c[i] for i in keep] for c in cells]


def markdown(rows: list[Row], title: str, notes: list[str]) -> str:
    names, cells = grid(rows)
    lines = [f"# {title}", "", "| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    return "\n".join(lines + [""] + notes) + "\n"


def html(md_rows: list[Row], title: str, notes: list[str], pngs: list[Path]) -> str:
    """report.html (``templates/report.html.j2``): the verdict and warnings on top, the table,
    then the plots; sized to fit MLflow's artifact pane (the table scrolls by itself rather than
    cut columns). Autoescaped: a variant's name or a note is text, never markup."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("ddplab.study", "templates"),
                             autoescape=True, trim_blocks=True, keep_trailing_newline=True)
    names, cells = grid(md_rows)
    images = [{"stem": p.stem, "name": p.name, "data": base64.b64encode(p.read_bytes()).decode()}
              for p in pngs]
    return env.get_template("report.html.j2").render(
        title=title, heads=names, cells=cells, numeric=_numeric(*_figure(md_rows)), zip=zip,
        images=images,
        verdicts=[n for n in notes if n.startswith("Verdict:")],
        warnings=[n for n in notes if n.startswith("WARNING:")],
        notes=[n for n in notes if not n.startswith(("Verdict:", "WARNING:"))])


def results_csv(rows: list[Row]) -> str:
    """One line per variant; the compared figure's columns named after it (``val/loss_median``),
    throughput's keeping their names (``throughput_median``)."""
    metric = rows[0].metric if rows else ""
    named = {} if not rows or is_throughput(metric) else {
        c: f"{metric}_{c.removeprefix('throughput_')}" for c in COLUMNS if c.startswith("throughput_")}
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=[named.get(c, c) for c in COLUMNS])
    w.writeheader()
    for r in rows:
        w.writerow({named.get(k, k): v for k, v in asdict(r).items()})
    return buf.getvalue()


def print_table(rows: list[Row], title: str, console: Any) -> None:
    from rich.table import Table

    metric, mode = _figure(rows)
    throughput = is_throughput(metric)
    t = Table(title=title)
    memory = any(r.model_state_mb is not None for r in rows)
    accuracy = any(r.eval_accuracy is not None for r in rows)  # (a script's jobs: none)
    # What the jobs trained to and how fast, beside a compared time (a script study's default)
    loss = any(r.train_loss is not None for r in rows) and not accuracy
    speed = any(r.samples_per_s is not None for r in rows)
    figure = ("samples/s", "speedup", "efficiency") if throughput else (
        f"{metric} ({better(mode)})", "vs baseline")
    for c in ("variant", "ok/all", *figure, *(["eval acc"] if accuracy else []),
              *(["train loss"] if loss else []), *(["samples/s"] if speed else []), "wall s",
              *(["state MB"] if memory else []), "backend", "launcher"):
        t.add_column(c)
    for r in rows:
        ratios = (fmt(r.speedup), fmt(r.efficiency)) if throughput else (
            f"{r.change:+.1%}" if r.change is not None else "-",)
        t.add_row(r.variant, f"{r.runs - r.failed}/{r.runs}", fmt(r.throughput_median),
                  *ratios, *([fmt(r.eval_accuracy)] if accuracy else []),
                  *([fmt(r.train_loss)] if loss else []), *([fmt(r.samples_per_s)] if speed else []),
                  fmt(r.wall_time_s), *([fmt(r.model_state_mb)] if memory else []),
                  r.backend, r.launcher)
    console.print(t)
