"""``lily bench --agent``: the multi-turn agent scenario of the prompt cache.

An agent conversation: a system prompt of about ``system_tokens`` tokens with tool
definitions, then ``turns`` requests; after each reply the conversation gets the reply with
a tool call, the tool's result and a user message (about ``turn_tokens`` tokens together),
as a coding agent's loop does. Every request runs greedily on an engine with the prompt
cache and, with ``cold=True``, on one without (reset before each request), which also
checks that the outputs are identical.

Per turn the report gives the prompt tokens, the tokens it shares with the previous request
(``shared``: the longest common prefix of the two rendered prompts), the tokens computed
with and without the cache, the seconds per request, and the reuse ratio cached / shared
(the target is >= 0.95: computed <= new tokens + the generation prompt).

With ``parallel`` N (:func:`run_parallel`), N such conversations (the same system prompt and
tools, each its own task) run at once on one engine through a
:class:`lily.scheduler.Scheduler` (continuous batching, issue 31): the report adds the wall
time of all of them, the generated tokens per second over it, and whether every reply equals
the same conversation's run alone.
"""

from __future__ import annotations

import threading
import time

from lily.errors import InvalidParameterError
from lily.scheduler import MAX_BATCH

_TOOL_NAMES = ("read_file", "write_file", "list_directory", "search_code", "run_tests", "run_shell",
               "git_diff", "git_commit")

_PARAGRAPH = (
    "Work in small verified steps. Read the relevant files before changing them, keep every "
    "change minimal and explain it in one sentence. Run the tests that cover what you touched "
    "and report their result honestly; never claim a test passed that you did not run. When a "
    "request is ambiguous, state the assumption you make. Prefer the project's existing helpers "
    "to new code, and keep the style of the surrounding file. "
)

_RESULT = (
    "def parse_config(raw, where):\n    values = {}\n    for key, value in raw.items():\n"
    "        if key.startswith('_'):\n            continue\n        values[key] = check(key, value, where)\n"
    "    return values\n"
)


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ').capitalize()} in the workspace.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "a path relative to the workspace root"},
            "pattern": {"type": "string", "description": "optional text or glob to match"}},
            "required": ["path"]}}} for name in _TOOL_NAMES[:n]]


def _fill(engine, unit: str, tokens: int) -> str:
    """``unit`` repeated to about ``tokens`` tokens."""
    per = max(1, len(engine.tokenizer.encode(unit)))
    return unit * max(1, round(tokens / per))


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _check(system_tokens, turns, turn_tokens, max_tokens, tools) -> None:
    for name, v in (("system_tokens", system_tokens), ("turns", turns), ("turn_tokens", turn_tokens),
                    ("max_tokens", max_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidParameterError(f"{name} must be a positive integer, got {v!r}")
    if not 1 <= tools <= len(_TOOL_NAMES):
        raise InvalidParameterError(f"tools must be in [1, {len(_TOOL_NAMES)}], got {tools!r}")


class _Conversation:
    """One agent conversation: the system prompt with tools, a task, and after each reply a
    tool call, its result and a user message (about ``turn_tokens`` tokens)."""

    def __init__(self, engine, system_tokens: int, turn_tokens: int, max_tokens: int, tools: int, task: str):
        self.engine, self.turn_tokens = engine, turn_tokens
        self.tools = _tools(tools)
        tool_tokens = len(engine.tokenizer.encode_chat([{"role": "user", "content": "."}], tools=self.tools))
        system = _fill(engine, _PARAGRAPH, max(1, system_tokens - tool_tokens))
        self.messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        self.kw = {"tools": self.tools, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}

    def ids(self) -> list[int]:
        return self.engine.tokenizer.encode_chat(self.messages, tools=self.tools, add_generation_prompt=True)

    def reply(self, r, t: int) -> None:
        """The conversation after reply ``r`` of turn ``t`` (0-based)."""
        result = _fill(self.engine, _RESULT, int(self.turn_tokens * 0.8))
        self.messages = self.messages + [
            {"role": "assistant", "content": r.text,
             "tool_calls": [{"type": "function", "function": {"name": "read_file",
                                                              "arguments": {"path": f"src/module_{t}.py"}}}]},
            {"role": "tool", "content": result},
            {"role": "user", "content": _fill(self.engine, "Good; now check the next module and say what you "
                                                           "would change. ", int(self.turn_tokens * 0.2))}]


_TASK = "Fix the failing configuration test in this repository."


def run(engine, cold_engine=None, *, system_tokens: int = 4096, turns: int = 8, turn_tokens: int = 300,
        max_tokens: int = 16, tools: int = len(_TOOL_NAMES), on_turn=None) -> dict:
    """Run the scenario on ``engine`` (with its prompt cache) and, if given, on
    ``cold_engine`` (no cache; reset before each request), with ``tools`` tool definitions
    (1 to 8) in the system message; ``on_turn(row)`` is called after each turn. Returns a
    JSON-ready report:
    ``turns`` (one dict per request) and ``summary``.

    Raises :class:`InvalidParameterError` for non-positive sizes or an engine without a cache.
    """
    _check(system_tokens, turns, turn_tokens, max_tokens, tools)
    if engine.prompt_cache is None:
        raise InvalidParameterError("the agent scenario measures the prompt cache: the engine has none")
    conv = _Conversation(engine, system_tokens, turn_tokens, max_tokens, tools, _TASK)
    rows, prev = [], None
    for t in range(turns):
        ids = conv.ids()
        shared = _common(prev, ids) if prev is not None else 0
        t0 = time.perf_counter()
        r = engine.chat(conv.messages, **conv.kw)
        row = _turn_row(t, r, shared, time.perf_counter() - t0)
        if cold_engine is not None:
            cold_engine.reset()
            t0 = time.perf_counter()
            c = cold_engine.chat(conv.messages, **conv.kw)
            row.update(cold_computed=c.timings.prefill_tokens, cold_seconds=round(time.perf_counter() - t0, 3),
                       identical=c.token_ids == r.token_ids)
        rows.append(row)
        if on_turn is not None:
            on_turn(row)
        prev = ids
        conv.reply(r, t)
    later = rows[1:]
    summary = {
        "device": engine.device, "model": engine.name, "system_tokens": rows[0]["prompt_tokens"],
        "turns": turns,
        "computed_with_cache": sum(r["computed"] for r in rows),
        "computed_without_cache": sum(r["prompt_tokens"] for r in rows),
        "min_reuse_after_turn_1": min((r["reuse"] for r in later), default=None),
        "seconds_with_cache": round(sum(r["seconds"] for r in rows), 2),
    }
    if cold_engine is not None:
        summary["seconds_without_cache"] = round(sum(r["cold_seconds"] for r in rows), 2)
        summary["outputs_identical"] = all(r["identical"] for r in rows)
    summary["cache"] = engine.prompt_cache.info()
    return {"turns": rows, "summary": summary}


def _turn_row(t: int, r, shared: int, seconds: float) -> dict:
    return {"turn": t + 1, "prompt_tokens": r.prompt_tokens, "shared": shared,
            "new_tokens": r.prompt_tokens - shared, "cached": r.cached_tokens,
            "computed": r.timings.prefill_tokens, "seconds": round(seconds, 3),
            "reuse": round(r.cached_tokens / shared, 4) if shared else None}


def run_parallel(engine, parallel: int, *, system_tokens: int = 4096, turns: int = 8, turn_tokens: int = 300,
                 max_tokens: int = 16, tools: int = len(_TOOL_NAMES), alone: bool = True, on_turn=None) -> dict:
    """``parallel`` conversations at once on ``engine`` (each its own task after the same
    system prompt), each turn submitted as soon as its conversation has the previous reply,
    through a scheduler of ``min(parallel, 8)`` rows. With ``alone``, every conversation is
    then run again by itself on the same engine (its prompt cache cleared first) and the
    replies compared. ``on_turn(row)`` after each turn (``row["conversation"]`` names it).
    Returns ``turns`` (every conversation's rows) and ``summary`` (wall time, generated
    tokens per second over it, outputs identical)."""
    _check(system_tokens, turns, turn_tokens, max_tokens, tools)
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise InvalidParameterError(f"parallel must be a positive integer, got {parallel!r}")
    def tasks():
        return [_Conversation(engine, system_tokens, turn_tokens, max_tokens, tools, f"Task {i + 1}: {_TASK}")
                for i in range(parallel)]

    convs, rows, replies, errors = tasks(), [], {}, []
    lock = threading.Lock()
    with engine.scheduler(max_batch=min(parallel, MAX_BATCH), max_queue=parallel) as batch:
        batch.start()

        def talk(i: int, conv: _Conversation) -> None:
            try:
                converse(i, conv)
            except Exception as exc:  # noqa: BLE001 - raised on the caller's thread below
                errors.append(exc)

        def converse(i: int, conv: _Conversation) -> None:
            prev = None
            for t in range(turns):
                ids = conv.ids()
                t0 = time.perf_counter()
                r = batch.chat(conv.messages, **conv.kw)
                row = {"conversation": i + 1, **_turn_row(t, r, _common(prev, ids) if prev else 0,
                                                          time.perf_counter() - t0)}
                with lock:
                    rows.append(row)
                    replies[(i, t)] = r.token_ids
                if on_turn is not None:
                    on_turn(row)
                prev = ids
                conv.reply(r, t)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=talk, args=(i, c)) for i, c in enumerate(convs)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    summary = {"device": engine.device, "model": engine.name, "parallel": parallel, "turns": turns,
               "seconds": round(wall, 2), "generated_tokens": parallel * turns * max_tokens,
               "generated_tok_s": round(parallel * turns * max_tokens / wall, 3),
               "computed": sum(r["computed"] for r in rows), "prompt_tokens": sum(r["prompt_tokens"] for r in rows)}
    if alone:
        same, t_alone = True, 0.0
        for i, conv in enumerate(tasks()):
            if engine.prompt_cache is not None:
                engine.prompt_cache.clear()
            engine.reset()
            t0 = time.perf_counter()
            for t in range(turns):
                r = engine.chat(conv.messages, **conv.kw)
                same = same and r.token_ids == replies[(i, t)]
                conv.reply(r, t)
            t_alone += time.perf_counter() - t0
        summary.update(seconds_alone=round(t_alone, 2), outputs_identical=same)
    return {"turns": sorted(rows, key=lambda r: (r["conversation"], r["turn"])), "summary": summary}


def format_report(rep: dict) -> str:
    """The report as a table (one line per turn) and a summary line."""
    cold = "cold_computed" in rep["turns"][0]
    head = f"{'turn':>4} {'prompt':>7} {'shared':>7} {'new':>6} {'cached':>7} {'computed':>9} {'reuse':>6} {'s':>7}"
    if cold:
        head += f" {'cold computed':>14} {'cold s':>7} {'same':>5}"
    lines = [head]
    for r in rep["turns"]:
        reuse = f"{r['reuse']:.3f}" if r["reuse"] is not None else "-"
        line = (f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['shared']:>7} {r['new_tokens']:>6} {r['cached']:>7} "
                f"{r['computed']:>9} {reuse:>6} {r['seconds']:>7.2f}")
        if cold:
            line += f" {r['cold_computed']:>14} {r['cold_seconds']:>7.2f} {'yes' if r['identical'] else 'NO':>5}"
        lines.append(line)
    s = rep["summary"]
    lines.append(f"tokens computed: {s['computed_with_cache']} with the cache, {s['computed_without_cache']} "
                 f"without; lowest reuse after turn 1: {s['min_reuse_after_turn_1']}; "
                 f"{s['seconds_with_cache']} s with the cache"
                 + (f", {s['seconds_without_cache']} s without; outputs identical: {s['outputs_identical']}"
                    if cold else "") + f" ({s['device']}, {s['model']})")
    return "\n".join(lines)


def format_parallel(rep: dict) -> str:
    """:func:`run_parallel`'s report: one line per conversation and turn, and the summary."""
    lines = [f"{'conv':>4} {'turn':>4} {'prompt':>7} {'cached':>7} {'computed':>9} {'s':>7}"]
    for r in rep["turns"]:
        lines.append(f"{r['conversation']:>4} {r['turn']:>4} {r['prompt_tokens']:>7} {r['cached']:>7} "
                     f"{r['computed']:>9} {r['seconds']:>7.2f}")
    s = rep["summary"]
    line = (f"{s['parallel']} conversations x {s['turns']} turns at once: {s['seconds']} s, "
            f"{s['generated_tok_s']} generated tok/s; {s['computed']} of {s['prompt_tokens']} prompt tokens computed")
    if "seconds_alone" in s:
        line += f"; one after another {s['seconds_alone']} s, outputs identical: {s['outputs_identical']}"
    lines.append(line + f" ({s['device']}, {s['model']})")
    return "\n".join(lines)
