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
"""

from __future__ import annotations

import time

from lily.errors import InvalidParameterError

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


def run(engine, cold_engine=None, *, system_tokens: int = 4096, turns: int = 8, turn_tokens: int = 300,
        max_tokens: int = 16, tools: int = len(_TOOL_NAMES), on_turn=None) -> dict:
    """Run the scenario on ``engine`` (with its prompt cache) and, if given, on
    ``cold_engine`` (no cache; reset before each request), with ``tools`` tool definitions
    (1 to 8) in the system message; ``on_turn(row)`` is called after each turn. Returns a
    JSON-ready report:
    ``turns`` (one dict per request) and ``summary``.

    Raises :class:`InvalidParameterError` for non-positive sizes or an engine without a cache.
    """
    for name, v in (("system_tokens", system_tokens), ("turns", turns), ("turn_tokens", turn_tokens),
                    ("max_tokens", max_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidParameterError(f"{name} must be a positive integer, got {v!r}")
    if not 1 <= tools <= len(_TOOL_NAMES):
        raise InvalidParameterError(f"tools must be in [1, {len(_TOOL_NAMES)}], got {tools!r}")
    if engine.prompt_cache is None:
        raise InvalidParameterError("the agent scenario measures the prompt cache: the engine has none")
    tools = _tools(tools)
    tool_tokens = len(engine.tokenizer.encode_chat([{"role": "user", "content": "."}], tools=tools))
    system = _fill(engine, _PARAGRAPH, max(1, system_tokens - tool_tokens))
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Fix the failing configuration test in this repository."}]
    kw = {"tools": tools, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    rows, prev = [], None
    for t in range(turns):
        ids = engine.tokenizer.encode_chat(messages, tools=tools, add_generation_prompt=True)
        shared = _common(prev, ids) if prev is not None else 0
        t0 = time.perf_counter()
        r = engine.chat(messages, **kw)
        warm_s = time.perf_counter() - t0
        row = {"turn": t + 1, "prompt_tokens": r.prompt_tokens, "shared": shared,
               "new_tokens": r.prompt_tokens - shared, "cached": r.cached_tokens,
               "computed": r.timings.prefill_tokens, "seconds": round(warm_s, 3),
               "reuse": round(r.cached_tokens / shared, 4) if shared else None}
        if cold_engine is not None:
            cold_engine.reset()
            t0 = time.perf_counter()
            c = cold_engine.chat(messages, **kw)
            row.update(cold_computed=c.timings.prefill_tokens, cold_seconds=round(time.perf_counter() - t0, 3),
                       identical=c.token_ids == r.token_ids)
        rows.append(row)
        if on_turn is not None:
            on_turn(row)
        prev = ids
        result = _fill(engine, _RESULT, int(turn_tokens * 0.8))
        messages = messages + [
            {"role": "assistant", "content": r.text,
             "tool_calls": [{"type": "function", "function": {"name": "read_file",
                                                              "arguments": {"path": f"src/module_{t}.py"}}}]},
            {"role": "tool", "content": result},
            {"role": "user", "content": _fill(engine, "Good; now check the next module and say what you would change. ",
                                              int(turn_tokens * 0.2))}]
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
