"""The epoch loop and its cadence (log, evaluate, checkpoint), then the job's ending: final
evaluation, the final checkpoint, summary.json. The train step itself is loop.py's.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DdplabError
from ..files import finite_json
from ..forensics.heartbeat import beat
from ..tracking import schema
from . import checkpoint, loop, mfu, stragglers, strategy
from .job import Job
from .summary import CpuUse


def fit(job: Job) -> None:
    """Epochs from where the state stands (a resume) to ``train.epochs`` or ``max_steps``."""
    state, train = job.state, job.cfg.train
    for epoch in range(state.epoch, train.epochs):
        if _done(job):
            break
        t0, cpu0, first_step = time.perf_counter(), time.process_time(), state.step
        job.loaders.sampler.set_position(epoch, state.samples_in_epoch)
        samples = 0
        for result in loop.train_epoch(state, job.loaders.train, train.max_steps):
            samples += result.samples
            _after_step(job, result)
            if job.stats.stopped_early:
                break
        _log_interval(job)
        if job.loaders.epoch_over(state.samples_in_epoch):
            state.epoch, state.samples_in_epoch = epoch + 1, 0
            if state.scheduler_per_epoch:
                state.scheduler.step()
        # else max_steps ended the epoch early: the state (and the final checkpoint) keeps the
        # position, so a resume with a higher max_steps trains the rest of this epoch first.
        job.stats.end_epoch(time.perf_counter() - t0, samples * job.layout.le.world_size,
                            state.step - first_step, time.process_time() - cpu0)
        job.run.log_metrics({"epoch/time_s": job.stats.epoch_times[-1],
                             "epoch/epoch": epoch + 1}, state.step)
        last = epoch + 1 == train.epochs or _done(job)
        due = (epoch + 1) % train.eval_every_epochs == 0 or last
        if due and job.stats.evaluated_at != state.step:  # eval_every_steps may have just run
            _evaluate(job)
            if not last:
                _watch(job)
        every = job.cfg.checkpoint.every_epochs
        if every and (epoch + 1) % every == 0 and not last:  # the last one is finish()'s
            _save(job, final=False)


def _done(job: Job) -> bool:
    return bool(job.stats.stopped_early) or (
        bool(job.cfg.train.max_steps) and job.state.step >= job.cfg.train.max_steps)


def _watch(job: Job) -> None:
    """train.early_stopping, after each evaluation. The metric is all-reduced, so every rank
    decides alike and stops at the same step."""
    es, stats = job.cfg.train.early_stopping, job.stats
    value = stats.last.get(es.metric) if es.metric else None
    if value is None:
        return
    sign = 1.0 if es.mode == "min" else -1.0
    if stats.early_best is None or sign * (stats.early_best - value) > es.min_delta:
        stats.early_best, stats.early_best_step, stats.early_waited = value, job.state.step, 0
        return
    stats.early_waited += 1
    if stats.early_waited >= es.patience:
        stats.stopped_early = (
            f"stopped early at step {job.state.step}: {es.metric} did not improve by more than "
            f"{es.min_delta:g} in {es.patience} evaluation(s); best {stats.early_best:.4f} at "
            f"step {stats.early_best_step}")
        job.run.set_tags({schema.STOPPED_EARLY: stats.stopped_early})
        job.console.say(stats.stopped_early)


def _after_step(job: Job, result: loop.StepResult) -> None:
    job.meter.add(result)
    job.profiler.step()
    job.stats.step_times.append(result.step_time_s)
    job.stats.data_time += result.data_time_s
    if job.stats.time_to_first_step_s is None:
        job.stats.time_to_first_step_s = time.perf_counter() - job.t_start
        job.stats.first_step_at = time.time()
        job.run.log_metrics({"train/time_to_first_step_s": job.stats.time_to_first_step_s},
                            result.step)
    if result.step % job.cfg.train.log_every == 0:
        _log_interval(job)
    every_eval = job.cfg.train.eval_every_steps
    if every_eval and result.step % every_eval == 0:
        _evaluate(job)
        _watch(job)
    every = job.cfg.checkpoint.every_steps
    if every and result.step % every == 0 and not _done(job):
        _save(job, final=False)


def _log_interval(job: Job) -> None:
    if not job.meter.step_times:
        return
    s = loop.reduce_interval(job.meter, job.layout.device)
    steady = not _profiled(job, len(job.meter.step_times))
    job.meter = loop.Meter()
    metrics = {"train/loss": s["loss"], "train/samples_per_s": s["samples_per_s"],
               "train/step_time_s": s["step_time_s"], "train/data_wait_frac": s["data_wait_frac"],
               "train/lr": float(job.state.lr)}  # the interval's last step's: never a tensor
    metrics |= {f"train/rank{r}_samples_per_s": v for r, v in enumerate(s["per_rank_samples_per_s"])}
    metrics |= {f"train/rank{r}_busy_s": v for r, v in enumerate(s["per_rank_busy_s"])}
    job.run.log_metrics(metrics, job.state.step)
    _stragglers(job, s["per_rank_busy_s"])
    job.stats.samples_per_s.append(s["samples_per_s"])
    job.stats.intervals.append((s["samples"], s["slowest_s"], steady))
    job.stats.last.update(metrics)
    job.console.say(f"epoch {job.state.epoch + 1}/{job.cfg.train.epochs} step {job.state.step}/"
                    f"{job.total_steps} loss {s['loss']:.4f} {s['samples_per_s']:.0f} samples/s")
    if not math.isfinite(s["loss"]):
        _nonfinite(job, s["loss"])


def _profiled(job: Job, steps: int) -> bool:
    """Whether torch.profiler ran in the last ``steps`` steps (its warm-up and active steps,
    counted from this process's first: steps_run): they are slower, not the job's pace."""
    p = job.cfg.profile
    first, last = job.state.steps_run - steps + 1, job.state.steps_run
    return p.enabled and first <= p.wait + p.warmup + p.active and last > p.wait


def _stragglers(job: Job, busy: list[float]) -> None:
    """Every rank holds the same reduced figures, so every rank decides the same."""
    if len(busy) < 2 or job.stats.straggler:
        return
    slow = {r: (mine, others) for r, mine, others in stragglers.slow(busy)}
    for r in range(len(busy)):
        job.stats.slow_streak[r] = job.stats.slow_streak.get(r, 0) + 1 if r in slow else 0
        if job.stats.slow_streak[r] >= stragglers.INTERVALS:
            host = job.rank_hosts[r] if r < len(job.rank_hosts) else "?"
            job.stats.straggler = stragglers.describe(
                r, host, *slow[r], f"over {stragglers.INTERVALS} intervals to step {job.state.step}")
            job.run.set_tags({schema.STRAGGLER: job.stats.straggler})
            job.console.say(f"warning: {job.stats.straggler}")
            return


class LossNotFinite(DdplabError):
    """train/loss became NaN or infinite (train.nonfinite_loss=stop)."""


def _nonfinite(job: Job, loss: float) -> None:
    """Every rank holds the same reduced loss, so every rank stops here together."""
    what = f"train/loss is {loss} at step {job.state.step} (epoch {job.state.epoch + 1})"
    if job.cfg.train.nonfinite_loss == "warn":
        job.console.say(f"warning: {what}; training goes on (train.nonfinite_loss=warn)")
        return
    raise LossNotFinite(f"{what}: the job stopped (train.nonfinite_loss=stop). Lower optim.lr, "
                        "set train.grad_clip, or set train.nonfinite_loss=warn to go on")


def _evaluate(job: Job) -> None:
    r = loop.evaluate(strategy.unwrap(job.state.model), job.loaders.eval, job.state)
    metrics = {"eval/loss": r.loss}
    if r.accuracy is not None:
        metrics["eval/accuracy"] = r.accuracy
    if job.info.kind == "tokens":
        metrics["eval/perplexity"] = math.exp(min(r.loss, 700.0))  # exp(710) overflows a float
    metrics |= {f"eval/{name}": value for name, value in r.own.items()}  # train.metrics
    job.run.log_metrics(metrics, job.state.step)
    job.stats.last.update(metrics)
    job.stats.evaluated_at = job.state.step
    shown = [f"{k.removeprefix('eval/')} {v:.4f}" for k, v in metrics.items()]
    scored = f" ({r.correct}/{r.predictions})" if r.accuracy is not None else ""
    job.console.say(f"eval at step {job.state.step}: {' '.join(shown)}{scored}")


def _save(job: Job, final: bool) -> None:
    beat("checkpoint")  # (capture gathers a sharded state from every rank)
    world = job.layout.le.world_size
    job.ckpt.save(checkpoint.capture(job.state, world, job.cfg.to_dict(), job.run.run_id, final,
                                     job.cfg.global_batch(world)))


def _cpu(job: Job) -> CpuUse:
    """Collective: the job's CPU seconds over all ranks, and what tracking took of them (each
    node's delivery process, rank 0's opening of the run, its appends to the spool)."""
    total, startup = job.run.delivery.cpu_s() if job.run.delivery else (0.0, 0.0)
    mine = time.process_time()
    t = torch.tensor([mine, total, startup, job.run.open_cpu_s, job.run.busy_s],
                     dtype=torch.float64, device=job.layout.device)
    if job.layout.le.world_size > 1:
        dist.all_reduce(t)
    ranks, delivery, delivery_startup, opening, appends = t.tolist()
    return CpuUse(ranks + delivery, delivery + opening + appends, delivery_startup + opening, mine)


def finish(job: Job) -> dict[str, Any]:
    """Final evaluation (if the last step has none yet), final checkpoint, summary.json."""
    if job.stats.evaluated_at != job.state.step:
        _evaluate(job)  # max_steps stopped training between two evaluations
    _save(job, final=True)
    le = job.layout.le
    summary = job.stats.summary(
        wall_time_s=time.perf_counter() - job.t_start, world_size=le.world_size,
        global_batch=job.cfg.global_batch(le.world_size), steps=job.state.step,
        checkpoint=str(job.ckpt.last) if job.ckpt.last else None, tracking_busy_s=job.run.busy_s,
        cpu=_cpu(job))
    # A resumed attempt's wall time, epochs and rates are its own, its steps the run's: which
    # step it began at says so (128 steps in 9 s were 84 of them, after a resume at step 44).
    summary["attempt_began_at_step"] = job.resume.step if job.resume.run_id else 0
    memory = strategy.memory(job.state.model, job.state.optimizer, job.layout.device)
    summary["memory"] = memory
    rate = summary["samples_per_s_steady"]
    summary["mfu"] = _mfu(job, rate or 0.0)
    job.run.log_metrics({**({"perf/samples_per_s": rate} if rate is not None else {}),
                         "perf/wall_time_s": summary["wall_time_s"], **memory,
                         **({"perf/mfu": summary["mfu"]} if summary["mfu"] is not None else {})},
                        job.state.step)
    text = finite_json(summary)
    job.run.log_text(text, "summary.json")
    job.console.save_summary(text)
    final = ", ".join(f"{k} {v:.4f}" for k, v in job.stats.last.items() if k.startswith("eval/"))
    job.console.say(f"done in {summary['wall_time_s']:.1f}s: {job.state.step} steps, {final}")
    return summary


def _mfu(job: Job, samples_per_s: float) -> float | None:
    """perf/mfu from the steady throughput; None when the job could not count its FLOPs."""
    basis = job.mfu_basis
    if basis is None or not basis.flops_per_sample or not basis.peak_flops_s or not samples_per_s:
        return None
    mfu_ = round(basis.mfu(samples_per_s), 6)
    if said := mfu.above_peak(mfu_, f"{basis.peak_source}: {basis.peak_flops_s / 1e12:.3g} TFLOP/s"):
        job.console.warn(said)
    return mfu_


