"""The multi-turn prompt cache (lily.prompt_cache), each test named after the public bug it
guards against. Outputs are compared token for token with a cold engine (greedy).

The cache's bookkeeping runs on the numpy reference, named everywhere (a file is tied to the
device kind that wrote it); the native path (pipelined generation, device snapshots) has its
own tests here on device="sim" (and test_native_session.py)."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from lily import Engine, PromptCache, PromptCacheError
from lily.errors import InvalidParameterError
from lily.prompt_cache import native_snapshot_bytes, snapshot_points

SYSTEM = "You are a careful assistant."
GREEDY = {"temperature": 0, "max_tokens": 4}


@pytest.fixture(scope="module")
def cold():
    """A reference engine without a prompt cache: every request from an empty session."""
    return Engine.load(device="reference", prompt_cache_bytes=0)


@pytest.fixture()
def warm():
    return Engine.load(device="reference")


def _cold(cold, messages, **kw):
    cold.reset()
    return cold.chat(messages, **GREEDY, **kw)


def _gen_start(engine, messages, **kw) -> int:
    """Position of the generation prompt (the last <|im_start|>) in the rendered prompt."""
    ids = engine.tokenizer.encode_chat(messages, add_generation_prompt=True, **kw)
    return max(i for i, t in enumerate(ids) if t == engine.im_start)


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("thinking", [True, False])
def test_turn2_extends_turn1_qwen3_1826(warm, cold, thinking):
    """QwenLM/Qwen3#1826: with thinking off the empty think block of the generation prompt
    vanished from the re-rendered history, so turn 2 recomputed turn 1's reply. Lily renders
    a chat with thinking off with the template's preserve_thinking (Tokenizer.chat_kwargs):
    the history is rendered as generated and turn 2 reuses turn 1's prompt and reply (issue
    29). With thinking on, the template drops the reasoning: turn 2 reuses turn 1 up to the
    divergence. Either way it answers as a cold engine does."""
    kw = {"chat_template_kwargs": {"enable_thinking": thinking}}
    m1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who comes here?"}]
    r1 = warm.chat(m1, **GREEDY, **kw)
    m2 = m1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And then?"}]
    r2 = warm.chat(m2, **GREEDY, **kw)
    c2 = _cold(cold, m2, **kw)
    assert r2.token_ids == c2.token_ids
    render = warm.tokenizer.chat_kwargs({"enable_thinking": thinking})
    assert render.get("preserve_thinking") is (None if thinking else True)
    p1 = warm.tokenizer.encode_chat(m1, add_generation_prompt=True, **render)
    p2 = warm.tokenizer.encode_chat(m2, add_generation_prompt=True, **render)
    assert r2.timings.prefill_tokens == r2.prompt_tokens - r2.cached_tokens
    if not thinking:  # the whole first request and (bar its last token or two) its reply
        shared = _common(p1 + r1.token_ids, p2)
        assert shared >= len(p1) + 2 and r2.cached_tokens >= shared - 2, (len(p1), shared, r2.cached_tokens)
        return
    header = 5  # <|im_start|>assistant\n in the demo tokenizer: agrees in both renders
    assert _common(p1, p2) == _gen_start(warm, m1, enable_thinking=thinking) + header
    assert r2.cached_tokens == _gen_start(warm, m1, enable_thinking=thinking)
    assert r2.timings.prefill_tokens <= len(p2) - _common(p1, p2) + header


def test_same_request_twice_mlx_lm_1215(warm, cold):
    """mlx-lm #1215: the same request again computes one token (the last, whose logits pick
    the first output) and gives the same output."""
    m = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Speak."}]
    a = warm.chat(m, **GREEDY)
    b = warm.chat(m, **GREEDY)
    assert b.timings.prefill_tokens == 1 and b.cached_tokens == b.prompt_tokens - 1
    assert a.token_ids == b.token_ids == _cold(cold, m).token_ids


def test_new_chat_same_system_prompt_mlx_lm_975(warm, cold):
    """mlx-lm #975: a new chat with the same system prompt reuses exactly the system
    message and nothing of the previous chat."""
    sysmsg = {"role": "system", "content": SYSTEM}
    warm.chat([sysmsg, {"role": "user", "content": "First question, about kings."}], **GREEDY)
    m = [sysmsg, {"role": "user", "content": "A different question."}]
    r = warm.chat(m, **GREEDY)
    ids = warm.tokenizer.encode_chat(m, add_generation_prompt=True)
    system_end = [i for i, t in enumerate(ids) if t == warm.im_start][1]
    assert r.cached_tokens == system_end
    reused = [e for e in warm.prompt_cache.entries() if e.length == system_end]
    assert len(reused) == 1 and reused[0].tokens.tolist() == ids[:system_end]
    assert r.token_ids == _cold(cold, m).token_ids


def test_warm_then_tiny_prompt_llama_cpp_22450(warm, cold):
    """llama.cpp #22450: after long conversations a tiny unrelated prompt gets exactly the
    cold output (no stray state)."""
    for topic in ("the storm", "the crown"):
        m = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell of {topic}."}]
        r = warm.chat(m, **GREEDY)
        warm.chat(m + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "More."}], **GREEDY)
    r = warm.generate("A", **GREEDY)
    cold.reset()
    c = cold.generate("A", **GREEDY)
    assert r.cached_tokens == 0 and r.token_ids == c.token_ids


def test_remember_a_fact_llama_cpp_21831(warm, cold):
    """llama.cpp #21831: a fact given in turn 1 is asked for in turn 2; the reused state
    gives the cold engine's log-probabilities for every generated token (the demo model's level of
    ability: what matters is the state, not the answer)."""
    m1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "My name is Horatio. Remember it."}]
    r1 = warm.chat(m1, **GREEDY)
    m2 = m1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "What is my name?"}]
    kw = {"logprobs": True, "top_logprobs": 5}
    r2 = warm.chat(m2, **GREEDY, **kw)
    assert r2.cached_tokens > 0
    c2 = _cold(cold, m2, **kw)
    assert r2.token_ids == c2.token_ids
    for a, b in zip(r2.logprobs, c2.logprobs):
        # the same ids; the values to float32 rounding (numpy's matmul sums in an order that
        # depends on the number of rows of a prefill piece, so a split prompt differs in ulps)
        assert a.token_id == b.token_id and [i for i, _ in a.top] == [i for i, _ in b.top]
        np.testing.assert_allclose([a.logprob] + [v for _, v in a.top], [b.logprob] + [v for _, v in b.top],
                                   rtol=0, atol=2e-5)


def test_interleaved_conversations_reuse_their_own_prefix(warm, cold):
    """An agent and its sub-agent alternate A, B, A, B: each turn 2 reuses its own turn 1."""
    convs = {k: [{"role": "system", "content": f"{SYSTEM} You are agent {k}."},
                 {"role": "user", "content": f"Task for {k}."}] for k in "AB"}
    for k in "AB":
        r = warm.chat(convs[k], **GREEDY)
        convs[k] = convs[k] + [{"role": "assistant", "content": r.text}]
    for k in "AB":
        first = convs[k][:2]
        m = convs[k] + [{"role": "user", "content": "Go on."}]
        r = warm.chat(m, **GREEDY)
        assert r.cached_tokens == _gen_start(warm, first)
        assert r.token_ids == _cold(cold, m).token_ids


def test_eviction_under_small_budget_never_wrong(demo_path, cold):
    """A budget of about two snapshots: entries are evicted, the cache never exceeds its
    budget, and every answer is the cold one."""
    probe = Engine.load(device="reference")
    probe.chat([{"role": "user", "content": "x"}], **GREEDY)
    one = max(e.nbytes for e in probe.prompt_cache.entries())
    eng = Engine.load(device="reference", prompt_cache_bytes=int(2.5 * one))
    for i, k in enumerate("ABAB"):
        m = [{"role": "system", "content": f"Agent {k}."}, {"role": "user", "content": f"Step {i}."}]
        r = eng.chat(m, **GREEDY)
        assert r.token_ids == _cold(cold, m).token_ids
        cache = eng.prompt_cache
        assert cache.nbytes <= cache.max_bytes
        assert cache.nbytes == sum(e.nbytes for e in cache.entries())
    assert eng.prompt_cache.stats.evictions > 0


def test_failed_restore_leaves_engine_usable(warm, cold, monkeypatch):
    m = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Speak."}]
    warm.chat(m, **GREEDY)
    n = len(warm.prompt_cache)

    def broken(state):
        raise InvalidParameterError("restore failed (injected)")

    monkeypatch.setattr(warm.backend, "restore", broken)
    warm.reset()
    r = warm.chat(m, **GREEDY)
    assert r.cached_tokens == 0 and r.token_ids == _cold(cold, m).token_ids
    assert len(warm.prompt_cache) <= n  # the bad entry is gone (new ones may have been taken)
    monkeypatch.undo()
    assert warm.chat(m, **GREEDY).token_ids == r.token_ids


def _entries_consistent(engine, cold) -> None:
    """Every entry's state is the state of its tokens: the next token's logits agree with a
    cold prefill of the same tokens."""
    for e in engine.prompt_cache.entries():
        engine.backend.restore(e.state)
        got = engine.backend.forward(np.array([7]), all_logits=False)
        cold.reset()
        want = cold.prefill(e.tokens.tolist() + [7])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    engine.reset()


def test_cancellation_mid_prefill_keeps_cache_consistent(warm, cold, monkeypatch):
    """Cancelled between prefill pieces: the snapshots taken so far are valid, the next
    request reuses them and answers as cold."""
    m = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Speak of the war."}]
    cancel = threading.Event()
    prefill = warm.backend.prefill  # the engine's prefill pieces (Backend.prefill, no logits)

    def prefill_then_cancel(tokens):
        prefill(tokens)
        cancel.set()  # after the first piece (the system message)

    monkeypatch.setattr(warm.backend, "prefill", prefill_then_cancel)
    r = warm.chat(m, cancel=cancel, **GREEDY)
    monkeypatch.undo()
    assert r.finish_reason == "cancelled" and r.completion_tokens == 0
    assert len(warm.prompt_cache) == 1  # the system message, nothing half-done
    _entries_consistent(warm, cold)
    r = warm.chat(m, **GREEDY)
    assert r.cached_tokens > 0 and r.token_ids == _cold(cold, m).token_ids
    _entries_consistent(warm, cold)


def test_snapshot_points():
    ims = 9
    p = [ims, 1, 2, ims, 3, 4, ims, 5, 6]
    assert snapshot_points(p, 0, ims) == [3, 6, 8]
    assert snapshot_points(p, 6, ims) == [8]
    assert snapshot_points([1, 2, 3], 0, None) == [2]
    assert snapshot_points([1], 0, ims) == []


def test_budget_and_accounting():
    with pytest.raises(InvalidParameterError):
        PromptCache(-1)
    cache = PromptCache(1000)

    class State:
        def __init__(self, n):
            self.nbytes = n

    assert cache.insert([1, 2], State(400))
    assert cache.insert([1, 2, 3], State(400))
    assert cache.nbytes == 400 + 8 + 400 + 12
    assert cache.lookup([1, 2, 3, 4], 3).length == 3
    assert cache.insert([5], State(400))  # evicts the least recently used: [1, 2]
    assert [e.length for e in cache.entries()] == [3, 1]
    assert not cache.insert([6], State(2000))  # too large alone: nothing evicted
    assert len(cache) == 2 and cache.stats.evictions == 1
    assert cache.lookup([1, 2, 3], 2) is None  # the limit keeps one token to compute


def test_native_snapshot_bytes_formula():
    """The documented memory formula: 20 KiB per token plus 66.4 MB for Qwen3.6-35B-A3B
    (the recurrent state with its pending decay c per row), and the simulator's real
    snapshots of the demo model."""
    from lily.checkpoint import load_config
    from lily.engine import default_model_path
    cfg, _ = load_config(default_model_path())
    full = cfg.__class__(**{**cfg.__dict__, "num_hidden_layers": 40, "layer_types": tuple(
        "full_attention" if i % 4 == 3 else "linear_attention" for i in range(40)),
        "num_key_value_heads": 2, "linear_num_key_heads": 16, "linear_num_value_heads": 32})
    per_token = native_snapshot_bytes(full, 1) - native_snapshot_bytes(full, 0)
    assert per_token == 20 * 1024
    assert native_snapshot_bytes(full, 0) == 30 * (32 * 128 * (128 + 1) * 4 + 3 * 8192 * 4) == 66_355_200


@pytest.fixture(scope="module")
def sim_engines():
    return (Engine.load(device="sim", max_context=256),
            Engine.load(device="sim", max_context=256, prompt_cache_bytes=0))


def test_sim_turn2_and_repeat_match_cold(sim_engines):
    """The native path (pipelined generation, device snapshots): turn 2 reuses turn 1, a
    repeat computes one token, outputs equal a cold native engine; the snapshot sizes are
    the formula's."""
    warm, cold = sim_engines
    m1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who?"}]
    r1 = warm.chat(m1, **GREEDY)
    assert warm.position == len(warm.tokens)
    m2 = m1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "Why?"}]
    r2 = warm.chat(m2, **GREEDY)
    assert r2.cached_tokens == _gen_start(warm, m1)
    assert r2.token_ids == _cold(cold, m2).token_ids
    r3 = warm.chat(m2, **GREEDY)
    assert r3.timings.prefill_tokens == 1 and r3.token_ids == r2.token_ids
    for e in warm.prompt_cache.entries():
        assert e.nbytes == native_snapshot_bytes(warm.config, e.length) + 4 * e.length


def test_save_load_round_trip_and_refusals(sim_engines, tmp_path, warm, cold):
    sim, sim_cold = sim_engines
    m = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who?"}]
    ids = sim.tokenizer.encode_chat(m, add_generation_prompt=True)
    system_end = [i for i, t in enumerate(ids) if t == sim.im_start][1]
    fresh = Engine.load(device="sim", max_context=256)
    fresh.cache_prompt(ids[:system_end])
    path = tmp_path / "system.lilycache"
    assert fresh.save_prompt_cache(path) == 1
    loaded = Engine.load(device="sim", max_context=256)
    assert loaded.load_prompt_cache(path) == 1
    r = loaded.chat(m, **GREEDY)
    assert r.cached_tokens == system_end and r.token_ids == _cold(sim_cold, m).token_ids
    assert all(e.pinned for e in loaded.prompt_cache.entries() if e.length == system_end)

    # another device kind
    with pytest.raises(PromptCacheError, match="device differs.*'sim'.*'reference'"):
        warm.load_prompt_cache(path)
    assert len(warm.prompt_cache) == 0
    # a damaged file: nothing loaded
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    bad = tmp_path / "bad.lilycache"
    bad.write_bytes(bytes(data))
    empty = Engine.load(device="sim", max_context=256)
    with pytest.raises(PromptCacheError, match="damaged"):
        empty.load_prompt_cache(bad)
    bad.write_bytes(bytes(data[:100]))
    with pytest.raises(PromptCacheError, match="not a readable"):
        empty.load_prompt_cache(bad)
    assert len(empty.prompt_cache) == 0
    # a smaller context window than the entries, and a budget too small
    with pytest.raises(PromptCacheError, match="context window"):
        Engine.load(device="sim", max_context=8).load_prompt_cache(path)
    with pytest.raises(PromptCacheError, match="budget"):
        Engine.load(device="sim", max_context=256, prompt_cache_bytes=1000).load_prompt_cache(path)


def test_version_1_file_refused(tmp_path, monkeypatch):
    """A file of format version 1 (native recurrent state without the pending decay c, a
    smaller part) is refused by its version, naming both versions; nothing is loaded."""
    from lily import prompt_cache
    old = Engine.load(device="sim", max_context=64)
    old.cache_prompt("To be, or not")
    path = tmp_path / "v1.lilycache"
    monkeypatch.setattr(prompt_cache, "FORMAT_VERSION", 1)
    old.save_prompt_cache(path)
    monkeypatch.undo()
    fresh = Engine.load(device="sim", max_context=64)
    with pytest.raises(PromptCacheError, match="format version 1, this Lily reads version 2"):
        fresh.load_prompt_cache(path)
    assert len(fresh.prompt_cache) == 0


def test_reference_file_from_another_model(warm, tmp_path, monkeypatch):
    from lily import prompt_cache
    warm.cache_prompt("To be, or not")
    path = tmp_path / "ref.lilycache"
    real = prompt_cache.model_identity

    def other(engine):
        ident = real(engine)
        ident["model"]["hidden_size"] += 1
        ident["quantization"]["bits"] = 8
        return ident

    monkeypatch.setattr(prompt_cache, "model_identity", other)
    warm.save_prompt_cache(path)
    monkeypatch.undo()
    fresh = Engine.load(device="reference")
    with pytest.raises(PromptCacheError, match="model differs: hidden_size.*quantization differs: bits"):
        fresh.load_prompt_cache(path)
    assert len(fresh.prompt_cache) == 0
    ok = tmp_path / "ok.lilycache"
    warm.save_prompt_cache(ok)
    assert fresh.load_prompt_cache(ok) == len(warm.prompt_cache)
    r = fresh.generate("To be, or not to be", **GREEDY)
    assert r.cached_tokens == len(fresh.tokenizer.encode("To be, or not"))


def test_server_reports_cached_tokens_and_health(warm, caplog):
    """Chat completions report usage.prompt_tokens_details.cached_tokens (streaming usage
    chunk too); /health shows the cache; one log line per request names cached/computed."""
    import json
    import logging

    from fastapi.testclient import TestClient

    from lily.server import create_app

    body = {"model": "lily-demo-shakespeare", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hail."}]}
    with TestClient(create_app(warm)) as client, caplog.at_level(logging.INFO, logger="lily.server"):
        first = client.post("/v1/chat/completions", json=body).json()
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        second = client.post("/v1/chat/completions", json=body).json()
        n = second["usage"]["prompt_tokens"]
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": n - 1}
        lines = client.post("/v1/chat/completions", json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}}).text
        chunks = [json.loads(x[6:]) for x in lines.splitlines() if x.startswith("data: {")]
        assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": n - 1}
        health = client.get("/health").json()["prompt_cache"]
        assert health["entries"] == len(warm.prompt_cache) and health["hits"] == 2
        assert health["bytes"] == warm.prompt_cache.nbytes
    assert any(f"({n - 1} cached, 1 computed)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("shared", [False, True])
def test_prompt_cache_key_hint_evicts_superseded_first(shared):
    """OpenAI's prompt_cache_key: a conversation's entry that its own later entry extends
    is evicted before another conversation's older one, unless another key reused it;
    lookups never depend on the key."""

    class State:
        nbytes = 400

    cache = PromptCache(3 * 404 + 16)
    cache.insert([9], State())                      # conversation X, the oldest
    cache.insert([1], State(), key="A")
    if shared:
        assert cache.lookup([1, 5], 1, key="B").length == 1  # a sub-agent B reuses it
    cache.insert([1, 2], State(), key="A")          # A's next turn extends [1]
    assert cache.lookup([1, 2, 3], 3, key="Z").length == 2  # the key never decides reuse
    cache.insert([7], State())                      # room for one more: one eviction
    left = sorted(e.tokens.tolist() for e in cache.entries())
    assert left == ([[1], [1, 2], [7]] if shared else [[1, 2], [7], [9]])


def test_cli_cache_prompt_then_chat_reuses_system(tmp_path, cold):
    """`lily cache-prompt` writes the system message as every conversation starts with it."""
    from lily.cli import main
    path = tmp_path / "sys.lilycache"
    assert main(["cache-prompt", "--device", "reference", str(path), "--system", SYSTEM]) == 0
    eng = Engine.load(device="reference")
    assert eng.load_prompt_cache(path) == 1
    m = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hail."}]
    ids = eng.tokenizer.encode_chat(m, add_generation_prompt=True)
    r = eng.chat(m, **GREEDY)
    assert r.cached_tokens == [i for i, t in enumerate(ids) if t == eng.im_start][1]
    assert r.token_ids == _cold(cold, m).token_ids
    assert main(["cache-prompt", "--device", "reference", str(path)]) == 1  # nothing to cache: a clear error, exit 1


def test_cli_cache_prompt_tools_are_reused_by_a_chat_request(tmp_path):
    """A tools file in its own key order, with nulls, caches the tokens a chat completions
    request with the same tools renders (both go through lily.structured.template_tools)."""
    import json

    fastapi = pytest.importorskip("fastapi")  # noqa: F841
    from fastapi.testclient import TestClient

    from lily.cli import main
    from lily.server import create_app
    params = {"type": "object", "properties": {"loud": {"type": "boolean"}}, "required": ["loud"]}
    spec = tmp_path / "tools.json"
    spec.write_text(json.dumps([{"function": {"parameters": params, "strict": True, "description": None,
                                              "name": "ring_bell"}, "type": "function"}]))
    path = tmp_path / "tools.lilycache"
    assert main(["cache-prompt", "--device", "reference", str(path), "--system", SYSTEM, "--tools", str(spec)]) == 0
    eng = Engine.load(device="reference")
    assert eng.load_prompt_cache(path) == 1
    held = len(next(iter(eng.prompt_cache.entries())).tokens)
    tools = [{"type": "function", "function": {"name": "ring_bell", "parameters": params, "strict": True}}]
    with TestClient(create_app(eng, model_name="demo")) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": SYSTEM},
                                                              {"role": "user", "content": "Hail."}],
                                                 "tools": tools, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == held


def test_agent_bench_scenario(cold):
    """`lily bench --agent` on a small conversation: every later turn computes only its new
    tokens plus the generation prompt's header, and the outputs equal the cold runs."""
    from lily.lab import agent_bench
    rep = agent_bench.run(Engine.load(device="reference"), cold, system_tokens=64, turns=2, turn_tokens=40, max_tokens=2, tools=1)
    later = rep["turns"][1:]
    assert all(r["computed"] <= r["new_tokens"] + 5 and r["reuse"] >= 0.95 for r in later)
    assert all(r["cold_computed"] == r["prompt_tokens"] for r in rep["turns"])
    assert rep["summary"]["outputs_identical"]
    assert "outputs identical: True" in agent_bench.format_report(rep)


def _chat(args, monkeypatch, capsys, lines="Hail.\n/stats\n\n"):
    """`lily chat ARGS` in this process on the demo model: (exit code, stderr)."""
    import io

    from lily.cli import main
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    code = main(["chat", "-n", "2", "-t", "0", "--device", "reference", *args])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def cache_files(tmp_path_factory):
    """Files of `lily cache-prompt`: SYSTEM, SYSTEM with a tool, and a raw prompt."""
    from lily.cli import main
    d = tmp_path_factory.mktemp("cachefiles")
    tools = d / "tools.json"
    tools.write_text('[{"type": "function", "function": {"name": "ring_bell", "parameters": {"type": "object"}}}]')
    files = {"system": d / "sys.lilycache", "tools": d / "tools.lilycache", "raw": d / "raw.lilycache"}
    assert main(["cache-prompt", "--device", "reference", str(files["system"]), "--system", SYSTEM]) == 0
    assert main(["cache-prompt", "--device", "reference", str(files["tools"]), "--system", SYSTEM, "--tools", str(tools)]) == 0
    assert main(["cache-prompt", "--device", "reference", str(files["raw"]), "--prompt", "ROMEO. Good morrow"]) == 0
    return files


@pytest.mark.parametrize("case, args, needle", [
    ("system", ["--system", "You are a pirate."],
     "written for another system prompt: the file has '...You are a careful assistant.<|im_end|>\\n' (15 tokens), "
     "this chat '...You are a pirate.<|im_end|>\\n' ("),
    ("system", [], "written for a system prompt (15 tokens), this chat has none: the file has "
                   "'<|im_start|>system\\nYou are a careful ass...'; give the same --system;"),
    ("tools", ["--system", SYSTEM], "the file holds tool definitions, which lily chat cannot give"),
    ("raw", ["--system", SYSTEM], "written for a raw prompt (lily cache-prompt --prompt)"),
])
def test_cli_chat_says_when_its_cache_file_cannot_be_reused(cache_files, monkeypatch, capsys, case, args, needle):
    """`lily chat --prompt-cache-file F` whose conversation cannot start from F's snapshots
    (another --system, none, tools, a raw prompt) says so in one line, names both sides, and
    chats anyway without reusing anything."""
    path = cache_files[case]
    code, err = _chat(["--prompt-cache-file", str(path), *args], monkeypatch, capsys)
    assert code == 0, err
    warning = [ln for ln in err.splitlines() if ln.startswith("lily: warning: ")]
    assert len(warning) == 1 and warning[0].startswith(f"lily: warning: {path}: written for "), err
    assert needle in warning[0] and warning[0].endswith("not reused, running without it")
    assert "loaded" not in err and "0 prompt tokens reused" in err


def test_cli_chat_with_its_cache_file_reuses_it(cache_files, monkeypatch, capsys):
    code, err = _chat(["--prompt-cache-file", str(cache_files["system"]), "--system", SYSTEM], monkeypatch, capsys)
    assert code == 0, err
    assert f"lily: loaded 1 prompt cache entry from {cache_files['system']}" in err and "warning" not in err
    assert re.search(r"; [1-9]\d* prompt tokens reused", err), err


def test_cli_chat_refuses_another_models_cache_file(cache_files, monkeypatch, capsys, tmp_path):
    """A file of another model is an error before the chat starts (exit 1, the same
    'FILE: written for another ...: the file has ..., this ...' shape), not a warning."""
    from lily import prompt_cache
    from lily.cli import main
    real = prompt_cache.model_identity
    monkeypatch.setattr(prompt_cache, "model_identity",
                        lambda e: {**real(e), "model": {**real(e)["model"], "num_hidden_layers": 99}})
    path = tmp_path / "other.lilycache"
    assert main(["cache-prompt", "--device", "reference", str(path), "--system", SYSTEM]) == 0
    monkeypatch.setattr(prompt_cache, "model_identity", real)
    capsys.readouterr()
    code, err = _chat(["--prompt-cache-file", str(path), "--system", SYSTEM], monkeypatch, capsys)
    assert code == 1
    assert f"lily: error: {path}: written for another model or device: model differs: " \
           "num_hidden_layers=99 (this engine: " in err and "lily chat -" not in err


def test_cli_cache_mismatch_same_text_other_rendering():
    """A file whose snapshot holds the chat's system message as the same text but other
    tokens (another chat template or tokenizer) is named as such, and dropped."""
    from types import SimpleNamespace

    from lily.cli import _cache_mismatch, _system_prefix
    eng = Engine.load(device="reference")
    start = _system_prefix(eng, SYSTEM, None)
    text = eng.tokenizer.decode(start)
    cut = text.index("careful") + 3
    other = eng.tokenizer.encode(text[:cut]) + eng.tokenizer.encode(text[cut:])
    assert other != start and eng.tokenizer.decode(other) == text
    eng.prompt_cache.insert(other, SimpleNamespace(nbytes=0), pinned=True)
    assert _cache_mismatch(eng, start) == ("written for the same system prompt rendered differently "
                                           "(another chat template or tokenizer)")
    assert len(eng.prompt_cache) == 0
    eng.prompt_cache.insert(start[:-1], SimpleNamespace(nbytes=0), pinned=True)
    assert _cache_mismatch(eng, start) is None and len(eng.prompt_cache) == 1  # a prefix: reused, kept
