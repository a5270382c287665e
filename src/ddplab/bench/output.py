"""What rank 0 makes of the measurements: progress lines, the table, the support matrix, and
ONE MLflow run (metrics per op and size, results.csv, support.md, busbw.png). Other ranks
hold a ``Silent`` output, so the measuring code never asks which rank it is."""

from __future__ import annotations

import csv
import io
import os
import tempfile
from pathlib import Path
from typing import Any

from ..log import logger
from ..tracking import life, schema, spooled
from .collectives import Result

Matrix = dict[tuple[str, str], dict[str, str]]


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B" if nbytes < 1024 else f"{nbytes / 1024:.1f}K"


def table(results: list[Result]) -> str:
    head = (f"{'backend':8s} {'device':6s} {'op':15s} {'size':>6s} {'iters':>5s} {'p50 ms':>10s} "
            f"{'p95 ms':>10s} {'algbw GB/s':>10s} {'busbw GB/s':>10s}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.backend:8s} {r.device:6s} {r.op:15s} {human(r.size):>6s} {r.iters:5d} "
                     f"{r.p50_s * 1e3:10.3f} {r.p95_s * 1e3:10.3f} {r.algbw / 1e9:10.3f} "
                     f"{r.busbw / 1e9:10.3f}")
    return "\n".join(lines)


def support_text(matrix: Matrix, ops: list[str]) -> str:
    """The matrix (yes / no per op and backend/device), then each distinct "no" reason."""
    cols = list(matrix)
    names = [f"{b}/{d}" for b, d in cols]
    width = max(len(n) for n in names) + 1
    lines = [f"{'op':15s}" + "".join(f"{n:>{width}s}" for n in names)]
    for op in ops:
        cells = ["yes" if matrix[c][op] == "yes" else "no" for c in cols]
        lines.append(f"{op:15s}" + "".join(f"{x:>{width}s}" for x in cells))
    reasons = []
    for (b, d), column in matrix.items():
        for why in dict.fromkeys(v for v in column.values() if v != "yes"):
            which = [op for op in ops if column[op] == why]
            scope = "every op" if len(which) == len(ops) else ", ".join(which)
            reasons.append(f"  {b}/{d} ({scope}): {why[4:]}")
    return "\n".join(lines + (["", "why not:"] + reasons if reasons else []))


def results_csv(results: list[Result]) -> str:
    buf = io.StringIO()
    rows = [r.row() for r in results]
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return buf.getvalue()


def support_csv(matrix: Matrix, ops: list[str]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["backend", "device", "op", "works", "why_not"])
    for (b, d), column in matrix.items():
        for op in ops:
            cell = column[op]
            w.writerow([b, d, op, cell == "yes", "" if cell == "yes" else cell[4:]])
    return buf.getvalue()


def plot(results: list[Result], path: Path) -> bool:
    """busbw against size, a line per backend/device/op; False when nothing is sized."""
    series: dict[str, list[Result]] = {}
    for r in results:
        if r.size:
            series.setdefault(f"{r.backend}/{r.device} {r.op}", []).append(r)
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, rs in series.items():
        ax.plot([r.size for r in rs], [r.busbw / 1e9 for r in rs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("busbw vs size (nccl-tests' bus bandwidth)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


class Silent:
    """Every rank but 0."""

    run_id = ""

    def say(self, text: str) -> None:
        pass

    def finish(self, results: list[Result], matrix: Matrix, ops: list[str], status: str) -> None:
        pass

    def abort(self, status: str) -> None:
        pass


class Report(Silent):
    """Rank 0: prints, and records one MLflow run when ``client`` is set (else prints only);
    ``out`` also keeps the files on disk."""

    def __init__(self, client: Any, experiment: str, run_name: str, params: dict[str, Any],
                 out: str, page: Path | None = None) -> None:
        self.client, self.out, self.page, self.params = client, out, page, params
        self.run_id, self.uri, self.experiment_id = "", "", ""
        if client is not None:
            from ..tracking import experiment_id

            self.experiment_id = experiment_id(client, experiment)
            run = life.create(client, self.experiment_id, run_name,
                              {schema.KIND: "bench-collectives"})
            self.run_id, self.uri = run.info.run_id, client.tracking_uri
            # Its records through a spool, as a job's: a server gone meanwhile loses none.
            self.client = spooled.SpooledClient(client, self.uri, self.run_id,
                                                self.experiment_id,
                                                spooled.home("bench", self.run_id))
            self.client.log_batch(self.run_id, params=_params(params))

    def say(self, text: str) -> None:
        logger("bench").info(text)

    def finish(self, results: list[Result], matrix: Matrix, ops: list[str], status: str) -> None:
        print("\n" + table(results), flush=True)
        if matrix:
            print("\nsupport matrix (this machine, this world size):\n"
                  + support_text(matrix, ops), flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(self.out) if self.out else Path(tmp)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "results.csv").write_text(results_csv(results))
            if matrix:
                (folder / "support.csv").write_text(support_csv(matrix, ops))
                (folder / "support.md").write_text(f"```\n{support_text(matrix, ops)}\n```\n")
            plot(results, folder / "busbw.png")
            if self.client is not None:
                self._record(results, matrix, folder, status)
            if self.page is not None:
                self._write_page(self.page, results, matrix, ops, folder / "busbw.png")
        if self.out:
            print(f"\nfiles in {self.out}/: " + ", ".join(sorted(os.listdir(self.out))))

    def _write_page(self, page: Path, results: list[Result], matrix: Matrix, ops: list[str],
                    png: Path) -> None:
        import shlex
        import sys

        from .. import pages
        from ..distributed import host

        p = self.params
        body = (f"{p['world_size']} ranks ({p['nnodes']} node(s), {p['launcher']}), {p['dtype']}; "
                "p50/p95 of the slowest rank's time per call, every result checked.\n\n"
                f"```\n{table(results)}\n```\n")
        if matrix:
            body += ("\nSupport matrix (this machine, this world size):\n\n"
                     f"```\n{support_text(matrix, ops)}\n```\n")
        stamp = pages.Stamp(pages.now(), pages.commit(pages.CODE), host.summary(),
                            f"{p['launcher']} x{p['world_size']}: " +
                            shlex.join(["ddplab", *sys.argv[1:]]))
        pages.write(page, "Collectives: `ddplab bench collectives`", stamp, body,
                    "Written by `ddplab bench collectives --page`; run the command again to "
                    "replace it.", [png] if png.exists() else [])
        print(f"\nwrote {os.path.relpath(page)}", flush=True)

    def _record(self, results: list[Result], matrix: Matrix, folder: Path, status: str) -> None:
        from mlflow.entities import Metric, RunTag

        from ..tracking import ui_address
        from ..tracking.spool import now_ms

        t = now_ms()
        metrics = [Metric(f"{r.backend}/{r.device}/{r.op}/{key}", value, t, r.size)
                   for r in results for key, value in (
                       ("busbw_GBps", r.busbw / 1e9), ("algbw_GBps", r.algbw / 1e9),
                       ("p50_ms", r.p50_s * 1e3), ("p95_ms", r.p95_s * 1e3))]
        for i in range(0, len(metrics), schema.BATCH_METRICS):  # MLflow's log_batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i:i + schema.BATCH_METRICS])
        tags = [RunTag(schema.support_tag(b, d),
                       f"{sum(v == 'yes' for v in col.values())}/{len(col)} ops")
                for (b, d), col in matrix.items()]
        self.client.log_batch(self.run_id, tags=tags)
        for name in ("results.csv", "support.csv", "support.md", "busbw.png"):
            if (folder / name).exists():
                self.client.log_artifact(self.run_id, str(folder / name))
        life.end(self.client, self.run_id, status)
        kept = self.client.close(spooled.DELIVERY_S)
        print(f"\nMLflow run {self.run_id} {status}"
              + ui_address(self.uri, self.experiment_id, self.run_id), flush=True)
        if kept:
            logger("bench").warning(kept)

    def abort(self, status: str) -> None:
        if self.client is not None and self.run_id:
            life.end(self.client, self.run_id, status)
            kept = self.client.close(spooled.DELIVERY_S)
            if kept:
                logger("bench").warning(kept)


def _params(params: dict[str, Any]) -> list[Any]:
    from mlflow.entities import Param

    return [Param(k, str(v)[:schema.PARAM_LIMIT]) for k, v in params.items()]
