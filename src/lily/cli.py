"""The ``lily`` command: generate, chat, info, serve.

Every subcommand runs on the embedded demo model when ``--model`` is not given, so
``lily generate "ROMEO."`` works right after ``pip install``.
"""

from __future__ import annotations

import argparse
import json
import sys

from lily.errors import ContextLengthError, InvalidParameterError, LilyError

_INT32_MAX = (1 << 31) - 1
_SERVE_EXTRA = 'pip install ".[serve]" in the Lily source tree, or pip install fastapi uvicorn'

_EPILOG = """examples:
  lily generate "ROMEO."                      # the embedded demo model (Shakespeare)
  lily generate --model ~/models/Qwen3.6-35B-A3B-4bit --chat "Explain RoPE briefly."
  lily chat                                   # interactive chat, streaming
  lily info                                   # config, tensors, memory, devices
  lily serve --port 8000                      # OpenAI-compatible server (pip install ".[serve]")
  lily bench --model ~/models/Qwen3.6-35B-A3B-4bit --device metal   # vs MLX-LM (".[bench]")
"""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, metavar="PATH",
                   help="MLX 4-bit qwen3_5_moe checkpoint directory (default: the embedded demo model)")
    p.add_argument("--device", default="reference", choices=["reference", "sim", "metal", "auto"],
                   help="where to run the model: reference (numpy, default), sim (the Metal kernels on "
                        "the CPU simulator: slow, for verification), metal (Apple GPU), auto")
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="context window in tokens (default: min(32768, the model's limit))")
    g = p.add_argument_group("native devices (sim, metal, auto)")
    g.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prompt tokens per prefill chunk (default 2048; scratch memory is sized for one chunk)")
    g.add_argument("--no-weight-cache", action="store_true",
                   help="do not write or use aligned copies of the checkpoint files (see `lily info`); "
                        "the weights are then copied into memory at every load")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults come from the checkpoint's generation_config.json)")
    g.add_argument("--max-tokens", "-n", type=int, default=None, help="maximum tokens to generate (default 256)")
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
            "presence_penalty", "frequency_penalty", "seed", "stop")
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


def _load(args):
    from lily.engine import Engine
    options, flags = {}, []
    if args.prefill_chunk is not None:
        options["prefill_chunk"] = args.prefill_chunk
        flags.append("--prefill-chunk")
    if args.no_weight_cache:
        options["weight_cache"] = False
        flags.append("--no-weight-cache")
    if flags and args.device == "reference":
        raise InvalidParameterError(f"{' and '.join(flags)} apply only to the native devices "
                                    "(--device sim, metal or auto)")
    return Engine.load(args.model, device=args.device, max_context=args.max_context,
                       progress=sys.stderr.isatty(), device_options=options or None)


def _print_stats(ev, file=sys.stderr) -> None:
    t = ev.timings
    print(f"\n[{ev.prompt_tokens} prompt tokens, {t.prefill_tokens_per_s:.1f} tok/s prefill; "
          f"{ev.completion_tokens} generated, {t.decode_tokens_per_s:.1f} tok/s; "
          f"finish: {ev.finish_reason}]", file=file)


class _ChatPrinter:
    """Shows a streamed chat reply: the answer on stdout, the model's thinking on stderr
    (dimmed on a terminal), so ``lily generate --chat ... > answer.txt`` keeps the answer
    alone. The split is the server's (lily.chat_output); tool-call markup stays in the answer."""

    def __init__(self, engine, messages: list[dict], template_kwargs: dict):
        from lily.chat_output import ChatOutputParser, prompt_opens_reasoning
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
    engine = _load(args)
    printer = None
    if args.chat:
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
    if args.verbose:
        _print_stats(last)
    if _context_full(engine, last):
        _context_notice(engine, " (--max-context sets it)")
    return 0


def cmd_chat(args) -> int:
    overrides = _overrides(args)
    engine = _load(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    kwargs = {"enable_thinking": False} if args.no_think else {}
    print(f"lily chat - {engine.path.name} on {engine.device}. Empty line or Ctrl-D to quit, "
          "/reset to start over, /help for the commands.", file=sys.stderr)
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
            print("[empty line, Ctrl-D, /exit or /quit: quit; /reset: start a new conversation"
                  + (" (the system prompt is kept)" if args.system else "")
                  + "; /help: this; start a message with // to send a leading /]", file=sys.stderr)
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
        try:
            for ev in engine.stream_chat(messages, chat_template_kwargs=kwargs, **overrides):
                printer.feed(ev.text)
                reply.append(ev.text)
                last = ev
            printer.finish(last.finish_reason if last else None)
        except KeyboardInterrupt:
            printer.finish()
            print("\n[interrupted]", file=sys.stderr)
        except ContextLengthError as e:
            messages.pop()
            print(f"[{e}; /reset to start over]", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": "".join(reply)})
        if args.verbose and last is not None:
            _print_stats(last)
        if _context_full(engine, last):
            _context_notice(engine, "; /reset to start over")


def cmd_info(args) -> int:
    from lily import _core
    from lily.engine import Engine
    from lily.weight_cache import default_dir
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


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def cmd_bench(args) -> int:
    from lily.bench import bench, format_report
    options = {"prefill_chunk": args.prefill_chunk} if args.prefill_chunk else None
    rep = bench(args.model, device=args.device, lengths=args.lengths, decode_tokens=args.decode_tokens,
                rounds=args.rounds, positions=args.positions, device_options=options)
    print(format_report(rep))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=2)
        print(f"\nwritten: {args.json}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    try:
        from lily.server import serve
    except ImportError as e:
        print(f"lily serve needs the server extra: {_SERVE_EXTRA} ({e})", file=sys.stderr)
        return 2
    engine = _load(args)
    try:
        serve(engine, host=args.host, port=args.port, api_key=args.api_key,
              model_name=args.model_name, max_queue=args.max_queue,
              default_max_tokens=args.default_max_tokens, log_level=args.log_level)
    except OSError as e:  # the address cannot be bound
        print(f"lily: error: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def _check_generate(parser: argparse.ArgumentParser, args) -> None:
    if args.no_think and not args.chat:
        parser.error("--no-think needs --chat (it switches off the chat template's thinking "
                     "block; a raw prompt has no template)")
    if args.echo and args.chat:
        parser.error("--echo prints a raw prompt before its continuation; with --chat the reply "
                     "answers the prompt instead of continuing it")


def _check_serve(parser: argparse.ArgumentParser, args) -> None:
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 0:
        parser.error(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        parser.error(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lily",
        description="Lily runs Qwen3.6-35B-A3B (qwen3_5_moe, MLX 4-bit checkpoints) locally. "
                    "Without --model it uses a small embedded demo model that writes Shakespeare.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="continue a prompt (or answer it with --chat) and print the text",
                       description="Generate text from PROMPT and stream it to stdout.")
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--no-think", action="store_true", help="with --chat: disable the thinking block "
                   "(an error without --chat: a raw prompt has no chat template)")
    g.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    g.add_argument("--verbose", "-v", action="store_true", help="print token counts and speed to stderr")
    _add_model_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate, check=lambda a: _check_generate(g, a))

    c = sub.add_parser("chat", help="interactive chat with the chat template, streaming",
                       description="Chat interactively; each turn is rendered with the model's chat template.")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--no-think", action="store_true", help="disable the thinking block")
    c.add_argument("--verbose", "-v", action="store_true", help="print token counts and speed after each reply")
    _add_model_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

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
    b.add_argument("--decode-tokens", type=int, default=64, metavar="N",
                   help="tokens generated per request (default 64)")
    b.add_argument("--rounds", type=int, default=3, help="rounds per length; the engine order alternates (default 3)")
    b.add_argument("--positions", type=int, default=192, metavar="N",
                   help="teacher-forced positions of the consistency check (default 192; 0 skips it)")
    b.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="Lily's prefill chunk on the native devices (default 2048)")
    b.add_argument("--json", default=None, metavar="FILE", help="also write the full results as JSON")
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat completions, streaming)")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--model-name", default=None, help="model id reported by /v1/models (default: directory name)")
    s.add_argument("--max-queue", type=int, default=8, help="requests allowed to wait (default 8); more get HTTP 429")
    s.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="max tokens for chat requests that set none (default: until the context is full; completions follow OpenAI: 16)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve, check=lambda a: _check_serve(s, a))
    return p


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"lily: warning: {message}", file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    import warnings
    warnings.showwarning = _show_warning  # one line, not the source line that warned
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if getattr(args, "check", None):
        args.check(args)  # usage errors exit 2, like argparse's own
    try:
        return args.func(args) or 0
    except LilyError as e:
        print(f"lily: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`lily generate ... | head`): stop quietly, as shell tools do
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
