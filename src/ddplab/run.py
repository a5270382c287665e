"""The one function that strings the steps together, in the order the data flows:
config -> launch environment -> process group -> data -> model -> loop -> tracking ->
checkpoint -> report.

Launched as (any launcher; the rank layout comes from launch.py):
    ddplab train experiments/quickstart.yaml                                  # one process
    torchrun --standalone --nproc-per-node 2 -m ddplab train experiments/quickstart.yaml
    torchrun --nnodes 2 --node-rank K --rdzv-backend c10d --rdzv-endpoint node0:29400 \\
        --rdzv-id job1 -m ddplab train experiments/quickstart.yaml           # on each node
    mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT ddplab train experiments/quickstart.yaml
    srun --ntasks 4 --ntasks-per-node 2 ddplab train experiments/quickstart.yaml
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import backend, capsule, checkpoint, checks, config, data, loop, models, optim, tracking
from .launch import LaunchEnv
from .report import Console, RunStats


class Terminated(Exception):
    """SIGTERM: the launcher stops the survivors when a rank fails, or the job was stopped."""


class Signals:
    """SIGINT raises KeyboardInterrupt and SIGTERM raises Terminated, once each job.

    The first signal is remembered: after Ctrl-C a rank may fail in a collective (its peer is
    gone) before its own interrupt surfaces, and the run must still end KILLED, not FAILED.
    Later signals are ignored, so torchrun's follow-up SIGTERM cannot cut the run's ending.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            return
        self.received = signum
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated("terminated by SIGTERM (a peer rank failed, or the job was stopped)")

    def status(self) -> str:
        return "KILLED" if self.received == signal.SIGINT else "FAILED"

    def shield(self) -> None:
        """From here on nothing interrupts: the run's ending must reach the store."""
        for sig in self.previous:
            signal.signal(sig, signal.SIG_IGN)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


@dataclass
class Layout:
    """What the launch steps decided, before any data or model exists."""

    le: LaunchEnv
    device: torch.device
    choice: backend.BackendChoice
    threads: int
    pinned: list[int]
    ccl_env: dict[str, str]


def train(path: str | None, overrides: list[str], summary_out: str = "") -> str:
    """Run one job. Returns the MLflow run id ("" when tracking is off)."""
    t_start = time.perf_counter()
    cfg = config.load(path, overrides)
    le = LaunchEnv.from_environ(os.environ)
    checks.before_start(cfg, le, summary_out, torch.cuda.is_available())
    layout = _layout(cfg, le)
    backend.init_process_group(layout.choice, le, layout.device, cfg.dist.timeout_s)
    try:
        with Signals() as signals:
            run_id = _tracked(cfg, layout, t_start, signals, summary_out)
        # No rank leaves before rank 0 has ended the run: a peer's exit (torchrun stops the
        # group when one rank exits non-zero) must never cut the final checkpoint or status.
        backend.finish_together()
        return run_id
    finally:
        backend.destroy_process_group()


def _layout(cfg: config.ExperimentConfig, le: LaunchEnv) -> Layout:
    _seed(cfg.train)
    device = backend.resolve_device(cfg.dist.device, le.local_rank)
    choice = backend.resolve(cfg.dist.backend, device.type, cfg.dist.allow_backend_fallback)
    if choice.fell_back:
        warnings.warn(choice.reason, stacklevel=2)
    ccl_env = backend.apply_ccl_env(le, os.environ) if choice.name == "ccl" else {}
    threads, pinned = torch.get_num_threads(), []
    if device.type == "cpu":
        threads, pinned = backend.apply_cpu_layout(cfg.dist, le, choice.name)
    else:
        torch.cuda.set_device(device)
    return Layout(le, device, choice, threads, pinned, ccl_env)


def _seed(cfg: config.TrainConfig) -> None:
    # One seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def _tracked(cfg: config.ExperimentConfig, layout: Layout, t_start: float,
             signals: Signals, summary_out: str) -> str:
    le = layout.le
    ckpt_root = Path(cfg.checkpoint.dir) / cfg.name
    resumed_from, payload = checkpoint.broadcast_resume(cfg.checkpoint.resume, ckpt_root,
                                                        le.is_rank0, le.world_size)
    # Every rank holds the payload, so every rank refuses alike, before any run is touched.
    changes = checkpoint.check_resume(payload["config"], cfg, resumed_from) if payload else []
    tracker = tracking.open_tracker(cfg.tracking, le, cfg.name, cfg.description,
                                    payload["run_id"] if payload else "")
    system = tracking.SystemMetrics(
        tracker.run_id, tracker.uri, le.node_rank, cfg.tracking.system_metrics_interval_s,
        resume=payload is not None,
        active=cfg.tracking.system_metrics and le.is_node_leader)
    status, error = "FAILED", ""
    try:
        Fit(cfg, layout, tracker, payload, resumed_from, t_start, summary_out, changes).run()
        status = "FINISHED"
    except BaseException as e:
        status = signals.status()
        error = ("interrupted (SIGINT / Ctrl-C)" if status == "KILLED"
                 else f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        raise
    finally:
        signals.shield()
        system.stop()
        tracker.finish(status, error)
    Console(le.is_rank0).say(_where(tracker))
    return tracker.run_id


def _where(tracker: tracking.NullTracker) -> str:
    if not tracker.run_id:
        return "tracking was off: nothing recorded in MLflow"
    route = f"#/experiments/{tracker.experiment_id}/runs/{tracker.run_id}"
    # Inside compose or a cluster the tracking URI is an in-network name (http://mlflow:5000)
    # that the user's browser cannot open: DDPLAB_UI_URL says where the browser finds the UI.
    ui = os.environ.get("DDPLAB_UI_URL", "")
    if ui or tracker.uri.startswith(("http://", "https://")):
        return f"MLflow run {tracker.run_id} FINISHED: {(ui or tracker.uri).rstrip('/')}/{route}"
    return (f"MLflow run {tracker.run_id} FINISHED in {tracker.uri}; browse it with `make ui`, "
            f"then http://127.0.0.1:5000/{route}")


class Fit:
    """Builds data, model and state, then runs the epochs. Each method does one thing."""

    def __init__(self, cfg: config.ExperimentConfig, layout: Layout,
                 tracker: tracking.NullTracker, payload: dict[str, Any] | None,
                 resumed_from: str, t_start: float, summary_out: str = "",
                 changes: list[tuple[str, Any, Any]] | None = None) -> None:
        self.cfg, self.layout, self.le, self.tracker = cfg, layout, layout.le, tracker
        self.changes = changes or []
        self.payload, self.resumed_from, self.t_start = payload, resumed_from, t_start
        self.console = Console(self.le.is_rank0, summary_out)
        self.ckpt = checkpoint.Checkpointer(Path(cfg.checkpoint.dir) / cfg.name,
                                            cfg.checkpoint.keep, self.le.is_rank0)
        self.stats = RunStats()
        self.meter = loop.Meter()

    # ---- building ----

    def run(self) -> None:
        hosts = self._hosts()
        self.loaders = self._data()
        self.state, ipex = self._model()
        self._record_start(hosts, ipex)
        self._epochs()
        self._finish()

    def _hosts(self) -> list[str]:
        names: list[Any] = [None] * self.le.world_size
        dist.all_gather_object(names, socket.gethostname())
        return sorted(set(names))

    def _data(self) -> data.Loaders:
        d = self.cfg.data
        # Only one process per node may download; the others wait for it.
        first = self.le.is_node_leader or not (d.dataset == "cifar10" and d.download)
        if first:
            data.datasets(d, self.cfg.train.seed)
        dist.barrier()
        if not first:
            data.datasets(d, self.cfg.train.seed)
        return data.loaders(d, self.cfg.train.seed, self.le.rank, self.le.world_size,
                            pin=self.layout.device.type == "cuda")

    def _model(self) -> tuple[loop.TrainState, models.IpexStatus]:
        cfg, device = self.cfg, self.layout.device
        channels, size, _, classes = data.input_shape(cfg.data)
        model = models.prepare(models.build(cfg.model.name, channels, size, classes), cfg.model,
                               device)
        opt = optim.optimizer(model, cfg.optim)
        model, opt, ipex = models.maybe_ipex(model, opt, cfg.model, device, cfg.train.amp)
        state = loop.TrainState(
            model=models.wrap(model, cfg.model, device), optimizer=opt,
            scheduler=optim.scheduler(opt, cfg.optim, self.total_steps()),
            scaler=torch.amp.GradScaler(device.type, enabled=cfg.train.amp == "fp16"),
            device=device, amp=cfg.train.amp, grad_accum=cfg.train.grad_accum_steps,
            grad_clip=cfg.train.grad_clip, channels_last=cfg.model.channels_last)
        if self.payload is not None:
            checkpoint.restore(state, self.payload, self.le.world_size)
        return state, ipex

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: the last accumulation group may be short."""
        return math.ceil(self.loaders.micro_batches_per_epoch / self.cfg.train.grad_accum_steps)

    def total_steps(self) -> int:
        total = self.cfg.train.epochs * self.steps_per_epoch()
        return min(total, self.cfg.train.max_steps) if self.cfg.train.max_steps else total

    def _record_start(self, hosts: list[str], ipex: models.IpexStatus) -> None:
        le, layout, v = self.le, self.layout, capsule.versions()
        tags = {
            "ddplab.backend": layout.choice.name,
            "ddplab.backend_requested": layout.choice.requested,
            "ddplab.backend_reason": layout.choice.reason,
            "ddplab.world_size": le.world_size, "ddplab.nnodes": le.nnodes,
            "ddplab.nproc_per_node": le.local_world_size, "ddplab.launcher": le.launcher,
            "ddplab.device": layout.device.type, "ddplab.hosts": ",".join(hosts),
            "ddplab.rank0_host": socket.gethostname(),
            "ddplab.git_sha": capsule.git_sha(), "ddplab.image": capsule.container_image() or "none",
            "ddplab.threads_per_rank": layout.threads,
            "ddplab.pinned_cores": ",".join(map(str, layout.pinned)) or "none",
            "ddplab.ipex": "used" if ipex.used else f"not used: {ipex.reason}",
            "ddplab.global_batch": self.cfg.global_batch(le.world_size),
            "ddplab.resumed_from": self.resumed_from or "none",
            **{f"ddplab.version.{k}": val for k, val in v.items()},
        }
        self.tracker.set_tags(tags)
        self._record_config()
        env = capsule.build({"hosts": hosts, "launch": le.__dict__, "backend": layout.choice.__dict__,
                             "ccl_env_set_by_ddplab": layout.ccl_env, "ipex": ipex.__dict__})
        self.tracker.log_text(json.dumps(env, indent=2, default=str), "environment.json")
        what = "resuming " + self.resumed_from if self.resumed_from else "starting"
        self.console.say(
            f"{what}: run {self.tracker.run_id or '(tracking off)'}, {le.launcher} x"
            f"{le.world_size} on {len(hosts)} host(s), backend {layout.choice.name} "
            f"({layout.choice.reason}), {layout.threads} thread(s)/rank, "
            f"{self.total_steps()} steps of global batch {self.cfg.global_batch(le.world_size)}")

    def _record_config(self) -> None:
        """Params and config.yaml are the first attempt's and always agree (MLflow cannot change
        a param); a resume that changed allowed keys records them beside, with its own config."""
        self.tracker.log_params(self.cfg.flat())
        if not self.resumed_from:
            self.tracker.log_text(self.cfg.to_yaml(), "config.yaml")
            return
        step = self.payload["step"] if self.payload else 0
        self.tracker.log_text(self.cfg.to_yaml(), f"resumes/config-step{step:08d}.yaml")
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in self.changes
                           if k != "checkpoint.resume")
        self.tracker.set_tags({f"ddplab.resume_changes.step{step}": listed or "none"})

    # ---- training ----

    def _epochs(self) -> None:
        state, train = self.state, self.cfg.train
        for epoch in range(state.epoch, train.epochs):
            if self._done():
                break
            t0 = time.perf_counter()
            self.loaders.sampler.set_position(epoch, state.samples_in_epoch)
            for result in loop.train_epoch(state, self.loaders.train, train.max_steps):
                self._after_step(result)
            self._log_interval()
            state.epoch, state.samples_in_epoch = epoch + 1, 0
            self.stats.epoch_times.append(time.perf_counter() - t0)
            self.tracker.log_metrics({"epoch/time_s": self.stats.epoch_times[-1],
                                      "epoch/epoch": epoch + 1}, state.step)
            if (epoch + 1) % train.eval_every_epochs == 0 or epoch + 1 == train.epochs:
                self._evaluate()
            if self.cfg.checkpoint.every_epochs and (epoch + 1) % self.cfg.checkpoint.every_epochs == 0:
                self._save(final=False)

    def _done(self) -> bool:
        return bool(self.cfg.train.max_steps) and self.state.step >= self.cfg.train.max_steps

    def _after_step(self, result: loop.StepResult) -> None:
        self.meter.add(result)
        self.stats.step_times.append(result.step_time_s)
        self.stats.data_time += result.data_time_s
        if self.stats.time_to_first_step_s is None:
            self.stats.time_to_first_step_s = time.perf_counter() - self.t_start
            self.tracker.log_metrics(
                {"train/time_to_first_step_s": self.stats.time_to_first_step_s}, result.step)
        if result.step % self.cfg.train.log_every == 0:
            self._log_interval()
        every = self.cfg.checkpoint.every_steps
        if every and result.step % every == 0:
            self._save(final=False)

    def _log_interval(self) -> None:
        if not self.meter.step_times:
            return
        s = loop.reduce_interval(self.meter, self.layout.device)
        self.meter = loop.Meter()
        metrics = {"train/loss": s["loss"], "train/samples_per_s": s["samples_per_s"],
                   "train/step_time_s": s["step_time_s"], "train/data_wait_frac": s["data_wait_frac"],
                   "train/lr": self.state.scheduler.get_last_lr()[0]}
        metrics |= {f"train/rank{r}_samples_per_s": v
                    for r, v in enumerate(s["per_rank_samples_per_s"])}
        self.tracker.log_metrics(metrics, self.state.step)
        self.stats.samples_per_s.append(s["samples_per_s"])
        self.stats.last.update(metrics)
        self.console.say(f"epoch {self.state.epoch + 1}/{self.cfg.train.epochs} step "
                         f"{self.state.step}/{self.total_steps()} loss {s['loss']:.4f} "
                         f"{s['samples_per_s']:.0f} samples/s")

    def _evaluate(self) -> None:
        r = loop.evaluate(models.unwrap(self.state.model), self.loaders.eval, self.state)
        metrics = {"eval/loss": r.loss, "eval/accuracy": r.accuracy}
        self.tracker.log_metrics(metrics, self.state.step)
        self.stats.last.update(metrics)
        self.console.say(f"eval at step {self.state.step}: loss {r.loss:.4f} accuracy "
                         f"{r.accuracy:.4f} ({r.correct}/{r.count})")

    def _save(self, final: bool) -> None:
        self.ckpt.save(checkpoint.capture(self.state, self.le.world_size, self.cfg.to_dict(),
                                          self.tracker.run_id, final))

    def _finish(self) -> None:
        if "eval/accuracy" not in self.stats.last:
            self._evaluate()  # max_steps stopped training before an epoch's evaluation
        self._save(final=True)
        summary = self.stats.summary(time.perf_counter() - self.t_start, self.le.world_size,
                                     self.cfg.global_batch(self.le.world_size), self.state.step)
        summary["checkpoint"] = str(self.ckpt.last) if self.ckpt.last else None
        summary["tracking_busy_s"] = round(self.tracker.busy_s, 4)
        summary["tracking_busy_frac"] = self.tracker.busy_s / max(summary["wall_time_s"], 1e-9)
        epoch_samples = self.loaders.sampler.num_samples * self.le.world_size
        summary["epoch_samples_per_s"] = [epoch_samples / t for t in self.stats.epoch_times]
        text = json.dumps(summary, indent=2)
        self.tracker.log_text(text, "summary.json")
        self.console.save_summary(text)
        self.console.say(f"done in {summary['wall_time_s']:.1f}s: {self.state.step} steps, "
                         f"eval accuracy {self.stats.last.get('eval/accuracy', 0):.4f}")
