"""Unit: tracking URI precedence and the reachability probe against real sockets."""

import http.server
import socket
import threading

import pytest

from ddplab.config import TrackingConfig
from ddplab.tracking import NullTracker, check_reachable, resolve_uri
from tests.conftest import REPO


def test_uri_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_uri(TrackingConfig(), {}) == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert resolve_uri(TrackingConfig(), {"MLFLOW_TRACKING_URI": "http://m:5000"}) == "http://m:5000"
    assert resolve_uri(TrackingConfig(uri="http://x:1"), {"MLFLOW_TRACKING_URI": "y"}) == "http://x:1"


def test_closed_port_is_reported_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        reason = check_reachable(f"http://127.0.0.1:{port}", timeout_s=2)
    assert reason == f"tracking server http://127.0.0.1:{port} is unreachable (Failed to " \
        "establish a new connection: [Errno 111] Connection refused)", reason


def test_a_server_that_takes_the_connection_and_never_answers_is_slow_not_unreachable():
    """A hostile pass: a proxy answering 20 s late read "unreachable (Read timed out...)"; it
    took the connection. And a local store's full disk is no network failure ("did not answer
    (OSError: [Errno 28]...)", a hostile pass): each is said as what it is."""
    from ddplab.tracking import spool

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()  # the kernel completes connections; nothing ever reads or answers
        reason = check_reachable(f"http://127.0.0.1:{s.getsockname()[1]}", timeout_s=2)
    assert reason and "answered too slowly (it took the connection, then " in reason, reason
    assert "Read timed out" in reason and "unreachable" not in reason, reason
    said = spool.describe(OSError(28, "No space left on device"))
    assert said.startswith("failed: no space left on the device its files go to ("), said


@pytest.mark.parametrize("code, says, delivery_says", [
    (403, "answered HTTP 403 (API request to endpoint /api/2.0/mlflow/experiments/search failed "
          "with error code 403", "refused with HTTP 403 (API request to endpoint"),
    (502, "answered HTTP 502 (Bad Gateway): the server failing, or a proxy in front of it with no "
          "server behind it", "answered HTTP 502 (Bad Gateway): the server failing, or a proxy"),
    (500, "answered HTTP 500 (Internal Server Error): the server failing",
     "answered HTTP 500 (Internal Server Error): the server failing")])
def test_a_server_that_refuses_clients_is_a_problem(code, says, delivery_says, monkeypatch):
    """Like MLflow's 403 'Invalid Host header': /health would pass, a real API call does not.
    A 500 or a proxy's 502 read "unreachable", as a server that never answered does. The
    delivery (and `ddplab sync`) reads the same failure by the same rule."""
    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(code, "Invalid Host header")

        do_POST = do_GET  # noqa: N815 - MLflow's client searches with POST

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_port}"
    try:
        reason = check_reachable(uri)
        delivery = _delivery_failure(uri, monkeypatch)
    finally:
        server.shutdown()
    assert reason and reason.startswith(f"tracking server {uri} {says}"), reason
    assert delivery.startswith(delivery_says), delivery


def test_a_silent_server_is_said_by_its_cause_in_the_delivery_too(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        said = _delivery_failure(f"http://127.0.0.1:{s.getsockname()[1]}", monkeypatch)
    assert said == "did not answer (Failed to establish a new connection: [Errno 111] " \
        "Connection refused)", said


def _delivery_failure(uri, monkeypatch):
    """spool.describe's line for what the delivery's client raises against ``uri``."""
    from mlflow import MlflowClient

    from ddplab.tracking import spool

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(Exception) as caught:
        MlflowClient(uri).get_run("0" * 32)
    return spool.describe(caught.value)


def test_file_stores_need_no_probe():
    assert check_reachable("sqlite:///x.db") is None


def test_null_tracker_writes_nothing_anywhere(tmp_path, monkeypatch):
    """Every rank but 0 holds one: it must create no store, run or file, even with a store
    configured in its environment (which a real tracker would write to)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'm.db'}")
    t = NullTracker()
    t.log_params({"a": 1})
    t.set_tags({"b": 2})
    t.log_metrics({"c": 3.0}, 1)
    t.log_text("x", "y.txt")
    t.finish("FAILED", "boom")
    assert t.run_id == "" and list(tmp_path.iterdir()) == []


def test_a_disabled_tracker_is_the_null_one_on_every_rank(tmp_path, monkeypatch):
    from ddplab.launchers.detect import LaunchEnv
    from ddplab.tracking import open_tracker

    monkeypatch.chdir(tmp_path)
    le = LaunchEnv("none", 0, 1, 0, 1, 0, "127.0.0.1", 29500)
    t, ref = open_tracker(TrackingConfig(enabled=False), le, "x", "")
    assert type(t) is NullTracker and not ref.run_id and list(tmp_path.iterdir()) == []


def test_waits_for_a_server_that_comes_up_late(tmp_path, monkeypatch):
    """tracking.wait_s: a server that starts 2 s after the job is waited for, not fatal."""
    import time

    from ddplab.tracking import opening as tracking  # where the run is opened
    from ddplab.tracking.tracker import _create_or_attach
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    calls = []
    real = tracking.check_reachable

    def late(uri, timeout_s=5.0):
        calls.append(time.monotonic())
        return None if len(calls) >= 2 else real(f"http://127.0.0.1:{port}", 1)

    monkeypatch.setattr(tracking, "check_reachable", late)
    monkeypatch.chdir(tmp_path)
    cfg = TrackingConfig(uri=f"sqlite:///{tmp_path / 'm.db'}", wait_s=5)
    t = _create_or_attach(cfg, "x", "", "", tmp_path)
    assert t.run_id and len(calls) == 2
    with pytest.raises(tracking.TrackingError, match=r"after waiting 1s \(tracking.wait_s\)"):
        monkeypatch.setattr(tracking, "check_reachable", lambda uri, timeout_s=5.0: "down")
        _create_or_attach(TrackingConfig(uri="http://x:1", wait_s=1), "x", "", "", tmp_path)


def test_the_printed_address_opens_the_run_in_the_model_training_view(monkeypatch, tmp_path):
    from ddplab.tracking import ui_address
    from ddplab.tracking.store import embedded_store

    monkeypatch.delenv("DDPLAB_UI_URL", raising=False)
    assert ui_address("http://mlflow:5000/", "3", "abc") == (
        ": http://mlflow:5000/#/experiments/3/runs/abc?workflowType=machine_learning")
    monkeypatch.setenv("DDPLAB_UI_URL", "http://localhost:5123")  # compose: the browser's name
    assert ui_address("http://mlflow:5000", "3", "abc").startswith(": http://localhost:5123/#/")
    monkeypatch.delenv("DDPLAB_UI_URL")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(REPO)  # the checkout, whose make ui serves its own mlflow.db
    local = ui_address(embedded_store(), "3", "abc")
    assert "browse it with `make ui`, then" in local
    assert local.endswith("/#/experiments/3/runs/abc?workflowType=machine_learning")
    # Any other store, or outside a checkout: the command that serves that very store.
    for where in (REPO, tmp_path):
        monkeypatch.chdir(where)
        other = ui_address("sqlite:////x/mlflow.db", "3", "abc")
        assert "browse it with `mlflow server --app-name ddplab --backend-store-uri " \
               "sqlite:////x/mlflow.db`, then http://127.0.0.1:5000/#/experiments/3/" in other


def test_every_rank_can_call_what_rank_0_calls():
    """Callers never ask `if rank == 0`: every public method of the real tracker exists on the
    null one with the same parameters (a method added to one only breaks the other ranks)."""
    import inspect

    from ddplab.tracking import MlflowTracker

    def public(cls):
        return {n: inspect.signature(f) for n, f in inspect.getmembers(cls, inspect.isfunction)
                if not n.startswith("_")}

    real, null = public(MlflowTracker), public(NullTracker)
    setup = {"open_spool"}  # called only where the run is made (rank 0 itself)
    assert real and set(real) - setup <= set(null)
    real = {n: s for n, s in real.items() if n not in setup}
    assert {n: (real[n], null[n]) for n in real
            if list(real[n].parameters) != list(null[n].parameters)} == {}


def test_a_param_cut_to_mlflows_limit_is_said_in_the_run(tmp_path):
    """A 9,000-character model.args used to be cut to 6,000 in the params without a word."""
    import json

    from ddplab.tracking import MlflowTracker
    from ddplab.tracking.opening import Opened

    run = MlflowTracker(Opened("r1", "0", "sqlite:///x.db", 1))
    run.open_spool(tmp_path)
    run.log_params({"model.args": "x" * 9000, "optim.lr": 0.1})
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    params = {k: v for r in records for k, v in r.get("params", {}).items()}
    tags = {k: v for r in records for k, v in r.get("tags", {}).items()}
    assert len(params["model.args"]) == 6000 and params["optim.lr"] == "0.1"
    assert tags["ddplab.params_cut"].startswith("model.args (9000 characters): cut to 6000")


def test_two_jobs_creating_one_experiment_at_once_both_get_it(tmp_path):
    """Both look the experiment up before either creates it (held at a barrier, on a real
    SQLite store): the loser's "already exists" must give it the winner's experiment."""
    from mlflow.tracking import MlflowClient

    from ddplab.tracking.opening import experiment_id

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # the schema made once, as a store's first job does
    both_looked = threading.Barrier(2, timeout=60)

    class LooksFirst(MlflowClient):
        looked = False

        def get_experiment_by_name(self, name):
            found = super().get_experiment_by_name(name)
            if not self.looked:  # only each job's first look waits for the other's
                self.looked = True
                both_looked.wait()
            return found

    got, errors = [], []

    def job():
        try:
            got.append(experiment_id(LooksFirst(uri), "race"))
        except Exception as e:  # noqa: BLE001 - the failure is the finding
            errors.append(e)

    threads = [threading.Thread(target=job) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(got) == 2 and got[0] == got[1], (errors, got)


def test_a_users_ddplab_tag_is_kept_beside_ddplabs_own_record(monkeypatch):
    """ddplab.track.tags({"ddplab.mode": ...}) overwrote the record studies and reproduce read
    (MLflow's own set_tag in a script is kept apart the same way: test_script_mlflow)."""
    from ddplab import track

    got: dict = {}

    class Recorder:
        def set_tags(self, values):
            got.update(values)

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(track, "_sink", Recorder())
    track.tags({"ddplab.mode": "mine", "dataset": "cifar10"})
    assert got == {"user.ddplab.mode": "mine", "dataset": "cifar10"}


def test_a_local_stores_uri_names_the_same_store_from_any_directory(tmp_path):
    """reproduce runs a script where it ran: a relative sqlite:///mlflow.db there is another
    (empty) store, and the script's own set_tracking_uri("sqlite:///mlflow.db") was taken for
    another store than the job's absolute one."""
    from ddplab.tracking.store import absolute_store

    here = str(tmp_path)
    assert absolute_store("sqlite:///mlflow.db", here) == f"sqlite:///{tmp_path}/mlflow.db"
    assert absolute_store(f"sqlite:///{tmp_path}/m.db?timeout=5", "/") == \
        f"sqlite:///{tmp_path}/m.db?timeout=5"
    assert absolute_store("file:mlruns", here) == f"file://{tmp_path}/mlruns"
    assert absolute_store("mlruns", here) == f"{tmp_path}/mlruns"
    assert absolute_store("http://host:5000", here) == "http://host:5000"


def test_a_run_made_for_the_job_elsewhere_gets_its_description_and_source(tmp_path):
    """A visual pass: a study's child runs (and a reproduction's) showed "No description" and
    no Source in the UI, where a job's own run says which throughput to quote and its command.
    What a run made elsewhere already says is kept."""
    from mlflow import MlflowClient

    from ddplab.tracking.opening import THROUGHPUT_NOTE, Request, open_run

    uri = f"sqlite:///{tmp_path}/m.db"
    c = MlflowClient(uri)
    exp = c.create_experiment("s")
    bare = c.create_run(exp, tags={"ddplab.variant": "a"}).info.run_id
    said = c.create_run(exp, tags={"mlflow.note.content": "mine"}).info.run_id
    for run_id in (bare, said):
        open_run(Request(uri, "s", "r", "tiny job", run_id=run_id,
                         source="ddplab train experiments/quickstart.yaml"))
    tags = c.get_run(bare).data.tags
    assert tags["mlflow.note.content"] == f"tiny job\n\n{THROUGHPUT_NOTE}"
    assert tags["mlflow.source.name"] == "ddplab train experiments/quickstart.yaml"
    assert c.get_run(said).data.tags["mlflow.note.content"] == "mine"
