"""The published measurements `lily estimate` is calibrated on, and how (an ESTIMATE's
foundations; docs/performance.md, "Calibration" and "An honest estimate").

* pplx-garden's decode step, restated as records the model times (:func:`reference_decode_step`),
  and the bandwidth efficiency and stage gap fitted to its two published M5 Max runs
  (:func:`calibrate_reference`), under any latency model and small-grid rule of a
  :class:`lily.estimate.Machine`; the fit checked out of sample (:func:`out_of_sample`).

Nothing here measures anything; the tables are published figures of other engines.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from lily.lab import estimate
from lily.lab.published import PPLX_PUBLISHED_M5MAX, PPLX_PUBLISHED_M5MAX_0901

#: pplx-garden's published M5 Max runs (perplexityai/pplx-garden, lily/docs/): the file, and
#: length -> (their decode, MLX-LM decode, their prefill, MLX-LM prefill) tok/s. The
#: 2026-09-02 run (mlx 0.32.2) is the primary calibration (:data:`lily.estimate.CALIBRATION`), the
#: 2026-09-01 one (mlx 0.31.2, a different build of the same engine generation) the second
#: published measurement of the same step, which shows how much a re-run moves the fit.
PUBLISHED_RUNS = {
    "2026-09-02": "lily/docs/2026-09-02-performance-mlx-0.32.2.md",
    "2026-09-01": "lily/docs/2026-09-01-performance-mlx-0.31.2.md",
}


def published(run: str) -> dict:
    """The table of a :data:`PUBLISHED_RUNS` run: length -> (pplx-garden decode, MLX-LM decode,
    pplx-garden prefill, MLX-LM prefill), tok/s."""
    tables = {"2026-09-02": PPLX_PUBLISHED_M5MAX, "2026-09-01": PPLX_PUBLISHED_M5MAX_0901}
    if run not in tables:
        raise estimate.InvalidParameterError(f"unknown published run {run!r} (known: {', '.join(tables)})")
    return tables[run]


def _chain(dram=0.0, mem=0.0, local=0.0, barrier=0.0, reduce=0.0, alu=0.0) -> dict:
    return {"dram": dram, "mem": mem, "local": local, "barrier": barrier, "reduce": reduce, "alu": alu}


def _gemv_loop(k: int, bits: int = 4, lanes: int = 32) -> dict:
    """Their GEMVs (quant.metal, moe.metal): each lane strides 16-byte blocks of a row, so
    k * bits / 128 / lanes iterations, the first the dispatch's own load."""
    return _chain(dram=max(0.0, -(-k * bits // 128 // lanes) - 1))


def reference_decode_step(length: int, config=None) -> list:
    """pplx-garden's decode step (perplexityai/pplx-garden, lily/src at f263d07) as records
    :func:`lily.estimate.time_records` takes, for a step whose attention covers ``length``
    positions: one record per dispatch with its barrier stage, grid, the bytes it must move
    (unique bytes: their attention re-reads each KV row from every query head's threadgroup
    below 8K and from two below 32K, counted once, as caches are not modelled) and the
    latency chains of its kernel as read in their source (cost.h's kinds and conventions).
    Read from their model.rs (``encode_decode_step`` and its branches), kernels/*.rs and
    metal.rs: one command buffer per step with one concurrent-dispatch encoder, every
    dependency level closed by ``memoryBarrierWithScope(Buffers)``; 10 stages per DeltaNet
    layer, 12 per attention layer (split attention and its combine, from 257 positions), 5
    around them: 425. Weights as stored in the MLX checkpoint (4-bit, group 64, bf16 scales
    and biases; router and shared gate 8-bit), fp32 DeltaNet state and logits, bf16 KV cache.
    Compute is left out: every dispatch is bandwidth-bound at this model's rates."""
    c = estimate.model_config(config)
    h, vec = c.hidden_size, 2 * c.hidden_size
    recs: list = []
    stage = [0]

    def q(bits: int, n: int, k: int) -> float:  # codes plus bf16 scale and bias per 64
        return n * k * (bits / 8 + 4 / 64)

    def add(name: str, groups: int, threads: int, nbytes: float, end: bool = False, chain=None, lead=None,
            loop=None) -> None:
        """One dispatch; ``end``: a memory barrier follows it (the next stage depends on it)."""
        lead = lead or _chain()
        chain = {k: v + lead[k] for k, v in (chain or _chain()).items()}  # the lead is part of the chain
        recs.append({"kernel": name, "label": name, "pass": 0, "stage": stage[0], "groups": [groups, 1, 1],
                     "threads": [threads, 1, 1],
                     "work": {"family": "reference", "bytes": nbytes, "flops": {}, "chain": chain, "lead": lead,
                              "loop": loop or _chain()}})
        stage[0] += end

    hk, hv, dk = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim
    conv, dv = (2 * hk + hv) * dk, hv * c.linear_value_head_dim
    nq, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    e, k, mi, si = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size
    # Their kernels' chains (norm.metal, moe.metal, gdn.metal, attention.metal at f263d07):
    # rmsnorm / add_rmsnorm (one threadgroup of 256): simd_sum, a barrier, thread 0 adds the 8
    # partials and takes rsqrt, a barrier, then x and the weights read again (add_rmsnorm keeps
    # its 8 values in registers: constant-count loops, unrolled)
    norm = _chain(mem=1, barrier=2, reduce=1, alu=10)
    gemv = _chain(reduce=1)  # a simd_sum per row at the end
    add("embedding row", 8, 32, q(4, 1, h) + vec, end=True)
    add("input norm", 1, 256, 3 * vec, end=True, chain=norm, loop=_chain(mem=2 * h // 256 - 1))
    for kind in c.layer_types:
        if kind == "linear_attention":
            rows = conv + dv + 2 * hv  # qkv | z | a | b in one matvec, 2 rows per simdgroup
            add("in_proj", rows // 2, 32, q(4, rows, h) + vec + 2 * rows, end=True, chain=gemv, loop=_gemv_loop(h))
            kd = c.linear_conv_kernel_dim  # window read and written, taps, input and output
            add("conv step", conv // 256, 256, 2 * conv * (2 * (kd - 1) + kd + 2), end=True)
            # gdn_step_gated: q/k simd_sums, a barrier, thread 0's norms and gates from loads
            # after it, two barriers, the two column loops (constant count: unrolled, but each a
            # chain of Dk dependent FMAs), the gated norm (simd_sum, three barriers, z and the
            # weight read after them)
            add("deltanet step", hv, dk, 2 * hv * dk * dk * 4 + 2 * conv + 4 * dv, end=True,
                chain=_chain(mem=2, barrier=6, reduce=2, alu=2 * dk + 40))
            add("out_proj", h // 2, 32, q(4, h, dv) + 2 * dv + vec, chain=gemv, loop=_gemv_loop(dv))
        else:
            rows = 2 * nq * d + 2 * nkv * d  # q|gate, k, v in one matvec
            add("qkv_proj", rows // 2, 32, q(4, rows, h) + vec + 2 * rows, end=True, chain=gemv, loop=_gemv_loop(h))
            prep = _chain(mem=1, barrier=3, reduce=1, alu=20)  # the norm, its weights after the barriers, RoPE
            add("q norm + rope", nq, 256, 8 * nq * d, chain=prep)
            add("k norm + rope + cache", nkv, 256, 4 * nkv * d, chain=prep)
            add("v to cache", nkv * d // 256, 256, 4 * nkv * d, end=True)
            kv = 4 * nkv * length * d
            if length <= 256:  # one threadgroup per query head, no split
                add("attention", nq, 256, kv + 4 * nq * d, end=True,
                    chain=_chain(barrier=8, reduce=3 + length // 8, alu=8 * length // 8),
                    loop=_chain(dram=2 * length // 8))
            else:
                if length >= 32768:  # 128 blocks, a KV head's 8 query heads in one threadgroup
                    # sdpa_decode_mlx_b128h2r2: each simdgroup 2 heads, an iteration per 256
                    # positions (two rows), its K and V loads, two simd_sums, the exps
                    splits, groups, threads = 128, nkv * 128, 128
                    its = -(-length // 256)
                    attn = _chain(reduce=its, alu=14 * its)
                    attn_loop = _chain(dram=its)
                else:  # 256-position splits, one query head (four from 8K) per threadgroup
                    # sdpa_decode_split(_gqa_h4u): 32 rows per simdgroup, a K pass (a load, the
                    # dot products, simd_sum per row) and a V pass, barriers between the phases
                    splits = -(-length // 256)
                    four = length >= 8192
                    groups, threads = (nkv * 2 if four else nq) * splits, 256
                    attn = _chain(barrier=15 if four else 7, reduce=32 + (8 if four else 3),
                                  alu=32 * (12 if four else 6) + 32 * 2 + 30)
                    attn_loop = _chain(dram=64)
                part = nq * splits * (d + 2) * 4
                add("attention splits", groups, threads, kv + part + 2 * nq * d, end=True, chain=attn,
                    loop=attn_loop)
                # sdpa_decode_combine: thread 0's max and sum over the splits, a barrier, every
                # thread's weighted sum over them: three loops of a load per split
                add("attention combine", nq, 256, part + 2 * nq * d, end=True,
                    chain=_chain(barrier=1, alu=6 * splits + 10), loop=_chain(mem=3 * splits))
            add("sigmoid gate", nq * d // 256, 256, 6 * nq * d, end=True)
            add("o_proj", h // 2, 32, q(4, h, nq * d) + 2 * nq * d + vec, chain=gemv, loop=_gemv_loop(nq * d))
        stage[0] += 1  # after out_proj / o_proj
        add("residual + norm", 1, 256, 5 * vec, end=True, chain=_chain(mem=1, barrier=2, reduce=1, alu=18))
        add("router", e, 32, q(8, e, h) + vec + 4 * e, chain=gemv, loop=_gemv_loop(h, 8))
        add("shared gate|up", si, 32, q(4, 2 * si, h) + vec + 4 * si, chain=gemv, loop=_gemv_loop(h))
        add("shared gate", 1, 32, q(8, 1, h) + vec + 4, end=True, chain=gemv, loop=_gemv_loop(h, 8))
        # moe_router_topk (renormalised: no softmax pass): the logits copied behind a barrier,
        # then per round a scan, 5 shuffle-compare levels, a barrier, thread 0's pick over the
        # 8 simdgroups, a barrier; then thread 0's exps and weights
        add("top-k", 1, 256, 4 * e + 8 * k, chain=_chain(barrier=1 + 2 * k, local=k, alu=36 * k + 30))
        add("shared swiglu", -(-si // 256), 256, 6 * si, end=True)
        # the gathers: every weight address waits for indices[slot]
        add("experts gate|up", mi * k, 32, k * q(4, 2 * mi, h) + vec + 2 * k * mi, chain=gemv,
            lead=_chain(dram=1), loop=_gemv_loop(h))
        add("shared down", h // 2, 32, q(4, h, si) + 2 * si + vec, end=True, chain=gemv, loop=_gemv_loop(si))
        # moe_gather_gemv_q4_down_combine: per slot (a run-time loop) indices[slot], then that
        # expert's rows, a 4-level shuffle sum, the weighted add; the shared expert's at the end
        add("experts down + combine", h // 2, 32, k * q(4, h, mi) + 2 * k * mi + 2 * vec, end=True,
            chain=_chain(mem=1, alu=10 * k), lead=_chain(mem=1, dram=1), loop=_chain(mem=k - 1, dram=k - 1))
        add("residual + next norm", 1, 256, 5 * vec, end=True, chain=_chain(mem=1, barrier=2, reduce=1, alu=18))
    add("lm_head", c.vocab_size, 32, q(4, c.vocab_size, h) + vec + 4 * c.vocab_size, end=True, chain=gemv,
        loop=_gemv_loop(h))
    # argmax_f32 in two stages (elementwise.rs): a strided scan of the slice, a simd and a
    # threadgroup max with their barriers; then one threadgroup over the partials
    argmax = _chain(barrier=2, reduce=2, alu=16)
    add("argmax partials", 64, 256, 4 * c.vocab_size + 512, end=True, chain=argmax,
        loop=_chain(mem=-(-c.vocab_size // (64 * 256)) - 1))
    add("argmax", 1, 256, 516, end=True, chain=argmax)
    return recs


_STEPS: dict = {}


def _steps_for(lengths) -> dict:
    """Their step at the mean position of each length's timed steps (a position L + steps / 2
    attends over one more), kept for the next call (the estimate refits many times)."""
    steps = estimate.CALIBRATION["decode_steps"]
    for L in lengths:
        if L not in _STEPS:
            _STEPS[L] = reference_decode_step(L + steps // 2 + 1)
    return {L: _STEPS[L] for L in lengths}


def calibrate_reference(m: estimate.Machine | None = None, run: str = "2026-09-02", lengths=None) -> dict:
    """The bandwidth efficiency and stage gap fitted to a published pplx-garden M5 Max decode
    run (:data:`PUBLISHED_RUNS`) with the model of machine ``m`` (default: the published M5
    Max, its latency model and small-grid rule; its own efficiency and gap are ignored) timing
    their step (:func:`reference_decode_step` at the mean position of each length's timed
    steps), as :func:`lily.estimate.fit` fits a Lily run: the gap in closed form per efficiency,
    the efficiency by the smallest rms relative error. ``lengths``: the subset of the run's
    lengths to fit (default all ten). Returns ``bandwidth_efficiency``, ``stage_gap`` (s),
    ``rms_relative_error`` and per-length ``rows`` (measured and modelled tok/s, stages, bytes
    per step)."""
    m = m or estimate.machine(estimate.CALIBRATION["machine"])
    table = published(run)
    lengths = sorted(table) if lengths is None else sorted(lengths)
    missing = [L for L in lengths if L not in table]
    if missing:
        raise estimate.InvalidParameterError(f"run {run} has no decode figure at {missing}")
    measured = {L: table[L][0] for L in lengths}
    steps = _steps_for(lengths)
    eff, gap, err = estimate.fit_decode(m, [([steps[L]], 1 / measured[L]) for L in lengths])
    fitted = replace(m, bandwidth_efficiency=eff, stage_gap=gap)
    rows = []
    for L in lengths:
        t = estimate.time_records(fitted, steps[L])
        rows.append({"context": L, "measured_tok_s": measured[L], "modelled_tok_s": 1 / t.seconds,
                     "stages": t.stages, "gb_per_step": t.bytes / 1e9})
    return {"bandwidth_efficiency": eff, "stage_gap": gap, "rms_relative_error": err, "rows": rows}


def out_of_sample(m: estimate.Machine | None = None, run: str = "2026-09-02") -> dict:
    """The decode calibration checked on lengths it was not fitted to: fitted on one half of
    the run's ten lengths and predicting the other, for three splits: alternate lengths (256,
    1K, 4K, 16K, 64K against 512, 2K, 8K, 32K, 128K, and the reverse), and the five shortest
    against the five longest (extrapolation to long contexts). Returns per split the fitted
    constants, the predicted lengths' relative errors (model - measured) / measured and their
    rms and largest magnitude."""
    m = m or estimate.machine(estimate.CALIBRATION["machine"])
    lengths = sorted(published(run))
    even, odd = lengths[0::2], lengths[1::2]
    splits = {"even->odd": (even, odd), "odd->even": (odd, even),
              "short->long": (lengths[:5], lengths[5:]), "long->short": (lengths[5:], lengths[:5])}
    steps = _steps_for(lengths)
    measured = {L: published(run)[L][0] for L in lengths}
    out = {}
    for name, (fit_on, predict) in splits.items():
        c = calibrate_reference(m, run, fit_on)
        fitted = replace(m, bandwidth_efficiency=c["bandwidth_efficiency"], stage_gap=c["stage_gap"])
        errors = {L: (1 / estimate.time_records(fitted, steps[L]).seconds - measured[L]) / measured[L] for L in predict}
        e = np.array(list(errors.values()))
        out[name] = {"fitted_on": fit_on, "bandwidth_efficiency": c["bandwidth_efficiency"],
                     "stage_gap_us": c["stage_gap"] * 1e6, "fit_rms": c["rms_relative_error"], "errors": errors,
                     "rms": float(np.sqrt((e ** 2).mean())), "max_abs": float(np.abs(e).max())}
    return out
