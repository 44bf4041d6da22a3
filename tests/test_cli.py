"""The `lily` command as a user runs it (a subprocess on the installed package)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from lily.lab.device import devices
from lily.engine import AUTO_DEVICE_ENV, auto_device


def run(*args, input=None, timeout=300):
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-m", "lily", *args], capture_output=True, text=True,
                          input=input, timeout=timeout, env=env)


def test_help_lists_commands():
    r = run("--help")
    assert r.returncode == 0
    for cmd in ("generate", "chat", "info", "serve"):
        assert cmd in r.stdout
    assert "demo model" in r.stdout
    g = run("generate", "--help")
    assert g.returncode == 0 and "--temperature" in g.stdout and "--model" in g.stdout


def test_generate_default_model_prints_shakespeare():
    r = run("generate", "ROMEO.", "--max-tokens", "24", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    text = r.stdout.strip()
    assert len(text.split()) >= 5
    # the speed line, on stderr by default (as mlx_lm prints it); a native device (the default
    # on a Mac) times itself and says how busy it kept the device
    line = r.stderr.strip().splitlines()[-1]
    busy = r" \(GPU busy \d+%\)" if auto_device() != "reference" else ""
    # (a fresh prompt: nothing from the prompt cache, so no "(N cached, M computed)")
    assert re.fullmatch(r"\[prompt: 5 tokens, [\d.]+ tok/s \| generation: 24 tokens, "
                        rf"[\d.]+ tok/s{busy} \| peak memory: [\d.]+ GB \| finish: length\]", line), line
    assert float(line.split("peak memory: ")[1].split()[0]) > 0.01  # the weights alone are 21 MB
    assert "context window" not in r.stderr  # max tokens, not the context, ended it
    # --quiet drops the speed line; naming the device drops auto's one-line notice too (the
    # same device as auto's: greedy tokens of two devices may part at a near-tie)
    q = run("generate", "ROMEO.", "--max-tokens", "24", "--temperature", "0", "--quiet", "--device", auto_device())
    assert q.returncode == 0 and q.stdout == r.stdout and q.stderr == "", q.stderr


def test_generate_prompt_from_stdin():
    a = run("generate", "-", "-n", "6", "-t", "0", "-q", input="ROMEO.")
    b = run("generate", "ROMEO.", "-n", "6", "-t", "0", "-q")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
    empty = run("generate", "-", input="")
    assert empty.returncode == 1 and "the prompt is empty" in empty.stderr


def test_version():
    from lily import __version__
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"lily {__version__}"


def test_serve_help_has_a_description():
    r = run("serve", "--help")
    assert r.returncode == 0 and "Serve the model over HTTP" in r.stdout


def test_model_given_as_a_hugging_face_repo_id():
    r = run("generate", "x", "--model", "Qwen/Qwen3.6-35B-A3B")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "does not exist" in r.stderr and "Hugging Face repo id" in r.stderr
    assert "mlx_lm convert --hf-path Qwen/Qwen3.6-35B-A3B --mlx-path Qwen3.6-35B-A3B-4bit" in r.stderr


def test_generate_chat_mode_and_stop():
    r = run("generate", "Speak.", "--chat", "--no-think", "--max-tokens", "8", "--temperature", "0")
    assert r.returncode == 0, r.stderr


def test_info_json():
    r = run("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["layers"] == 8 and info["tensors"] == 357
    assert info["weight_bytes"] > 20_000_000
    assert "reference" in info["devices_available"]
    assert "devices" in info["native_build"]


def test_chat_interactive_session():
    r = run("chat", "--max-tokens", "6", "--temperature", "0", input="Hail, good sir.\n/reset\nAnd again.\n\n")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 0
    assert "[conversation reset]" in r.stderr
    assert "lily chat - lily-demo-shakespeare on " in r.stderr  # the server's model id (model_display_name)


def test_chat_eof_ends_the_prompt_line():
    """Ctrl-D (EOF) at the prompt: the "> " line is ended on stdout, where input() wrote it."""
    r = run("chat", "--max-tokens", "2", input="")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "> \n"


def test_generate_top_k_minus_one_and_bounds():
    a = run("generate", "ROMEO.", "-n", "6", "--temperature", "0.8", "--seed", "3", "--top-k", "-1")
    b = run("generate", "ROMEO.", "-n", "6", "--temperature", "0.8", "--seed", "3", "--top-k", "0")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
    for value in ("-5", "2147483648"):
        r = run("generate", "x", "--top-k", value)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert "-1 or 0" in r.stderr and "2147483647]" in r.stderr and "[0," not in r.stderr, r.stderr
    r = run("generate", "x", "--max-tokens", "2147483648")
    assert r.returncode == 1 and "[1, 2147483647]" in r.stderr, r.stderr


def test_generate_no_think_needs_chat():
    r = run("generate", "x", "--no-think")
    assert r.returncode == 2 and "--no-think needs --chat" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_generate_thinking_budget():
    r = run("generate", "Speak.", "--chat", "--thinking-budget", "3", "-n", "9", "-t", "0", "-q",
            "--device", "reference")
    assert r.returncode == 0 and "[/thinking]" in r.stderr, r.stderr
    thinking = r.stderr.split("[thinking]\n", 1)[1].split("[/thinking]", 1)[0]
    assert thinking.strip() and r.stdout.strip()  # 3 tokens of thinking, closed; the answer on stdout
    for args, needle in [(("x",), "--thinking-budget needs --chat"),
                         (("x", "--chat", "--no-think"), "which --no-think switches off"),
                         (("x", "--chat", "--thinking-budget", "0"), "--thinking-budget must be at least 1")]:
        r = run("generate", "--thinking-budget", "3", *args)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    r = run("chat", "--no-think", "--thinking-budget", "3", input="")
    assert r.returncode == 2 and "which --no-think switches off" in r.stderr


def test_generate_context_full_notice():
    r = run("generate", "ROMEO.", "--max-context", "12", "--max-tokens", "100", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "context window (12 tokens) is full" in r.stderr


@pytest.mark.parametrize("args, needle", [
    (("generate", "x", "--temperature", "-1"), "temperature"),
    (("generate", "x", "--model", "/nonexistent/model"), "/nonexistent/model: the path does not exist"),
    (("chat", "--model", "./no-such-dir"), "does not exist"),
    (("cache-prompt", "never-written.lilycache", "--system-file", "/nonexistent/sys.txt"),
     "--system-file /nonexistent/sys.txt: [Errno 2]"),
    pytest.param(("generate", "x", "--device", "metal"), "not available in this build",
                 marks=pytest.mark.skipif("metal" in devices(), reason="this build has the Metal device")),
])
def test_bad_input_is_a_clear_error(args, needle):
    r = run(*args)
    assert r.returncode == 1
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_a_missing_model_path_is_one_message_in_every_command():
    """Issue 29: `lily doctor --model nope` said "not a directory" (in its memory section,
    exit 1 after the kernel checks) where `lily generate` said "the path does not exist".
    Every command taking --model now says the same line, before doing anything."""
    want = "lily: error: --model ./nope: the path does not exist\n"
    for args in (("generate", "x"), ("chat",), ("info",), ("doctor",), ("serve",), ("estimate",),
                 ("cache-prompt", "x.lilycache", "--system", "s")):
        r = run(*args, "--model", "./nope")
        assert (r.returncode, r.stderr) == (1, want), (args, r.stderr)


_TOOL = {"type": "function", "function": {"name": "ring_bell", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("tools, needle", [
    ([{"type": "function", "function": {"name": "get.weather"}}], "tools[0].function.name: tool name 'get.weather' is invalid"),
    ([_TOOL, {"type": "function", "function": {"name": "lookup", "parameters": {"type": "nonsense"}}}],
     "tools[1].function.parameters (tool 'lookup'): invalid JSON schema: 'nonsense' is not valid"),
    ([{"type": "function", "function": {"name": "f", "description": 5}}], "tools[0].function.description (tool 'f')"),
    ([{"name": "bare", "parameters": {}}], "tools[0]: a tool must be an object"),
    ({"tools": "ring_bell"}, "expected a JSON list of tool definitions"),
])
def test_cache_prompt_refuses_tools_the_server_refuses(tmp_path, tools, needle):
    """The server's tool check (lily.structured.check_tools) before the model is loaded:
    exit 1, one line naming the file, the tool and the fault, and no cache file."""
    spec, out = tmp_path / "tools.json", tmp_path / "sys.lilycache"
    spec.write_text(json.dumps(tools))
    r = run("cache-prompt", str(out), "--system", "Be brief.", "--tools", str(spec))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"lily: error: --tools {spec}: ") and needle in r.stderr, r.stderr
    assert not out.exists()


def test_default_device_is_auto(monkeypatch):
    """No --device: metal where this build has it, else reference with a one-line notice
    (never the slow simulator unless $LILY_AUTO_DEVICE asks for it)."""
    monkeypatch.delenv(AUTO_DEVICE_ENV, raising=False)
    r = run("generate", "ROMEO.", "--max-tokens", "2", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    if "metal" in devices():
        assert "using device=" not in r.stderr
    else:
        assert "using device='reference'" in r.stderr
    monkeypatch.setenv(AUTO_DEVICE_ENV, "nope")
    bad = run("generate", "ROMEO.", "--max-tokens", "2")
    assert bad.returncode == 1 and f"{AUTO_DEVICE_ENV}='nope' names no device of this build" in bad.stderr


def test_native_device_flags(tmp_path, monkeypatch):
    base = ("generate", "ROMEO.", "--max-tokens", "6", "--temperature", "0")
    r = run(*base, "--device", "reference", "--prefill-chunk", "4")
    assert r.returncode == 1 and "--prefill-chunk applies only to the native devices" in r.stderr
    monkeypatch.setenv("LILY_CACHE_DIR", str(tmp_path / "wc"))  # a fresh cache: its notice shows
    default = run(*base, "--device", "sim")
    chunked = run(*base, "--device", "sim", "--prefill-chunk", "1", "--no-weight-cache")
    bad = run(*base, "--device", "sim", "--prefill-chunk", "-1")
    assert default.returncode == 0 and chunked.returncode == 0, default.stderr + chunked.stderr
    assert default.stdout == chunked.stdout and default.stdout.strip()
    assert "writing an aligned copy" in default.stderr and "aligned copy" not in chunked.stderr
    # a native device times itself: the speed line says how busy it kept the device
    assert re.search(r"generation: 6 tokens, [\d.]+ tok/s \(GPU busy \d+%\) \|", default.stderr), default.stderr
    assert bad.returncode == 2 and "--prefill-chunk: expected an integer >= 0, got -1" in bad.stderr


def test_closed_pipe_ends_quietly():
    # `lily generate ... | head -1`: the reader leaves early; no traceback
    p = subprocess.Popen([sys.executable, "-m", "lily", "generate", "ROMEO.", "-n", "300", "-t", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # before the first write, so the first write fails
    err = p.stderr.read()
    assert p.wait(120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_chat_printer_splits_thinking_from_the_answer(demo_engine, capsys):
    from lily.cli import _ChatPrinter
    msgs = [{"role": "user", "content": "Hi"}]
    p = _ChatPrinter(demo_engine, msgs, {})  # the template opens <think> for the model
    for piece in ["I should ", "greet.</th", "ink>\n\nHello", " there!"]:
        p.feed(piece)
    p.finish()
    out, err = capsys.readouterr()
    assert out == "Hello there!"
    assert err == "[thinking]\nI should greet.\n[/thinking]\n"
    p = _ChatPrinter(demo_engine, msgs, {"enable_thinking": False})
    p.feed("Plain answer.")
    p.finish()
    out, err = capsys.readouterr()
    assert (out, err) == ("Plain answer.", "")


def test_chat_commands():
    r = run("chat", "--no-think", "-n", "3", "-t", "0", input="/bogus\n/help\nHello\n/quit\nnever sent\n")
    assert r.returncode == 0, r.stderr
    assert "unknown command /bogus" in r.stderr and "/exit or /quit" in r.stderr
    assert r.stdout.count("> ") == 4  # /bogus, /help, Hello, /quit: the last line is never read


def test_chat_printer_marks_thinking_cut_by_the_token_limit(demo_engine, capsys):
    from lily.cli import _ChatPrinter
    p = _ChatPrinter(demo_engine, [{"role": "user", "content": "Hi"}], {})
    p.feed("Still pondering")
    p.finish("length")
    out, err = capsys.readouterr()
    assert out == "" and err == "[thinking]\nStill pondering\n[thinking cut off: the token limit was reached]\n"


def test_chat_escaped_slash_is_sent_not_run():
    r = run("chat", "--no-think", "-n", "2", "-t", "0", input="//reset\n")
    assert r.returncode == 0, r.stderr
    assert "conversation reset" not in r.stderr and "unknown command" not in r.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="no pty or readline")
def test_chat_line_editing_and_history(tmp_path):
    """On a terminal `lily chat` reads lines with readline: the up arrow recalls the previous
    message, and the history is kept in $XDG_STATE_HOME/lily/chat_history."""
    import pty
    import select
    import time
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONIOENCODING="utf-8", XDG_STATE_HOME=str(tmp_path), TERM="dumb")
    p = subprocess.Popen([sys.executable, "-m", "lily", "chat", "-n", "2", "-t", "0", "--no-think"],
                         stdin=slave, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    seen = b""

    def wait_prompts(n, timeout=120):
        nonlocal seen
        end = time.monotonic() + timeout
        while seen.count(b"> ") < n and time.monotonic() < end:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break
        return seen.count(b"> ") >= n

    try:
        assert wait_prompts(1)
        os.write(master, b"Hail, good sir.\r")
        assert wait_prompts(2)
        os.write(master, b"\x1b[A\r")          # up arrow: the previous line again
        assert wait_prompts(3)
        os.write(master, b"\x04")              # Ctrl-D
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
    assert p.returncode == 0, p.stderr.read()
    assert seen.count(b"> Hail, good sir.") == 2, seen  # typed, then recalled by the arrow
    # (consecutive duplicates may be stored once, depending on the readline library)
    assert "Hail, good sir." in _read_history(tmp_path / "lily" / "chat_history")


def _read_history(path) -> list[str]:
    """The lines of a history file as this Python's readline reads it: GNU readline writes
    one line per entry, macOS's libedit a ``_HiStOrY_V2_`` header and spaces as ``\\040``."""
    import readline
    saved = [readline.get_history_item(i) for i in range(1, readline.get_current_history_length() + 1)]
    try:
        readline.clear_history()
        readline.read_history_file(str(path))
        return [readline.get_history_item(i) for i in range(1, readline.get_current_history_length() + 1)]
    finally:
        readline.clear_history()
        for line in saved:
            readline.add_history(line)


def test_device_failure_is_reported_without_a_traceback(monkeypatch, capsys):
    """A device's run-time failure (a Metal command buffer in error, a kernel fault: the
    core's GpuError) ends the command with a one-line error, not a traceback."""
    from lily import _core, cli

    def fail(args):
        raise _core.GpuError("Metal command buffer failed: Caused GPU Timeout Error")
    monkeypatch.setattr(cli, "cmd_info", fail)
    assert cli.main(["info"]) == 1
    err = capsys.readouterr().err
    assert err == "lily: error: the device failed: Metal command buffer failed: Caused GPU Timeout Error\n"
    assert issubclass(_core.HazardError, _core.GpuError) and issubclass(_core.GpuError, RuntimeError)


@pytest.mark.skipif(sys.platform == "win32", reason="no SIGINT to send")
def test_chat_ctrl_c_ends_the_reply_not_the_session():
    """Issue 29: Ctrl-C during a reply ended `lily chat` (-v at once: _print_stats on an event
    without timings; /stats after it: AttributeError). Now it stops that reply (cancelled at
    the next step, the partial reply kept), the chat goes on, and -v and /stats print the turn."""
    import select
    import signal
    import time
    p = subprocess.Popen([sys.executable, "-m", "lily", "chat", "--no-think", "-n", "5000", "-t", "0.8", "-v"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    out = b""

    def read_until(pred, timeout=120):
        nonlocal out
        end = time.monotonic() + timeout
        while not pred() and time.monotonic() < end:
            if select.select([p.stdout], [], [], 0.2)[0]:
                chunk = os.read(p.stdout.fileno(), 4096)
                if not chunk:
                    break
                out += chunk
        return pred()

    try:
        prompts = 0  # "> " prompts printed so far
        for message in [b"Hail, good sir.\n", b"Speak again.\n"]:
            # Sampled (unseeded), a reply may end at once (an end-of-turn drawn first: ~1% a turn
            # on the demo model); that turn is not the one under test, so ask again.
            for _ in range(5):
                assert read_until(lambda k=prompts: out.count(b"> ") > k), out
                prompts = out.count(b"> ")
                p.stdin.write(message)
                p.stdin.flush()
                start = len(out)
                read_until(lambda start=start, k=prompts: len(out.rstrip()) > start + 10 or out.count(b"> ") > k)
                if out.count(b"> ") == prompts:
                    break
            assert len(out.rstrip()) > start + 10 and out.count(b"> ") == prompts, out  # the reply is streaming
            p.send_signal(signal.SIGINT)
        assert read_until(lambda: out.count(b"> ") > prompts), out  # back at the prompt after the second
        p.stdin.write(b"/stats\n\n")
        p.stdin.close()
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err = p.stderr.read().decode()
    assert p.returncode == 0, err[-3000:]
    assert "Traceback" not in err and err.count("[interrupted]") == 2, err[-3000:]
    assert err.count("finish: cancelled") == 3, err[-3000:]  # -v after each reply, then /stats
    assert "[prompt cache: " in err
