"""Session snapshots on the native runtime (Engine.snapshot / restore on device="sim"): the
restored session continues exactly as the original, and a snapshot that does not fit is
refused without touching the session."""

from __future__ import annotations

import numpy as np
import pytest

from lily import Engine, _core
from lily.errors import InvalidParameterError

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")


def _sim(path, max_context=64, chunk=5, native_device="sim"):
    return Engine.load(path, device=native_device, max_context=max_context, device_options={"prefill_chunk": chunk})


def _prompt(engine, n):
    return engine.tokenizer.encode("ROMEO.\nWhat light through yonder window breaks? It is the east.")[:n]


@pytest.fixture(scope="module")
def sim_engine(demo_path, native_device):
    return _sim(demo_path, native_device=native_device)


def test_restore_continues_exactly(sim_engine):
    e = sim_engine
    e.reset()
    e.prefill(_prompt(e, 12))  # three prefill chunks
    snap = e.snapshot()
    a = e.decode(5)
    b = e.decode(6)
    e.prefill(_prompt(e, 7))
    for _ in range(2):  # a snapshot can be restored any number of times
        e.restore(snap)
        assert e.position == 12
        np.testing.assert_array_equal(e.decode(5), a)
        np.testing.assert_array_equal(e.decode(6), b)


def test_restore_then_pipelined_generation_matches_a_fresh_session(sim_engine, demo_path, native_device):
    e = sim_engine
    ids = _prompt(e, 14)
    e.reset()
    e.prefill(ids[:10])
    snap = e.snapshot()
    e.generate(ids[:3], max_tokens=5, temperature=0.0)  # another conversation in between
    e.restore(snap)
    r = e.generate(ids, max_tokens=6, temperature=0.0)
    assert r.timings.prefill_tokens == 4  # the restored prefix is reused
    want = _sim(demo_path, native_device=native_device).generate(ids, max_tokens=6, temperature=0.0)
    assert r.token_ids == want.token_ids


def test_snapshot_holds_only_the_rows_in_use(sim_engine):
    e = sim_engine
    c = e.config
    e.reset()
    e.prefill(_prompt(e, 4))
    s4 = e.snapshot()[0]
    e.decode(7)
    s5 = e.snapshot()[0]
    attn_layers = len(c.full_attention_layers)
    per_token = attn_layers * 2 * c.num_key_value_heads * c.head_dim * 2  # K and V rows, bf16
    assert s5.nbytes - s4.nbytes == per_token
    assert s4.position == 4 and s5.position == 5


def test_restore_into_another_engine_with_a_larger_context(sim_engine, demo_path, native_device):
    e = sim_engine
    e.reset()
    e.prefill(_prompt(e, 9))
    snap = e.snapshot()
    want = e.decode(11)
    other = _sim(demo_path, max_context=128, chunk=4, native_device=native_device)
    other.restore(snap)
    np.testing.assert_array_equal(other.decode(11), want)


def test_bad_snapshots_are_refused_and_the_session_kept(sim_engine, demo_path, tiny_checkpoint, native_device):
    e = sim_engine
    e.reset()
    e.prefill(_prompt(e, 6))
    keep = e.snapshot()

    long_ctx = _sim(demo_path, max_context=64, native_device=native_device)
    long_ctx.prefill(_prompt(long_ctx, 20))
    small = _sim(demo_path, max_context=16, native_device=native_device)
    with pytest.raises(InvalidParameterError, match="context window of 16"):
        small.restore(long_ctx.snapshot())

    tiny = _sim(tiny_checkpoint, native_device=native_device)
    tiny.prefill([1, 2, 3])
    with pytest.raises(InvalidParameterError, match="another model"):
        e.restore(tiny.snapshot())
    ref = Engine.load(demo_path, device="reference")
    ref.prefill([1, 2])
    with pytest.raises(InvalidParameterError, match="not a snapshot"):
        e.restore(ref.snapshot())
    with pytest.raises(InvalidParameterError, match="not an Engine snapshot"):
        e.restore("state")
    with pytest.raises(InvalidParameterError, match="not a snapshot"):
        ref.restore(keep)

    assert e.position == 6  # untouched by the refused restores
    want = e.decode(3)
    e.restore(keep)
    np.testing.assert_array_equal(e.decode(3), want)


def test_snapshot_is_held_in_device_memory(sim_engine):
    """Issue 13: a native snapshot is one device buffer (counted by the device's allocations),
    copied there and back on the device (the copies under the hazard checker:
    tests/sim/test_sim_device.py); restoring it twice gives identical logits, as does a copy
    uploaded from its saved bytes (a prompt cache file)."""
    e = sim_engine
    e.reset()
    dev = e.backend.device
    ids = _prompt(e, 12)
    e.prefill(ids[:9])
    before = dev.allocated_bytes
    snap = e.snapshot()
    state = snap[0]
    assert state.position == 9 and state.device_bytes == state.nbytes > 0
    assert dev.allocated_bytes - before == state.nbytes
    want = e.prefill(ids[9:])
    e.prefill(ids[:2])  # the session moves on; the snapshot does not
    logits = []
    for _ in range(2):
        e.restore(snap)
        logits.append(e.prefill(ids[9:]))
    np.testing.assert_array_equal(logits[0], want)
    np.testing.assert_array_equal(logits[1], want)
    loaded = _core.SessionSnapshot(state.position, state.parts(), dev)
    assert loaded.nbytes == state.nbytes and loaded.parts() == state.parts()
    e.restore((loaded, snap[1]))
    np.testing.assert_array_equal(e.prefill(ids[9:]), want)
    del snap, state, loaded
    assert dev.allocated_bytes == before


def test_snapshot_upload_on_a_record_only_device_is_refused(sim_engine):
    state = sim_engine.snapshot()[0]
    with pytest.raises(ValueError, match="record-only"):
        _core.SessionSnapshot(state.position, state.parts(), _core.sim_device(record_only=True))


def test_timings_carry_the_device_time_of_each_phase(sim_engine):
    """Timings.gpu_prefill_s / gpu_decode_s: the device's execution time of the command
    buffers of each phase (the simulator's own run time here), each counted once: together
    they are exactly what the runtime's total grew by; a device phase never outlasts its
    wall-clock phase. The reference device measures none."""
    from lily.constraints import AllowedTokens
    e = sim_engine
    e.reset()
    before = e.backend.runtime.gpu_seconds
    r = e.generate(list(range(3, 15)), max_tokens=4, temperature=0.0, ignore_eos=True)  # 12 tokens, chunks of 5
    t = r.timings
    # decode by about one step more at most: step 1 runs while the host still takes token 0
    assert 0 < t.gpu_prefill_s <= t.prefill_s and 0 < t.gpu_decode_s <= t.decode_s + 1.5 * t.gpu_decode_s / 3, t
    assert e.backend.runtime.gpu_seconds - before == pytest.approx(t.gpu_prefill_s + t.gpu_decode_s, rel=1e-12)
    # host-sampled (constrained): every step is a forward pass, split the same way
    before = e.backend.runtime.gpu_seconds
    r = e.generate([5, 6], max_tokens=3, temperature=0.0, constraint=AllowedTokens(e.config.vocab_size, [7, 8], 3))
    t = r.timings
    assert 0 < t.gpu_prefill_s <= t.prefill_s and 0 < t.gpu_decode_s <= t.decode_s, t  # host-sampled: no overlap
    assert e.backend.runtime.gpu_seconds - before == pytest.approx(t.gpu_prefill_s + t.gpu_decode_s, rel=1e-12)
    ref = Engine.load(device="reference").generate("ROMEO.", max_tokens=2, temperature=0.0).timings
    assert ref.gpu_prefill_s is None and ref.gpu_decode_s is None


def test_state_write_back_window_changes_no_result(demo_path, native_device):
    """The Gated DeltaNet state written back every 3 decode steps (state_window 3) against every
    step (1), through what a session does between write-backs: decode steps, pipelined sampled
    generation with logprobs, a snapshot, a prefill continuing the session (an agent's next
    turn) and a restore. Logits, tokens, logprobs and the snapshot's bytes are equal bit for bit."""
    every, windowed = (Engine.load(demo_path, device=native_device, max_context=64,
                                   device_options={"prefill_chunk": 5, "state_window": w}) for w in (1, 3))
    ids = every.tokenizer.encode("ROMEO.\nBut soft, what light through yonder window breaks? It is the east, and "
                                 "Juliet is the sun. Arise, fair sun, and kill the envious moon.")[:20]
    assert len(ids) == 20

    def session(e):
        out = [e.prefill(ids[:7])]
        out += [e.decode(t) for t in ids[7:11]]  # positions 7..10: a write-back at 8; 9, 10 pending
        out += [e.prefill(ids[11:13], all_logits=True)]  # the prefill first writes back what is pending
        out += [e.decode(t) for t in ids[13:16]]  # 15 pending
        # the session's tokens continued: ids[16:18] are prefilled behind the pending step
        r = e.generate(ids[:18], max_tokens=5, temperature=0.8, seed=5, logprobs=True, top_logprobs=2)
        assert r.timings.prefill_tokens == 2
        snap = e.snapshot()
        parts = snap[0].parts()
        out += [e.prefill(ids[18:20], all_logits=True), e.decode(ids[0])]  # the next turn
        e.restore(snap)
        out += [e.decode(ids[0])]
        return out, r, parts

    (a, ra, pa), (b, rb, pb) = session(every), session(windowed)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert ra.token_ids == rb.token_ids
    assert [t.logprob for t in ra.logprobs] == [t.logprob for t in rb.logprobs]
    assert len(pa) == len(pb)
    for x, y in zip(pa, pb):
        assert bytes(x) == bytes(y)


def test_state_window_bounds_and_ring_memory(demo_path, native_device):
    """1..64 steps per write-back; the ring holds W - 1 steps per DeltaNet layer, no more than the
    context (a window longer than the context never ends in it)."""
    for bad, msg in ((0, "state_window must be a positive integer, got 0"), (65, "state_window must be at most 64")):
        with pytest.raises(InvalidParameterError, match=msg):
            Engine.load(demo_path, device=native_device, max_context=64, device_options={"state_window": bad})

    def state_bytes(w, ctx):
        e = Engine.load(demo_path, device=native_device, max_context=ctx, device_options={"state_window": w})
        return e.backend.runtime.memory_use["state"], e.config
    (one, cfg), (sixteen, _), (short, _) = state_bytes(1, 64), state_bytes(16, 64), state_bytes(64, 8)
    entry = 4 * _core.gdn_ring_entry_floats(cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                            cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    gdn = cfg.num_hidden_layers - len(cfg.full_attention_layers)
    assert sixteen - one == gdn * 14 * entry  # W = 1 still binds one entry
    assert short - one == gdn * 7 * entry  # 8 positions: 8 entries at most
