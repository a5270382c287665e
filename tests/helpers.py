"""Helpers several test modules share (no test module imports another)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`mlflow server` with its store in a folder; killed with SIGKILL, started again on the
    same port and store."""

    def __init__(self, root: Path, host: str = "127.0.0.1") -> None:
        self.root, self.port, self.host = root, free_port(), host
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # Containers reach a server on all interfaces as host.docker.internal (compose/).
        allowed = ",".join(f"{h}:{self.port}" for h in ("127.0.0.1", "localhost",
                                                        "host.docker.internal"))
        self.proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--host", self.host, "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"),
             "--allowed-hosts", allowed],
            cwd=self.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + 90
        while not self.answers():
            assert time.monotonic() < deadline and self.proc.poll() is None, "server did not start"
            time.sleep(0.5)

    def answers(self) -> bool:
        from ddplab.tracking import check_reachable

        return check_reachable(self.uri, timeout_s=2) is None

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(self.uri)
