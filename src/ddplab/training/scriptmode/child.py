"""The script's own process (``python -P .../boot.py SCRIPT [ARGS...]``, or ``... boot.py -m
pkg.module [ARGS...]``: boot.py runs the script from its top level, this module does the rest).

Started by the rank's supervisor (supervisor.py) with the launcher's environment, it runs the
script as ``__main__`` (``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` or
``python -m pkg.module ARGS`` would set them) after three small preparations that need nothing
from the script:

- ``torch.distributed.init_process_group`` and the first collectives are observed, so the run
  records the backend, world size, device and threads the SCRIPT chose, and when
  (``perf/time_to_process_group_s``, ``perf/time_to_first_collective_s``);
- where Intel's ``oneccl_bindings_for_pytorch`` is not installed, ddplab's own ``ccl`` stands in
  for it (stand_in/), so the book's oneCCL script runs unedited;
- an exception that ends the script is written to the report file (its last line names the
  failure in the run) and shown once on stderr, as Python would.

torch is not imported for the script: the observation is installed right after the script's
own ``import torch`` (imports.py), so what the script sets before it (``OMP_NUM_THREADS``, as
the book's chapter 9 scripts do) holds as under plain torchrun.
"""

from __future__ import annotations

import builtins
import io
import os
import re
import runpy
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from types import CodeType
from typing import Any, NoReturn, cast

from ...ccl.handlers import crash_handlers_kept
from ...errors import keep_ends
from ...forensics import heartbeat
from . import mlflow_join
from .env import BOOT, STACKS_ENV, T0_ENV, report
from .imports import after_import

STAND_IN = Path(__file__).parent / "stand_in"
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "barrier",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "reduce",
               "broadcast_object_list", "all_gather_object", "gather", "scatter")


def _since_start() -> float:
    return round(time.time() - float(os.environ.get(T0_ENV) or time.time()), 3)


def _observe(dist: Any) -> None:
    """Wrap init_process_group and the collectives of the freshly imported torch.distributed."""
    import functools

    init = dist.init_process_group
    first = {"seen": False}

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        # A rank that waits here for a peer still in its own set-up (a slow import, a sleep)
        # is not the one behind: its phase is past set-up.
        heartbeat.beat(heartbeat.JOINING, 1)
        # A ccl group's libfabric may take SIGSEGV (ccl/handlers.py): a crash must still
        # end the script as a crash (the supervisor names the signal), not as exit(1).
        with crash_handlers_kept():
            out = init(*args, **kwargs)
        heartbeat.beat("setup", 1)
        # ... and over what the script loaded itself before (Intel's bindings): its crash dump.
        heartbeat.crash_handler_on_top()
        import torch

        device = kwargs.get("device_id")
        backend = str(dist.get_backend())
        report({"backend": backend, "world_size": dist.get_world_size(), "rank": dist.get_rank(),
                 "device": str(getattr(device, "type", device) or
                               ("cuda" if "nccl" in backend else "cpu")),
                 "threads": torch.get_num_threads(), "process_group_s": _since_start()})
        return out

    def timed(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if not first["seen"] and dist.is_initialized():
                first["seen"] = True
                report({"first_collective_s": _since_start(), "first_collective": fn.__name__})
            return out
        return call

    def own(fn: Any) -> Any:
        """A collective the script calls itself: its phase while it waits there (a rank that
        ran out of batches sits in its barrier while its peers wait in their all-reduce)."""
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            before = heartbeat.current_phase()
            heartbeat.beat(heartbeat.OWN_COLLECTIVE)
            try:
                return fn(*args, **kwargs)
            finally:
                if before:
                    heartbeat.beat(before)
        return call

    dist.init_process_group = init_process_group
    _spawns_seen()
    # DDP's constructor broadcasts rank 0's parameters (in C++, past the wrappers below): for
    # most scripts that IS the first collective.
    from torch.nn.parallel import DistributedDataParallel as DDP

    cast(Any, DDP).__init__ = timed(DDP.__init__)  # Any: mypy refuses assigning to a method
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, timed(own(getattr(dist, name))))


def _spawns_seen() -> None:
    """``torch.multiprocessing.spawn`` (and Lightning's ddp_spawn, through it): the ranks it
    starts train in processes of their own, which the observation does not see; the run says
    so when it saw no training."""
    import functools

    import torch.multiprocessing as mp

    module: Any = sys.modules["torch.multiprocessing.spawn"]
    start = module.start_processes

    @functools.wraps(start)
    def start_processes(*args: Any, **kwargs: Any) -> Any:
        report({"spawned": True})
        return start(*args, **kwargs)

    module.start_processes = start_processes
    cast(Any, mp).start_processes = start_processes
    # A launcher script: torchrun's own main (torch.distributed.run), or elastic_launch, which
    # both start their ranks through launch_agent (its run was an empty FINISHED run, unsaid).
    import torch.distributed.launcher.api as launcher  # (18 ms)

    agent = launcher.launch_agent

    @functools.wraps(agent)
    def launch_agent(*args: Any, **kwargs: Any) -> Any:
        report({"spawned": True})
        return agent(*args, **kwargs)

    cast(Any, launcher).launch_agent = launch_agent
    _processes_seen()


def _processes_seen() -> None:
    """A ``multiprocessing.Process`` (torch.multiprocessing's is the same class) the script
    starts to train in, as pytorch/examples' mnist_hogwild does: its run ended FINISHED with no
    training figure and no word why. Only processes running the script's own code count: a
    DataLoader's workers, a Pool's or a ProcessPoolExecutor's (torch.compile's among them) run
    their library's, and torch.multiprocessing.spawn is seen above."""
    import functools
    import multiprocessing.process as processes

    start = processes.BaseProcess.start

    @functools.wraps(start)
    def started(self: Any) -> None:
        runs = getattr(getattr(self, "_target", None), "__module__", None) or ""
        if not runs.startswith(("torch.", "multiprocessing.", "concurrent.")):
            report({"spawned": True})  # (a subclass's own run(): no target, the script's)
        start(self)

    cast(Any, processes.BaseProcess).start = started


def _stacks_on_request() -> None:
    """heartbeat.STACK_SIGNAL (and SIGTERM) write every thread's Python stack to
    $DDPLAB_SCRIPT_STACKS: the
    supervisor asks before it stops the script (a peer failed, the launcher stops the job), so the run shows
    where this rank was, also while it waits inside a C++ collective. faulthandler's handler is
    C: nothing of the script's is needed."""
    path = os.environ.get(STACKS_ENV)
    if not path:
        return
    import faulthandler
    import signal

    stacks = open(path, "w")  # noqa: SIM115 - open for the process' life: the handler writes to it
    faulthandler.register(heartbeat.STACK_SIGNAL, file=stacks, all_threads=True)
    # torchrun stops a job by signalling each worker's whole process group, this process with
    # its supervisor: the stacks are written first, then the signal does what it did (chain).
    # A handler the script installs later replaces this one.
    faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)


def _ccl_stand_in() -> None:
    import importlib.util

    if importlib.util.find_spec("oneccl_bindings_for_pytorch") is None:
        sys.path.append(str(STAND_IN))  # after everything: a real install always wins


_watching: list[Any] = []
"""The observation, once the script has imported torch (_watch_torch; None: script.observe off)."""


def prepare(argv: list[str]) -> Path | str:
    """Everything before the script (boot.py): ``sys.argv`` and ``sys.path`` as ``python SCRIPT
    ARGS`` or ``python -m pkg.module ARGS`` set them, the stand-in, the stacks on request, the
    watch on torch and MLflow. Returns the script (a path; a str: a module's name)."""
    script: Path | str
    if argv[0] == "-m":  # python -m: sys.path[0] the current directory, argv[0] the module's file
        script, argv = argv[1], argv[1:]
        first = os.getcwd()
    else:  # python SCRIPT: sys.path[0] the directory of the file a symbolic link points to
        script = Path(argv[0])
        first = os.path.dirname(os.path.realpath(script))
    # Started with -P (subprocs.python_file): boot.py's directory is not on sys.path, whose
    # first entry is the standard library's, kept.
    if getattr(sys.flags, "safe_path", False):
        sys.path.insert(0, first)
    else:
        sys.path[0] = first
    sys.argv = [str(script), *argv[1:]]
    _ccl_stand_in()
    _stacks_on_request()
    # Once the SCRIPT imports torch (after whatever it sets first: OMP_NUM_THREADS), not before.
    after_import("torch", lambda _: _watching.append(_watch_torch()))
    mlflow_join.install()
    return script


def main_module(script: Path | str) -> tuple[CodeType, dict[str, Any]]:
    """The script's code and the namespace it runs in: a fresh ``__main__`` module, made as
    runpy's ``run_path`` and ``run_module(alter_sys=True)`` make it, and ``sys.modules["__main__"]``
    from here on (pickle and multiprocessing's spawn look the script's classes up there);
    ``sys.argv[0]`` its file. A script that cannot be found, read or compiled raises here, as it
    would under python, and is reported as the script's failure."""
    module = types.ModuleType("__main__")
    if isinstance(script, str):
        # The look-up python -m itself makes (runpy's private helper, the one its run_module
        # calls): the parent packages imported, a package run as its __main__, python's own
        # error when nothing is found.
        _, spec, code = runpy._get_module_details(script)  # type: ignore[attr-defined]
        file = spec.origin
        module.__dict__.update(__file__=file, __cached__=spec.cached, __loader__=spec.loader,
                               __package__=spec.parent, __spec__=spec)
    else:
        file = str(script)
        with io.open_code(os.path.abspath(file)) as f:
            # dont_inherit: this module's own `from __future__ import annotations` is not the
            # script's (its annotations stay objects, as under python)
            code = compile(f.read(), file, "exec", dont_inherit=True)
        module.__dict__.update(__file__=file, __cached__=None, __loader__=None, __package__="",
                               __spec__=None)
    module.__dict__["__builtins__"] = builtins  # the module, as python gives __main__
    sys.argv[0] = file
    sys.modules["__main__"] = module
    return code, module.__dict__


def returned() -> int:
    heartbeat.beat("done")
    return 0


def failed(e: BaseException) -> int:
    """The script ended by an exception (SystemExit included): its exit code, its failure
    reported (the run's error, the user's traceback on stderr, as Python would show it)."""
    if isinstance(e, SystemExit):
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        code &= 0xFF  # the exit status the process ends with: sys.exit(256) succeeds, -1 is 255
        if code:
            report({"exception": f"SystemExit: {e.code}", "t": time.time()})
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            heartbeat.failed(f"SystemExit: {e.code}")
        else:
            heartbeat.beat("done")
        e.__traceback__ = None  # (its frames would hold the script's globals past its end)
        return code
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the report
    tb = e.__traceback__
    # The frames above the script's own are ddplab's (boot.py, this module, runpy's and
    # importlib's while it finds a module or imports its packages): not the user's.
    while tb is not None and _ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    # (on the exception itself, not only in the text: python's display, under a script's own
    # excepthook too, reads the exception's traceback, not the hook's argument)
    _hide_our_frames(e, tb or e.__traceback__)
    text = "".join(traceback.format_exception(e))
    last = one_line(e)[:500]
    report({"exception": last, "traceback": keep_ends(text, 8000), "t": time.time()})
    heartbeat.failed(last)
    if sys.excepthook is sys.__excepthook__:
        sys.stderr.write(text)
    else:  # the script's own (rich.traceback.install(), a logger's, torch.distributed's
        # "[rank1]:" one): shown its way, as python does
        try:
            sys.excepthook(type(e), e, e.__traceback__)
        except Exception:  # noqa: BLE001 - a hook that fails: python's own words then
            sys.stderr.write(text)
    e.__traceback__ = None  # (its frames would hold the script's globals past its end)
    return 130 if isinstance(e, KeyboardInterrupt) else 1


def end(code: int) -> NoReturn:
    """The script is over: said to the supervisor (which tells a script that called os._exit
    itself by the missing line), the observation's figures written, the process ended."""
    try:
        report({"returned": code, **({} if code else {"t": time.time()})})
    finally:
        for watcher in _watching:
            if watcher is not None:
                # (a failed script ends at once: its peers' launcher stops what lingers, and
                # its FLOPs, ~0.3 s on a CPU, would only be cut short)
                watcher.finish(ended_well=code == 0)
    _exit(code)


def _watch_torch() -> Any:
    """init_process_group and the first collective observed; the training too (observe.py,
    when script.observe is on: the Observer, else None)."""
    import torch.distributed as dist

    from . import observe

    _observe(dist)
    return observe.install(_env_int("RANK"), _env_int("WORLD_SIZE", 1), report)


def _env_int(name: str, default: int = 0) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default


def one_line(e: BaseException) -> str:
    """The failure in one line, for the run's error and the console's verdict (the whole of it
    is in the traceback): a message of several lines read as one; one that holds a traceback of
    its own (torch's DataLoader worker: "Caught ValueError in DataLoader worker process 0.",
    the worker's traceback, "ValueError: bad sample 5") its first line and the error it ends
    with, the cause."""
    try:
        te = traceback.TracebackException(type(e), e, None)
        te.__notes__ = None  # (add_note's lines are not the error's)
        parts = list(te.format_exception_only())
    except Exception:  # noqa: BLE001 - an exception whose str() fails: its repr
        return repr(e)
    # (without terminal colour codes: rich's and loguru's errors carry them into the run's tags)
    lines = [ln.strip() for ln in ANSI.sub("", parts[-1]).splitlines() if ln.strip()]
    if len(lines) > 1 and any(ln.startswith("Traceback (most recent call last)") or
                              ln.startswith("Original Traceback") for ln in lines):
        return f"{lines[0]} ... {lines[-1]}"
    return " ".join(lines)


ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
"""A terminal's escape sequence (colours, cursor moves)."""
HOOKS = str(Path(__file__).parent) + os.sep
"""ddplab's code that runs inside the script's calls (its hooks, wrappers): not the user's."""


def _hide_our_frames(e: BaseException, tb: types.TracebackType | None) -> None:
    """``e`` (from ``tb`` on) and the exceptions it was raised from or while handling, each
    with a traceback of the user's frames only: not ddplab's hooks inside its calls (an error
    raised in ``loss.backward()`` passes through the observed backward)."""
    seen: set[int] = set()
    todo: list[tuple[BaseException, types.TracebackType | None]] = [(e, tb)]
    while todo:
        x, frames = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        kept = []
        while frames is not None:
            if not frames.tb_frame.f_code.co_filename.startswith(HOOKS):
                kept.append(frames)
            frames = frames.tb_next
        rebuilt = None
        for t in reversed(kept):
            rebuilt = types.TracebackType(rebuilt, t.tb_frame, t.tb_lasti, t.tb_lineno)
        x.__traceback__ = rebuilt
        todo += [(c, c.__traceback__) for c in (x.__cause__, x.__context__) if c is not None]


def _ours(filename: str) -> bool:
    return filename in (__file__, BOOT, runpy.__file__) or filename.startswith("<frozen ")


def _exit(code: int) -> NoReturn:
    """The script's end as python makes it, then the process ends without the interpreter's
    teardown: a script that never destroyed its process group would otherwise risk gloo's abort
    at exit (pytorch/pytorch#179291; cli.entry does the same for ddplab's own loop, and likewise
    gives back the shared memory a ccl process group's libfabric made, whose own clean-up is
    skipped). A script that ended well first has what python gives it: its non-daemon threads
    (and concurrent.futures' workers) finish, its atexit handlers run, and its namespace is let
    go, so a file it never closed is flushed and closed, a NamedTemporaryFile deleted, a
    ``__del__`` run. A failed one ends after its atexit handlers (its peers' launcher stops what
    lingers)."""
    import atexit
    import contextlib

    from ...log import flush_std

    try:
        if code == 0:
            _say_who_holds_the_end()
            # (Ctrl-C while it waits: python goes on to the atexit handlers, so does this)
            with contextlib.suppress(BaseException):
                threading._shutdown()  # type: ignore[attr-defined] # python's own first step
        atexit._run_exitfuncs()
        if code == 0:
            _let_go_of_main()
    finally:
        with contextlib.suppress(BaseException):  # nothing may keep the process from _exit
            from ... import ccl

            ccl.release_shm()
        flush_std()
        os._exit(code)


HOLD_SAY_S = (30.0, 300.0)
"""When a rank whose script ended still waits for its threads says so: first, then again."""


def _say_who_holds_the_end(say_s: tuple[float, float] = HOLD_SAY_S) -> None:
    """python waits for a script's non-daemon threads at its end, forever if one never ends
    (under plain torchrun too), while the rank's heartbeat says its script is done: no hang the
    watch can tell from a long final upload. Said on stderr, which threads hold the rank."""
    def held() -> list[str]:
        return [t.name for t in threading.enumerate()
                if not t.daemon and t is not threading.main_thread() and t.is_alive()]

    def say() -> None:
        wait = say_s[0]
        while True:
            time.sleep(wait)
            names = held()
            if not names:
                return
            s = "" if len(names) == 1 else "s"
            sys.stderr.write(
                f"ddplab: rank {os.environ.get('RANK', '0')}'s script has ended; its process "
                f"waits for its non-daemon thread{s} {', '.join(map(repr, names))}, as python "
                "does (Ctrl-C stops the job)\n")
            sys.stderr.flush()
            wait = say_s[1]

    if held():
        threading.Thread(target=say, daemon=True, name="ddplab-end-held").start()


def _let_go_of_main() -> None:
    """The script's globals let go as python's teardown lets go of ``__main__``: first only
    dropped, so what nothing else holds is finalised with the globals still there (a ``__del__``
    that uses them works); then, where something still holds them (ddplab's observation holds
    the model, whose class's methods hold the globals), each set to None, the names with a
    leading underscore first, and collected again. (The process group is held by
    torch.distributed itself, not by them: it stays to the end.)"""
    import contextlib
    import gc
    import weakref

    main = sys.modules.pop("__main__", None)
    if main is None:
        return
    for alias in [k for k, v in sys.modules.items() if v is main]:  # multiprocessing's __mp_main__
        del sys.modules[alias]
    with contextlib.suppress(Exception):
        namespace = main.__dict__
        _flush_files(namespace)
        ties = [weakref.ref(main), *(weakref.ref(f) for f in _functions_of(namespace))]
        del main, namespace
        gc.collect()
        left = next((t() for t in ties if t() is not None), None)
        if left is None:
            return
        namespace = left.__dict__ if isinstance(left, types.ModuleType) else left.__globals__
        del left
        for name in sorted(namespace, key=lambda n: not n.startswith("_")):
            if name != "__builtins__":
                namespace[name] = None
        gc.collect()


def _flush_files(namespace: dict[str, Any]) -> None:
    """The script's open files flushed: one collected within a cycle can lose what its buffer
    held (CPython's bpo-17852), where python's teardown drops ``__main__``'s files by reference
    counts. (A function of its own: no name here may outlive it and hold a global.)"""
    for value in list(namespace.values()):
        if isinstance(value, io.IOBase) and not value.closed:
            try:
                value.flush()
            except Exception:  # noqa: BLE001, S112 - a file that cannot flush: as at python's end
                continue


def _functions_of(namespace: dict[str, Any]) -> list[Any]:
    """The script's own functions and methods (their globals are ``namespace``): what may keep
    the globals alive once the module is gone."""
    found = []
    for value in list(namespace.values()):
        members = list(vars(value).values()) if isinstance(value, type) else [value]
        for member in members:
            member = getattr(member, "__func__", member)  # staticmethod, classmethod
            if isinstance(member, types.FunctionType) and member.__globals__ is namespace:
                found.append(member)
    return found
