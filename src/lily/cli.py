"""The ``lily`` command: generate, chat, info, serve.

Every subcommand runs on the embedded demo model when ``--model`` is not given, so
``lily generate "ROMEO."`` works right after ``pip install``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import warnings
from pathlib import Path

from lily import __version__, _core
from lily.chat_output import ChatOutputParser, prompt_opens_reasoning
from lily.checkpoint import load_config
from lily.engine import Engine
from lily.errors import ContextLengthError, InvalidParameterError, LilyError
from lily.prompt_cache import DEFAULT_MAX_BYTES
from lily.scheduler import DEFAULT_BATCH, DEFAULT_INTERLEAVE, DEFAULT_QUEUE, MAX_BATCH
from lily.structured import check_tools, template_tools
from lily.weight_cache import default_dir

# The lab (lily.lab: doctor, bench, estimate) is imported inside the commands that run it, so
# that the engine's commands never load it (tests/test_layering.py).

_INT32_MAX = (1 << 31) - 1
_SERVE_DEPS = "fastapi and uvicorn, dependencies of Lily: reinstall it (pip install .) or pip install fastapi uvicorn"

_EPILOG = """examples:
  lily doctor                                 # first thing on a new machine: checks GPU and kernels
  lily generate "ROMEO."                      # the embedded demo model (Shakespeare)
  lily generate --model ~/models/Qwen3.6-35B-A3B-4bit --chat "Explain RoPE briefly."
  lily chat                                   # interactive chat, streaming
  lily info                                   # config, tensors, memory, devices
  lily serve --port 8000                      # OpenAI- and Anthropic-compatible server
  lily cache-prompt system.lilycache --system-file system.txt --tools tools.json
  lily serve --prompt-cache-file system.lilycache   # every chat starts from the cached system prompt
  lily bench --model ~/models/Qwen3.6-35B-A3B-4bit --device metal   # vs MLX-LM (".[bench]")
"""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, metavar="PATH",
                   help="MLX 4-bit qwen3_5_moe checkpoint directory (default: the embedded demo model)")
    p.add_argument("--device", default="auto", choices=["auto", "metal", "reference", "sim"],
                   help="where to run the model: auto (default: metal on a Mac, else reference), metal "
                        "(Apple GPU), reference (numpy on the CPU), sim (the Metal kernels on the CPU "
                        "simulator: slow, for verification)")
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="context window in tokens (default: min(32768, the model's limit))")
    g = p.add_argument_group("native devices (sim, metal, auto)")
    g.add_argument("--prefill-chunk", type=_int_at_least(0), default=None, metavar="N",
                   help="prompt tokens per prefill chunk (default 0: automatic, 4096 or less when memory is "
                        "short; scratch memory is sized for one chunk)")
    g.add_argument("--no-weight-cache", action="store_true",
                   help="do not write or use aligned copies of the checkpoint files (see `lily info`); "
                        "the weights are then copied into memory at every load")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults come from the checkpoint's generation_config.json)")
    g.add_argument("--max-tokens", "-n", type=int, default=None,
                   help="maximum tokens to generate (default: the checkpoint's max_new_tokens when its "
                        "generation_config sets one, 256 for the demo model; else 256, a chat reply 4096)")
    g.add_argument("--temperature", "-t", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None, help="keep the K most likely tokens; 0 or -1 disable")
    g.add_argument("--top-p", type=float, default=None,
                   help="keep the smallest set of tokens whose probability reaches P (0 < P <= 1)")
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens less likely than P times the most likely one (0 <= P <= 1)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="penalise tokens already seen (prompt and output): positive logits divided by "
                        "it, negative ones multiplied (1 = off)")
    g.add_argument("--presence-penalty", type=float, default=None,
                   help="subtract this from the logits of generated tokens (-2..2, 0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=None,
                   help="subtract this times the count of each generated token (-2..2, 0 = off)")
    g.add_argument("--seed", type=int, default=None,
                   help="seed for reproducible sampling (the same text on the same device; each "
                        "device draws its own random numbers)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string (repeatable); it is not printed")


def _overrides(args) -> dict:
    keys = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
            "presence_penalty", "frequency_penalty", "seed", "stop", "thinking_budget")
    out = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    top_k = out.get("top_k")
    if top_k is not None:
        if not -1 <= top_k <= _INT32_MAX:  # the same convention and message as the server
            raise InvalidParameterError(f"invalid sampling parameter top_k={top_k}: must be -1 or 0 (both "
                                        f"disable top-k) or a count in [1, {_INT32_MAX}]")
        if top_k == -1:
            out["top_k"] = 0
    return out


def _context_full(engine, ev) -> bool:
    """The generation ended because the context window is full (not max tokens)."""
    return (ev is not None and ev.finish_reason == "length"
            and ev.prompt_tokens + ev.completion_tokens >= engine.max_context)


def _context_notice(engine, hint: str = "") -> None:
    print(f"[stopped: the context window ({engine.max_context} tokens) is full{hint}]", file=sys.stderr)


# "owner/name" as Hugging Face spells repo ids; a local path is tried first
_HF_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _check_model_path(model: str | None) -> None:
    """A clear error for a --model that is not there (a local path or a Hugging Face repo id),
    the same in every command (:func:`main` checks it first)."""
    if model is None or Path(model).expanduser().exists():
        return
    if _HF_REPO_ID.fullmatch(model) and not model.startswith((".", "~")):
        name = model.split("/", 1)[1]
        local = name if name.lower().endswith("bit") else name + "-4bit"
        raise InvalidParameterError(
            f"--model {model}: the path does not exist. It looks like a Hugging Face repo id; Lily "
            "loads a local MLX 4-bit checkpoint and never downloads. Convert the original weights "
            "once (this downloads them; needs pip install mlx-lm):\n"
            f"  python -m mlx_lm convert --hf-path {model} --mlx-path {local} -q --q-bits 4 --q-group-size 64\n"
            f"or, if the repo already holds an MLX 4-bit checkpoint:\n"
            f"  huggingface-cli download {model} --local-dir {local}\n"
            f"then: --model {local}")
    raise InvalidParameterError(f"--model {model}: the path does not exist")
def _add_cache_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompt cache (reuse of earlier prompts' state)")
    g.add_argument("--prompt-cache-bytes", type=int, default=DEFAULT_MAX_BYTES, metavar="N",
                   help=f"memory for session snapshots (default {DEFAULT_MAX_BYTES >> 30} GiB; "
                        "0 disables the cache)")
    g.add_argument("--prompt-cache-file", default=None, metavar="FILE",
                   help="load snapshots written by `lily cache-prompt` (kept for the whole run)")


def _load(args, conversation_start=None):
    """The engine for ``args`` with its ``--prompt-cache-file`` loaded. A file of another
    model, quantization or device, or a damaged one, is refused (PromptCacheError, exit 1).
    ``conversation_start(engine)``: the tokens every conversation of this run starts with
    (``lily chat``: its system message); a file none of whose snapshots they begin with is
    reported in one line on stderr, dropped, and the run goes on without it."""
    options, flags = {}, []
    if args.prefill_chunk is not None:
        options["prefill_chunk"] = args.prefill_chunk
        flags.append("--prefill-chunk")
    if args.no_weight_cache:
        options["weight_cache"] = False
        flags.append("--no-weight-cache")
    if flags and args.device == "reference":
        what = "applies" if len(flags) == 1 else "apply"
        raise InvalidParameterError(f"{' and '.join(flags)} {what} only to the native devices "
                                    "(--device sim, metal or auto)")
    engine = Engine.load(args.model, device=args.device, max_context=args.max_context,
                         progress=sys.stderr.isatty(), device_options=options or None,
                         **({"prompt_cache_bytes": args.prompt_cache_bytes}
                            if getattr(args, "prompt_cache_bytes", None) is not None else {}))
    cache_file = getattr(args, "prompt_cache_file", None)
    if cache_file:
        n = engine.load_prompt_cache(cache_file)
        why = _cache_mismatch(engine, conversation_start(engine)) if conversation_start else None
        if why:
            print(f"lily: warning: {cache_file}: {why}; not reused, running without it", file=sys.stderr)
        else:
            print(f"lily: loaded {n} prompt cache entr{'y' if n == 1 else 'ies'} from {cache_file}",
                  file=sys.stderr)
    return engine


def _excerpts(a: str, b: str, width: int = 40) -> tuple[str, str]:
    """``a`` and ``b`` shown from a word or two before their first differing character, cut
    to about ``width`` characters each."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    back = max(0, k - 8)
    start = max(a.rfind(" ", 0, back), a.rfind("\n", 0, back)) + 1  # whole words
    k = start if k - start <= 30 else back

    def cut(t: str) -> str:
        t = ("..." if k else "") + t[k:]
        return t if len(t) <= width + 3 else t[:width] + "..."
    return cut(a), cut(b)


def _cache_mismatch(engine, start: list[int]) -> str | None:
    """Why no snapshot loaded from a prompt cache file (the cache's pinned entries) can
    begin a conversation whose prompt starts with ``start``, having dropped them all (they
    would hold memory for nothing); None when one can. The engine reuses an entry only when
    its tokens are a prefix of the prompt (:meth:`lily.prompt_cache.PromptCache.lookup`)."""
    cache = engine.prompt_cache
    pinned = [e for e in cache.entries() if e.pinned]
    if not pinned or any(e.length <= len(start) and e.tokens.tolist() == start[:e.length] for e in pinned):
        return None
    for e in pinned:
        cache.discard(e)
    held = max(pinned, key=lambda e: e.length).tokens.tolist()
    if held[0] != engine.im_start:
        return (f"written for a raw prompt (lily cache-prompt --prompt) of {len(held)} tokens, which a chat "
                f"never starts with: the file has {_excerpts(engine.tokenizer.decode(held), '')[0]!r}")
    if not start:
        return (f"written for a system prompt ({len(held)} tokens), this chat has none: the file has "
                f"{_excerpts(engine.tokenizer.decode(held), '')[0]!r}; give the same --system")
    theirs, ours = engine.tokenizer.decode(held), engine.tokenizer.decode(start)
    if theirs == ours:
        return ("written for the same system prompt rendered differently (another chat template or "
                "tokenizer)")
    a, b = _excerpts(theirs, ours)
    tools = "<tools>" in theirs and "<tools>" not in ours  # Qwen's template renders tools into the system message
    return (f"written for another system prompt: the file has {a!r} ({len(held)} tokens), this chat "
            f"{b!r} ({len(start)} tokens); "
            + ("the file holds tool definitions, which lily chat cannot give" if tools
               else "give the --system the file was written with"))


def peak_memory_bytes() -> int:
    """The process's peak resident memory (``getrusage`` ``ru_maxrss``: KiB on Linux, bytes on
    macOS), weights mapped and touched included; 0 where it is not available."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _print_stats(ev, file=None) -> None:
    """The speed line (as mlx_lm prints after a generation): prompt and generation tokens
    with their rates (and, when the prompt cache reused some, the prompt tokens cached and
    computed), the peak memory, why it ended."""
    t = ev.timings
    if t is None:  # not a final event: nothing measured
        return
    cached = getattr(ev, "cached_tokens", 0)
    reuse = f" ({cached} cached, {t.prefill_tokens} computed)" if cached else ""
    busy = t.decode_gpu_busy
    busy = f" (GPU busy {100 * busy:.0f}%)" if busy is not None else ""  # the rest is the host's
    print(f"[prompt: {ev.prompt_tokens} tokens{reuse}, "
          f"{t.prefill_tokens_per_s:.1f} tok/s | "
          f"generation: {ev.completion_tokens} tokens, {t.decode_tokens_per_s:.1f} tok/s{busy} | "
          f"peak memory: {peak_memory_bytes() / 1e9:.3f} GB | finish: {ev.finish_reason}]",
          file=file or sys.stderr)


class _ChatPrinter:
    """Shows a streamed chat reply: the answer on stdout, the model's thinking on stderr
    (dimmed on a terminal), so ``lily generate --chat ... > answer.txt`` keeps the answer
    alone. The split is the server's (lily.chat_output); tool-call markup stays in the answer."""

    def __init__(self, engine, messages: list[dict], template_kwargs: dict):
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        self.parser = ChatOutputParser(reasoning=prompt_opens_reasoning(prompt), parse_tools=False)
        self.dim = sys.stderr.isatty()
        self.thinking = False

    def feed(self, text: str) -> None:
        self._show(self.parser.feed(text))

    def finish(self, finish_reason: str | None = None) -> None:
        self._show(self.parser.finish())
        self._end_thinking("[thinking cut off: the token limit was reached]"
                           if finish_reason == "length" else "[/thinking]")

    def _end_thinking(self, marker: str = "[/thinking]") -> None:
        if self.thinking:
            sys.stderr.write(("\033[0m" if self.dim else "") + f"\n{marker}\n")
            sys.stderr.flush()
            self.thinking = False

    def _show(self, deltas) -> None:
        for d in deltas:
            if d.kind == "reasoning":
                if not self.thinking:
                    sys.stderr.write("[thinking]\n" + ("\033[2m" if self.dim else ""))
                    self.thinking = True
                sys.stderr.write(d.text)
                sys.stderr.flush()
            elif d.text:
                self._end_thinking()
                sys.stdout.write(d.text)
                sys.stdout.flush()


def cmd_generate(args) -> int:
    overrides = _overrides(args)  # invalid values are reported before the model loads
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    engine = _load(args)
    printer = None
    if args.chat:
        overrides.setdefault("max_tokens", engine.chat_max_tokens)
        kwargs = {"enable_thinking": False} if args.no_think else {}
        messages = [{"role": "user", "content": args.prompt}]
        printer = _ChatPrinter(engine, messages, kwargs)
        events = engine.stream_chat(messages, chat_template_kwargs=kwargs, **overrides)
    else:
        events = engine.stream(args.prompt, **overrides)
    last = None
    if not args.chat and args.echo:
        sys.stdout.write(args.prompt)
    for ev in events:
        if printer:
            printer.feed(ev.text)
        else:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        last = ev
    if printer:
        printer.finish(last.finish_reason if last else None)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet and last is not None:
        _print_stats(last)
    if _context_full(engine, last):
        _context_notice(engine, " (--max-context sets it)")
    return 0


def _history_file() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "lily" / "chat_history"


def _line_editing() -> None:
    """Arrow keys, editing and history (kept in ``_history_file()``) for ``input()`` on a
    terminal, where Python has readline (not on Windows)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return
    try:
        import readline
    except ImportError:
        return
    import atexit
    path = _history_file()
    try:
        readline.read_history_file(path)
    except OSError:
        pass  # no history yet
    readline.set_history_length(1000)

    def save():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass  # a read-only home: history is kept for this session only
    atexit.register(save)


def cmd_chat(args) -> int:
    overrides = _overrides(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    kwargs = {"enable_thinking": False} if args.no_think else {}
    engine = _load(args, lambda e: _system_prefix(e, args.system, None, kwargs) if args.system else [])
    overrides.setdefault("max_tokens", engine.chat_max_tokens)
    print(f"lily chat - {engine.name} on {engine.device}. Empty line or Ctrl-D to quit, Ctrl-C to stop a "
          "reply, /reset to start over, /help for the commands.", file=sys.stderr)
    _line_editing()
    last_turn = None  # the final event of the last reply (/stats)
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            # end the "> " line on stdout, where input() wrote it, so the shell prompt
            # starts on a line of its own
            sys.stdout.write("\n")
            sys.stdout.flush()
            return 0
        if not user.strip():
            return 0
        command = user.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/help":
            print("[empty line, Ctrl-D, /exit or /quit: quit; Ctrl-C: stop the reply (the chat goes on); "
                  "/reset: start a new conversation"
                  + (" (the system prompt is kept)" if args.system else "")
                  + "; /stats: tokens of the last turn and the prompt cache"
                  + "; /help: this; start a message with // to send a leading /]", file=sys.stderr)
            continue
        if command == "/stats":
            if last_turn is not None:
                _print_stats(last_turn)
            info = engine.prompt_cache.info() if engine.prompt_cache is not None else None
            print("[prompt cache: " + (f"{info['entries']} snapshots, {info['bytes'] / 2**20:.1f} MiB of "
                                       f"{info['max_bytes'] / 2**20:.0f} MiB; {info['cached_tokens']} prompt "
                                       f"tokens reused, {info['computed_tokens']} computed]"
                                       if info else "off]"), file=sys.stderr)
            continue
        if command == "/reset":
            messages = messages[:1] if args.system else []
            print("[conversation reset" + (", system prompt kept]" if args.system else "]"), file=sys.stderr)
            continue
        if command.startswith("//"):
            user = user.replace("//", "/", 1)
        elif command.startswith("/") and " " not in command:
            print(f"[unknown command {command}; /help lists them]", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": user})
        reply, last = [], None
        printer = _ChatPrinter(engine, messages, kwargs)
        with _CancelOnInterrupt() as stop:
            events = engine.stream_chat(messages, chat_template_kwargs=kwargs, cancel=stop.cancel, **overrides)
            try:
                for ev in events:
                    printer.feed(ev.text)
                    reply.append(ev.text)
                    last = ev
            except KeyboardInterrupt:  # a second Ctrl-C: the generation is dropped at once
                events.close()
                last = None
            except ContextLengthError as e:
                messages.pop()
                print(f"[{e}; /reset to start over]", file=sys.stderr)
                continue
        interrupted = stop.cancel.is_set()
        printer.finish(last.finish_reason if last else None)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if interrupted:
            print("[interrupted]", file=sys.stderr)
        if interrupted and not "".join(reply):
            messages.pop()  # nothing was said: the turn did not happen
        else:
            messages.append({"role": "assistant", "content": "".join(reply)})
        last_turn = last
        if args.verbose and last is not None:
            _print_stats(last)
        if _context_full(engine, last):
            _context_notice(engine, "; /reset to start over")


class _CancelOnInterrupt:
    """While a reply streams, Ctrl-C (SIGINT) cancels the generation instead of raising: the
    engine stops at its next decode step or prefill chunk with ``finish_reason="cancelled"``
    (its session left consistent, its timings complete), and the chat goes on. A second
    Ctrl-C raises KeyboardInterrupt as usual. Off the main thread (no signal handler can be
    installed there) Ctrl-C keeps Python's behaviour."""

    def __init__(self):
        self.cancel = threading.Event()
        self._old = None

    def _handle(self, signum, frame):
        if self.cancel.is_set():
            raise KeyboardInterrupt
        self.cancel.set()

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


def _system_prefix(engine, system: str | None, tools: list | None, template_kwargs: dict | None = None) -> list[int]:
    """The tokens of the system message (with the tool definitions) exactly as the chat
    template renders them at the start of every conversation: the conversation is rendered
    with a placeholder user message and cut before it."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "."}]
    ids = engine.tokenizer.encode_chat(messages, tools=tools, add_generation_prompt=False, **(template_kwargs or {}))
    starts = [i for i, t in enumerate(ids) if t == engine.im_start]
    if len(starts) < 2:
        raise InvalidParameterError("the chat template rendered no system message to cache "
                                    "(give --system or --tools)")
    return ids[:starts[1]]


def cmd_cache_prompt(args) -> int:
    tools = None
    if args.tools:
        try:
            tools = json.loads(Path(args.tools).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise InvalidParameterError(f"--tools {args.tools}: {e}") from None
        if isinstance(tools, dict) and "tools" in tools:
            tools = tools["tools"]
        if not isinstance(tools, list):
            raise InvalidParameterError(f"--tools {args.tools}: expected a JSON list of tool definitions")
        try:  # the server's check: a cache for tools every request would be refused with is no use
            check_tools(tools, lambda i, field: f"tools[{i}].function{'.' + field if field else ''}")
        except InvalidParameterError as e:
            raise InvalidParameterError(f"--tools {args.tools}: {e}") from None
        tools = template_tools(tools)  # rendered as a chat request's tools are
    system = args.system
    if args.system_file:
        try:
            system = Path(args.system_file).read_text(encoding="utf-8") if args.system_file != "-" else sys.stdin.read()
        except (OSError, ValueError) as e:
            raise InvalidParameterError(f"--system-file {args.system_file}: {e}") from None
    engine = _load(args)
    ids = engine.encode_prompt(args.prompt) if args.prompt is not None else _system_prefix(engine, system, tools)
    computed = engine.cache_prompt(ids)
    n = engine.save_prompt_cache(args.file)
    info = engine.prompt_cache.info()
    print(f"cached {len(ids)} prompt tokens ({computed} computed) as {n} snapshot{'s' if n != 1 else ''}, "
          f"{info['bytes'] / 2**20:.1f} MiB: {args.file}", file=sys.stderr)
    return 0


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _test_checkpoints(root: Path) -> list[Path]:
    """The checkpoints lily.lab.testing converted into ``root`` (and interrupted conversions),
    nothing else that may live there."""
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and ((d / "config.json").is_file() or d.name.startswith(".tmp-")))


def cmd_cache(args) -> int:
    """``lily cache list`` / ``lily cache clear [--stale]``: the aligned weight cache
    (lily.weight_cache) and the test checkpoints (lily.lab.testing)."""
    import shutil

    from lily import weight_cache
    from lily.lab.testing import default_cache_dir
    wdir, tdir = weight_cache.default_dir(), default_cache_dir()
    files = weight_cache.scan(wdir)
    tests = _test_checkpoints(tdir)
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    if args.action == "clear":
        if args.stale:
            gone = weight_cache.prune(wdir)
            print(f"removed {len(gone)} stale weight cache file{'s' if len(gone) != 1 else ''} "
                  f"({mib(sum(c.size for c in gone))}) from {wdir}")
            return 0
        freed = weight_cache.clear(wdir)
        print(f"removed the weight cache in {wdir} ({mib(freed)})")
        tbytes = sum(_dir_bytes(d) for d in tests)
        for d in tests:
            shutil.rmtree(d, ignore_errors=True)
        print(f"removed {len(tests)} test checkpoint{'s' if len(tests) != 1 else ''} in {tdir} ({mib(tbytes)})")
        return 0
    sizes = [(d, _dir_bytes(d)) for d in tests]
    if args.json:
        print(json.dumps({"weight_cache": {"dir": str(wdir), "files": [
            {"path": str(c.path), "bytes": c.size, "sources": c.sources, "stale": c.stale} for c in files]},
            "test_checkpoints": {"dir": str(tdir), "checkpoints": [{"path": str(d), "bytes": n} for d, n in sizes]}},
            indent=2))
        return 0
    print(f"weight cache: {wdir} (aligned copies of checkpoint files the native devices map; $LILY_CACHE_DIR)")
    for c in files:
        print(f"  {mib(c.size):>12}  {c.path.name}  " + ("stale: its checkpoint file is gone or changed"
                                                       if c.stale else "<- " + ", ".join(c.sources)))
    stale = sum(c.size for c in files if c.stale)
    print(f"  {mib(sum(c.size for c in files)):>12}  in {len(files)} file{'s' if len(files) != 1 else ''}"
          + (f", {mib(stale)} stale (`lily cache clear --stale` removes it)" if stale else ""))
    print(f"test checkpoints: {tdir} (converted by lily.lab.testing for the test suite; $LILY_TEST_CACHE)")
    for d, n in sizes:
        print(f"  {mib(n):>12}  {d.name}")
    print(f"  {mib(sum(n for _, n in sizes)):>12}  in {len(sizes)} checkpoint{'s' if len(sizes) != 1 else ''}")
    print("prompt cache files (lily cache-prompt) are where you saved them: not listed here")
    return 0


def cmd_info(args) -> int:
    engine = Engine.load(args.model, device="reference", progress=sys.stderr.isatty())
    info = engine.info()
    info["native_build"] = _core.build_info()
    info["weight_cache_dir"] = str(default_dir())  # where native devices keep aligned copies
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    width = max(len(k) for k in info)
    for k, v in info.items():
        if k == "weight_bytes":
            v = f"{v / 2**20:.1f} MiB ({v:,} bytes)"
        print(f"{k:<{width}}  {v}")
    return 0


def cmd_doctor(args) -> int:
    from lily.lab import doctor
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()] if args.kernels else None
    return doctor.run(device=args.device, kernels=kernels, model=args.model, max_context=args.max_context,
                      seed=args.seed, as_json=args.json, quick=args.quick, rows=args.rows)


def _int_at_least(lowest: int):
    """argparse type: an integer >= lowest (`lily doctor --seed`, `--max-context`,
    `--prefill-chunk`)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lowest:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lowest}, got {v}")
        return v
    return parse


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"a length is listed twice in {text!r}")
    return out


def _check_writable(path: str, flag: str) -> None:
    """Refuses, before a long run, an output file that cannot be written at its end."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise InvalidParameterError(f"{flag} {path}: cannot write there (" +
                                    ("a directory" if p.is_dir() else "no such directory" if not parent.is_dir()
                                     else "permission denied") + ")")


def cmd_bench(args) -> int:
    """``lily bench`` (against MLX-LM) and ``lily bench --agent`` (multi-turn, prompt cache):
    the same device options, report and --json file."""
    if args.json:
        _check_writable(args.json, "--json")
    options = {k: v for k, v in (("prefill_chunk", args.prefill_chunk), ("state_window", args.state_window),
                                  ("split_block", args.split_block)) if v is not None} or None
    if args.kernels:
        from lily.lab import kernel_bench
        rep = kernel_bench.run(args.device, reps=args.reps, only=args.kernel_names,
                               log=lambda s: print(s, file=sys.stderr, flush=True))
        print(kernel_bench.format_report(rep))
    elif args.agent:
        from lily.lab import agent_bench
        load = dict(device=args.device, device_options=options, max_context=args.max_context)
        engine = Engine.load(args.model, **load)
        kw = dict(system_tokens=args.system_tokens, turns=args.turns, turn_tokens=args.turn_tokens,
                  max_tokens=64 if args.decode_tokens is None else args.decode_tokens,
                  on_turn=lambda row: print(f"turn {row['turn']}: {row}", file=sys.stderr, flush=True))
        if args.parallel is not None:
            rep = agent_bench.run_parallel(engine, args.parallel, alone=not args.no_cold, **kw)
            print(agent_bench.format_parallel(rep))
        else:
            cold = None if args.no_cold else Engine.load(args.model, prompt_cache_bytes=0, **load)
            rep = agent_bench.run(engine, cold, **kw)
            print(agent_bench.format_report(rep))
    elif args.concurrent is not None:
        from lily.lab import concurrent_bench
        engine = Engine.load(args.model, device=args.device, device_options=options, max_context=args.max_context,
                             prompt_cache_bytes=0)
        rep = concurrent_bench.run(engine, args.concurrent, prompt_tokens=(args.lengths or [256])[0],
                                   decode_tokens=64 if args.decode_tokens is None else args.decode_tokens,
                                   on_row=lambda row: print(f"N={row['n']}: {row}", file=sys.stderr, flush=True))
        print(concurrent_bench.format_report(rep))
    else:
        from lily.lab.bench import bench, format_report
        rep = bench(args.model, device=args.device, lengths=args.lengths, decode_tokens=args.decode_tokens,
                    rounds=args.rounds, positions=args.positions, protocol=args.protocol, device_options=options)
        print(format_report(rep))
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(rep, f, indent=2)
        except OSError as e:
            raise InvalidParameterError(f"--json {args.json}: cannot write the report ({e}); it is printed above") from None
        print(f"\nwritten: {args.json}", file=sys.stderr)
    return 0


def cmd_estimate(args) -> int:
    from lily.lab.estimate import estimate, fit, fit_kernels, format_fit, format_fit_kernels, format_report
    machine, fitted, kernels, chunk = args.machine or "m5max", None, None, args.prefill_chunk
    if args.kernels_report is not None:  # the per-kernel constants first, then the run on top of them
        path, report = args.kernels_report
        machine, kernels = fit_kernels(report, machine_key=args.machine, source=path)
    if args.bench is not None:
        path, bench = args.bench
        base = machine if kernels else None
        machine, fitted = fit(bench, machine_key=args.machine, config=args.config, source=path, base=base,
                              fixed=base.measured if base else ())
        chunk = chunk or fitted["plan"]["prefill_chunk"]  # the measured run's plan unless told otherwise
    rep = estimate(machine, config=args.config, contexts=args.contexts, prompts=args.prompts,
                   breakdown_at=args.at, chunk=chunk, model_name=str(args.model) if args.model else None,
                   batches=args.batches)
    if args.json:
        out = rep if not (fitted or kernels) else {"fit": fitted, "kernels_fit": kernels, "estimate": rep}
        print(json.dumps(out, indent=2))
    else:
        print("".join(f + "\n\n" for f in (format_fit_kernels(kernels) if kernels else "",
                                           format_fit(fitted) if fitted else "") if f) + format_report(rep))
    return 0


def _check_estimate(parser: argparse.ArgumentParser, args) -> None:
    """Usage errors (exit 2) for lengths the model cannot take; the bounds live in lily.lab.estimate."""
    from lily.lab.estimate import KERNELS_KIND, MACHINES, check_length, model_config
    from lily.lab.published import LENGTHS
    if args.machine is not None and args.machine not in MACHINES:
        parser.error(f"argument --machine: invalid choice: {args.machine!r} (choose from {', '.join(MACHINES)})")
    if max(args.batches) > MAX_BATCH:
        parser.error(f"--batches: at most {MAX_BATCH} rows decode together, got {max(args.batches)}")
    try:
        args.config = load_config(args.model)[0] if args.model else model_config()
    except LilyError as e:
        parser.error(f"--model: {e}")
    args.bench = args.kernels_report = None
    for path in args.fit or ():  # a `lily bench --json` run and/or a `lily bench --kernels --json` report
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            parser.error(f"--fit: cannot read {path} as a `lily bench --json` report: {e}")
        which = "kernels_report" if isinstance(report, dict) and report.get("kind") == KERNELS_KIND else "bench"
        if getattr(args, which) is not None:
            parser.error(f"--fit: {path} and {getattr(args, which)[0]} are both "
                         f"{'kernel timings' if which == 'kernels_report' else 'bench runs'}: give one of each at most")
        setattr(args, which, (path, report))
    limit = args.config.max_position_embeddings
    # the default lengths stop at the model's limit (the demo model's is small)
    args.contexts = args.contexts or [n for n in LENGTHS if n < limit] or [limit - 1]
    args.prompts = args.prompts or [n for n in LENGTHS if n <= limit] or [limit]
    checks = [("--contexts", n, "context") for n in args.contexts]
    checks += [("--prompts", n, "prompt") for n in args.prompts]
    if args.at is None:
        args.at = min(4096, limit - 1)
    checks.append(("--at", args.at, "context"))
    if args.prefill_chunk:  # 0: automatic, as everywhere
        checks.append(("--prefill-chunk", args.prefill_chunk, "chunk"))
    for flag, n, kind in checks:
        try:
            check_length(flag, n, limit, kind=kind)
        except InvalidParameterError as e:
            parser.error(str(e))


def cmd_serve(args) -> int:
    try:
        from lily.server import serve  # an optional extra (fastapi, uvicorn)
    except ImportError as e:
        print(f"lily serve needs {_SERVE_DEPS} ({e})", file=sys.stderr)
        return 2
    engine = _load(args)
    try:
        serve(engine, host=args.host, port=args.port, api_key=args.api_key,
              model_name=args.model_name, strict_model_name=args.strict_model_name, max_queue=args.max_queue,
              default_max_tokens=args.default_max_tokens, log_level=args.log_level,
              clamp_max_tokens=args.clamp_max_tokens, max_batch=args.max_batch,
              prefill_interleave=args.prefill_interleave,
              default_reasoning={"on": True, "off": False, None: None}[args.reasoning],
              strip_billing_header=not args.keep_billing_header)
    except OSError as e:  # the address cannot be bound
        print(f"lily: error: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def _check_thinking_budget(parser: argparse.ArgumentParser, args) -> None:
    budget = args.thinking_budget
    if budget is None:
        return
    if budget < 1:
        parser.error(f"--thinking-budget must be at least 1 (tokens of thinking), got {budget}")
    if args.no_think:
        parser.error("--thinking-budget bounds the thinking block, which --no-think switches off: give one of them")
    if not getattr(args, "chat", True):
        parser.error("--thinking-budget needs --chat (it bounds the chat template's thinking block; "
                     "a raw prompt has no template)")


_THINKING_BUDGET_HELP = ("at most N tokens of thinking per reply; then Lily closes the thinking block and "
                         "the model answers (the closing tokens count towards --max-tokens); needs the chat "
                         "template's thinking (not with --no-think; lily generate: with --chat)")


def _check_generate(parser: argparse.ArgumentParser, args) -> None:
    if args.no_think and not args.chat:
        parser.error("--no-think needs --chat (it switches off the chat template's thinking "
                     "block; a raw prompt has no template)")
    _check_thinking_budget(parser, args)
    if args.echo and args.chat:
        parser.error("--echo prints a raw prompt before its continuation; with --chat the reply "
                     "answers the prompt instead of continuing it")


def _check_serve(parser: argparse.ArgumentParser, args) -> None:
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 0:
        parser.error(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 1 <= args.max_batch <= MAX_BATCH:
        parser.error(f"--max-batch must be in 1..{MAX_BATCH}, got {args.max_batch}")
    if args.prefill_interleave < 16:
        parser.error(f"--prefill-interleave must be >= 16, got {args.prefill_interleave}")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        parser.error(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    _check_cache(parser, args)


def _check_cache(parser: argparse.ArgumentParser, args) -> None:
    if args.prompt_cache_bytes < 0:
        parser.error(f"--prompt-cache-bytes must be >= 0, got {args.prompt_cache_bytes}")
    if args.prompt_cache_bytes == 0 and getattr(args, "prompt_cache_file", None):
        parser.error("--prompt-cache-file needs the prompt cache (--prompt-cache-bytes is 0)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lily",
        description="Lily runs Qwen3.6-35B-A3B (qwen3_5_moe, MLX 4-bit checkpoints) locally. "
                    "Without --model it uses a small embedded demo model that writes Shakespeare.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"lily {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="continue a prompt (or answer it with --chat) and print the text",
                       description="Generate text from PROMPT and stream it to stdout; a speed line "
                                   "(prompt and generation tokens per second, peak memory) follows "
                                   "on stderr unless --quiet.")
    g.add_argument("prompt", help="the prompt text; - reads it from stdin")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--no-think", action="store_true", help="with --chat: disable the thinking block "
                   "(an error without --chat: a raw prompt has no chat template)")
    g.add_argument("--thinking-budget", type=int, default=None, metavar="N", help=_THINKING_BUDGET_HELP)
    g.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    g.add_argument("--quiet", "-q", action="store_true", help="no speed line on stderr after the text")
    _add_model_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate, check=lambda a: _check_generate(g, a))

    c = sub.add_parser("chat", help="interactive chat with the chat template, streaming",
                       description="Chat interactively; each turn is rendered with the model's chat template.")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--no-think", action="store_true", help="disable the thinking block")
    c.add_argument("--thinking-budget", type=int, default=None, metavar="N", help=_THINKING_BUDGET_HELP)
    c.add_argument("--verbose", "-v", action="store_true", help="print token counts and speed after each reply")
    _add_model_args(c)
    _add_sampling_args(c)
    _add_cache_args(c)
    c.set_defaults(func=cmd_chat, check=lambda a: (_check_cache(c, a), _check_thinking_budget(c, a)))

    cp = sub.add_parser("cache-prompt", help="prefill a system prompt (and tools) once and save its state to a file",
                        description="Prefill a prompt and write its session snapshots to FILE, for "
                                    "`lily serve --prompt-cache-file FILE` or `lily chat --prompt-cache-file "
                                    "FILE` (or Engine.load_prompt_cache): every conversation that starts "
                                    "with it skips its prefill. The file is tied to the model, its "
                                    "quantization and the device kind.")
    cp.add_argument("file", help="the cache file to write")
    src = cp.add_mutually_exclusive_group()
    src.add_argument("--system", default=None, help="system prompt, rendered with the chat template")
    src.add_argument("--system-file", default=None, metavar="PATH", help="read the system prompt from PATH ('-': stdin)")
    src.add_argument("--prompt", default=None, help="a raw prompt (no chat template) instead")
    cp.add_argument("--tools", default=None, metavar="JSON_FILE",
                    help="tool definitions (a JSON list, OpenAI format) rendered into the system message")
    _add_model_args(cp)
    cp.set_defaults(func=cmd_cache_prompt, prompt_cache_bytes=None)

    k = sub.add_parser("cache", help="list or clear Lily's caches on disk (aligned weight copies, test checkpoints)",
                       description="`lily cache list` shows the aligned weight cache (a copy of each unaligned "
                                   "checkpoint file, written at the first load on a native device so that loads "
                                   "map it instead of copying the weights into memory) and the test checkpoints, "
                                   "with sizes and, for each weight copy, the checkpoint files it serves. "
                                   "`lily cache clear` deletes both; `--stale` only the weight copies whose "
                                   "checkpoint file is gone or changed (Lily also removes those whenever it "
                                   "writes a copy).")
    k.add_argument("action", choices=["list", "clear"])
    k.add_argument("--stale", action="store_true", help="clear: only the stale weight copies")
    k.add_argument("--json", action="store_true", help="list: machine-readable output")
    k.set_defaults(func=cmd_cache, check=lambda a: (a.stale and a.action != "clear" and k.error("--stale goes with clear"),
                                                    a.json and a.action != "list" and k.error("--json goes with list")))

    i = sub.add_parser("info", help="show the model's config, tensor count, memory footprint and devices",
                       description="Print the checkpoint's configuration, tensor count, weight bytes, "
                                   "EOS ids, the devices in this build and the weight cache directory.")
    i.add_argument("--model", "-m", default=None, metavar="PATH", help="checkpoint directory (default: demo model)")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench", help="benchmark against MLX-LM side by side (ratios) and check consistency",
                       description="Run Lily and MLX-LM on the same checkpoint, alternating, and report "
                                   "prefill and decode throughput per prompt length as ratios (lily / "
                                   "mlx-lm), then teacher-forced agreement. Needs the bench extra: "
                                   'pip install ".[bench]". Meaningful on a Mac with --device metal.')
    b.add_argument("--model", "-m", default=None, metavar="PATH", help="checkpoint directory (default: demo model)")
    b.add_argument("--device", default="auto", choices=["sim", "metal", "auto", "reference"],
                   help="Lily's device (default auto: metal on a Mac)")
    b.add_argument("--lengths", type=_int_list, default=None, metavar="L1,L2,...",
                   help="prompt lengths in tokens (default: 256, 512, ..., 131072 up to the model's limit)")
    b.add_argument("--protocol", default="spec", choices=["spec", "pplx"],
                   help="spec: docs/goals.md's protocol, chat-text prompts; pplx: pplx-garden's published contract (synthetic "
                        "ids, exact-shape warm-up, time to first token, exactly 64 decode steps, 2 rounds; "
                        "lengths beyond the model's limit dropped) (default spec)")
    b.add_argument("--decode-tokens", type=int, default=None, metavar="N",
                   help="tokens generated per request, or per agent reply (default 64; fixed by --protocol pplx)")
    b.add_argument("--rounds", type=int, default=None,
                   help="rounds per length; the engine order alternates (default 3; pplx 2)")
    b.add_argument("--positions", type=int, default=None, metavar="N",
                   help="teacher-forced positions of the consistency check (default 192, pplx 0; 0 skips it)")
    b.add_argument("--prefill-chunk", type=_int_at_least(0), default=None, metavar="N",
                   help="Lily's prefill chunk on the native devices (default 0: automatic, 4096 or less)")
    b.add_argument("--state-window", type=_int_at_least(1), default=None, metavar="N",
                   help="native devices: decode steps per write-back of the DeltaNet state (default 16; 1: every "
                        "step, the plan before the write-back window; same results)")
    b.add_argument("--split-block", type=_int_at_least(0), default=None, metavar="N",
                   help="native devices: KV rows per block of the split decode attention (default 0: chosen by "
                        "context)")
    b.add_argument("--json", default=None, metavar="FILE", help="also write the full results as JSON")
    k = b.add_argument_group("--kernels: each hot kernel timed alone (Lily alone, no MLX-LM, no checkpoint)")
    k.add_argument("--kernels", action="store_true",
                   help="time each hot kernel alone at the model's shapes (decode GEMVs, decode attention at "
                        "4K/32K/128K, prefill GEMMs per tile size, expert GEMMs, prefill attention, the DeltaNet "
                        "scan) against its roofline; the --json file calibrates `lily estimate --fit`. On sim: small "
                        "shapes, the harness only")
    k.add_argument("--reps", type=_int_at_least(1), default=None, metavar="N",
                   help="timed runs per kernel (default 20 on metal, 1 on sim)")
    k.add_argument("--kernel", dest="kernel_names", type=lambda v: [x for x in v.split(",") if x], default=None,
                   metavar="K1,K2,...", help="time only these kernels")
    a = b.add_argument_group("--agent: the multi-turn agent scenario of the prompt cache (Lily alone, no MLX-LM)")
    a.add_argument("--agent", action="store_true",
                   help="run the agent scenario instead: tokens computed and time per turn with and "
                        "without the prompt cache, reuse ratio, outputs compared (--decode-tokens per reply)")
    a.add_argument("--system-tokens", type=int, default=4096, metavar="N",
                   help="system prompt with tool definitions, in tokens (default 4096)")
    a.add_argument("--turns", type=int, default=8, help="requests in the conversation (default 8)")
    a.add_argument("--turn-tokens", type=int, default=300, metavar="N",
                   help="tokens each turn adds: a tool result and a user message (default 300)")
    a.add_argument("--max-context", type=int, default=None, metavar="N", help="context window (default: the model's)")
    a.add_argument("--no-cold", action="store_true",
                   help="skip the runs without the cache (with --parallel: skip the conversations' solo reruns and the "
                        "check that each equals its solo run)")
    a.add_argument("--parallel", type=_int_at_least(1), default=None, metavar="N",
                   help="N conversations at once (continuous batching), then each alone for the comparison")
    # not `c`: lily chat's check closes over that name (the chat parser)
    conc = b.add_argument_group("--concurrent: several requests at once (continuous batching; Lily alone, no MLX-LM)")
    conc.add_argument("--concurrent", type=_int_list, default=None, metavar="N1,N2,...",
                   help="for each N, N requests of --lengths' first length (default 256) at once, "
                        "--decode-tokens each: aggregate and per-request tok/s, time to first token, "
                        "outputs compared with N = 1")
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("doctor", help="check this machine: toolchain, GPU, memory, and every kernel against numpy",
                       description="Print the chip, GPU family, OS and toolchain versions, whether the Metal "
                                   "library and the tensor library load, the memory the model needs, then run "
                                   "every shipped kernel once on the GPU (the simulator off a Mac) against its "
                                   "numpy reference on random inputs from a printed seed, at small shapes and at "
                                   "the model's own, and the embedded demo model end to end against the numpy "
                                   "reference (teacher-forced logits, a prefill and 16 sampled decode steps). Ends "
                                   "with a block to paste into a bug report. Exit status 1 when anything failed.")
    d.add_argument("--device", default="auto", choices=["auto", "metal", "sim"],
                   help="device to check (default auto: metal on a Mac, else the simulator)")
    d.add_argument("--kernels", default=None, metavar="K1,K2,...",
                   help="check only these kernels (at small and model shapes; no end-to-end check)")
    d.add_argument("--model", "-m", default=None, metavar="PATH",
                   help="checkpoint whose memory needs to show (default: demo model)")
    d.add_argument("--max-context", type=_int_at_least(1), default=None, metavar="N",
                   help="context length for the KV-cache estimate, in [1, the model's maximum] (default: as "
                        "Engine.load, 32768 or the model's maximum)")
    d.add_argument("--seed", type=_int_at_least(0), default=None, metavar="N",
                   help="non-negative seed of the random inputs (default: a fresh one, printed in the report)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    d.add_argument("--quick", action="store_true",
                   help="the kernels at small shapes only (seconds): no end-to-end check, no model-size run (which "
                        "takes an hour or more on the simulator)")
    d.add_argument("--rows", type=_int_at_least(1), default=None, metavar="N",
                   help="prefill chunk rows of the model-size kernel checks (default 4096, the model's chunk; on "
                        "the simulator 256: 4096 takes hours there)")
    d.set_defaults(func=cmd_doctor)
    e = sub.add_parser("estimate", help="ESTIMATE decode and prefill speed on an Apple GPU without a Mac",
                       description="A performance model (docs/performance.md) of the real plan's recorded "
                                   "dispatches on a chosen Apple GPU: decode tok/s per context, prefill tok/s "
                                   "per prompt length, and where the time goes by kernel family. An estimate, "
                                   "not a measurement.")
    e.add_argument("--machine", default=None, metavar="KEY",  # checked in _check_estimate: the lab loads only there
                   help="the GPU modelled, a key of lily.lab.estimate.MACHINES (default m5max; with --fit, the "
                        "measured run's chip)")
    e.add_argument("--model", "-m", default=None, metavar="PATH",
                   help="take the dimensions from this checkpoint's config.json (default: Qwen3.6-35B-A3B)")
    e.add_argument("--contexts", type=_int_list, default=None, metavar="L1,L2,...",
                   help="decode contexts (default 256, 512, ..., 131072, below the model's limit)")
    e.add_argument("--prompts", type=_int_list, default=None, metavar="L1,L2,...",
                   help="prefill prompt lengths (default 256, 512, ..., 131072, up to the model's limit)")
    e.add_argument("--at", type=int, default=None, metavar="L",
                   help="context / prompt length of the per-family breakdown (default 4096, or the model's "
                        "longest context when it is shorter)")
    e.add_argument("--prefill-chunk", type=_int_at_least(0), default=None, metavar="N",
                   help="prefill chunk rows (default 0: the runtime's automatic choice with memory to spare, 4096)")
    e.add_argument("--batches", type=_int_list, default=[1, 2, 4, 8], metavar="B1,B2,...",
                   help="rows of the batched decode steps estimated at --at (continuous batching; default 1,2,4,8, "
                        f"at most {MAX_BATCH})")
    e.add_argument("--fit", default=None, nargs="+", metavar="JSON",
                   help="calibrate the model on a Mac run first: a `lily bench --json` file (its bandwidth efficiency, "
                        "stage gap and matrix efficiency fitted to Lily's figures) and/or a `lily bench --kernels "
                        "--json` file (each constant the kernel timings identify; the run then fits the rest); "
                        "docs/performance.md")
    e.add_argument("--json", action="store_true",
                   help="print the report as JSON (with --fit: {fit, kernels_fit, estimate})")
    e.set_defaults(func=cmd_estimate, check=lambda a: _check_estimate(e, a))

    s = sub.add_parser("serve", help="HTTP server: OpenAI chat completions and Responses, Anthropic Messages (streaming)",
                       description="Serve the model over HTTP: OpenAI chat completions, completions and "
                                   "Responses, Anthropic Messages, and models, streaming or not, on "
                                   "127.0.0.1 unless --host says otherwise. Up to --max-batch generations "
                                   "decode together (continuous batching); others wait in a queue. See "
                                   "docs/server.md.")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--served-model-name", "--model-name", dest="model_name", default=None,
                   help="model id the server advertises (default: the name lily chat shows, lily-demo-shakespeare "
                        "for the demo model, else the checkpoint directory's name); requests may name any model "
                        "unless --strict-model-name")
    s.add_argument("--strict-model-name", action="store_true",
                   help="refuse requests naming another model (404 model_not_found)")
    s.add_argument("--max-batch", type=int, default=DEFAULT_BATCH, metavar="B",
                   help=f"generations that decode together, 1..{MAX_BATCH} (default {DEFAULT_BATCH}; fewer when the "
                        "GPU's memory holds fewer sequences: each reserves its KV cache at --max-context and its state)")
    s.add_argument("--max-queue", type=int, default=DEFAULT_QUEUE,
                   help=f"requests allowed to wait for a place in the batch (default {DEFAULT_QUEUE}); more get "
                        "HTTP 429 with Retry-After")
    s.add_argument("--prefill-interleave", type=int, default=DEFAULT_INTERLEAVE, metavar="N",
                   help=f"tokens of a new prompt's prefill chunk while others decode (default {DEFAULT_INTERLEAVE}): "
                        "the most one of their steps waits for it")
    s.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="max tokens for chat and Responses requests that set none (default 4096, or the "
                        "checkpoint's max_new_tokens: 256 for the demo model; completions follow OpenAI: 16)")
    s.add_argument("--reasoning", choices=["on", "off"], default=None,
                   help="whether requests that do not say think (default: the chat template's, on); each API's "
                        "own field overrides it (chat_template_kwargs.enable_thinking or reasoning_effort, "
                        "reasoning.effort, thinking)")
    s.add_argument("--clamp-max-tokens", action="store_true",
                   help="serve a request whose prompt + max_tokens exceeds the context with max_tokens capped to "
                        "the room left (default: HTTP 400 context_length_exceeded, as OpenAI's and Anthropic's "
                        "APIs); for agent tools that send a fixed limit larger than a local window")
    s.add_argument("--keep-billing-header", action="store_true",
                   help="keep the 'x-anthropic-billing-header: ... cch=<nonce>' line Claude Code puts first in "
                        "the system prompt (default: dropped, since its nonce changes with every request and "
                        "would defeat the prompt cache)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _add_cache_args(s)
    s.set_defaults(func=cmd_serve, check=lambda a: _check_serve(s, a))
    return p


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"lily: warning: {message}", file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = _show_warning  # one line, not the source line that warned
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        _check_model_path(getattr(args, "model", None))  # every command with --model: one message
        if getattr(args, "check", None):
            args.check(args)  # usage errors exit 2, like argparse's own
        return args.func(args) or 0
    except LilyError as e:
        print(f"lily: error: {e}", file=sys.stderr)
        return 1
    except _core.GpuError as e:  # a GPU fault or a library that does not load: not a Python bug
        print(f"lily: error: the device failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`lily generate ... | head`): stop quietly, as shell tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
