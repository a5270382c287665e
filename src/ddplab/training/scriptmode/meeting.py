"""Where a script's ranks meet without a process group: the store of ``env://``.

Where torchrun's agent hosts one for its workers (``TORCHELASTIC_USE_AGENT_STORE=True``:
--standalone, one node), it is the agent's; everywhere else (torchrun's multi-node c10d
rendezvous, mpirun, srun) global rank 0's supervisor hosts it at MASTER_ADDR:MASTER_PORT and
the script's own ``init_process_group`` joins it as a client (the same variable tells it so),
so the port the script expects is the one it uses. Through it rank 0 tells every rank the
run, each rank says how its script ended, and a failure on one rank stops the others' scripts
(srun does not by itself).
"""

from __future__ import annotations

import json
import os
import pickle
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ...distributed.group import RANK0_FAILED, Rank0Error, rendezvous_store
from ...errors import DdplabError, first_line
from ...launchers import LaunchEnv

T = TypeVar("T")
PREFIX = "ddplab/script/"


class LauncherGone(DdplabError):
    """The store the ranks meet through is gone while the script runs: its host, torchrun's
    agent (or rank 0's supervisor), was killed outright."""


def _gone(e: Exception) -> LauncherGone:
    first = first_line(str(e))
    return LauncherGone(f"the launcher is gone (the store the ranks meet through, torchrun's "
                        f"agent or rank 0's, no longer answers: {type(e).__name__}: {first}): "
                        "the script was stopped")


class Meeting:
    def __init__(self, le: LaunchEnv, timeout_s: int) -> None:
        import torch.distributed as dist

        self.le = le
        # torchrun sets the variable to "False" where its agent hosts no store for the workers
        # (a multi-node c10d rendezvous): then rank 0 hosts it, as under mpirun and srun.
        self.hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" \
            and le.world_size > 1
        store = dist.HashStore() if le.world_size == 1 else rendezvous_store(le, timeout_s)
        # torchrun --max-restarts keeps its agent store across attempts: each attempt its keys.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = dist.PrefixStore(f"{PREFIX}attempt{attempt}/", store)
        self.script_store: Any = None
        self.script_port = 0
        if attempt != "0" and not self.hosts_store and le.world_size > 1:
            self._fresh_store_for_the_script(le, timeout_s)

    def _fresh_store_for_the_script(self, le: LaunchEnv, timeout_s: int) -> None:
        """torchrun --max-restarts keeps its agent store, and in it the last attempt's keys of
        the script's own process group: a rank whose script starts first reads a peer's old
        address and gloo cannot connect ("connectFullMesh failed ... Connection refused";
        plain torchrun meets it too, when one rank starts later). A restarted attempt's scripts
        get a store of their own, which rank 0's supervisor hosts while the job runs."""
        import datetime

        import torch.distributed as dist

        if le.is_rank0:
            self.script_store = dist.TCPStore(
                le.master_addr, 0, le.world_size, True, datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False)
            self.store.set("script_port", str(self.script_store.port))
        self.script_port = int(self.store.get("script_port"))

    def child_env(self) -> dict[str, str]:
        """What the script's process needs to join this store from its own env:// rendezvous."""
        if self.script_port:
            return {"MASTER_PORT": str(self.script_port)}
        if not self.hosts_store:
            return {}
        return {"TORCHELASTIC_USE_AGENT_STORE": "True"}

    def share_from_rank0(self, produce: Callable[[], T], is_rank0: bool, world_size: int) -> T:
        """Like group.share_from_rank0, through the store: rank 0's failure reaches all."""
        key = "run"
        if is_rank0:
            try:
                value = produce()
            except Exception as e:
                self._set_pickled(key, (None, f"{type(e).__name__}: {first_line(str(e))}"))
                raise
            self._set_pickled(key, (value, None))
            return value
        value, error = pickle.loads(self.store.get(key))  # noqa: S301 - rank 0 of this job
        if error:
            raise Rank0Error(f"{RANK0_FAILED}{error}")
        return value

    def _set_pickled(self, key: str, obj: object) -> None:
        # torch's stub types Store.set's value as str; the binding takes bytes as well
        self.store.set(key, pickle.dumps(obj))  # type: ignore[arg-type]

    def report(self, outcome: dict[str, Any]) -> None:
        """This rank's script has ended (``outcome``: how); a failure stops the others. Nobody
        to tell once the store is gone (LauncherGone says why)."""
        try:
            self.store.set(f"out/{self.le.rank}", json.dumps(outcome))
            if outcome.get("failed") and not outcome.get("stopped"):
                self.store.add("failures", 1)
        except RuntimeError:  # torch's DistNetworkError, DistStoreError
            return

    def peer_failed(self) -> bool:
        try:
            return self.le.world_size > 1 and self.store.add("failures", 0) > 0
        except RuntimeError as e:  # torch's DistNetworkError, DistStoreError
            raise _gone(e) from None

    def outcomes(self) -> dict[int, dict[str, Any]]:
        keys = {r: f"out/{r}" for r in range(self.le.world_size)}
        try:
            return {r: json.loads(self.store.get(k)) for r, k in keys.items()
                    if self.store.check([k])}
        except RuntimeError as e:  # torch's DistNetworkError, DistStoreError
            raise _gone(e) from None

    def leave(self, wait_s: float = 15.0) -> None:
        """Done with the store; the rank that hosts it waits for the others to be done too."""
        if self.le.world_size == 1:
            return
        try:
            done = self.store.add("left", 1)
        except RuntimeError:  # the store is gone already: nobody left to wait for
            return
        deadline = time.monotonic() + wait_s
        while self.hosts_store and self.le.is_rank0 and done < self.le.world_size \
                and time.monotonic() < deadline:
            time.sleep(0.1)
            done = self.store.add("left", 0)

    def wait_all(self, stop: Callable[[], bool] = lambda: False, grace_s: float = 3.0
                 ) -> dict[int, dict[str, Any]]:
        """Every rank's outcome; after a failure (or ``stop()``), whatever arrives within
        ``grace_s`` (a rank killed outright never reports)."""
        deadline = None
        while True:
            got = self.outcomes()
            if len(got) == self.le.world_size:
                return got
            if deadline is None and (stop() or any(o.get("failed") for o in got.values())):
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() >= deadline:
                return got
            time.sleep(0.2)
