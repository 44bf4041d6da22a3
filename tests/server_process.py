"""A ``lily`` server as a real subprocess on a free loopback port, for the tests that need one
(tests/test_server.py, test_server_soak.py, test_server_shutdown.py).

The server's stdout and stderr go to one log file, so a server that never answers ``/health``
(it exited, or it hangs) fails the test with a message naming that log and quoting its tail,
and a chatty server cannot block on a full pipe.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

LOG_TAIL = 2000  # characters of the log quoted in a failure message


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(port: int, device: str = "auto", **kwargs: object) -> list[str]:
    """``lily.server.serve(Engine.load(device=device), port=port, **kwargs)`` in a fresh
    interpreter, as the CLI calls it (kwargs are written with ``repr``)."""
    args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
    code = ("from lily.engine import Engine\nfrom lily.server import serve\n"
            f"serve(Engine.load(device={device!r}), port={port}{args})\n")
    return [sys.executable, "-c", code]


def lily_serve_argv(port: int, *extra: str) -> list[str]:
    """``python -m lily serve --port port *extra``."""
    return [sys.executable, "-m", "lily", "serve", "--port", str(port), *extra]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:<port>
    log: Path  # the server's stdout and stderr

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def running_server(argv: list[str], port: int, log: Path, *, timeout: float = 60.0) -> Iterator[ServerProcess]:
    """Start ``argv`` (a server that will listen on 127.0.0.1:port), wait until ``GET /health``
    answers 200, yield it; on leaving, whatever happened, stop the process (SIGTERM, SIGKILL
    after 10 s) unless it has already exited. Fails the test (pytest.fail, naming ``log``) if
    the process exits or ``/health`` does not answer within ``timeout`` seconds."""
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log)
    try:
        _wait_healthy(server, timeout)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _wait_healthy(server: ServerProcess, timeout: float) -> None:
    t0 = time.time()
    while True:
        try:
            if httpx.get(server.base + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        code = server.proc.poll()
        if code is not None:
            why = f"exited with code {code}"
        elif time.time() - t0 >= timeout:
            why = f"did not answer /health within {timeout:g} s"
        else:
            time.sleep(0.1)
            continue
        pytest.fail(f"server {why}; its log {server.log} ends:\n{server.log_text()[-LOG_TAIL:]}")
