"""Reference engine vs the MLX-LM peer on the CPU (docs/verification.md).

Two comparisons per checkpoint (the embedded trained demo model and both random presets):

* against MLX-LM with float32 activations (same dequantized weights): the math must agree
  to float32 rounding (relative L2 error of logits < 1e-4) and greedy decoding must be
  identical token for token;
* against stock MLX-LM (bf16 activations), the teacher-forced protocol over >= 192
  positions of a prompt rendered through the real chat template: top-1 agreement and
  perplexity ratio, plus last-position logits within a stated relative error. bf16
  rounding moves logits by a few percent, so greedy tokens are compared only where the
  peer's top-1/top-2 margin is clearly above that noise.
"""

from __future__ import annotations

import numpy as np
import pytest

from lily.engine import Engine
from peer import load_peer, peer_greedy, peer_logits, rel_err, teacher_forced

MIN_POSITIONS = 192

# bf16 peer thresholds, set below what was measured over 200 positions (demo 0.88,
# tiny 0.80, dims 0.75 top-1 agreement; perplexity ratios 0.999-1.013). Random weights
# give many near-ties, so their agreement is lower; the float32 test above is the sharp one.
TOP1_MIN = {"demo": 0.85, "tiny": 0.74, "dims": 0.70}
PPL_RATIO_TOL = 0.02
LAST_LOGITS_REL_ERR = 0.10
CLEAR_MARGIN = 0.75  # logits; bf16 noise moves single logits by up to ~0.4 here
# The native prefill against the float32 reference: bf16 KV cache (as MLX-LM) and bfloat
# GEMM and attention operands (nothing is clipped; docs/prefill.md, "Operand precision");
# measured 1.54e-2 on tiny, 1.29e-2 on dims (relative L2 error of all-position logits; 6.0e-3
# on dims with half operands, 1.5e-4 with fp32 ones).
NATIVE_REL_ERR = 3e-2


def _conversation(engine: Engine) -> list[int]:
    text = (
        "Now is the winter of our discontent made glorious summer by this sun of York; "
        "and all the clouds that lour'd upon our house in the deep bosom of the ocean buried. "
        "Now are our brows bound with victorious wreaths, our bruised arms hung up for monuments, "
        "our stern alarums changed to merry meetings, our dreadful marches to delightful measures. "
    )
    messages = [
        {"role": "system", "content": "You are a careful assistant. Answer in verse when asked."},
        {"role": "user", "content": "Continue this speech in the same style:\n" + text},
        {"role": "assistant", "content": text * 2},
        {"role": "user", "content": "Once more, with feeling: " + text},
    ]
    ids = engine.tokenizer.encode_chat(messages, add_generation_prompt=True)
    assert len(ids) > MIN_POSITIONS, len(ids)
    # The peer's CPU lm_head over 248,320 rows costs ~0.2 s per position: keep 200.
    return ids[:MIN_POSITIONS + 9]


@pytest.fixture(scope="module", params=["demo", "tiny", "dims"])
def case(request, demo_path):
    path = demo_path if request.param == "demo" else request.getfixturevalue(f"{request.param}_checkpoint")
    engine = Engine.load(path, device="reference")
    ids = _conversation(engine)
    ref = engine.prefill(ids, all_logits=True)
    engine.reset()
    return request.param, path, engine, ids, ref


def test_matches_float32_peer(case):
    name, path, engine, ids, ref = case
    model, _ = load_peer(path, float32=True)
    peer = peer_logits(model, ids)
    err = rel_err(ref, peer)
    assert err < 1e-4, f"{name}: relative L2 error {err:.2e} vs float32 MLX-LM"
    assert (ref.argmax(-1) == peer.argmax(-1)).mean() > 0.99


_bf16_peer: dict = {}


def _bf16_peer_logits(path, ids):
    key = (str(path), tuple(ids))
    if key not in _bf16_peer:
        model, _ = load_peer(path)
        _bf16_peer[key] = peer_logits(model, ids)
    return _bf16_peer[key]


def test_teacher_forced_vs_bf16_peer(case):
    name, path, engine, ids, ref = case
    peer = _bf16_peer_logits(path, ids)
    n = len(ids) - 1
    assert n >= MIN_POSITIONS
    stats = teacher_forced(ref[:-1], peer[:-1], np.asarray(ids[1:]))
    print(f"\n{name}: {n} positions, {stats}")
    assert stats["top1_agreement"] >= TOP1_MIN[name], stats
    assert abs(stats["ppl_ratio"] - 1.0) < PPL_RATIO_TOL, stats
    last = rel_err(ref[-1], peer[-1])
    assert last < LAST_LOGITS_REL_ERR, f"{name}: last-position relative error {last:.3f}"


@pytest.mark.parametrize("prompt", ["ROMEO.\n", "KING HENRY.\nWhat news", "To be, or not to be"])
def test_demo_greedy_identical_to_float32_peer(demo_path, prompt):
    engine = Engine.load(demo_path, device="reference")
    ids = engine.tokenizer.encode(prompt)
    model, _ = load_peer(demo_path, float32=True)
    expected = peer_greedy(model, ids, 48)
    got = engine.generate(ids, max_tokens=48, temperature=0.0, ignore_eos=True).token_ids
    assert got == expected, engine.tokenizer.decode(got) + " || " + engine.tokenizer.decode(expected)


def test_demo_greedy_vs_bf16_peer_where_margin_is_clear(demo_path):
    """Follow the stock peer's greedy path; wherever its top-1 margin is clear, the
    reference must choose the same token (near-ties are bf16 noise, reported only)."""
    engine = Engine.load(demo_path, device="reference")
    model, _ = load_peer(demo_path)
    ids = engine.tokenizer.encode("ROMEO.\n")
    path = ids + peer_greedy(model, ids, 96)
    ref = engine.prefill(path, all_logits=True)[len(ids) - 1:-1]
    peer = peer_logits(model, path)[len(ids) - 1:-1]
    top2 = np.sort(peer, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > CLEAR_MARGIN
    agree = ref.argmax(-1) == peer.argmax(-1)
    print(f"\nclear-margin positions {clear.sum()}/{len(clear)}, agreement overall {agree.mean():.3f}")
    assert clear.sum() >= 16
    assert agree[clear].all()


@pytest.mark.skipif("sim" not in __import__("lily._core", fromlist=["x"]).compiled_devices(),
                    reason="simulator not built")
def test_native_sim_teacher_forced(case):
    """The native path on the simulator (chunked prefill: 201 tokens in chunks of 64, so
    three chunk boundaries inside the prompt), same protocol: it must track the reference
    (bf16 KV cache and bfloat operands: relative error < NATIVE_REL_ERR) and agree with
    MLX-LM as well as the reference does."""
    name, path, engine, ids, ref = case
    native = Engine.load(path, device="sim", max_context=len(ids) + 1, device_options={"prefill_chunk": 64})
    nat = native.prefill(ids, all_logits=True)
    err = rel_err(nat, ref)
    assert err < NATIVE_REL_ERR, f"{name}: native vs reference relative error {err:.2e}"
    peer = _bf16_peer_logits(path, ids)
    stats = teacher_forced(nat[:-1], peer[:-1], np.asarray(ids[1:]))
    print(f"\n{name} (sim): {len(ids) - 1} positions, {stats}")
    assert stats["top1_agreement"] >= TOP1_MIN[name], stats
    assert abs(stats["ppl_ratio"] - 1.0) < PPL_RATIO_TOL, stats


@pytest.mark.parametrize("prompt", ["ROMEO.\n", "KING HENRY.\nWhat news", "To be, or not to be"])
def test_demo_sim_greedy_identical_to_float32_peer(demo_path, prompt):
    """Pipelined greedy generation on the simulator (GPU token hand-off) reproduces MLX-LM's
    float32 greedy text token for token (stock bf16 MLX-LM diverges from any float32 engine
    within a few tokens on this model: see docs/verification.md)."""
    if "sim" not in __import__("lily._core", fromlist=["x"]).compiled_devices():
        pytest.skip("simulator not built")
    engine = Engine.load(demo_path, device="sim", max_context=128)
    ids = engine.tokenizer.encode(prompt)
    model, _ = load_peer(demo_path, float32=True)
    expected = peer_greedy(model, ids, 40)
    got = engine.generate(ids, max_tokens=40, temperature=0.0, ignore_eos=True).token_ids
    assert got == expected, engine.tokenizer.decode(got) + " || " + engine.tokenizer.decode(expected)
