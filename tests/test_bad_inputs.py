"""Unit: bad input of every kind stops `ddplab train` before any run exists.

A table of what careless users and broken launchers give: config files, `--set`,
`DDPLAB_SET`, launcher variables, the tracking URI, paths. Each must exit 2 with ONE line
naming the source and the key, no traceback, and leave the MLflow store empty. The table runs
through `cli.main` in-process (seconds for all of it); a few rows also run as the real
`ddplab` program, to check the process's own exit code and output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddplab import cli
from tests.conftest import QUICK, REPO, ddplab, job_env, runs

QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")


F1 = "torchmetrics.classification:MulticlassF1Score"


def _file(text: str | bytes):
    return ("file", text)


# (id, experiment file text or None for the quickstart, --set items, env, extra args, expected)
CASES = [
    # ---- config files: keys, types, ranges ----
    ("unknown key", _file("train:\n  epoch: 3\n"), [], {}, [], "exp.yaml: train.epoch: unknown key"),
    ("wrong type", _file("train:\n  epochs: three\n"), [], {}, [], "exp.yaml: train.epochs: got 'three'"),
    ("top level list", _file("- a\n"), [], {}, [], "exp.yaml: the top level must be a mapping"),
    ("section as list", _file("train: [1]\n"), [], {}, [], "exp.yaml: train: got [1]"),
    ("invalid yaml", _file("train: {epochs: 1\n"), [], {}, [], "exp.yaml: not valid YAML"),
    # PyYAML kept the last of a key given twice, silently (a study's metric_mode flipped)
    ("duplicate key", _file("train:\n  epochs: 1\n  epochs: 9\n"), [], {}, [],
     "exp.yaml: not valid YAML (the key 'epochs' is given twice at line 3, column 3)"),
    ("binary file", _file(b"\x89PNG\r\n\x1a\n\x00\xff\xfe"), [], {}, [], "exp.yaml: not a text file"),
    ("bool as int", _file("data:\n  batch_size: true\n"), [], {}, [], "data.batch_size: got True"),
    ("int as bool", _file("train:\n  deterministic: 1\n"), [], {}, [], "train.deterministic: got 1"),
    ("name with slash", _file("name: ../up\n"), [], {}, [], "name: got '../up'"),
    ("empty name", _file("name: ''\n"), [], {}, [], "name: got ''"),
    ("lr nan in file", _file("optim:\n  lr: .nan\n"), [], {}, [], "optim.lr: got nan; must be a finite"),
    ("lr inf in file", _file("optim:\n  lr: .inf\n"), [], {}, [], "optim.lr: got inf"),
    ("epochs 0", _file("train:\n  epochs: 0\n"), [], {}, [], "train.epochs: got 0; must be >= 1"),
    ("epochs float", _file("train:\n  epochs: 1.5\n"), [], {}, [], "train.epochs: got 1.5; expected int"),
    ("unknown section", _file("trainer:\n  epochs: 1\n"), [], {}, [], "trainer: unknown key"),
    # ---- script mode: the script: section ----
    ("script missing", _file("script: {path: nothere.py}\n"), [], {}, [], "nothere.py' not found"),
    ("script not python", _file("script: {path: exp.yaml}\n"), [], {}, [], "a Python file (.py)"),
    ("script args not a list", _file("script: {path: x.py, args: 3}\n"), [], {}, [],
     "script.args: got 3; expected a list"),
    ("script flag with dashes", None, ["script.flags.--lr=1"], {}, [], "script.flags.--lr: got 1"),
    ("script env bad name", None, ["script.env.1A=x"], {}, [], "script.env.1A: got 'x'"),
    ("script log tail zero", None, ["script.log_tail_kb=0"], {}, [], "script.log_tail_kb: got 0"),
    ("script args without a script", None, [], {}, ["--", "--epochs", "3"],
     "arguments after `--` are for a script"),
    # ---- --set: every numeric field with a sane range ----
    ("lr nan", None, ["optim.lr=.nan"], {}, [], "--set 'optim.lr=.nan': optim.lr: got nan"),
    ("lr zero", None, ["optim.lr=0"], {}, [], "optim.lr: got 0.0; must be in (0, inf)"),
    ("lr negative", None, ["optim.lr=-1e-3"], {}, [], "optim.lr: got -0.001"),
    ("lr text", None, ["optim.lr=fast"], {}, [], "optim.lr: got 'fast'; expected float"),
    ("momentum negative", None, ["optim.momentum=-5"], {}, [], "optim.momentum: got -5.0; must be in [0, 1)"),
    ("momentum one", None, ["optim.momentum=1"], {}, [], "optim.momentum: got 1.0"),
    ("gamma negative", None, ["optim.gamma=-1"], {}, [], "optim.gamma: got -1.0"),
    ("gamma zero", None, ["optim.gamma=0"], {}, [], "optim.gamma: got 0.0"),
    ("weight decay negative", None, ["optim.weight_decay=-0.1"], {}, [], "optim.weight_decay: got -0.1"),
    ("warmup negative", None, ["optim.warmup_steps=-1"], {}, [], "optim.warmup_steps: got -1"),
    ("step size zero", None, ["optim.step_size=0"], {}, [], "optim.step_size: got 0"),
    ("unknown optimizer", None, ["optim.name=lamb"], {}, [], "optim.name: got 'lamb'"),
    ("unknown scheduler", None, ["optim.scheduler=linear"], {}, [], "optim.scheduler: got 'linear'"),
    ("grad clip nan", None, ["train.grad_clip=.nan"], {}, [], "train.grad_clip: got nan"),
    ("grad clip negative", None, ["train.grad_clip=-1"], {}, [], "train.grad_clip: got -1.0"),
    ("seed huge", None, ["train.seed=99999999999999999999"], {}, [], "train.seed: got 99999999999999999999"),
    ("seed negative", None, ["train.seed=-1"], {}, [], "train.seed: got -1"),
    ("max steps negative", None, ["train.max_steps=-1"], {}, [], "train.max_steps: got -1"),
    ("log every zero", None, ["train.log_every=0"], {}, [], "train.log_every: got 0"),
    ("accum zero", None, ["train.grad_accum_steps=0"], {}, [], "train.grad_accum_steps: got 0"),
    ("amp unknown", None, ["train.amp=fp8"], {}, [], "train.amp: got 'fp8'"),
    ("amp fp16 on cpu", None, ["train.amp=fp16"], {}, [], "train.amp: got 'fp16'; fp16 needs a CUDA"),
    ("global batch mismatch", None, ["train.global_batch_size=100"], {}, [],
     "train.global_batch_size: got 100"),
    ("timeout huge", None, ["dist.timeout_s=99999999999"], {}, [], "dist.timeout_s: got 99999999999"),
    ("timeout zero", None, ["dist.timeout_s=0"], {}, [], "dist.timeout_s: got 0"),
    ("threads zero", None, ["dist.threads_per_rank=0"], {}, [], "dist.threads_per_rank: got 0"),
    ("threads text", None, ["dist.threads_per_rank=many"], {}, [], "dist.threads_per_rank: got 'many'"),
    ("backend unknown", None, ["dist.backend=nvlink"], {}, [], "dist.backend: got 'nvlink'"),
    ("cuda without gpu", None, ["dist.device=cuda"], {}, [], "dist.device: got 'cuda'"),
    ("nccl on cpu", None, ["dist.backend=nccl"], {}, [], "dist.backend: got 'nccl'"),
    ("wait negative", None, ["tracking.wait_s=-1"], {}, [], "tracking.wait_s: got -1.0"),
    ("bucket zero", None, ["dist.bucket_cap_mb=0"], {}, [], "dist.bucket_cap_mb: got 0.0"),
    ("hook unknown", None, ["dist.comm_hook=zip"], {}, [], "dist.comm_hook: got 'zip'"),
    # ---- dist.strategy: the device, the world, and knobs of another strategy ----
    ("strategy unknown", None, ["dist.strategy=deepspeed"], {}, [], "dist.strategy: got 'deepspeed'"),
    ("dp on cpu", None, ["dist.strategy=dp"], {}, [], "dist.strategy: got 'dp'; DataParallel"),
    ("ddp hook under fsdp", None, ["dist.strategy=fsdp", "dist.comm_hook=bf16"], {}, [],
     "dist.comm_hook: got 'bf16'; a DDP knob, and dist.strategy is 'fsdp'"),
    ("ddp buckets under fsdp", None, ["dist.strategy=fsdp", "dist.bucket_cap_mb=5"], {}, [],
     "dist.bucket_cap_mb: got 5.0; a DDP knob"),
    ("fsdp knob under ddp", None, ["dist.fsdp.reshard_after_forward=false"], {}, [],
     "dist.fsdp.reshard_after_forward: got False; it applies to dist.strategy 'fsdp'"),
    ("fsdp bf16 under zero", None, ["dist.strategy=zero", "dist.fsdp.mixed_precision=bf16"], {}, [],
     "dist.fsdp.mixed_precision: got 'bf16'; it applies to dist.strategy 'fsdp'"),
    ("fsdp offload on cpu", None, ["dist.strategy=fsdp", "dist.fsdp.cpu_offload=true"], {}, [],
     "dist.fsdp.cpu_offload: got True; it moves GPU memory"),
    ("compile mode without compile", None, ["model.compile_mode=max-autotune"], {}, [],
     "model.compile_mode: got 'max-autotune'; only with model.compile: true"),
    ("fsdp with compile", None, ["dist.strategy=fsdp", "model.compile=true"], {}, [],
     "model.compile: got True; not combined with dist.strategy 'fsdp'"),
    ("fsdp wrap not a class", None, ["dist.fsdp.wrap=my-block"], {}, [],
     "dist.fsdp.wrap: got 'my-block'; comma-separated Python class names"),
    ("fsdp wrap typo", None, ["dist.strategy=fsdp", "dist.fsdp.wrap=Blok"], {}, [],
     "dist.fsdp.wrap: got 'Blok'; the model has no module class Blok"),
    ("profile active 0", None, ["profile.active=0"], {}, [], "profile.active: got 0; must be >= 1"),
    ("profile wait negative", None, ["profile.wait=-1"], {}, [], "profile.wait: got -1; must be >= 0"),
    ("delivery bound negative", None, ["tracking.delivery_timeout_s=-5"], {}, [],
     "tracking.delivery_timeout_s: got -5.0"),
    ("metrics interval zero", None, ["tracking.system_metrics_interval_s=0"], {}, [],
     "tracking.system_metrics_interval_s: got 0.0"),
    ("tracking uri scheme", None, ["tracking.uri=garbage://x"], {}, [], "tracking.uri: got 'garbage://x'"),
    ("noise nan", None, ["data.noise=.nan"], {}, [], "data.noise: got nan"),
    ("batch zero", None, ["data.batch_size=0"], {}, [], "data.batch_size: got 0"),
    ("workers negative", None, ["data.num_workers=-1"], {}, [], "data.num_workers: got -1"),
    ("persistent without workers", None, ["data.persistent_workers=true"], {}, [],
     "data.persistent_workers: got True"),
    ("classes one", None, ["data.num_classes=1"], {}, [], "data.num_classes: got 1"),
    ("image too small", None, ["data.image_size=2"], {}, [], "data.image_size: got 2"),
    ("torchvision model one channel", None, ["model.name=resnet18", "data.channels=1"], {}, [],
     "data.channels: got 1; model.name 'resnet18' takes 3-channel"),
    ("unknown model", None, ["model.name=vgg"], {}, [], "model.name: got 'vgg'"),
    ("cifar missing", None, ["data.dataset=cifar10", "data.root=nowhere"], {}, [],
     "data.root: got 'nowhere'"),
    ("keep zero", None, ["checkpoint.keep=0"], {}, [], "checkpoint.keep: got 0"),
    ("every steps negative", None, ["checkpoint.every_steps=-1"], {}, [], "checkpoint.every_steps: got -1"),
    ("resume empty", None, ["checkpoint.resume="], {}, [], "checkpoint.resume: got ''"),
    # A hostile pass: a file that is not ddplab's checkpoint was a failed job (exit 1) with
    # torch's weights_only refusal, its lines long, the key unnamed.
    ("resume not a checkpoint", None, ["checkpoint.resume=afile"], {}, [],
     "checkpoint.resume: got 'afile'; not a checkpoint ddplab wrote (torch.load cannot read it)"),
    ("flops negative", None, ["model.flops_per_sample=-1"], {}, [],
     "model.flops_per_sample: got -1.0; must be in [0, inf)"),
    ("mfu not a bool", None, ["train.mfu=maybe"], {}, [], "train.mfu: got 'maybe'; expected true or false"),
    ("target key empty", None, ["data.target_key="], {}, [], "data.target_key: got ''; must name"),
    ("input keys hold the target", None, ["data.input_keys=[labels]"], {}, [],
     "data.input_keys: got ['labels']; must be keys other than data.target_key"),
    ("input keys not a list", None, ["data.input_keys=5"], {}, [], "data.input_keys: got 5"),
    ("loss misspelt", None, ["train.loss=modle"], {}, [],
     "train.loss: got 'modle'; choose one of: cross_entropy, mse, model"),
    ("model loss with metrics", None, ["train.loss=model",
     'train.metrics=[{name: f1, fn: "torchmetrics.classification:MulticlassF1Score"}]'], {}, [],
     "train.metrics: got ['f1']; not with train.loss model"),
    ("set without equals", None, ["train.epochs"], {}, [], "--set 'train.epochs': expected key.sub=value"),
    ("set bad yaml", None, ["train.epochs=[1"], {}, [], "--set 'train.epochs=[1': value is not valid YAML"),
    ("set unknown section", None, ["trian.epochs=2"], {}, [], "--set 'trian.epochs=2': trian: unknown key"),
    ("set through a value", None, ["name.x=1"], {}, [], "--set 'name.x=1': name is not a section"),
    # ---- DDPLAB_SET: blamed by its own name ----
    ("env set wrong type", None, [], {"DDPLAB_SET": "train.epochs=x"}, [],
     "DDPLAB_SET 'train.epochs=x': train.epochs: got 'x'"),
    ("env set no equals", None, [], {"DDPLAB_SET": "epochs"}, [],
     "DDPLAB_SET 'epochs': expected key.sub=value"),
    ("env set lr nan", None, [], {"DDPLAB_SET": "optim.lr=.nan"}, [], "DDPLAB_SET 'optim.lr=.nan'"),
    # ---- launcher environments ----
    ("rank without local rank", None, [], {"RANK": "1", "WORLD_SIZE": "1"}, [],
     "RANK=1, WORLD_SIZE=1 set but LOCAL_RANK not"),
    ("rank and world, no local", None, [], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1"},
     [], "but LOCAL_RANK not"),
    ("world size text", None, [], {"WORLD_SIZE": "abc"}, [], "WORLD_SIZE=abc set but"),
    ("rank beyond world", None, [], {"RANK": "5", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, [],
     "rank 5 is outside 0..1"),
    ("pmi mixed with rank", None, [], {"PMI_RANK": "0", "PMI_SIZE": "1", "RANK": "1", "WORLD_SIZE": "2"},
     [], "pmi gives rank 0 but RANK=1"),
    ("openmpi local size zero", None, [], {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                                           "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                                           "OMPI_COMM_WORLD_LOCAL_SIZE": "0"}, [],
     "OMPI_COMM_WORLD_LOCAL_SIZE='0' must be >= 1"),
    ("master port", None, [], {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": "70000"},
     [], "MASTER_PORT 70000 is not a TCP port"),
    *[(f"nodes on host {v!r}", None, [], {"DDPLAB_NODES_ON_HOST": v}, [],
       f"DDPLAB_NODES_ON_HOST: got {v!r}; a whole number from 1 to 4096")
      for v in ("0", "-1", "x", "1e9", "2.5", "\u00b2", "99999")],
    ("tracking uri from env", None, [], {"MLFLOW_TRACKING_URI": "garbage://x"}, [],
     "MLFLOW_TRACKING_URI: got 'garbage://x'"),
    ("password file missing", None, [], {"MLFLOW_TRACKING_PASSWORD_FILE": "/nonexistent/pw"}, [],
     "environment: MLFLOW_TRACKING_PASSWORD_FILE=/nonexistent/pw: cannot read it"),
    ("token file is a folder", None, [], {"MLFLOW_TRACKING_TOKEN_FILE": "/"}, [],
     "environment: MLFLOW_TRACKING_TOKEN_FILE=/: cannot read it"),
    # ---- paths ----
    ("summary out is a directory", None, [], {}, ["--summary-out", "."], "--summary-out: got '.'"),
    ("summary out under a file", None, [], {}, ["--summary-out", "afile/summary.json"],
     "--summary-out: got 'afile/summary.json'; afile is a file"),
    # A hostile pass: these three were found only once the job had trained, as a traceback.
    ("summary out under /proc", None, [], {}, ["--summary-out", "/proc/x.json"],
     "--summary-out: got '/proc/x.json'; cannot write it"),
    ("summary out name too long", None, [], {}, ["--summary-out", "s" * 300 + ".json"],
     "; cannot write it (File name too long)"),
    ("checkpoint dir under a file", None, ["checkpoint.dir=afile/ck"], {}, [],
     "checkpoint.dir: got 'afile/ck'; afile is a file"),
    ("missing experiment", ("missing", None), [], {}, [], "nope.yaml: experiment file not found"),
    ("experiment is a directory", ("directory", None), [], {}, [],
     "a directory; an experiment is a YAML file"),
    # ---- your own parts (userbad.py sits beside exp.yaml; see the clean_env fixture) ----
    ("import path syntax", _file("model:\n  name: 'my-mod:build'\n"), [], {}, [],
     "model.name: got 'my-mod:build'; an import path is"),
    ("own module missing", _file("model:\n  name: nosuchmod:build\n"), [], {}, [],
     "model.name: got 'nosuchmod:build'; module 'nosuchmod' not found"),
    ("own attribute missing", _file("model:\n  name: userbad:nothing\n"), [], {}, [],
     "userbad has no attribute 'nothing'"),
    ("own part not callable", _file("model:\n  name: userbad:NOT_CALLABLE\n"), [], {}, [],
     "NOT_CALLABLE is a int, not callable"),
    ("own module raises at import", _file("train:\n  loss: userbroken:loss\n"), [], {}, [],
     "train.loss: got 'userbroken:loss'; importing userbroken raised RuntimeError: half-written"),
    ("own model raises", _file("model:\n  name: userbad:raises\n"), [], {}, [],
     "model.name: got 'userbad:raises'; calling it raised ValueError: no such width"),
    ("early stopping metric", None, ["train.early_stopping.metric=eval/acc"], {}, [],
     "train.early_stopping.metric: got 'eval/acc'; one of eval/loss, eval/accuracy, eval/perplexity"),
    # ---- train.metrics: your own evaluation metrics (torchmetrics) ----
    ("metric not a list", None, ["train.metrics={name: f1}"], {}, [],
     "train.metrics: got {'name': 'f1'}; expected a list, each item a metric"),
    ("metric name", None, [f"train.metrics=[{{name: 1f, fn: {F1}}}]"], {}, [],
     "train.metrics[0].name: got '1f'; a letter, then"),
    ("metric named like ddplab's", None, [f"train.metrics=[{{name: loss, fn: {F1}}}]"], {}, [],
     "train.metrics[0].name: got 'loss'; eval/loss is ddplab's own"),
    ("metric path syntax", None, ["train.metrics=[{name: f1, fn: f1score}]"], {}, [],
     "train.metrics[0].fn: got 'f1score'; the metric's class as 'package.module:Class'"),
    ("metric unknown key", None, [f"train.metrics=[{{name: f1, fn: {F1}, average: macro}}]"], {}, [],
     "train.metrics[0].average: unknown key; allowed keys: name, fn, args"),
    ("metric names twice", None, [f"train.metrics=[{{name: f1, fn: {F1}}}, {{name: f1, fn: {F1}}}]"],
     {}, [], "train.metrics: got 'f1'; metric names must be unique"),
    ("metric not importable", None, ["train.metrics=[{name: f1, fn: torchmetrics.classification:F9}]"],
     {}, [], "train.metrics[0].fn: got 'torchmetrics.classification:F9'; torchmetrics.classification "
     "has no attribute 'F9'"),
    ("metric argument refused", None,
     [f"train.metrics=[{{name: f1, fn: {F1}, args: {{average: sideways}}}}]"], {}, [],
     f"train.metrics[0].fn: got '{F1}'; calling it raised ValueError"),
    ("metric is no metric", None, ["train.metrics=[{name: f1, fn: collections:OrderedDict}]"], {}, [],
     "what it made (OrderedDict) is not a metric: it needs update(preds, target) and compute()"),
    ("metric cannot read the output", None,
     ["train.metrics=[{name: mse, fn: torchmetrics.regression:MeanSquaredError}]"], {}, [],
     "train.metrics (mse): got 'torchmetrics.regression:MeanSquaredError'; update(the model's output, "
     "the targets) raised RuntimeError"),
    ("early stopping on a metric not given", None,
     [f"train.metrics=[{{name: f1, fn: {F1}}}]", "train.early_stopping.metric=eval/f2"], {}, [],
     "train.early_stopping.metric: got 'eval/f2'; one of eval/loss, eval/accuracy, eval/perplexity "
     "or eval/<name> of one of train.metrics (f1)"),
    ("optimizer not a class", None, ["optim.name=torch.optim:lr_scheduler"], {}, [],
     "optim.name: got 'torch.optim:lr_scheduler'"),
    ("optimizer path syntax", None, ["optim.name=rmsprop"], {}, [],
     "optim.name: got 'rmsprop'; choose one of: sgd, adam, adamw, or 'package.module:callable'"),
    ("scheduler not importable", None, ["optim.scheduler=torch.optim.lr_scheduler:Nope",
                                        "optim.warmup_steps=0"], {}, [],
     "optim.scheduler: got 'torch.optim.lr_scheduler:Nope'"),
    ("scheduler not a scheduler", None, ["optim.scheduler=torch.optim:SGD", "optim.warmup_steps=0"],
     {}, [],
     "not a torch.optim.lr_scheduler.LRScheduler class"),
    ("scheduler args refused", None, ["optim.scheduler=torch.optim.lr_scheduler:StepLR",
                                      "optim.scheduler_args={step_size: 2, decay: 0.5}",
                                      "optim.warmup_steps=0"], {}, [],
     "optim.scheduler_args: got {'step_size': 2, 'decay': 0.5}; StepLR refused them"),
    ("scheduler args without one", None, ["optim.scheduler_args={pct_start: 0.1}"], {}, [],
     "optim.scheduler_args: got {'pct_start': 0.1}; only with a scheduler by import path"),
    ("warm-up with own scheduler", None, ["optim.scheduler=torch.optim.lr_scheduler:OneCycleLR",
                                          "optim.warmup_steps=10"], {}, [],
     "optim.warmup_steps: got 10; 0 with a scheduler of your own"),
    ("scheduler interval", None, ["optim.scheduler_interval=batch"], {}, [],
     "optim.scheduler_interval: got 'batch'"),
    ("scheduler path syntax", None, ["optim.scheduler=onecycle"], {}, [],
     "optim.scheduler: got 'onecycle'; choose one of: none, cosine, step, or 'package.module:callable'"),
    ("optimizer argument refused", None, ["optim.name=torch.optim:RMSprop", "optim.args={alfa: 0.9}"],
     {}, [], "optim.args: got {'alfa': 0.9}; RMSprop refused them (TypeError"),
    ("own model scores other classes", _file("model:\n  name: userbad:thousand_classes\n"), [], {}, [],
     "model.name: got 'userbad:thousand_classes'; it scores 1000 classes, the data has 10"),
    ("own model without parameters", _file("model:\n  name: userbad:no_parameters\n"), [], {}, [],
     "model.name: got 'userbad:no_parameters'; the model has no trainable parameters"),
    ("own loss without gradient", _file("train:\n  loss: userbad:detached_loss\n"), [], {}, [],
     "train.loss: got 'userbad:detached_loss'; its result carries no gradient"),
    ("own model wrong type", _file("model:\n  name: userbad:returns_int\n"), [], {}, [],
     "it returned int, expected a torch.nn.Module"),
    ("own model bad args", _file("model:\n  name: userbad:mlp\n  args: {depth: 2}\n"), [], {}, [],
     "calling it raised TypeError"),
    ("own model forward fails", _file("model:\n  name: userbad:wrong_width\n"), [], {}, [],
     "model.name: got 'userbad:wrong_width'; its forward on a batch of 2 samples raised"),
    ("own data one set", _file("data:\n  dataset: userbad:one_set\n"), [], {}, [],
     "it returned TensorDataset, expected (train_dataset, eval_dataset)"),
    ("own data empty", _file("data:\n  dataset: userbad:empty_sets\n"), [], {}, [],
     "its train dataset is empty"),
    ("own data not map-style", _file("data:\n  dataset: userbad:iterables\n"), [], {}, [],
     "is not map-style"),
    ("own data bad samples", _file("data:\n  dataset: userbad:bare_tensors\n"), [], {}, [],
     "expected (input, target)"),
    ("own data args not a mapping", _file("data:\n  dataset: userbad:one_set\n  args: 5\n"), [], {},
     [], "data.args: got 5; expected a mapping"),
    ("own loss not scalar", _file("train:\n  loss: userbad:per_sample_loss\n"), [], {}, [],
     "train.loss: got 'userbad:per_sample_loss'; it returned a tensor of shape (2,), expected a scalar"),
    ("own loss raises", _file("train:\n  loss: userbad:raising_loss\n"), [], {}, [],
     "on the model's outputs it raised ZeroDivisionError"),
    ("loss unknown", None, ["train.loss=hinge"], {}, [], "train.loss: got 'hinge'; choose one of"),
    ("args for a built-in model", None, ["model.args.width=2"], {}, [],
     "model.args: got {'width': 2}; model 'cnn' takes no args"),
    ("args for a built-in dataset", None, ["data.args.n=2"], {}, [],
     "data.args: got {'n': 2}; only your own dataset callable takes args"),
    ("dataset unknown", None, ["data.dataset=mnist"], {}, [], "data.dataset: got 'mnist'; choose one of"),
    ("gpt unknown arg", None, ["model.name=gpt", "model.args.n_layers=2"], {}, [],
     "model.args.n_layers: got 2; unknown gpt argument"),
    ("gpt heads do not divide", None, ["model.name=gpt", "model.args.n_embd=100", "model.args.n_head=3"],
     {}, [], "model.args.n_embd: got 100; must be a multiple of model.args.n_head (3)"),
    ("gpt dropout one", None, ["model.name=gpt", "model.args.dropout=1.0"], {}, [],
     "model.args.dropout: got 1.0; must be in [0, 1)"),
    ("gpt layers text", None, ["model.name=gpt", "model.args.n_layer=two"], {}, [],
     "model.args.n_layer: got 'two'; expected int"),
    ("gpt on images", None, ["model.name=gpt"], {}, [], "model.name: got 'gpt'; gpt takes token data"),
    ("cnn on tokens", None, ["data.dataset=tokens", "data.root="], {}, [],
     "model.name: got 'cnn'; it takes images, data.dataset 'tokens' gives tokens data"),
    ("tokens text missing", None, ["data.dataset=tokens", "model.name=gpt", "data.root=nowhere.txt"],
     {}, [], "data.root: got 'nowhere.txt'; no such file or folder"),
    ("tokens text too short", None, ["data.dataset=tokens", "model.name=gpt", "data.root=short.txt"],
     {}, [], "bytes of text is too short for data.seq_len 128"),
    ("tokens channels_last", None, ["data.dataset=tokens", "model.name=gpt", "data.root=",
                                    "model.channels_last=true"], {}, [], "model.channels_last: got True"),
    ("seq len zero", None, ["data.seq_len=0"], {}, [], "data.seq_len: got 0; must be >= 1"),
    ("eval every steps negative", None, ["train.eval_every_steps=-1"], {}, [],
     "train.eval_every_steps: got -1"),
    ("imagefolder missing", None, ["data.dataset=imagefolder", "data.root=nowhere"], {}, [],
     "data.root: got 'nowhere'; "),
    ("imagefolder split missing", None, ["data.dataset=imagefolder", "data.root=imgs_noval"], {}, [],
     "imgs_noval/val is missing"),
    ("imagefolder split empty", None, ["data.dataset=imagefolder", "data.root=imgs_empty"], {}, [],
     "imgs_empty/val holds no images"),
    ("imagefolder classes differ", None, ["data.dataset=imagefolder", "data.root=imgs_mismatch"], {}, [],
     "the class folders of train (a, b) and val (a, c) differ"),
    ("imagefolder two channels", None, ["data.dataset=imagefolder", "data.channels=2"], {}, [],
     "data.channels: got 2; ImageFolder images are read as 1"),
]

USERBAD = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

NOT_CALLABLE = 3

def raises():
    raise ValueError("no such width")

def returns_int():
    return 3

def mlp(width=4):
    return nn.Linear(width, 2)

def wrong_width():
    return nn.Linear(5, 2)

def one_set():
    return TensorDataset(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))

def empty_sets():
    empty = TensorDataset(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    return empty, empty

def iterables():
    return iter([1]), iter([2])

def bare_tensors():
    return torch.zeros(4, 3), torch.zeros(4, 3)

def per_sample_loss(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets, reduction="none")

def raising_loss(outputs, targets):
    return 1 / 0

def no_parameters():
    return nn.Flatten()

def thousand_classes():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 1000))

def detached_loss(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets).detach()
"""


def _user_files(root: Path) -> None:
    """The user's modules and data trees that the table's own-part rows point at."""
    (root / "userbad.py").write_text(USERBAD)
    (root / "userbroken.py").write_text("raise RuntimeError('half-written module')\n")
    (root / "short.txt").write_text("too short")
    for tree, splits in {"imgs_noval": {"train": "ab"}, "imgs_empty": {"train": "ab", "val": ""},
                         "imgs_mismatch": {"train": "ab", "val": "ac"}}.items():
        for split, classes in splits.items():
            (root / tree / split).mkdir(parents=True)
            for c in classes:
                (root / tree / split / c).mkdir()
                (root / tree / split / c / "x.png").write_bytes(b"")


def _experiment(tmp_path: Path, spec) -> str:
    if spec is None:
        return QUICKSTART
    kind, text = spec
    if kind == "missing":
        return "nope.yaml"
    if kind == "directory":
        return str(tmp_path)
    p = tmp_path / "exp.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(p)


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "DDPLAB_SET", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith(LAUNCH_VARS + ("OMPI_", "PMI_", "SLURM_", "PET_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("not a directory")
    _user_files(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    return store


def test_the_table_has_unique_rows_and_reaches_every_config_section():
    """A new section of the experiment schema must come with bad inputs of its own here."""
    import dataclasses

    from ddplab.config import ExperimentConfig

    ids = [c[0] for c in CASES]
    assert len(set(ids)) == len(ids)
    sections = [f.name for f in dataclasses.fields(ExperimentConfig)
                if dataclasses.is_dataclass(f.default_factory)]
    untested = [s for s in sections if not any(f"{s}." in c[-1] for c in CASES)]
    assert sections and untested == []


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line_and_no_run(case, clean_env, tmp_path, monkeypatch, capsys):
    _, spec, sets, env, extra, expected = case
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = ["train", _experiment(tmp_path, spec), *[a for s in sets for a in ("--set", s)], *extra]
    code = cli.main(args)
    err = capsys.readouterr().err
    # "[ddplab] checks: still importing X (6 s)": progress a slow import shows on a busy machine
    lines = [line for line in err.splitlines()
             if line.strip() and not line.startswith("[ddplab] checks: still ")]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith(("ddplab: error: ", "[rank")), err
    assert expected in lines[0] and "Traceback" not in err
    store = Path(os.environ["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///"))
    assert not store.exists() or runs(str(os.environ["MLFLOW_TRACKING_URI"])) == []
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("sets, env, expected", [
    (["optim.lr=.nan"], {}, "optim.lr: got nan"),
    ([], {"DDPLAB_SET": "optim.lr=x"}, "DDPLAB_SET 'optim.lr=x'"),
    ([], {"RANK": "1", "WORLD_SIZE": "1"}, "but LOCAL_RANK not"),
])
def test_the_real_program_exits_2_without_a_traceback(tmp_path, store, sets, env, expected):
    out = ddplab(["train", QUICKSTART, *QUICK, *[a for s in sets for a in ("--set", s)]], tmp_path,
                 job_env(store, **env))
    assert out.returncode == 2 and expected in out.stderr and "Traceback" not in out.stderr
    assert not Path(store.removeprefix("sqlite:///")).exists() or runs(store) == []


@pytest.mark.parametrize("command", [["train", QUICKSTART], ["study", "run", "study.yaml"]])
def test_a_deleted_working_directory_is_one_line_not_a_traceback(command, tmp_path):
    """A shell left in a folder another terminal deleted: the embedded store (./mlflow.db) and
    every relative path resolve against it, and the first of them raised FileNotFoundError."""
    typed = " ".join([str(Path(sys.executable).parent / "ddplab"), *command])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    out = subprocess.run(["bash", "-c", f"mkdir gone && cd gone && rmdir ../gone && {typed}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip() == (
        "ddplab: error: the current directory no longer exists (deleted or moved away): cd into "
        "an existing folder and run again"), out.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # no store, spool or checkpoint made anywhere


@pytest.mark.e2e
def test_a_resume_refused_by_every_rank_alike_is_said_once_not_once_per_rank(tmp_path, store):
    """A resume's checks run in the ranks (rank 0 reads the checkpoint and sends it): their
    refusal came once per rank (a hostile pass: N copies on N ranks), then `ddplab run`'s own
    line. Once from local rank 0, once from ddplab run; the exit 2 and no new run stand."""
    sets = [*QUICK, "--set", "data.train_samples=256", "--set", "train.max_steps=2"]
    first = ddplab(["run", "--nproc-per-node", "2", QUICKSTART, *sets], tmp_path, job_env(store))
    assert first.returncode == 0, first.stderr[-2000:]
    (final,) = (tmp_path / "checkpoints").rglob("step-00000002.pt")
    out = ddplab(["run", "--nproc-per-node", "2", QUICKSTART, *sets, "--set",
                  f"checkpoint.resume={final}"], tmp_path, job_env(store))
    says = "nothing is left to train; to train it longer, raise train.max_steps above 2"
    said = [line for line in out.stderr.splitlines() if says in line]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    # (rank 1 refuses alike, unless torchrun stopped it first, rank 0 having refused: a loaded
    # machine, CI)
    assert len(said) == 2 and said[0].startswith("[rank 0] ddplab: error: checkpoint.resume: ") \
        and re.match(r"ddplab: error: ranks? (0|0,1) refused the job \(exit code 2\)", said[1]), said
    assert len(runs(store)) == 1


def test_ddplab_run_imports_the_users_parts_before_it_starts_the_ranks(clean_env, tmp_path, capsys):
    """A hostile pass: `ddplab run --set model.name=badmods:fn` (a module raising at import)
    started both ranks, each refusing in its own line inside torchrun's, where `ddplab train`
    refused it in one line before anything started."""
    (tmp_path / "badmods.py").write_text("raise RuntimeError('no GPU driver here')\n")
    exp = tmp_path / "exp.yaml"
    exp.write_text(Path(QUICKSTART).read_text())
    code = cli.main(["run", "--nproc-per-node", "2", str(exp), "--set", "model.name=badmods:fn"])
    err = capsys.readouterr().err
    assert code == 2 and "model.name: got 'badmods:fn'; importing badmods raised RuntimeError: " \
        "no GPU driver here" in err, err
    assert len(err.strip().splitlines()) == 1 and "[rank" not in err, err


@pytest.mark.parametrize("argv, says", [
    (["launch", "--", "nosuch.yaml"], "nosuch.yaml: experiment file not found"),
    (["launch", "--", QUICKSTART, "--set", "trian.x=1"], "trian: unknown key"),
    (["launch"], "give the experiment after --"),
    (["launch", "--rdzv-port", "99999", "--", QUICKSTART], "'99999' is not a TCP port"),
])
def test_a_node_launcher_refuses_a_bad_job_before_waiting_for_its_peers(argv, says, monkeypatch,
                                                                          capsys):
    """A hostile pass: `ddplab launch -- nosuch.yaml` said only "timed out after 180s waiting for
    2 addresses" (exit 1); with its peers there, each rank refused in torchrun's banner."""
    import time

    monkeypatch.setenv("DDPLAB_WAIT_TIMEOUT", "20")
    monkeypatch.setenv("DDPLAB_PEERS", "ddplab-no-such-peer.invalid")
    t0 = time.monotonic()
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert time.monotonic() - t0 < 15  # not after waiting for the peers


def test_a_bad_node_count_in_the_environment_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("NNODES", "abc")
    with pytest.raises(SystemExit) as e:
        cli.main(["launch", "--", QUICKSTART])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "NNODES" in err and "'abc'" in err and "Traceback" not in err
    monkeypatch.setenv("NNODES", "2")
    assert cli.main(["config", QUICKSTART]) == 0  # other commands never read it


@pytest.mark.parametrize("env, args, says", [
    ({"NPROC": "abc"}, [], "$NPROC: got 'abc'; must be a whole number of ranks >= 1"),
    ({}, ["--nproc-per-node", "100000"], "--nproc-per-node: got 100000; must be from 1 to"),
    ({"NPROC": "0"}, [], "$NPROC: got 0; must be from 1 to"),
])
def test_a_bad_rank_count_is_one_line_from_ddplab_run_alone(env, args, says, monkeypatch, capsys):
    """A hostile pass: NPROC=abc made every command (--help, config, doctor) a ValueError
    traceback, read as ddplab run's parser was built; --nproc-per-node 100000 on 2 cores started
    ranks until stopped, and left some running."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["config", QUICKSTART]) == 0  # other commands never read it
    capsys.readouterr()
    code = cli.main(["run", *args, QUICKSTART])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, says", [
    (["train", "--sett", "x=1", "t.py"], "ddplab train: error: unrecognized arguments: --sett t.py; "
                                         "did you mean --set? (see ddplab train --help)"),
    (["study", "run", "--dryrun", "s.yaml"], "ddplab study run: error: unrecognized arguments: "
                                             "--dryrun; did you mean --dry-run?"),
    (["train", "--nproc-per-node", "2", "t.py"], "--nproc-per-node is a launcher's: ddplab run "
                                                 "--nproc-per-node N ..."),
    (["run", "--nproc-per-node", "2", "t.py", "--lr", "2"],
     "go after --: ddplab run --nproc-per-node 2 t.py -- --lr 2 (see ddplab run --help)"),
    # After the script's name, a flag near one of ddplab's (--seed, --set) is still the script's.
    (["train", "t.py", "--seed", "0"], "go after --: ddplab train t.py -- --seed 0"),
    (["train", "-m", "pkg.mod", "--x", "1"], "go after --: ddplab train -m pkg.mod -- --x 1"),
    (["bogus"], "ddplab: error: argument command: invalid choice: 'bogus'"),
])
def test_a_mistyped_command_line_is_one_line_saying_what_was_meant(argv, says, capsys):
    """argparse's own errors, as ddplab's: one line, no usage block, the likely fix."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err, err


def test_every_subcommand_has_a_handler():
    import argparse

    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [name for name, p in sub.choices.items() if not callable(p.get_default("func"))]
    assert len(sub.choices) >= 11 and missing == []
    # Nested commands keep their parent's handler.
    args = cli._parser().parse_args(["bench", "collectives", "--backend", "gloo"])
    assert args.func is cli._bench
    assert cli._parser().parse_args(["study", "run", "s.yaml"]).func is cli._study


def test_the_launchers_optimizer_check_refuses_bad_args_without_importing_dynamo():
    """`ddplab run` and a study check optim.args on a stand-in optimizer before any rank
    starts; that check must not import torch._dynamo (1.6 s of CPU on every job's way to its
    first step), and must still refuse what the optimizer refuses."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ddplab.config import ConfigError, ExperimentConfig, OptimConfig\n"
        "from ddplab.training import checks\n"
        "checks._optimizer(ExperimentConfig(optim=OptimConfig(name='adamw')), trains_here=False)\n"
        "assert 'torch._dynamo' not in sys.modules, 'the check imported torch._dynamo'\n"
        "try:\n"
        "    checks._optimizer(ExperimentConfig(optim=OptimConfig(name='adamw', args={'betas': (2, 0)})),"
        " trains_here=False)\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused them" in out.stdout and "beta" in out.stdout, out.stdout


@pytest.mark.parametrize("timeout", ["-1", "nan", "0"])
def test_sync_refuses_a_timeout_that_tries_nothing(timeout, tmp_path, monkeypatch, capsys):
    """A hostile pass: `ddplab sync --timeout -1` was accepted."""
    monkeypatch.chdir(tmp_path)
    code = cli.main(["sync", "--timeout", timeout])
    err = capsys.readouterr().err
    assert code == 2 and "--timeout: got" in err and "must be seconds in (0, 86400]" in err, err
