"""The thinking budget (``SamplingParams.thinking_budget``): after k tokens inside the
thinking block the engine appends the close itself and the model answers from its live
session, on the reference device and the simulator, with logprobs, stop strings,
cancellation and a structured-output constraint."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from lily.engine import THINKING_CLOSE_TEXT, Engine
from lily.generation import ThinkingBudget as _ThinkingBudget
from lily.errors import InvalidParameterError
from lily.sampling import SamplingParams
from lily.structured import Grammar

ASK = [{"role": "user", "content": "Speak, Romeo."}]


def _prompt(engine) -> list[int]:
    return engine.tokenizer.encode_chat(ASK)  # the template opens <think>


def _fresh(engine, ids, **kw):
    """A generation from an empty session with no prompt cache: nothing reused."""
    cache, engine.prompt_cache = engine.prompt_cache, None
    try:
        engine.reset()
        r = engine.generate(ids, **kw)
    finally:
        engine.prompt_cache = cache
    assert r.cached_tokens == 0
    return r


def _check_budget(engine, k: int, max_tokens: int, atol: float):
    """A budget of ``k``: k thinking tokens, the close, then exactly the answer a fresh
    generation from prompt + thinking + close gives (greedy), and a session that holds all
    of it (next logits within ``atol`` of a fresh prefill's). Returns the result."""
    tok = engine.tokenizer
    prompt = _prompt(engine)
    assert engine.prompt_opens_thinking(prompt)
    r = engine.generate(prompt, max_tokens=max_tokens, temperature=0.0, thinking_budget=k, logprobs=True)
    close = tok.encode(THINKING_CLOSE_TEXT)
    assert tok.token_to_id("</think>") in close  # the special token, not its letters
    assert r.finish_reason == "length" and r.completion_tokens == len(r.token_ids) == max_tokens
    assert r.timings.decode_tokens == max_tokens
    assert tok.token_to_id("</think>") not in r.token_ids[:k]
    assert r.token_ids[k:k + len(close)] == close
    assert r.text == tok.decode(r.token_ids)
    # forced tokens: logprob 0.0, no alternatives; the model's own tokens: real ones
    assert [lp.token_id for lp in r.logprobs] == r.token_ids
    assert all(lp.logprob == 0.0 and lp.top == () for lp in r.logprobs[k:k + len(close)])
    assert all(lp.logprob < 0.0 for lp in r.logprobs[:k])
    _check_session(engine, prompt + r.token_ids, atol)
    n = k + len(close)
    fresh = _fresh(engine, prompt + r.token_ids[:n], max_tokens=max_tokens - n, temperature=0.0)
    assert fresh.token_ids == r.token_ids[n:]
    return r


def _check_session(engine, ids: list[int], atol: float):
    """The session holds ``ids`` (but possibly the last): its next logits equal those of
    ``ids`` computed from scratch."""
    held = engine.tokens
    assert held == ids[:len(held)] and len(held) >= len(ids) - 1
    more = ids + [ids[-1]]
    got = engine.prefill(more[len(held):])
    engine.reset()
    want = engine.prefill(more)
    np.testing.assert_allclose(got, want, rtol=atol, atol=atol)


def test_budget_closes_the_thinking_and_the_session_continues(demo_engine, monkeypatch):
    starts = []  # (feed, steps, history) of each backend.start
    start = demo_engine.backend.start
    monkeypatch.setattr(demo_engine.backend, "start",
                        lambda feed, steps, history, *a: (starts.append((list(feed), steps, list(history))),
                                                          start(feed, steps, history, *a)))
    r = _check_budget(demo_engine, k=4, max_tokens=12, atol=2e-4)
    # the continuation: the last thinking token (if the host had not fed it yet) and the
    # close as its feed, the rest of max_tokens, the whole text so far as the penalties' history
    prompt, close = _prompt(demo_engine), r.token_ids[4:7]
    feed, steps, history = starts[1]
    assert feed in (r.token_ids[3:7], close) and steps == 12 - 7 and history == prompt + r.token_ids[:7]
    monkeypatch.undo()
    # the chat parser sees the block close: k tokens of reasoning, then the answer
    c = demo_engine.chat(ASK, max_tokens=12, temperature=0.0, thinking_budget=4)
    tok = demo_engine.tokenizer
    assert c.token_ids == r.token_ids
    assert c.reasoning == tok.decode(r.token_ids[:4]).strip()
    assert c.content == tok.decode(r.token_ids[7:]).strip() and c.content


def test_budget_on_the_native_device(demo_path, native_device):
    e = Engine.load(demo_path, device=native_device, max_context=64, device_options={"prefill_chunk": 16})
    r = _check_budget(e, k=2, max_tokens=7, atol=2e-2)
    assert r.timings.gpu_decode_s > 0 and r.timings.prefill_s > 0


def test_stop_string_across_the_forced_close(demo_engine):
    e, k = demo_engine, 3
    full = e.generate(_prompt(e), max_tokens=9, temperature=0.0, thinking_budget=k)
    thinking = e.tokenizer.decode(full.token_ids[:k])
    answer = e.tokenizer.decode(full.token_ids[k + 3:])
    stop = "think>\n\n" + answer[:2]  # from the forced text into the model's answer
    r = e.generate(_prompt(e), max_tokens=9, temperature=0.0, thinking_budget=k, stop=[stop])
    assert r.finish_reason == "stop" and r.text == thinking + "\n</"
    # a stop string inside the forced text ends there too
    r = e.generate(_prompt(e), max_tokens=9, temperature=0.0, thinking_budget=k, stop=["</think>"])
    assert r.finish_reason == "stop" and r.text == thinking + "\n"


def test_max_tokens_counts_the_forced_tokens(demo_engine):
    e = demo_engine
    r = e.generate(_prompt(e), max_tokens=4, temperature=0.0, thinking_budget=3)
    assert r.finish_reason == "length" and r.completion_tokens == 4
    assert r.token_ids[3] == e.tokenizer.encode(THINKING_CLOSE_TEXT)[0]


def test_cancel_after_the_forced_close(demo_engine):
    e, k = demo_engine, 3
    prompt = _prompt(e)
    close = e.tokenizer.encode(THINKING_CLOSE_TEXT)
    cancel = threading.Event()
    ids = []
    for ev in e.stream(prompt, max_tokens=20, temperature=0.0, thinking_budget=k, cancel=cancel):
        assert not cancel.is_set() or ev.finish_reason == "cancelled"
        ids += ev.token_ids
        if ids[k:] == close:
            cancel.set()
    assert ev.finish_reason == "cancelled" and ids[k:] == close
    thinking = ids[:k]
    # the session holds what the model computed: the prompt and the thinking (the last
    # thinking token may wait for the next step), never the unfed close
    assert e.tokens in (prompt + thinking, prompt + thinking[:-1])
    again = e.generate(prompt, max_tokens=5, temperature=0.0, thinking_budget=k)
    assert again.token_ids[:k] == thinking and again.cached_tokens > 0


def test_structured_answer_after_the_budget(demo_engine):
    """The grammar leaves the thinking free; the forced close advances it like sampled
    tokens, so the answer that follows is the constrained one."""
    e = demo_engine
    g = Grammar.json_schema({"enum": ["yes", "no"]})
    r = e.chat(ASK, max_tokens=30, temperature=0.0, thinking_budget=3, constraint=g)
    assert r.finish_reason == "stop"
    assert r.token_ids[3:6] == e.tokenizer.encode(THINKING_CLOSE_TEXT)
    assert json.loads(r.content) in ("yes", "no")


def test_counting_starts_at_the_models_own_think():
    class Tok:
        def token_to_id(self, s):
            return {"<think>": 1, "</think>": 2}.get(s)

        def encode(self, text):
            return [9, 2, 9]

    b = _ThinkingBudget(Tok(), 2, inside=False)
    assert [b.spent(t) for t in (5, 6, 1, 7, 8, 9)] == [False, False, False, False, True, False]
    b = _ThinkingBudget(Tok(), 2, inside=True)  # the model closes first: no effect
    assert [b.spent(t) for t in (5, 2, 7, 8, 9)] == [False] * 5


@pytest.mark.parametrize("bad", [0, -3, 1.5, "8", True])
def test_bad_budget_names_the_field(demo_engine, bad):
    with pytest.raises(InvalidParameterError, match="thinking_budget"):
        SamplingParams(thinking_budget=bad)
    with pytest.raises(InvalidParameterError, match="thinking_budget"):
        demo_engine.generate("x", max_tokens=2, thinking_budget=bad)
