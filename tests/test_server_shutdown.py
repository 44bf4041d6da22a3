"""``lily serve`` as a process: stopping it with SIGINT while it works, and a port that is taken.

The server runs as a real ``python -m lily serve`` subprocess (the embedded demo model) on a
free loopback port; the tests talk to it with httpx and the official ``openai`` client.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from server_process import free_port, lily_serve_argv, running_server

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")]

HI = [{"role": "user", "content": "Hi"}]
# what must never appear on the server's stderr after a clean shutdown
NOT_CLEAN = ("Traceback", "Exception in ASGI application", "CancelledError", "graceful shutdown exceeded")


def test_sigint_while_streaming_ends_everything_cleanly(tmp_path):
    """SIGINT with one stream generating and one request queued: the stream gets a final
    OpenAI error event and ``[DONE]``, the queued request a 503, and the process exits 0
    promptly without a traceback (before the fix: a 5 s wait, then uvicorn cancelled the
    stream task with a CancelledError traceback and the stream was cut)."""
    port = free_port()
    # one generation at a time, so the second request waits in the queue
    with running_server(lily_serve_argv(port, "--max-batch", "1"), port, tmp_path / "server.log") as server:
        base, proc = server.base, server.proc
        queued: dict = {}

        def queued_request():
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
            try:
                client.completions.create(model="lily-demo-shakespeare", prompt="KING:", max_tokens=500)
            except openai.APIStatusError as e:
                queued["status"], queued["body"] = e.status_code, e.body

        lines: list[str] = []
        body = {"messages": HI, "max_tokens": 5000, "stream": True}
        with httpx.Client(timeout=30) as client, client.stream("POST", base + "/v1/chat/completions",
                                                               json=body) as r:
            assert r.status_code == 200
            it = r.iter_lines()
            while len(lines) < 4:  # the role chunk and a few tokens: the generation runs
                line = next(it)
                if line.startswith("data: "):
                    lines.append(line)
            t = threading.Thread(target=queued_request)
            t.start()
            t0 = time.time()
            while httpx.get(base + "/health").json()["queued"] < 1:
                assert time.time() - t0 < 10, "the second request was not queued"
                time.sleep(0.02)
            t_sig = time.time()
            proc.send_signal(signal.SIGINT)
            lines += [line for line in it if line.startswith("data: ")]
            t_stream = time.time() - t_sig
        t.join(10)
        proc.wait(15)
        t_exit = time.time() - t_sig
        stderr = server.log_text()
    print(f"stream ended {t_stream:.2f}s and the process exited {t_exit:.2f}s after SIGINT")
    assert lines[-1] == "data: [DONE]", lines[-3:]
    err = json.loads(lines[-2][len("data: "):])["error"]
    assert err == {"message": "the server is shutting down", "type": "server_error", "param": None,
                   "code": "server_shutting_down"}
    assert all("error" not in json.loads(x[6:]) for x in lines[:-2])  # the chunks before are normal
    assert queued.get("status") == 503 and queued["body"]["code"] == "server_shutting_down", queued
    assert proc.returncode == 0, stderr[-3000:]
    for needle in NOT_CLEAN:
        assert needle not in stderr, stderr[-3000:]
    assert "chat (stream) failed after" in stderr  # the stream's log line
    assert t_stream < 2.0 and t_exit < 3.0  # about 0.1 s and 0.5 s on an idle machine


def test_port_taken_is_an_error_without_a_serving_line():
    """The 'serving ... on http://...' line is logged only once the address is bound."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        r = subprocess.run(lily_serve_argv(port), capture_output=True, text=True, timeout=60)
    out, err = r.stdout, r.stderr
    assert r.returncode == 1, err[-2000:]
    assert "cannot listen on 127.0.0.1" in err and "address already in use" in err.lower(), err[-2000:]
    assert "serving lily-demo-shakespeare" not in err + out and "Traceback" not in err


def test_default_max_tokens_flag(tmp_path):
    """``--default-max-tokens`` caps chat requests that set no max_tokens; an explicit one
    wins (completions keep OpenAI's own default of 16). ``--reasoning off``: a request that
    does not say does not think (its text is content). The start-up line says both (issue 29:
    a new user saw neither)."""
    port = free_port()
    argv = lily_serve_argv(port, "--default-max-tokens", "3", "--reasoning", "off")
    with running_server(argv, port, tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="lily-demo-shakespeare", messages=HI, temperature=0)
        capped = client.chat.completions.create(**kw)
        assert capped.usage.completion_tokens <= 3 and capped.choices[0].message.content
        assert capped.usage.completion_tokens == 3 or capped.choices[0].finish_reason == "stop"
        longer = client.chat.completions.create(**kw, max_tokens=6)
        assert longer.usage.completion_tokens > 3 or longer.choices[0].finish_reason == "stop"
    log = (tmp_path / "server.log").read_text()
    assert "requests without a limit: max_tokens 3 (chat, Responses), 16 (completions); reasoning off" in log


@pytest.mark.parametrize("flags, match", [(["--default-max-tokens", "0"], "--default-max-tokens must be >= 1"),
                                          (["--max-queue", "-1"], "--max-queue must be >= 0"),
                                          (["--port", "70000"], "--port must be in 0..65535")])
def test_serve_flag_errors(flags, match):
    r = subprocess.run([sys.executable, "-m", "lily", "serve", *flags], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and match in r.stderr
