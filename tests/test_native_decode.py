"""Native decode (csrc/runtime/decode.cpp + metal/*.metal) on the Metal simulator against
the numpy reference: logits, greedy tokens, the pipelined GPU token hand-off, the split-KV
attention path, hazard checking with shuffled stage order, and the record-only counters of
the full-size model.

Tolerance: the native step keeps activations in fp32 like the reference but stores the
KV cache in bf16 (as MLX-LM does), so logits differ by ~1e-3 relative; 5e-3 is the bound.
Prompts are fed as decode steps here (`forward(..., decode_steps=True)`): the prefill
kernels' bfloat operands have their own bound, tested in test_native_prefill.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from lily import _core
from lily.checkpoint import parse_config
from lily.engine import Engine
from lily.native_backend import default_state_window
from lily.lab.estimate import QWEN36_35B_A3B
from lily.lab.kernels.gdn import gdn_ring_entry

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

REL_TOL = 5e-3


def _ids(engine, n):
    text = "ROMEO.\nBut soft, what light through yonder window breaks? It is the east, and Juliet. " * 4
    ids = engine.tokenizer.encode(text)
    return ids[:n]


def _compare(native, ref, ids):
    nl = native.backend.runtime.forward(np.asarray(ids, dtype=np.uint32), "all", decode_steps=True)
    rl = ref.prefill(ids, all_logits=True)
    err = np.linalg.norm(nl - rl, axis=-1) / np.linalg.norm(rl, axis=-1)
    assert err.max() < REL_TOL, err
    top2 = np.sort(rl, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05
    assert (nl.argmax(-1) == rl.argmax(-1))[clear].all()
    return nl, rl


@pytest.mark.parametrize("which, n", [("demo", 20), ("tiny", 12), ("dims", 8)])
def test_native_logits_match_reference(which, n, demo_path, request, native_device):
    path = demo_path if which == "demo" else request.getfixturevalue(f"{which}_checkpoint")
    native = Engine.load(path, device=native_device, max_context=64)
    ref = Engine.load(path, max_context=64, device="reference")
    _compare(native, ref, _ids(ref, n))
    # Decode after prefill continues the same session.
    tok = 42
    np.testing.assert_allclose(native.decode(tok), ref.decode(tok), rtol=0, atol=REL_TOL * 50)


@pytest.mark.parametrize("block", [4, 0])
def test_split_attention_path(demo_path, native_device, block):
    """Lowered threshold: every step past 8 tokens uses split-KV attention + combine, with
    blocks of 4 rows (ragged last block) or chosen by context (0: one 32-row block here)."""
    native = Engine.load(demo_path, device=native_device, max_context=64,
                         device_options={"split_threshold": 8, "split_block": block})
    ref = Engine.load(demo_path, max_context=64, device="reference")
    _compare(native, ref, _ids(ref, 23))


def test_hazards_with_shuffled_stages(demo_path):
    """Random execution order within each barrier stage and of threadgroups, with every
    dispatch's writes checked against its declared ranges: same logits as forward order."""
    opts = {"device_options": {"order": "random", "thread_order": "random", "seed": 7, "verify_writes": True}}
    shuffled = Engine.load(demo_path, device="sim", max_context=32, device_options=opts)
    plain = Engine.load(demo_path, device="sim", max_context=32)
    ids = _ids(plain, 6)
    np.testing.assert_allclose(shuffled.prefill(ids, all_logits=True), plain.prefill(ids, all_logits=True),
                               rtol=1e-5, atol=1e-5)


def test_pipelined_greedy_matches_reference(demo_path, native_device):
    """GPU token hand-off with two command buffers in flight: the generated ids equal the
    reference's greedy choice at every position where its top-1 margin is clear."""
    native = Engine.load(demo_path, device=native_device, max_context=96)
    ref = Engine.load(demo_path, max_context=96, device="reference")
    prompt = _ids(ref, 8)
    native.prefill(prompt[:-1])
    before = native.position
    out = native.backend.generate_greedy(prompt[-1], 24, set())
    assert len(out) == 24 and native.position == before + 24
    logits = ref.prefill(prompt + out[:-1], all_logits=True)[len(prompt) - 1:]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05
    assert clear.sum() >= 12
    assert (logits.argmax(-1) == np.array(out))[clear].all()


def test_pipelined_stop_discards_one_speculative_step(demo_path, native_device):
    native = Engine.load(demo_path, device=native_device, max_context=64)
    prompt = _ids(native, 6)
    native.prefill(prompt[:-1])
    free = native.backend.generate_greedy(prompt[-1], 10, set())
    native.reset()
    native.prefill(prompt[:-1])
    stop = free[3]
    out = native.backend.generate_greedy(prompt[-1], 10, {stop})
    assert out == free[: free.index(stop) + 1]
    # The step encoded ahead of the stop ran and consumed the stop id; the session
    # continues from there exactly like a reference fed the same tokens.
    assert native.position in (len(prompt) + len(out) - 1, len(prompt) + len(out))
    ref = Engine.load(demo_path, max_context=64, device="reference")
    fed = (prompt + out)[: native.position]
    ref.prefill(fed)
    np.testing.assert_allclose(native.decode(7), ref.decode(7), rtol=0, atol=0.05)


def test_context_full_and_bad_tokens(demo_path, native_device):
    native = Engine.load(demo_path, device=native_device, max_context=4)
    with pytest.raises(Exception, match="context window"):
        native.prefill([1, 2, 3, 4, 5])
    assert native.position == 0
    with pytest.raises(Exception, match="outside the vocabulary"):
        native.prefill([1, 10**6])


REAL = QWEN36_35B_A3B  # the real model's dimensions (lily.lab.estimate)


def _minimum_bytes(cfg, context):
    """docs/model.md's per-token minimum: the active weights (embedding row, all non-expert
    linears and norms, k routed + the shared expert, lm_head) at 4 bits + bf16 scale/bias
    per 64 (8 bits for the router and shared-expert gate), the KV rows read and the new one
    written (bf16), and the GDN state (fp32): the conv state read and written, the recurrent
    state read every step and written back once per window of W steps, whose other W - 1
    steps each append a ring entry that the window's later steps read (on average (W - 1) / 2
    entries per step; docs/decode.md "The recurrent state's write-back window")."""
    from lily.checkpoint import expected_tensors
    total = 0
    for kind, name, shape in expected_tensors(cfg):
        *lead, out_f, in_f = shape if kind == "linear" else (1, *shape)
        bits = 8 if name.endswith((".mlp.gate", ".shared_expert_gate")) else 4
        per_row = in_f * bits // 8 + (in_f // 64) * 4
        if kind != "linear":
            total += int(np.prod(shape)) * (4 if kind == "f32" else 2)
        elif name == "model.embed_tokens":
            total += per_row
        elif ".switch_mlp." in name:
            total += cfg.num_experts_per_tok * out_f * per_row
        else:
            total += out_f * per_row
    kv = cfg.full_attention_layers.__len__() * cfg.num_key_value_heads * cfg.head_dim * 2 * 2 * (context + 1 + 1)
    gdn = cfg.num_hidden_layers - len(cfg.full_attention_layers)
    # the recurrent state with gdn_scan's pending decay per row (S = c S'), and the conv state
    W = default_state_window()
    S = cfg.gdn_state_floats * 4
    entry = gdn_ring_entry(cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                        cfg.linear_key_head_dim, cfg.linear_value_head_dim) * 4
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * 4
    state = gdn * (2 * conv + S + S / W + entry * (W - 1) / W + entry * (W - 1) / 2)
    return total, kv, state


@pytest.mark.parametrize("context", [200, 4096, 32768, 131072])
def test_full_size_decode_step_counters(context):
    """Record-only counting of one decode step of the real 40-layer model (docs/decode.md
    reports these numbers). Bytes moved (activations and split-attention partials included)
    must be within 5% of the docs/model.md minimum; from 256 rows on the attention is split so
    that its grid has >= 2x the 40 cores of an M5 Max in threadgroups, each KV row read by
    one threadgroup (8 query heads each)."""
    from lily.native_backend import count_decode_window
    cfg = parse_config(REAL)
    window = count_decode_window(cfg, context)  # one write-back window: the mean step
    c = window[0]
    weights, kv, state = _minimum_bytes(cfg, context + (len(window) - 1) / 2)
    moved = np.mean([s["weight_bytes"] + s["kv_bytes"] + s["state_bytes"] + s["activation_bytes"] for s in window])
    minimum = weights + kv + state
    assert np.mean([s["state_bytes"] for s in window]) == pytest.approx(state, rel=1e-12)
    assert len({(s["dispatches"], s["barrier_stages"]) for s in window}) == 1
    groups = [(r["label"], int(np.prod(r["groups"]))) for r in c["records"]]
    attn = [(label, n) for label, n in groups if "+ attention" in label]
    print(f"\ncontext {context}: {c['dispatches']} dispatches, {c['barrier_stages']} stages, "
          f"{moved / 1e9:.3f} GB moved vs minimum {minimum / 1e9:.3f} GB, "
          f"attention threadgroups {attn[0][1]}")
    assert 1 <= moved / minimum < 1.05
    assert abs(c["weight_bytes"] / weights - 1) < 0.01
    split = context >= 256
    # the greedy argmax: partials over 61 threadgroups, then the combine writes the token
    assert [n for _, n in groups[-2:]] == [61, 1]
    assert c["dispatches"] == 243 + 10 * split
    assert c["barrier_stages"] == 243 + 10 * split <= 260
    assert len(attn) == 10
    for _, n in attn:
        # one threadgroup per KV head (8 query heads each) per block; at most 128 in all (the
        # partials stay bounded), at least 2x the 40 cores from 4K rows on
        assert n == 2 if not split else (80 if context >= 4096 else 16) <= n <= 128


# ---- the engine's generation on the device (sampling on the GPU, pipelined) -------------


@pytest.fixture(scope="module")
def sim_engine(demo_path, native_device):
    return Engine.load(demo_path, device=native_device, max_context=128)


def test_engine_greedy_text_and_session(sim_engine, demo_engine):
    a = sim_engine.generate("ROMEO.\n", max_tokens=16, temperature=0.0)
    b = demo_engine.generate("ROMEO.\n", max_tokens=16, temperature=0.0)
    assert a.finish_reason == "length" and len(a.token_ids) == 16
    assert a.token_ids == b.token_ids  # clear margins on this prompt (see the margin test above)
    # The session holds the prompt and every token the device consumed.
    prompt = sim_engine.tokenizer.encode("ROMEO.\n")
    assert sim_engine.tokens == prompt + a.token_ids[:-1] == sim_engine.tokens[: sim_engine.position]


def test_engine_sampling_on_device_is_seeded(sim_engine):
    kw = dict(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, min_p=0.02)
    a = sim_engine.generate("JULIET.\n", seed=11, **kw)
    b = sim_engine.generate("JULIET.\n", seed=11, **kw)
    c = sim_engine.generate("JULIET.\n", seed=12, **kw)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_engine_logprobs_on_device(demo_engine, demo_path, native_device):
    """Logprobs computed on the device are the log-softmax (over the sampled vocabulary) of the
    device's own logits for the same prompt and tokens, and name the reference's tokens. Their
    values are checked against the device's logits, not the reference's: the prompt runs
    through the prefill kernels, whose bfloat operands move the logits by up to
    test_native_prefill.py's bound (0.047 in this first logprob). No prompt cache: a hit
    changes which tokens run as prefill and which as decode steps."""
    fresh = Engine.load(demo_path, device=native_device, max_context=128, prompt_cache_bytes=0)
    a = fresh.generate("ROMEO.\n", max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=3)
    b = demo_engine.generate("ROMEO.\n", max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=3)
    fresh.reset()
    steps = [fresh.prefill(fresh.tokenizer.encode("ROMEO.\n"))] + [fresh.decode(t) for t in a.token_ids[:-1]]
    for x, y, logits in zip(a.logprobs, b.logprobs, steps, strict=True):
        z = logits[: fresh.sample_vocab].astype(np.float64)
        lp = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
        assert x.token_id == y.token_id == int(lp.argmax())
        assert x.logprob == pytest.approx(lp[x.token_id], abs=1e-4)
        assert [i for i, _ in x.top] == [i for i, _ in y.top] == [int(i) for i in np.argsort(-lp)[:3]]
        assert [v for _, v in x.top] == pytest.approx([lp[i] for i, _ in x.top], abs=1e-4)


def test_engine_penalties_on_device_match_cpu_sampler(sim_engine, demo_engine):
    kw = dict(max_tokens=20, temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5)
    a = sim_engine.generate("ROMEO.\n", **kw)
    b = demo_engine.generate("ROMEO.\n", **kw)
    plain = sim_engine.generate("ROMEO.\n", max_tokens=20, temperature=0.0)
    assert a.token_ids != plain.token_ids
    assert a.token_ids[:8] == b.token_ids[:8]


def test_engine_stop_string_and_cancel_on_device(sim_engine):
    full = sim_engine.generate("ROMEO.\n", max_tokens=20, temperature=0.0).text
    stop = full[8:13]
    r = sim_engine.generate("ROMEO.\n", max_tokens=20, temperature=0.0, stop=[stop])
    assert r.finish_reason == "stop" and r.text == full[: full.index(stop)]
    import threading
    ev = threading.Event()
    gen = sim_engine.stream("ROMEO.\n", max_tokens=30, temperature=0.0, cancel=ev)
    next(gen)
    ev.set()
    assert list(gen)[-1].finish_reason == "cancelled"
    # Still usable, and the session continues consistently.
    assert sim_engine.generate("ROMEO.\n", max_tokens=3, temperature=0.0).completion_tokens == 3


def test_constrained_generation_samples_on_the_host(sim_engine, demo_engine):
    """A constrained request on a native device takes the host-sampling path (the logits
    come to the host each step) and matches the reference; unconstrained requests keep
    the GPU token hand-off and their results."""
    from lily.constraints import AllowedTokens
    allowed = demo_engine.tokenizer.encode(" the and of to a I")
    before = sim_engine.generate("ROMEO.\n", max_tokens=8, temperature=0.0)
    got = []
    for engine in (sim_engine, demo_engine):
        c = AllowedTokens(engine.config.vocab_size, allowed, length=6)
        got.append(engine.generate("ROMEO.\n", max_tokens=12, temperature=0.0, constraint=c))
    assert got[0].token_ids == got[1].token_ids and got[0].finish_reason == "stop"
    assert set(got[0].token_ids) <= set(allowed) and len(got[0].token_ids) == 6
    prompt = sim_engine.tokenizer.encode("ROMEO.\n")
    assert sim_engine.tokens == prompt + got[0].token_ids[:-1]  # the session holds what was fed
    assert sim_engine.generate("ROMEO.\n", max_tokens=8, temperature=0.0).token_ids == before.token_ids


def test_engine_logit_bias_on_device_matches_host_sampler(sim_engine, demo_engine):
    """logit_bias on the device samplers (greedy: argmax_partial_bias; with penalties or a
    temperature: sample_token) and on the host's (the reference): +100 on a token makes
    greedy pick it every step, -100 bans the greedy leaders, the same settings give the
    same tokens on both, a seeded draw with bans repeats and never shows a banned one, and
    the biased greedy step keeps the unbiased one's stages."""
    prompt = "ROMEO.\n"
    plain = demo_engine.generate(prompt, max_tokens=8, temperature=0.0).token_ids
    lift = next(t for t in demo_engine.tokenizer.encode(" the and of") if t not in plain)
    ban = {t: -100.0 for t in plain[:3]}
    greedy = dict(max_tokens=4, temperature=0.0)
    penalised = dict(greedy, repetition_penalty=1.3, presence_penalty=0.5)
    got = {}
    for name, engine in (("sim", sim_engine), ("ref", demo_engine)):
        got[name] = [engine.generate(prompt, logit_bias={lift: 100.0}, **greedy).token_ids,
                     engine.generate(prompt, logit_bias=ban, **greedy).token_ids,
                     engine.generate(prompt, logit_bias=ban, **penalised).token_ids]
    assert got["sim"] == got["ref"]
    forced, banned, banned_pen = got["sim"]
    assert forced == [lift] * 4
    assert not set(banned) & set(ban) and not set(banned_pen) & set(ban)
    sampled = dict(max_tokens=6, temperature=1.0, seed=5, logit_bias=ban)
    a, b = (sim_engine.generate(prompt, **sampled).token_ids for _ in range(2))
    assert a == b and not set(a) & set(ban)
    # the biased greedy step: argmax_partial_bias in argmax_partial's place, the same stages,
    # one more [V] float32 read (counted steps run on the session's state: reset after)
    rt = sim_engine.backend.runtime
    counts = []
    for bias in (None, {lift: 100.0}):
        sim_engine.generate(prompt, max_tokens=1, temperature=0.0, logit_bias=bias)
        counts.append(rt.count_step(sim_engine.position))
    sim_engine.reset()
    plain_c, biased_c = counts
    assert [r["kernel"] for r in biased_c["records"]][-2:] == ["argmax_partial_bias", "sample_greedy_combine"]
    assert biased_c["barrier_stages"] == plain_c["barrier_stages"]
    assert biased_c["declared_bytes_read"] - plain_c["declared_bytes_read"] == 4 * sim_engine.config.vocab_size
