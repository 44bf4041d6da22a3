"""``lily bench --concurrent 1,2,4,8``: N requests at once on one engine (continuous batching,
issue 31; :class:`lily.scheduler.Scheduler`).

For each N, N different prompts of ``prompt_tokens`` tokens are submitted together and each
generates ``decode_tokens`` tokens greedily (EOS ignored). The report gives, per N: the wall
time; the aggregate throughput (every generated token over the wall time) and the decode
throughput (tokens after each request's first over the span from the first first token to
the last token); the mean per-request decode speed (each request's tokens after its first
over its own decode time); the time to first token from submission (mean and worst: queue
wait, prefill interleaved with the others' steps, the first step); the decode steps run and
their mean rows; and whether each request's tokens equal the same request's at N = 1 (rows
are computed as alone: docs/decode.md "Batched decode"). Runs on any device; the prompt
cache is not used (every request computes its prompt).
"""

from __future__ import annotations

import time

from lily.errors import InvalidParameterError
from lily.scheduler import MAX_BATCH

_TEXT = ("A local inference engine serves several agents at once: a main conversation, subagents "
         "working on parts of a task, and small background requests for titles and summaries. ")


def prompts(engine, n: int, tokens: int) -> list[list[int]]:
    """``n`` different prompts of ``tokens`` token ids (a numbered request, then text)."""
    body = engine.tokenizer.encode(_TEXT * max(1, tokens // 16 + 1))
    out = []
    for i in range(n):
        head = engine.tokenizer.encode(f"Request {i + 1}. ")
        out.append((head + body)[:tokens])
    return out


def run(engine, counts=(1, 2, 4, 8), *, prompt_tokens: int = 256, decode_tokens: int = 64,
        prefill_interleave: int = 1024, on_row=None) -> dict:
    """The scenario on ``engine`` for each N of ``counts`` (the batch is min(N, 8); more wait
    in the queue); ``on_row(row)`` after each. Returns a JSON-ready report: ``rows`` (one per
    N) and ``summary``. Raises :class:`InvalidParameterError` for sizes below 1 or a prompt
    that does not fit the context with its tokens."""
    for name, v in (("prompt_tokens", prompt_tokens), ("decode_tokens", decode_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidParameterError(f"{name} must be a positive integer, got {v!r}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise InvalidParameterError(f"--concurrent counts must be positive integers, got {list(counts)}")
    if prompt_tokens + decode_tokens > engine.max_context:
        raise InvalidParameterError(f"a prompt of {prompt_tokens} tokens and {decode_tokens} generated tokens do "
                                    f"not fit the context window of {engine.max_context}")
    all_prompts = prompts(engine, max(counts), prompt_tokens)
    alone: dict[int, list[int]] = {}
    rows = []
    for n in counts:
        with engine.scheduler(max_batch=min(n, MAX_BATCH), max_queue=max(0, n - MAX_BATCH),
                              prefill_interleave=prefill_interleave) as batch:
            t0 = time.perf_counter()
            reqs = [batch.submit(p, max_tokens=decode_tokens, temperature=0, ignore_eos=True)
                    for p in all_prompts[:n]]
            batch.run_until_idle()
            wall = time.perf_counter() - t0
            results = [r.result() for r in reqs]
            steps = [len(e[1]) for e in batch.trace if e[0] == "step"]
        firsts = [r.started + res.timings.prefill_s for r, res in zip(reqs, results)]
        ends = [r.finished for r in reqs]
        ttft = [f - r.submitted for f, r in zip(firsts, reqs)]
        tokens = sum(res.completion_tokens for res in results)
        after_first = sum(max(0, res.completion_tokens - 1) for res in results)
        span = max(ends) - min(firsts)
        per_request = [res.timings.decode_tokens_per_s * (res.completion_tokens - 1) / res.completion_tokens
                       if res.completion_tokens > 1 else 0.0 for res in results]
        same = []
        for i, res in enumerate(results):
            if i not in alone and n == 1:
                alone[i] = res.token_ids
            same.append(alone.get(i) == res.token_ids if i in alone else None)
        row = {"n": n, "batch": min(n, MAX_BATCH), "wall_s": round(wall, 3),
               "aggregate_tok_s": round(tokens / wall, 3) if wall > 0 else 0.0,
               "decode_tok_s": round(after_first / span, 3) if span > 0 else 0.0,
               "per_request_tok_s": round(sum(per_request) / n, 3),
               "ttft_mean_s": round(sum(ttft) / n, 3), "ttft_max_s": round(max(ttft), 3),
               "steps": len(steps), "mean_rows": round(sum(steps) / len(steps), 2) if steps else 0.0,
               "same_as_alone": [s for s in same if s is not None]}
        rows.append(row)
        if on_row is not None:
            on_row(row)
        if n == 1:  # the alone outputs of the other prompts, for the comparison
            for i in range(1, max(counts)):
                if i not in alone and any(c > i for c in counts):
                    alone[i] = engine.generate(all_prompts[i], max_tokens=decode_tokens, temperature=0,
                                               ignore_eos=True).token_ids
    summary = {"device": engine.device, "model": engine.name, "prompt_tokens": prompt_tokens,
               "decode_tokens": decode_tokens,
               "all_same_as_alone": all(all(r["same_as_alone"]) for r in rows)}
    return {"rows": rows, "summary": summary}


def format_report(rep: dict) -> str:
    """The report as a table (one line per N) and a summary line."""
    lines = [f"{'N':>3} {'batch':>5} {'wall s':>8} {'aggregate tok/s':>16} {'decode tok/s':>13} "
             f"{'per request tok/s':>18} {'TTFT mean s':>12} {'TTFT max s':>11} {'steps':>6} {'rows':>5} {'same':>5}"]
    for r in rep["rows"]:
        same = "-" if not r["same_as_alone"] else ("yes" if all(r["same_as_alone"]) else "NO")
        lines.append(f"{r['n']:>3} {r['batch']:>5} {r['wall_s']:>8.2f} {r['aggregate_tok_s']:>16.2f} "
                     f"{r['decode_tok_s']:>13.2f} {r['per_request_tok_s']:>18.2f} {r['ttft_mean_s']:>12.2f} "
                     f"{r['ttft_max_s']:>11.2f} {r['steps']:>6} {r['mean_rows']:>5.2f} {same:>5}")
    s = rep["summary"]
    lines.append(f"{s['prompt_tokens']}-token prompts, {s['decode_tokens']} tokens each, greedy; every request's "
                 f"tokens as alone: {s['all_same_as_alone']} ({s['device']}, {s['model']})")
    return "\n".join(lines)
