"""Continuous batching (lily.scheduler.Scheduler; issue 31): rows decoding together give each
request the tokens it gets alone, bit for bit, on every device; a long prompt delays the
running rows by one bounded chunk per step (counted from the scheduler's trace, not timed);
a cancelled request frees its row; and the server streams several requests at once.

The demo model with few tokens keeps these cheap; the simulator cases are the slowest (a
decode step of a few rows takes about a second there)."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import openai
import pytest

from lily import Engine, _core
from lily.errors import InvalidParameterError, QueueFullError
from lily.server import create_app
from lily.structured import grammar_for_request
from test_server import Server

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo, Romeo", "To be, or not to be", "KING HENRY.\nOnce more unto the breach"]


def _load(device: str, **kw) -> Engine:
    return Engine.load(device=device, max_context=256, prompt_cache_bytes=0, **kw)


@pytest.fixture(scope="module")
def ref() -> Engine:
    return _load("reference")


@pytest.fixture(scope="module")
def sim() -> Engine:
    if "sim" not in _core.compiled_devices():
        pytest.skip("simulator not built")
    return _load("sim")


def _mixed(engine) -> list[dict]:
    """Per-request parameters of one batch: a constrained row (a JSON object, picked on the
    host), greedy, sampled (temperature, top-k, seed), greedy with logprobs and a penalty."""
    return [dict(temperature=0.0, constraint=grammar_for_request(format={"type": "json_object"})),
            dict(temperature=0.0),
            dict(temperature=0.9, top_k=20, seed=7),
            dict(temperature=0.0, logprobs=True, top_logprobs=2, repetition_penalty=1.3)]


@pytest.mark.parametrize("device", ["reference", "sim"])
def test_rows_equal_their_solo_runs(device, request):
    """Four requests with mixed sampling parameters and a constrained row decode together;
    each row's tokens (and logprobs) equal the same request run alone on the engine."""
    engine = request.getfixturevalue("ref" if device == "reference" else "sim")
    n = 4 if device == "sim" else 6
    kws = _mixed(engine)
    solo = [engine.generate(p, max_tokens=n, **kw) for p, kw in zip(PROMPTS, kws)]
    with engine.scheduler(max_batch=4) as batch:
        reqs = [batch.submit(p, max_tokens=n, **kw) for p, kw in zip(PROMPTS, kws)]
        batch.run_until_idle()
        got = [r.result() for r in reqs]
        steps = [e[1] for e in batch.trace if e[0] == "step"]
    host = [e[1] for e in batch.trace if e[0] == "start"][0]  # the constrained row's sequence
    assert any(len(s) >= 3 and host in s for s in steps)  # it stepped together with other rows
    for s, g in zip(solo, got):
        assert g.token_ids == s.token_ids
        assert g.text == s.text and g.finish_reason == s.finish_reason
        if s.logprobs:
            assert [(lp.token_id, lp.logprob, lp.top) for lp in g.logprobs] == \
                   [(lp.token_id, lp.logprob, lp.top) for lp in s.logprobs]
    assert engine.tokens  # the engine's own session is usable again: it holds the last row's tokens
    engine.generate(PROMPTS[0], max_tokens=1)


def test_long_prompt_delays_decoding_rows_by_one_bounded_chunk(sim):
    """Three rows decode; a long prompt arrives. Until it gets its first token, every decode
    step of the three waits for at most one prefill chunk of at most ``prefill_interleave``
    tokens, none of them misses a step, and the new row's first token comes within the
    scheduler's stated bound (iterations, each one chunk and one step). Its tokens equal
    its solo run's although its prompt ran in smaller chunks."""
    long_prompt = sim.tokenizer.encode("Now is the winter of our discontent made glorious summer " * 3)
    solo = sim.generate(long_prompt, max_tokens=2, temperature=0)
    with sim.scheduler(max_batch=4, prefill_interleave=16) as batch:
        early = [batch.submit(p, max_tokens=40, temperature=0) for p in PROMPTS[:3]]
        while not all(r._events.qsize() for r in early):  # all three decoding
            batch._drive()
        mark = len(batch.trace)
        late = batch.submit(long_prompt, max_tokens=2, temperature=0)
        while late._events.qsize() == 0:
            batch._drive()
        trace = list(batch.trace)[mark:]
        first_step = next(i for i, e in enumerate(trace) if e[0] == "step" and late_seq(batch, late) in e[1])
        before = trace[:first_step]
        chunks_between = 0
        for e in before:
            if e[0] in ("start", "end"):
                continue
            if e[0] == "chunk":
                assert e[2] <= 16
                chunks_between += 1
                assert chunks_between <= 1, trace  # one chunk, then the running rows step again
            else:
                assert len(e[1]) == 3, e  # no running row skipped a step
                chunks_between = 0
        iterations = sum(1 for e in before if e[0] == "step") + 1
        assert iterations <= batch.bounds(len(long_prompt))["iterations"]
        for r in early:
            r.cancel.set()
        batch.run_until_idle()
        assert late.result().token_ids == solo.token_ids


def test_prompts_prefilling_together_take_turns(sim):
    """A long prompt and a short one start together: the rows prefilling take turns, one
    chunk each, so the short one reaches its first token within the stated bound with one
    other row prefilling, not after the whole long prompt; both equal their solo runs."""
    long_prompt = sim.tokenizer.encode("Now is the winter of our discontent made glorious summer " * 8)
    short = sim.tokenizer.encode(PROMPTS[0])
    solos = [sim.generate(p, max_tokens=2, temperature=0).token_ids for p in (long_prompt, short)]
    with sim.scheduler(max_batch=4, prefill_interleave=16) as batch:
        mark = len(batch.trace)
        reqs = [batch.submit(p, max_tokens=2, temperature=0) for p in (long_prompt, short)]
        while reqs[1]._events.qsize() == 0:
            batch._drive()
        trace = list(batch.trace)[mark:]
        seq = late_seq(batch, reqs[1])
        first = next(i for i, e in enumerate(trace) if e[0] == "step" and seq in e[1])
        chunks = [e for e in trace[:first] if e[0] == "chunk"]
        assert all(e[2] <= 16 for e in chunks), trace
        assert len(chunks) + 1 <= batch.bounds(len(short), prefilling=1)["iterations"] < len(long_prompt) // 16, trace
        batch.run_until_idle()
        assert [r.result().token_ids for r in reqs] == solos


def late_seq(batch, req) -> int:
    return next(row.seq for row in batch._rows if row.request is req)


def test_cancelled_request_frees_its_row(ref):
    """Two rows run and a third waits; cancelling one mid-stream ends it with 'cancelled',
    it takes no step after the one already in flight, and the waiting request gets its row."""
    with ref.scheduler(max_batch=2) as batch:
        a = batch.submit(PROMPTS[0], max_tokens=30, temperature=0)
        b = batch.submit(PROMPTS[1], max_tokens=4, temperature=0)
        c = batch.submit(PROMPTS[2], max_tokens=3, temperature=0)
        events = a.events(batch._drive)
        next(events), next(events)
        assert batch.counts() == (2, 1)
        seq_a = next(row.seq for row in batch._rows if row.request is a)
        a.cancel.set()
        mark = len(batch.trace)
        rest = list(events)
        assert rest[-1].finish_reason == "cancelled"
        batch.run_until_idle()
        later = list(batch.trace)[mark:]
        end = later.index(("end", seq_a))  # the row freed its sequence, which C may take next
        assert sum(e[0] == "step" and seq_a in e[1] for e in later[:end]) == 0  # no step after the cancel
        assert ("start", seq_a) in later[end:] or c.started is not None
        assert b.result().finish_reason == "length" and c.result().finish_reason == "length"
        assert c.started is not None and batch.counts() == (0, 0)


def test_queue_limit_and_options(ref):
    with pytest.raises(InvalidParameterError, match="max_batch"):
        ref.scheduler(max_batch=9)
    with pytest.raises(InvalidParameterError, match="prefill_interleave"):
        ref.scheduler(prefill_interleave=4)
    with ref.scheduler(max_batch=1, max_queue=1) as batch:
        batch.submit(PROMPTS[0], max_tokens=2)
        batch.submit(PROMPTS[1], max_tokens=2)
        with pytest.raises(QueueFullError) as e:
            batch.submit(PROMPTS[2], max_tokens=2)
        assert e.value.retry_after >= 1 and "queue limit 1" in str(e.value)
        info = batch.info()
        assert (info["running"], info["queued"], info["full"]) == (0, 2, True)
        batch.run_until_idle()
        assert batch.info()["served"] == 2


def test_engine_session_waits_for_the_row_holding_it(ref):
    """While a row runs on the engine's own session, the engine's calls wait for it (the
    scheduler runs on its own thread) instead of racing it; driven on the caller's thread,
    they refuse at once."""
    with ref.scheduler(max_batch=2) as batch:
        req = batch.submit(PROMPTS[0], max_tokens=3, temperature=0)
        batch._drive()  # admitted onto the engine's session
        with pytest.raises(InvalidParameterError, match="in use by a Scheduler"):
            ref.reset()
        batch.start()
        ref.reset()  # waits for the row to end
        assert req.done


def test_server_streams_four_requests_together_each_as_alone(ref):
    """Four concurrent streaming requests through the openai client: each receives tokens
    before any other finishes, and each equals its solo output."""
    kw = dict(max_tokens=7, temperature=0)
    solo = [ref.generate(p, **kw).text for p in PROMPTS]
    srv = Server(create_app(ref, model_name="demo", max_batch=4))
    try:
        client = srv.client()
        got: dict[int, list] = {}

        def run(i):
            got[i] = [(time.perf_counter(), k.choices[0].text)
                      for k in client.completions.create(model="demo", prompt=PROMPTS[i], stream=True, **kw)]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [("".join(x for _, x in got[i])) for i in range(4)] == solo
        first = [next(t for t, x in got[i] if x) for i in range(4)]
        last = [got[i][-1][0] for i in range(4)]
        assert max(first) < min(last)  # every stream had tokens before any stream ended
        h = httpx.get(srv.base + "/health").json()
        assert h["batch"]["max_batch"] == 4 and h["batch"]["served"] >= 4
    finally:
        srv.stop()


def test_server_cancelled_stream_frees_its_row(ref):
    """A client that drops its stream mid-way frees its row: a request waiting for it
    (max_batch=1) then runs to the end."""
    srv = Server(create_app(ref, model_name="demo", max_batch=1, max_queue=4))
    try:
        client = srv.client()
        stream = client.completions.create(model="demo", prompt=PROMPTS[0], stream=True, max_tokens=60,
                                           temperature=0)
        it = iter(stream)
        next(it), next(it)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault(
            "r", client.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=3, temperature=0)))
        t.start()
        t0 = time.time()
        while httpx.get(srv.base + "/health").json()["queued"] == 0:
            assert time.time() - t0 < 30
            time.sleep(0.02)
        stream.close()
        t.join(120)
        assert out["r"].choices[0].finish_reason == "length"
    finally:
        srv.stop()


def test_reference_rows_match_lone_forward(ref):
    """ReferenceModel.forward_rows: each row's logits equal a lone forward's bit for bit."""
    model = ref.backend.model
    states = [model.new_state(64) for _ in range(3)]
    lone = [model.new_state(64) for _ in range(3)]
    prompts = [ref.tokenizer.encode(p)[:5] for p in PROMPTS[:3]]
    for st, lo, p in zip(states, lone, prompts):
        model.forward(p[:-1], st)
        model.forward(p[:-1], lo)
    rows = model.forward_rows(np.array([p[-1] for p in prompts]), states)
    for i, (lo, p) in enumerate(zip(lone, prompts)):
        np.testing.assert_array_equal(rows[i], model.forward([p[-1]], lo))


def test_runtime_sequences_and_batched_calls(sim):
    """lily._core.Runtime's sequences and batched calls: a sequence reserves what
    sequence_bytes says and is refused past the working set; work is taken in commit order;
    a row's slots are not reused before its output is taken; a batched step of one row is
    the batch-1 step (same dispatches, stages and bytes)."""
    rt = sim.backend.runtime
    assert rt.sequence_room == 2**32 - 1  # no working set limit on this simulator
    seq = rt.open_sequence()
    try:
        assert rt.sequences() == [0, seq] and rt.sequences_bytes == rt.sequence_bytes > 0
        assert rt.sequence_position(seq) == 0
        ids = sim.tokenizer.encode(PROMPTS[1])
        rt.reset(seq)
        t1 = rt.submit_chunk(seq, ids[:-1], False, True)  # logits kept for the host
        t2 = rt.submit_step([(seq, ids[-1], True)])
        with pytest.raises(RuntimeError, match="was not taken"):
            rt.take(t2)  # t1 first
        rows, _ = rt.take(t1)
        assert rows[0][:2] == (seq, len(ids) - 2) and rows[0][5].shape == (sim.config.vocab_size,)
        rt.take(t2)
        with pytest.raises(ValueError, match="twice"):
            rt.submit_step([(seq, 1, False), (seq, 2, False)])
        a, b = rt.submit_step([(seq, 1, False)]), rt.submit_step([(seq, -1, False)])
        with pytest.raises(RuntimeError, match="two steps not taken"):
            rt.submit_step([(seq, -1, False)])
        rt.take(a), rt.take(b)
        assert rt.sequence_position(seq) == len(ids) + 2
    finally:
        rt.close_sequence(seq)
    with pytest.raises(ValueError, match="not open"):
        rt.reset(seq)
    one, batch = rt.count_step(37), rt.count_batch_step([37])
    for k in ("dispatches", "barrier_stages", "declared_bytes_read", "declared_bytes_written", "weight_bytes",
              "kv_bytes", "state_bytes", "activation_bytes"):
        assert one[k] == batch[k], k
    assert [r["kernel"] for r in one["records"]] == [r["kernel"] for r in batch["records"]]
    sim.reset()


def test_sequences_are_admitted_by_memory(demo_path):
    """A device whose working set holds the session and one more sequence: the scheduler
    opens that one, a third request waits for a row although max_batch allows four, and
    /health-style info says a new request would wait."""
    if "sim" not in _core.compiled_devices():
        pytest.skip("simulator not built")
    probe = Engine.load(demo_path, device="sim", max_context=64, prompt_cache_bytes=0)
    need = probe.backend.runtime.memory_use["total"] + probe.backend.sequence_bytes()
    del probe
    e = Engine.load(demo_path, device="sim", max_context=64, prompt_cache_bytes=0,
                    device_options={"device_options": {"working_set_bytes": need + need // 100}})
    assert e.backend.sequence_room() == 1
    with e.scheduler(max_batch=4) as batch:
        reqs = [batch.submit(p, max_tokens=2, temperature=0) for p in PROMPTS[:3]]
        batch._drive()
        info = batch.info()
        assert (info["running"], info["queued"], info["full"], info["sequence_room"]) == (2, 1, True, 0)
        batch.run_until_idle()
        assert all(r.result().finish_reason == "length" for r in reqs)



def _steps(rt, seqs, snaps, first, groups, rounds=2):
    """Restores each of `seqs` from its snapshot, then runs `rounds` (1 or 2) rounds of steps,
    each round one submit_step per group of row indices, together. Round 1 feeds each row its
    `first` token and keeps every row's logits for the host; round 2 feeds the token the device
    chose and keeps the logits of even rows, the device's token of odd ones. Returns each row's
    outputs."""
    for seq, snap in zip(seqs, snaps):
        rt.restore(snap, seq)
    out = {i: [] for i in range(len(seqs))}
    for rnd in range(rounds):
        for g in groups:
            rows = [(seqs[i], first[i] if rnd == 0 else -1, rnd == 0 or i % 2 == 0) for i in g]
            got, _ = rt.take(rt.submit_step(rows))
            for i, (_, _, logits), r in zip(g, rows, got):
                out[i].append(r[5].tobytes() if logits else r[2])
    return out


def _picks(path, ids, lengths):
    """Each layer's top-k experts at the last position of each row's prompt ids[:n], on the
    reference (the routing the native rows' first batched step sees, up to near-ties)."""
    ref = Engine.load(path, device="reference", max_context=32, prompt_cache_bytes=0)
    model, picks = ref.backend.model, []
    for n in lengths:
        layers = {}
        route = model.route

        def recording(i, x, layers=layers, route=route):
            out = route(i, x)
            layers[i] = set(out[1][-1].tolist())
            return out

        model.route = recording
        ref.reset()
        ref.prefill(ids[:n])
        del model.route
        picks.append(layers)
    return picks


@pytest.mark.parametrize("checkpoint", ["demo", "tiny"])
def test_batched_steps_equal_each_row_alone(checkpoint, request):
    """Batched steps of 2 and 4 rows (the dense projections, router and lm_head once over the
    rows: norm_gemv_batch_q*, gemv_batch_q4_*_add, gemv_gated_batch_q4_*_add; the experts over
    the union of the rows' picks and the shared expert once: moe_route_gate_up_batch_q4,
    moe_down_batch_q4; each row's embedding, attention, DeltaNet step and sampler its own) give
    every row the logits and tokens of its steps alone, bit for bit. The rows sit at different
    positions: below and past the split-attention threshold (8), steps that write the Gated
    DeltaNet state back and steps that append to the ring (window 4); host-sampled and
    device-sampled rows mix, and round 2 reads the token the batched sampler handed over on the
    device. The demo model (32 experts, top 8) and the tiny preset (16, top 4; round 1 only: its
    lm_head has the real vocabulary), whose rows' picks overlap in some layers and are disjoint
    in others (checked on the reference). Under
    the simulator's hazard checks: random stage order, every write checked against the
    declared ranges."""
    if "sim" not in _core.compiled_devices():
        pytest.skip("simulator not built")
    path = request.getfixturevalue("demo_path" if checkpoint == "demo" else "tiny_checkpoint")
    opts = {"split_threshold": 8, "state_window": 4,
            "device_options": {"order": "random", "seed": 3, "verify_writes": True}}
    e = Engine.load(path, device="sim", max_context=32, prompt_cache_bytes=0, device_options=opts)
    rt = e.backend.runtime
    ids = e.tokenizer.encode("ROMEO.\nBut soft, what light through yonder window breaks? It is the east")
    lengths = (3, 12, 15, 6)  # first steps at positions 2, 11, 14, 5
    if checkpoint == "tiny":  # the rows' first steps share experts in some layers, none in others
        picks = _picks(path, ids, lengths)
        pairs = [(a[i], b[i]) for x, a in enumerate(picks) for b in picks[x + 1:] for i in a]
        assert any(a & b for a, b in pairs) and any(not a & b for a, b in pairs)
    seqs = [rt.open_sequence() for _ in lengths]
    try:
        for seq, n in zip(seqs, lengths):
            rt.reset(seq)
            rt.submit_chunk(seq, ids[:n - 1], False, False)
        snaps = [rt.snapshot(seq) for seq in seqs]
        first = [ids[n - 1] for n in lengths]
        rounds = 2 if checkpoint == "demo" else 1  # tiny's lm_head has the real vocabulary's rows
        alone = _steps(rt, seqs, snaps, first, [[0], [1], [2], [3]], rounds)
        four = _steps(rt, seqs, snaps, first, [[2, 0, 3, 1]], rounds)
        two = _steps(rt, seqs, snaps, first, [[0, 3], [1, 2]], rounds)
    finally:
        for seq in seqs:
            rt.close_sequence(seq)
    for i in range(len(lengths)):
        assert four[i] == alone[i], f"row {i} of 4 differs from its steps alone"
        assert two[i] == alone[i], f"row {i} of 2 differs from its steps alone"


# The batch-1 step of the full-size model at 64 tokens (record-only, state_window=1) as land27
# counted it, before the batched MoE kernels: a one-row step must stay exactly this.
BATCH_1_STEP = {"dispatches": 243, "barrier_stages": 243, "declared_bytes_read": 19582390228,
                "declared_bytes_written": 71663404, "weight_bytes": 1669563648, "kv_bytes": 1331200,
                "state_bytes": 132710400, "activation_bytes": 5709472}


def test_batched_step_reads_each_dense_weight_once():
    """Counters of a batched step (record-only, the full-size model at 64 tokens): the dense
    projections' dispatches read their weights once for the rows (the batched kernels, b the
    smallest of 2, 4, 8 holding the rows), each row adding only its own x and y; the MoE block
    runs moe_route_gate_up_batch_q4 and moe_down_batch_q4 (the routed experts counted over the
    union of the rows' picks expected with uniform routing, the shared expert once); the
    embedding row and the per-row kernels count once per row; the rows' samplers share two
    barrier stages. One row is the batch-1 step, unchanged (its land27 counters)."""
    from lily.checkpoint import parse_config
    from lily.lab.estimate import QWEN36_35B_A3B
    from lily.native_backend import count_batch_window

    cfg = parse_config(QWEN36_35B_A3B)
    H, V = cfg.hidden_size, cfg.vocab_size
    step = {b: count_batch_window(cfg, 64, b, state_window=1)[0] for b in (1, 3, 4)}
    by_label = {b: {r["label"].split(" (#")[0]: r for r in c["records"]} for b, c in step.items()}
    for b in (3, 4):
        kernels = [r["kernel"] for r in step[b]["records"]]
        for k in ("norm_gemv_batch_q4_b4", "norm_gemv_batch_q8_b4", "gemv_batch_q4_b4_add",
                  "gemv_gated_batch_q4_b4_add"):
            assert k in kernels, k
        assert kernels.count("embed_rows_q4") == b and "embed_norm_gemv_q4" not in kernels
        L = cfg.num_hidden_layers
        for k in ("moe_route_gate_up_batch_q4_b4", "moe_down_batch_q4_b4"):
            assert kernels.count(k) == L, k
        assert "moe_route_gate_up_swiglu_q4" not in kernels and "moe_down_q4" not in kernels
        for label, x_cols in (("final norm + lm_head", H), ("L1 input norm + in_proj qkv|z|b|a", H),
                              ("L3 o_proj", cfg.num_attention_heads * cfg.head_dim)):
            one, many = by_label[1][label], by_label[b][label]
            assert many["bytes_read"] - one["bytes_read"] >= (b - 1) * x_cols * 4, label
            assert many["bytes_read"] - one["bytes_read"] < one["bytes_read"] / 8, label  # weights not re-read
        assert by_label[b]["final norm + lm_head"]["bytes_written"] == b * V * 4
        # the rows' samplers share two barrier stages (every row's argmax partials, then every
        # row's combine); the step has one stage more than batch 1: the embedding's own
        last = step[b]["records"][-2 * b:]
        assert [r["label"].split(" (#")[0] for r in last] == ["greedy argmax partials"] * b + \
            ["greedy token -> next slot"] * b
        assert [r["stage"] - last[0]["stage"] for r in last] == [0] * b + [1] * b
        assert step[b]["barrier_stages"] == step[1]["barrier_stages"] + 1
    # weight bytes: the routed experts (gate, up and down) over the expected union
    # (E (1 - (1 - k/E)^b) experts a layer), and per row the same small part (embedding row,
    # per-row kernels' small tensors); the dense projections and the shared expert stay once
    L, E, k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
    expert = cfg.moe_intermediate_size * (H // 2 + 2 * (H // 64) * 2)  # one expert matrix (codes, scales, biases)

    def routed_beyond_k(b):  # the union's expert bytes past one row's k experts
        return 3 * L * (round(E * (1 - (1 - k / E) ** b) * expert) - k * expert)

    w1, w3, w4 = (step[b]["weight_bytes"] for b in (1, 3, 4))
    per_row = (w4 - w1 - routed_beyond_k(4)) // 3
    assert w3 - w1 - routed_beyond_k(3) == 2 * per_row
    assert 0 < per_row < expert * L  # less than one expert matrix a layer: no expert per row
    assert w4 - w1 < 3 * (w1 / 2)
    one = step[1]
    assert {key: one[key] for key in BATCH_1_STEP} == BATCH_1_STEP
    assert not any("batch" in r["kernel"] or r["kernel"] == "embed_rows_q4" for r in one["records"])
