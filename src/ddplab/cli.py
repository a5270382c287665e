"""Command line: argv -> the right command. Imports nothing heavy until a command runs.

    ddplab train EXPERIMENT.yaml [--set key.sub=value ...] [--summary-out summary.json]
    ddplab train MY_TRAIN.py [--set ...] [-- SCRIPT ARGS ...]   # your own script, as it is
    ddplab train -m PKG.TRAIN [--set ...] [-- SCRIPT ARGS ...]  # a packaged one (python -m)
    ddplab run --nproc-per-node 2 EXPERIMENT|SCRIPT.py [--set ...] [-- ARGS]  # preflight, torchrun
    ddplab doctor [EXPERIMENT.yaml] [--set ...]
    ddplab config EXPERIMENT.yaml [--set ...]     # print the resolved config
    ddplab sync [PATH ...]                        # deliver what a tracking outage left behind
    ddplab import STORE.tar.gz                    # runs from another machine's store, into this one
    ddplab study run STUDY.yaml [--dry-run] [--fresh] [--repeats N] [--variants A,B] [--set ...]
    ddplab report PARENT_RUN_ID [--page NAME]     # a study's report, rebuilt from the store
    ddplab reproduce RUN_ID [--strict]            # re-run a recorded run and compare
    ddplab diagnose RUN_ID                        # why a job failed or hung: rank, step, stacks
    ddplab bench collectives [--backend gloo] [--ops all_reduce] [--sizes 1M,64M]  # any launcher
    ddplab launch --nnodes 2 --peers node -- EXPERIMENT.yaml [--set ...]   # one node of many
    ddplab mpi worker | ddplab mpi launch --nnodes 2 --slots 1 -- EXPERIMENT.yaml  # Open MPI
"""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
import warnings
from typing import TYPE_CHECKING, Any, NoReturn, cast

from . import __version__
from .errors import first_line
from .log import flush_std, logger

if TYPE_CHECKING:
    from .tracking.store import TrackingError

EXIT_ERROR, EXIT_USAGE = 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse's, but bad input is one line (what is wrong, and where the help is), not the
    usage block first; its sub-commands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ddplab", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"ddplab {__version__}")
    # (its parsers are _Parser: argparse makes them of the parent's class)
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]",
               p.add_subparsers(dest="command", required=True))
    overrides: dict[str, Any] = {"action": "append", "default": [], "metavar": "KEY=VALUE",
                                 "help": "override a config value, e.g. --set train.epochs=3 (repeatable)"}
    t = sub.add_parser("train", help="run an experiment under any launcher (or none)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="your own script's arguments go after --, e.g.\n  torchrun "
                              "--standalone --nproc-per-node 2 -m ddplab train my_train.py -- "
                              "--epochs 3")
    t.add_argument("experiment", nargs="?", help="experiment YAML file "
                   "(experiments/quickstart.yaml) or your own training script (my_train.py; its "
                   "arguments go after --)")
    t.add_argument("-m", dest="module", default="", metavar="MODULE",
                   help="your own training script as a module of a package, run as python -m "
                        "runs it (its arguments go after --)")
    t.add_argument("--set", dest="overrides", **overrides)
    t.add_argument("--summary-out", default="", metavar="PATH",
                   help="also write summary.json here (rank 0), e.g. for scripts and benchmarks")
    t.set_defaults(func=lambda a: _train(a.experiment, a.overrides, a.summary_out,
                                         a.script_args, a.module), script_args=[])
    d = sub.add_parser("doctor", help="preflight checks; exits non-zero on problems")
    d.add_argument("experiment", nargs="?", help="check against this experiment's settings")
    d.add_argument("--set", dest="overrides", **overrides)
    d.set_defaults(func=_doctor)
    c = sub.add_parser("config", help="print the fully resolved experiment config")
    c.add_argument("experiment")
    c.add_argument("--set", dest="overrides", **overrides)
    c.set_defaults(func=_config)
    y = sub.add_parser("sync", help="deliver tracking records a job could not send (an outage)")
    y.add_argument("paths", nargs="*", default=["checkpoints"], metavar="PATH",
                   help="spools under these folders (default: ./checkpoints)")
    y.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="per spool, how long to keep trying while the server does not answer")
    y.add_argument("--tracking-uri", default="", metavar="URI",
                   help="deliver to this server instead of the one each spool recorded")
    y.set_defaults(func=_sync)
    im = sub.add_parser("import", help="copy the runs of another machine's store (an archive "
                                       "such as the GPU proof's store.tar.gz) into this one")
    im.add_argument("source", help="store.tar.gz, or a folder holding mlflow.db (and mlruns/)")
    im.add_argument("--tracking-uri", default="", metavar="URI",
                    help="into this store (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)")
    im.set_defaults(func=_import)
    st = sub.add_parser("study", help="run a study: a grid of jobs compared in one report")
    st.set_defaults(func=_study)
    st_sub = st.add_subparsers(dest="study_command", required=True)
    sr = st_sub.add_parser("run", help="run every job of a study file (skips finished ones)")
    sr.add_argument("study", help="study YAML file, e.g. experiments/studies/ch09-threads-vs-processes.yaml")
    sr.add_argument("--set", dest="overrides", **overrides)
    sr.add_argument("--dry-run", action="store_true", help="print the plan and commands only")
    sr.add_argument("--fresh", action="store_true", help="start a new parent run, re-run all")
    sr.add_argument("--repeats", type=int, default=0, metavar="N",
                    help="run each variant N times instead of the file's repeats (a quick look; 0, "
                         "the default: the file's)")
    sr.add_argument("--variants", default=None, metavar="A,B",
                    help="run only these variants, by name (the baseline stays if among them)")
    rp = sub.add_parser("report", help="rebuild a study's report from its parent run")
    rp.add_argument("parent_run_id")
    rp.add_argument("--page", default="", metavar="NAME",
                    help="also write it as docs/results/NAME.md (stamped: when, commit, machine, "
                         "command) with its plots in docs/results/NAME/, for the docs to link")
    rp.set_defaults(func=_study)
    rr = sub.add_parser("reproduce", help="re-run a recorded run and compare the results")
    rr.add_argument("run_id")
    rr.add_argument("--strict", action="store_true",
                    help="refuse when the code (git sha; a script run: the script's sha256) "
                         "or package versions differ")
    rr.set_defaults(func=_study)
    dg = sub.add_parser("diagnose", help="why a job failed or hung: which rank, where, its stacks")
    dg.add_argument("run_id")
    dg.set_defaults(func=_diagnose)
    ck = sub.add_parser("checkpoint", help="checkpoints: export one as a plain state_dict")
    ck.set_defaults(func=_checkpoint)
    ck_sub = ck.add_subparsers(dest="checkpoint_command", required=True)
    ex = ck_sub.add_parser("export", help="write the model's plain state_dict (any strategy, "
                                          "any world size) for use outside ddplab")
    ex.add_argument("source", help="a checkpoint file, or a folder (its newest checkpoint), "
                                   "e.g. checkpoints/quickstart")
    ex.add_argument("out", help="where to write it, e.g. model.pt")
    from .bench import parser as bench_parser
    from .launchers.local import parser as run_parser
    from .launchers.mpi import parser as mpi_parser
    from .launchers.rendezvous import parser as launch_parser

    bench_parser(sub)
    run_parser(sub)
    launch_parser(sub)
    mpi_parser(sub)
    # Their parsers live with their code; what runs them is chosen here.
    sub.choices["bench"].set_defaults(func=_bench)
    sub.choices["run"].set_defaults(func=_run, script_args=[])
    for name in ("launch", "mpi"):
        sub.choices[name].set_defaults(func=_launch)
    return p


def entry() -> None:
    """The ``ddplab`` program and ``python -m ddplab`` (what torchrun runs).

    After ``train`` the process ends at once, without interpreter finalization: Gloo's worker
    threads can still hold work objects whose tensors reference Python objects while the
    interpreter tears down, which aborts a rank whose job is done ("terminate called without
    an active exception", SIGABRT; pytorch/pytorch#179291). Everything that matters is written
    by then (the run's status, the checkpoint, summary.json), so stdio is flushed, oneCCL's
    shared memory released, and the process exits with its real code (0 finished, 1 failed,
    2 bad input, 130 interrupted).
    """
    args = parse(sys.argv[1:])
    from .log import logger

    logger()  # (said here, a bad DDPLAB_LOG_LEVEL is not said again by what this starts)
    _cwd_exists()
    try:
        if args.command == "train":
            from .launchers import tether

            tether.to_launcher(os.environ)  # (torchrun killed outright: its ranks end with it)
            _delivery_first(args)
        # Under torchrun, an unexpected exception lands in the rank's error file as well
        # (torch.distributed.elastic's @record), so the launcher's summary names it.
        code = (_recorded(run) if os.environ.get("TORCHELASTIC_ERROR_FILE") else run)(args)
    except KeyboardInterrupt:
        # Ctrl-C before the job's own handling began (importing torch takes seconds): Python's
        # traceback from inside torch's imports said nothing more than this.
        logger().error("interrupted (Ctrl-C) before the job started")
        code = 130
    finally:
        from . import ccl

        ccl.release_shm()  # libfabric's destructor, which would, does not run after os._exit
    if args.command in ("train", "bench"):
        flush_std()
        os._exit(code)
    raise SystemExit(code)


def _cwd_exists() -> None:
    """Relative paths, the embedded store (./mlflow.db) and a script's spool resolve against the
    working directory: one deleted under the user's shell is said here in one line, not as a
    traceback from whichever of them resolves it first."""
    try:
        os.getcwd()
    except FileNotFoundError:
        logger().error("the current directory no longer exists (deleted or moved away): cd into "
                       "an existing folder and run again")
        raise SystemExit(EXIT_USAGE) from None


def _delivery_first(args: argparse.Namespace) -> None:
    """A tracked job's node leader starts its delivery process before anything imports torch,
    so MLflow's start-up there runs beside the ranks' own (tracking/delivery.py, prestart).
    Anything wrong is left to the job itself, which says it in its own order."""
    from .agent.handle import prestart
    from .credentials import from_files
    from .launchers import LaunchEnv
    from .launchers.local import load_job
    from .logins import from_uri

    saved = dict(os.environ)
    try:
        # The job's own steps, in its order (cli.run, then config.load), for the credentials the
        # delivery process must inherit; this process's environment is left as it was.
        from_files()
        from_uri()
        cfg = load_job(args.experiment, args.module, args.overrides, args.script_args)
        env = dict(os.environ)
        le = LaunchEnv.from_environ(os.environ)
    except Exception:  # noqa: BLE001 - see above
        return
    finally:
        os.environ.clear()
        os.environ.update(saved)
    prestart(cfg, le, env)


def _recorded(fn: Any) -> Any:
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


def main(argv: list[str] | None = None) -> int:
    """The command line ``argv`` (tests call this in-process); returns the exit code."""
    return run(parse(sys.argv[1:] if argv is None else argv))


def parse(argv: list[str]) -> argparse.Namespace:
    """argv -> the command; ``ddplab train SCRIPT.py ... -- ARGS``: everything after the first
    ``--`` is the script's, untouched (its own flags may look like ddplab's)."""
    script_args: list[str] | None = None
    if argv[:1] in (["train"], ["run"]) and "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        chosen = _chosen(parser, args)
        chosen.error(f"unrecognized arguments: {' '.join(unknown)}{_hint(chosen, args, argv, unknown)}")
    if args.command in ("train", "run") and not (args.experiment or args.module):
        parser.error(f"{args.command}: give an experiment (a .yaml file, or your own script's "
                     ".py), or -m MODULE")
    if script_args is not None:
        args.script_args = script_args
    return args


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub-)command's own parser that ``args`` went through (``ddplab study run``'s)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest or "", None)
            if name in action.choices:
                return _chosen(action.choices[name], args)
    return parser


def _hint(chosen: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str],
          unknown: list[str]) -> str:
    """What the user likely meant by the arguments no parser took: a launcher's flag given to
    ``train``, a script's own arguments before the ``--`` (any after the script's name), or a
    misspelled option of the command's."""
    from .launchers.targets import MISPLACED_FOR_TRAIN

    known = sorted(o for o in chosen._option_string_actions if o.startswith("--"))
    script = ""
    if args.command in ("train", "run"):
        script = f"-m {args.module}" if args.module else str(args.experiment or "")
        script = script if script.endswith(".py") or args.module else ""
    after = script and _after_script(argv, args)
    for flag in (u.split("=", 1)[0] for u in unknown if u.startswith("--")):
        if args.command == "train" and flag in MISPLACED_FOR_TRAIN:
            return f"; {flag} is a launcher's: {MISPLACED_FOR_TRAIN[flag]} ..."
        if after and flag in after:
            break  # the script's, typed where ddplab's own options go
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.7)
        if close:
            return f"; did you mean {close[0]}?"
    if not script:
        return ""
    experiment = str(args.experiment or "")
    if args.module and experiment and not experiment.endswith((".yaml", ".yml")):
        unknown = [*unknown, experiment]  # a value of the script's, taken for the experiment
        unknown.sort(key=lambda t: len(argv) - argv[::-1].index(t))
    # The command as typed less the script's arguments, matched from the end (they come last:
    # a value of ddplab's equal to one of theirs, --nproc-per-node 2 ... --lr 2, stays).
    own: list[str] = []
    pending = list(unknown)
    for token in reversed(argv):
        if pending and token == pending[-1]:
            pending.pop()
        else:
            own.insert(0, token)
    return (f"; a script's own arguments go after --: ddplab {' '.join(own)} "
            f"-- {' '.join(unknown)}")


def _after_script(argv: list[str], args: argparse.Namespace) -> set[str]:
    """The tokens typed after the script's name (or -m's module): its own, surely."""
    name = args.module or str(args.experiment)
    return set(argv[argv.index(name) + 1:]) if name in argv else set()


def run(args: argparse.Namespace) -> int:
    """One parsed command, by its handler; bad input is exit 2 with one line. ``args.overrides``
    stays the command line's own ``--set`` values: ``config.load`` reads ``DDPLAB_SET`` itself
    (defaults < file < DDPLAB_SET < --set), and a launcher passes on only the ``--set`` values
    (its ranks inherit DDPLAB_SET)."""
    from .credentials import from_files
    from .errors import DdplabError
    from .logins import from_uri

    try:
        from_files()  # before any launcher copies the environment to the ranks
        from_uri()  # a login in MLFLOW_TRACKING_URI: out of the URI, into the credentials
        code: int = args.func(args)
        return code
    except DdplabError as e:
        # Failures become exit codes here: a DdplabError is its one line ("ddplab: error:" for
        # bad input, like argparse's; "ddplab <command>: error:" for a command that failed).
        logger("" if e.exit_code == EXIT_USAGE or args.command == "train" else args.command).error(e)
        return e.exit_code
    except KeyboardInterrupt as e:
        logger().warning("interrupted")
        _say_run(e)
        return 130
    except Exception as e:
        known = _store_refusal(e)
        if known is not None:  # MLflow's refusal of the store's schema, from any path to it
            logger().error(known)
            _tell_torchrun(known)  # so `ddplab run`'s last line says it too
            return known.exit_code
        first = first_line(str(e))
        if args.command == "train" and _peer_gone(f"{type(e).__name__}: {first}"):
            # Not a bug: a peer rank ended first (killed, failed) and this rank's collective lost
            # its connection. The verdict names that rank; this one's frames are in the run.
            logger().error(f"stopped: a peer rank ended first and this rank's collective lost "
                           f"it ({type(e).__name__}: {first})")
            _tell_torchrun(e)
            _say_run(e)
            return EXIT_ERROR
        # A bug (ddplab's, or the user's code's): one line first, then the traceback.
        where = _raised_in_user_code(e)
        logger().error(f"{where + ' raised' if where else 'unexpected'} {type(e).__name__}: "
                       f"{first} (traceback below)")
        if not getattr(e, "run_line", ""):
            raise
        # The job had a run: its traceback, then (last, as when it finishes) where the run is.
        import traceback

        traceback.print_exc()
        _tell_torchrun(e)  # what @record would have written
        _say_run(e)
        return EXIT_ERROR


def _store_refusal(e: BaseException, uris: list[str] | None = None) -> TrackingError | None:
    """MLflow's refusal to open a store as it is (tracking/store.py, unusable) where it escaped
    open_client (a client made elsewhere, the delivery process's answer), as its one line (a
    StoreUnusable or StoreUnwritable), else None. ``uris``: the stores the command used (the
    one named is the first that store_problem finds unusable); without them, the environment's,
    and only a schema refusal (MLflow's own words) is recognised."""
    from .tracking.store import embedded_store, store_problem, unusable

    if not uris:
        return unusable(e, os.environ.get("MLFLOW_TRACKING_URI") or embedded_store(),
                        schema_only=True)
    uri = next((u for u in uris if store_problem(u)), uris[0])
    return unusable(e, uri)


def _say_run(e: BaseException) -> None:
    """A failed or stopped job's last line: where its run is (jobend.Signals put it on ``e``;
    progress lines come from rank 0 only)."""
    from .training.jobend import say_last

    say_last(getattr(e, "run_line", ""))


def _peer_gone(error: str) -> bool:
    """Whether a rank's error is its collective's broken connection to a peer that is gone."""
    from .forensics.watch import PEER_GONE

    world = os.environ.get("WORLD_SIZE", "1")
    return world.isdigit() and int(world) > 1 and any(s in error for s in PEER_GONE)


def _raised_in_user_code(e: BaseException) -> str:
    """``your code (FILE:LINE)`` when the innermost frame is neither ddplab's nor an installed
    library's (a user's dataset, model, loss or script), else "": the traceback is theirs."""
    import sysconfig
    import traceback
    from pathlib import Path

    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    last = Path(frames[-1].filename)
    ours = Path(__file__).resolve().parent
    libraries = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib", "stdlib")}
    if not last.is_absolute() or last.resolve().is_relative_to(ours) or any(
            last.resolve().is_relative_to(lib) for lib in libraries):
        return ""
    return f"your code ({last}:{frames[-1].lineno})"


def _config(args: argparse.Namespace) -> int:
    from .config import load
    from .logins import mask

    print(mask(load(args.experiment, args.overrides, environ=os.environ).to_yaml()), end="")
    return 0


def _sync(args: argparse.Namespace) -> int:
    from .agent.sync import sync
    from .tracking import validated_uri
    from .tracking.store import StoreUnusable, store_problem

    if not 0 < args.timeout <= 86400:  # (-1 or nan was a sync that tried nothing)
        from .errors import BadInput

        raise BadInput(f"--timeout: got {args.timeout}; must be seconds in (0, 86400]")
    uri = validated_uri(args.tracking_uri) if args.tracking_uri else ""
    stores = [uri] if uri else _spool_uris(args.paths)
    for target in stores:  # before MLflow retries a store it cannot open for minutes
        problem = store_problem(target)
        if problem:
            raise StoreUnusable(problem)
    try:
        return sync(args.paths, args.timeout, uri)
    except Exception as e:
        known = _store_refusal(e, stores)
        if known is None:
            raise
        raise known from None


def _spool_uris(paths: list[str]) -> list[str]:
    """The stores the spools under ``paths`` deliver to (what sync opened)."""
    from pathlib import Path

    from .tracking import spool

    uris = []
    for directory in spool.find([Path(p) for p in paths]):
        try:
            uris.append(spool.Meta.read(directory).uri)
        except (OSError, ValueError, KeyError):
            continue
    return list(dict.fromkeys(uris))


def _import(args: argparse.Namespace) -> int:
    from .tracking import validated_uri
    from .tracking.importer import import_runs

    uri = validated_uri(args.tracking_uri)
    imported, skipped = import_runs(args.source, uri)
    print(f"ddplab import: {imported} run(s) into {uri}"
          f"{f'; {skipped} already there, skipped' if skipped else ''}")
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    from .training.checkpoint import export

    print(export(args.source, args.out))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import doctor

    return doctor(args.experiment, args.overrides)


def _study(args: argparse.Namespace) -> int:
    from . import study

    if args.command == "study":
        from .config import env_overrides

        # A study layers its own sets: study < variant < DDPLAB_SET < --set, every job given
        # them as --set (study/spec.py), so DDPLAB_SET's items go in, below the command line's.
        return study.run_study(args.study, env_overrides(os.environ) + args.overrides, args.fresh,
                               args.dry_run, args.repeats, args.variants)
    if args.command == "report":
        return study.show_report(args.parent_run_id, args.page)
    from .study.reproduce import reproduce

    return reproduce(args.run_id, args.strict)


def _diagnose(args: argparse.Namespace) -> int:
    from .agent.postmortem import diagnose

    return diagnose(args.run_id)


def _bench(args: argparse.Namespace) -> int:
    from .bench.run import BenchError, collectives
    from .distributed.choice import BackendError
    from .distributed.group import Rank0Error
    from .launchers import LaunchError
    from .tracking import TrackingError

    try:
        return collectives(args)
    except (BenchError, LaunchError) as e:
        logger("bench").error(e)
        return EXIT_USAGE
    except (BackendError, TrackingError, Rank0Error) as e:
        logger("bench").error(e)
        return EXIT_ERROR


def _run(args: argparse.Namespace) -> int:
    """``ddplab run``: the preflight's refusals are bad input (exit 2), like train's."""
    from .distributed.choice import BackendError
    from .launchers import local

    try:
        return local.run(args)
    except BackendError as e:
        logger().error(e)
        return EXIT_USAGE


def _launch(args: argparse.Namespace) -> int:
    from .launchers import LaunchError, mpi, rendezvous

    try:
        if args.command == "launch":  # (not mpi launch: its workers may hold files it lacks)
            _loads(rendezvous.train_args(args.train_args))
        return mpi.main(args) if args.command == "mpi" else rendezvous.launch(args)
    except (LaunchError, OSError, subprocess.CalledProcessError) as e:
        logger(args.command).error(e)
        return EXIT_ERROR


def _loads(train_argv: list[str]) -> None:
    """``ddplab launch``'s job loads (the experiment, its ``--set``, the script) before the node
    waits for its peers: a typo was "timed out waiting for 2 addresses" after 180 s, or, with
    peers there, one refusal per rank in torchrun's banner. Raises ConfigError (exit 2)."""
    from .launchers.local import load_job

    job = parse(["train", *train_argv])
    load_job(job.experiment, job.module, job.overrides, job.script_args)


def _train(experiment: str | None, overrides: list[str], summary_out: str,
           script_args: list[str] | None = None, module: str = "") -> int:
    from .errors import DdplabError

    warnings.filterwarnings("default")
    # SQLAlchemy's deprecations inside MLflow's store: nothing the user can act on.
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"mlflow(\.|$)")
    try:
        if module:  # a packaged script: script mode, whatever the experiment file says
            from .launchers.local import load_job
            from .training import scriptmode

            scriptmode.train(load_job(experiment, module, overrides, script_args), summary_out)
        else:
            from .training.run import train

            train(experiment, overrides, summary_out, script_args)
        return 0
    except DdplabError as e:
        # Its one line (the run, if any, records the traceback), then where the run is; under
        # torchrun it goes to the rank's error file too (torchrun's failure summary). A refusal
        # every rank makes alike (a resume's checks) is said once per node, not once per rank.
        if not e.collective or _local_rank() == 0:
            logger().error(e)
        _tell_torchrun(e)
        _say_run(e)
        _let_rank0_end_first(e)
        return e.exit_code
    except SystemExit as e:
        # User code (a model, loss, dataset, metric) called sys.exit while training: exit 0
        # from a part is no success; the run recorded it FAILED (tracking/runs.py).
        line = f"user code called sys.exit({e.code!r}) during the job; it ended FAILED"
        logger().error(line)
        _tell_torchrun(RuntimeError(line))
        _say_run(e)
        return EXIT_ERROR


RANK0_GRACE_S = 10.0
"""How long a rank that only passes rank 0's failure on waits for rank 0 to end first."""


def _let_rank0_end_first(e: BaseException) -> None:
    """A rank raising rank 0's failure (a Rank0Error) learnt of it before rank 0 said it: ending
    at once, it was torchrun's "first observed failure" and its SIGTERM to rank 0 cut rank 0's own
    line (seen on a loaded machine: the job said only "rank 0 failed" in a traceback). Under a
    launcher that stops every rank once one ends (torchrun, mpirun) it waits for that stop, up to
    RANK0_GRACE_S; elsewhere (srun waits for all tasks) it ends at once."""
    import time

    from .distributed.group import Rank0Error

    if isinstance(e, Rank0Error) and ("TORCHELASTIC_RUN_ID" in os.environ
                                      or "OMPI_COMM_WORLD_RANK" in os.environ):
        time.sleep(RANK0_GRACE_S)


def _local_rank() -> int:
    """This process's rank on its node, as its launcher says it (0 where none does)."""
    from .launchers.detect import LaunchEnv

    try:
        return LaunchEnv.from_environ(os.environ).local_rank
    except Exception:  # noqa: BLE001 - (a launch environment that does not add up: say it)
        return 0


def _tell_torchrun(e: BaseException) -> None:
    """Under torchrun, each rank's error goes into its error file too, so torchrun's failure
    summary ("Root Cause (first observed failure)") shows which rank failed first and why,
    instead of "error_file: <N/A>" (torch.distributed.elastic's ErrorHandler, what @record
    uses). Bad input is its one line; a failed script the user's own traceback (ScriptFailed:
    ``user_traceback``), not ddplab's frames around it, and when it failed."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    try:
        if hasattr(e, "user_traceback") or getattr(e, "exit_code", 0) == EXIT_USAGE:
            line = str(e)
            # A failed script: its line ("rank 1 (host h): ValueError: ...") over the user's
            # traceback (ScriptFailed.detail), as the run's error.txt has it.
            said = getattr(e, "detail", "") if getattr(e, "user_traceback", "") else line
            when = getattr(e, "t", None) or time.time()
            with open(path, "w") as f:  # ErrorHandler's format (torch.distributed.elastic)
                json.dump({"message": {"message": getattr(e, "user_error", "") or line,
                                       "extraInfo": {"py_callstack": said,
                                                     "timestamp": str(int(when))}}}, f)
            return
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)
    except OSError:  # the summary then says <N/A>, as before; the job's own line stands
        pass
