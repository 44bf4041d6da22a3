"""The tensor rate from designs measured on M5: MLX-LM's and pplx-garden's published M5 Max
prefill, modelled through their kernels' structure and timed by lily.lab.estimate's model, so the
tensor-op efficiency our estimate uses is fitted to engines that ran, not assumed
(docs/performance.md, "The tensor rate from designs measured on M5"). An ESTIMATE's
foundation: nothing here measures anything.

Each engine's prefill of a prompt is restated as per-chunk dispatch records (the GEMMs with
their tile shapes, threadgroups, threadgroup memory and k-loop chains; the attention; the
Gated DeltaNet scan; the elementwise traffic between them as one bandwidth-bound record per
layer), timed with the machine's likely constants and no stage gap, plus a fitted cost per
chunk (dispatch gaps and the host work the engine does between chunks) and the engine's
published decode step for the last token. The fit: the tensor efficiency of their GEMMs, and
the tensor efficiency of the attention's products, by the smallest rms relative error over the ten published
lengths, the per-chunk cost in closed form.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from lily.lab import estimate

#: Where each engine's structure was read (the files, at the versions of the published runs).
SOURCES = {
    "mlx_lm": ("ml-explore/mlx v0.32.1 + 0.32.2 bump (mlx/backend/metal/quantized.cpp qmm_nax and "
               "gather_qmm_rhs_nax, kernels/quantized_nax.h, scaled_dot_product_attention.cpp "
               "use_fallback); ml-explore/mlx-lm v0.31.3 (generate.py generate_step, models/qwen3_5.py, "
               "gated_delta.py, switch_layers.py)"),
    "pplx_garden": ("perplexityai/pplx-garden lily/ at f263d07 (src/model.rs PREFILL_CHUNK, "
                    "kernels/metal/attention.metal sdpa_nax_body, gdn.metal gdn_prefill_regscan, "
                    "quant.metal / moe.metal GEMMs)"),
}


def _chain(dram=0.0, mem=0.0, local=0.0, barrier=0.0, reduce=0.0, alu=0.0) -> dict:
    return {"dram": dram, "mem": mem, "local": local, "barrier": barrier, "reduce": reduce, "alu": alu}


class _Plan:
    """Records of one chunk of ``rows`` tokens, one dispatch per stage (the engines order their
    kernels so)."""

    def __init__(self, rows: int):
        self.rows = rows
        self.records: list = []

    def elementwise(self, name: str, family: str, per_token_bytes: float, ops: float) -> None:
        """Elementwise and reduction kernels: bandwidth-bound passes over the activations."""
        m = self.rows
        self.add(name, family, m * per_token_bytes / 4096, 256, m * per_token_bytes, alu=ops * m)

    def scan(self, name: str, c, per_token_bytes: float) -> None:
        """A Gated DeltaNet scan with one simdgroup per state row (both engines' register
        scans: MLX's gated_delta_step, pplx-garden's gdn_prefill_regscan): tokens in order, per
        token its q, k, v, gates loaded (a run-time loop), Dk / 32 decays and k.S FMAs per lane,
        simd_sum, delta, the update and q.S, simd_sum: ~14 dependent steps and two reductions."""
        m, hv, dk, dv = self.rows, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        self.add(name, "gated deltanet", hv * dv / 4, 128, m * per_token_bytes + 2 * 4 * hv * dv * dk,
                 alu=m * hv * dv * dk * 7.0, chain=_chain(reduce=2 * m, alu=m * (3 * dk // 32 + 6)),
                 loop=_chain(mem=m))

    def add(self, name: str, family: str, groups: float, threads: int, nbytes: float, *, tensor=0.0, alu=0.0,
            tg_memory=0, chain=None, loop=None, lead=None, path: str = "tensor_f16") -> None:
        lead = lead or _chain()
        chain = {k: v + lead[k] for k, v in (chain or _chain()).items()}
        flops = dict.fromkeys(estimate.PATHS, 0.0)
        flops.update({path: tensor, "alu_f32": alu})
        self.records.append({"kernel": name, "label": name, "pass": 0, "stage": len(self.records),
                             "groups": (max(1, math.ceil(groups)), 1, 1), "threads": (threads, 1, 1),
                             "threadgroup_memory": tg_memory,
                             "work": {"family": family, "bytes": nbytes, "flops": flops, "chain": chain,
                                      "lead": lead, "loop": loop or _chain()}})

    def gemm(self, name: str, family: str, rows: float, n: int, k: int, *, bm: int, bn: int = 64, bk: int = 64,
             threads: int = 128, tg_memory: int, step: dict, weight_bytes: float, act_bytes: float,
             dequant_per_weight: float = 3.0, tiles: float | None = None) -> None:
        """A quantized GEMM of ``rows`` computed rows (padding included) x ``n`` x ``k`` in
        ``bm`` x ``bn`` tiles of ``threads`` threads: the products on the tensor path, every
        tile's dequantization of its bn x k weights (``dequant_per_weight`` ALU operations each;
        ``tiles``: row tiles when not rows / bm), ``step`` the latency chain of one k step."""
        row_tiles = tiles if tiles is not None else math.ceil(rows / bm)
        steps = math.ceil(k / bk)
        chain = {key: v * steps for key, v in step.items()}
        chain["dram"] = max(0.0, chain["dram"] - 1)  # the first load is the dispatch's own
        self.add(name, family, row_tiles * math.ceil(n / bn), threads, weight_bytes + act_bytes,
                 tensor=2.0 * rows * n * k, alu=dequant_per_weight * row_tiles * n * k, tg_memory=tg_memory,
                 chain=chain)


def _q4(n: int, k: int, bits: int = 4) -> float:
    """Bytes of an MLX affine-quantized [n, k] matrix (codes, bf16 scale and bias per 64)."""
    return n * k * (bits / 8 + 4 / 64)


def _dims(cfg) -> tuple:
    """The model config and the dimensions the chunk builders use: hidden, experts, top-k,
    expert and shared intermediate sizes, the DeltaNet's key and value heads and head dims,
    the attention's query and KV heads and head dim."""
    c = estimate.model_config(cfg)
    return c, (c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
               c.shared_expert_intermediate_size, c.linear_num_key_heads, c.linear_num_value_heads,
               c.linear_key_head_dim, c.linear_value_head_dim, c.num_attention_heads, c.num_key_value_heads,
               c.head_dim)


def _reached(rows: int, c) -> float:
    """Experts a chunk of ``rows`` tokens reaches under uniform routing (as cost.cpp)."""
    e, k = c.num_experts, c.num_experts_per_tok
    return e * (1 - (1 - k / e) ** rows)


# ---- MLX-LM (mlx 0.32.2, mlx-lm 0.31.3) ------------------------------------------------

#: MLX-LM's prompt chunk (generate_step's prefill_step_size).
MLX_CHUNK = 2048
# qmm_t_nax / gather_qmm_rhs_nax (quantized_nax.h): 2 x 2 simdgroups, 64 x 64 output tiles (32
# rows for gathers of fewer than 64 rows per expert), k steps of 64: per step two barriers
# around the weight tile's load into threadgroup memory (BN x (BK + 8) half: 9 KiB), then two
# 32-deep sub-steps that each load their A fragments straight from device memory (a volatile
# compiler barrier keeps each sub-step's loads behind the one before).
_MLX_STEP = _chain(dram=1, mem=2, barrier=2)
_MLX_TG = 64 * 72 * 2


#: Bytes each attention score moves in mlx 0.32.2's unfused D = 256 attention: written by the
#: Q K^T matmul (bf16), read and written by the causal mask's `where`, read and written by the
#: softmax, read by the P V matmul (fast.cpp's fallback composes them as separate ops).
MLX_SCORE_BYTES = 12.0


def mlx_prefill_chunk(cfg, rows: int, p0: int, score_bytes: float = MLX_SCORE_BYTES) -> list:
    """One MLX-LM prefill chunk of ``rows`` tokens at position ``p0`` as records (the model's
    layers in mlx-lm's order; the last token's logits are not computed: generate_step
    evaluates only the cache between chunks). ``score_bytes``: the bytes each attention score
    moves in mlx 0.32.2's unfused D = 256 attention (its use_fallback takes the unfused path
    for head_dim 256 when more than 8 queries: the scores [heads, rows, keys] are written by
    one matmul, masked, soft-maxed and read by the next; the fused NAX kernel for head_dim 256
    came after the 0.32.2 release)."""
    c, (h, e, k, mi, si, hk, hv, dk, dv, nq, nkv, d) = _dims(cfg)
    plan, M = _Plan(rows), rows
    elementwise = plan.elementwise

    def dense(name, family, n, kk, bits=4):
        bm = 32 if M <= 32 else 64  # a 32-row block when one block covers M (small chunks)
        plan.gemm(name, family, math.ceil(M / bm) * bm, n, kk, bm=bm, tg_memory=_MLX_TG, step=_MLX_STEP,
                  weight_bytes=_q4(n, kk, bits), act_bytes=2.0 * M * (kk + n))

    for kind in c.layer_types:
        elementwise("input rms_norm", "norms, residual", 2 * 2 * h, 4 * h)
        if kind == "linear_attention":
            conv = 2 * hk * dk + hv * dv
            dense("in_proj_qkv", "dense projections", conv, h)
            dense("in_proj_z", "dense projections", hv * dv, h)
            dense("in_proj_b", "dense projections", hv, h)
            dense("in_proj_a", "dense projections", hv, h)
            # conv1d (concatenate, depthwise conv, silu), split, q/k rms_norm, g and beta
            elementwise("conv + silu + q/k norms + gates", "gated deltanet", 2 * (6 * conv + 4 * hk * dk), 20 * conv)
            plan.scan("gated_delta_step", c, 2 * (2 * hk * dk + 2 * hv * dv) + 8 * hv)  # gated_delta.py
            elementwise("gated rms_norm", "gated deltanet", 2 * 4 * hv * dv, 10 * hv * dv)
            dense("out_proj", "dense projections", h, hv * dv)
        else:
            dense("q_proj", "dense projections", 2 * nq * d, h)
            dense("k_proj", "dense projections", nkv * d, h)
            dense("v_proj", "dense projections", nkv * d, h)
            elementwise("q/k norms + rope + cache", "attention", 2 * 4 * (nq + 2 * nkv) * d, 20 * nq * d)
            keys = p0 + M
            scores = nq * M * keys
            # unfused: Q K^T and P V as bf16 GEMMs (steel_gemm_fused_nax) over every key of the
            # cache (the causal mask is applied to the scores, not skipped), the scores in between
            plan.add("attention Q K^T", "attention", nq * math.ceil(M / 64) * math.ceil(keys / 64), 128,
                     2.0 * (nq * M * d + nkv * keys * d) + 2.0 * scores, tensor=2.0 * scores * d,
                     tg_memory=2 * 64 * 72 * 2, chain=_chain(mem=d / 32, barrier=2 * d / 32), path="tensor_bf16")
            plan.add("attention scores (mask, softmax)", "attention", scores / 4096, 256,
                     score_bytes * scores, alu=12.0 * scores)
            plan.add("attention P V", "attention", nq * math.ceil(M / 64) * math.ceil(d / 64), 128,
                     2.0 * scores + 2.0 * (nkv * keys * d + nq * M * d), tensor=2.0 * scores * d,
                     tg_memory=2 * 64 * 72 * 2, chain=_chain(mem=keys / 32, barrier=2 * keys / 32), path="tensor_bf16")
            elementwise("sigmoid gate", "attention", 2 * 3 * nq * d, 4 * nq * d)
            dense("o_proj", "dense projections", h, nq * d)
        elementwise("residual + post norm", "norms, residual", 2 * 5 * h, 6 * h)
        dense("router", "routing", e, h, bits=8)
        dense("shared expert gate", "routing", 1, h, bits=8)
        elementwise("softmax, top-k, sort", "routing", 4 * 3 * e + 8 * 4 * k, 30 * e)
        # the shared expert: three dense GEMMs
        dense("shared gate", "shared expert", si, h)
        dense("shared up", "shared expert", si, h)
        elementwise("shared silu * up", "shared expert", 2 * 3 * si, 6 * si)
        dense("shared down", "shared expert", h, si)
        # SwitchGLU on the sorted assignments (switch_layers.py, indices.size >= 64): the
        # gathered rows, gather_qmm_rhs_nax for up, gate, down; each tile runs its whole k loop
        # once per expert segment it covers, over all its rows: ~bm - 1 padded rows per reached
        # expert and matrix; every reached expert's weights dequantized per tile segment
        S = M * k
        reached = _reached(M, c)
        bm = 32 if S // e < 64 else 64
        computed = S + (bm - 1) * reached
        segments = computed / bm  # (tile, expert) pairs
        elementwise("gather sorted rows", "routed experts", 2 * 2 * k * h, 0)
        for name, n, kk in (("experts up", mi, h), ("experts gate", mi, h), ("experts down", h, mi)):
            plan.gemm(name, "routed experts", computed, n, kk, bm=bm, tg_memory=_MLX_TG, step=_MLX_STEP,
                      weight_bytes=reached * _q4(n, kk), act_bytes=2.0 * S * (kk + n), tiles=segments)
        elementwise("silu * up, unsort, weighted sum", "routed experts", 2 * (3 * k * mi + 3 * k * h + 2 * h),
                    6 * k * mi + 2 * k * h)
    elementwise("embedding", "norms, residual", 2 * h + 4, 3 * h)
    return plan.records


# ---- pplx-garden (lily/ at f263d07) -----------------------------------------------------

#: pplx-garden's prompt chunk (model.rs PREFILL_CHUNK).
PPLX_CHUNK = 4096
# Their dense projections stage a bf16 dequantization of the weights (quant::gemm_q4_bf16_nt)
# and run a bf16 GEMM of 64 x 64 tiles on execution_simdgroups<4> with A sliced straight from
# device memory; the grouped expert GEMMs dequantize each expert's tile in threadgroup memory
# (goals.md: 32-row tiles on 4 simdgroups at ~64 rows per expert). Per k step: the loads, two
# barriers (taken as MLX's structure: a single-buffered tile in threadgroup memory).
_PPLX_STEP = _chain(dram=1, mem=1, barrier=2)
_PPLX_TG = 64 * 72 * 2


def pplx_prefill_chunk(cfg, rows: int, p0: int) -> list:
    """One pplx-garden prefill chunk of ``rows`` tokens at position ``p0`` as records: the
    dense projections as a dequantization pass plus a bf16 GEMM, the routed experts as grouped
    GEMMs of 32-row tiles (each reached expert's last tile padded), the causal NAX attention
    (sdpa_nax_body: 16 queries x 128 keys per step on 4 simdgroups, keys past the block's last
    query skipped), the register scan (gdn_prefill_regscan: one simdgroup per state column,
    tokens in order, two simd_sums each), and the elementwise traffic per layer."""
    c, (h, e, k, mi, si, hk, hv, dk, dv, nq, nkv, d) = _dims(cfg)
    plan, M = _Plan(rows), rows
    elementwise = plan.elementwise

    def dense(name, family, n, kk, bits=4):
        # the dequantization pass (weights to bf16, written and read back), then the GEMM
        plan.add(f"{name} dequant", family, n * kk / 4096, 256, _q4(n, kk, bits) + 2.0 * n * kk, alu=3.0 * n * kk)
        plan.gemm(name, family, math.ceil(M / 64) * 64, n, kk, bm=64, tg_memory=_PPLX_TG, step=_PPLX_STEP,
                  weight_bytes=2.0 * n * kk, act_bytes=2.0 * M * (kk + n), dequant_per_weight=0.0)

    for kind in c.layer_types:
        elementwise("norm", "norms, residual", 2 * 2 * h, 4 * h)
        if kind == "linear_attention":
            conv = 2 * hk * dk + hv * dv
            dense("in_proj_qkv", "dense projections", conv, h)
            dense("in_proj_z", "dense projections", hv * dv, h)
            dense("in_proj_ab", "dense projections", 2 * hv, h)
            elementwise("conv1d + q/k l2 norm + gates", "gated deltanet", 2 * (4 * conv + 4 * hk * dk), 16 * conv)
            plan.scan("gdn regscan", c, 2 * (2 * hk * dk + hv * dv) + 8 * hv + 2 * hv * dv)
            elementwise("gated rms_norm", "gated deltanet", 2 * 4 * hv * dv, 10 * hv * dv)
            dense("out_proj", "dense projections", h, hv * dv)
        else:
            dense("qkv_proj", "dense projections", 2 * nq * d + 2 * nkv * d, h)
            elementwise("q/k norm + rope + scatter", "attention", 2 * 4 * (nq + 2 * nkv) * d, 20 * nq * d)
            # causal: the block of 16 queries at q0 attends keys [0, p0 + q0 + 16), in 128-key steps;
            # the K/V rows counted once (caches are not modelled, as in cost.cpp)
            bq, bk = 16, 128
            blocks = math.ceil(M / bq)
            steps = sum(math.ceil((p0 + min(M, (b + 1) * bq)) / bk) for b in range(0, blocks, max(1, blocks // 64))) * (
                blocks / len(range(0, blocks, max(1, blocks // 64))))
            scores = nq * steps * bq * bk
            plan.add("attention (nax)", "attention", nq * blocks, 128,
                     4.0 * nkv * (p0 + M) * d + 4.0 * M * nq * d, tensor=4.0 * scores * d, alu=10.0 * scores,
                     tg_memory=bq * bk * 6 + 12 * bq,
                     chain=_chain(mem=math.ceil((p0 + M) / bk), barrier=3 * math.ceil((p0 + M) / bk),
                                  alu=30 * math.ceil((p0 + M) / bk)), path="tensor_bf16")
            elementwise("sigmoid gate", "attention", 2 * 3 * nq * d, 4 * nq * d)
            dense("o_proj", "dense projections", h, nq * d)
        elementwise("residual + post norm", "norms, residual", 2 * 5 * h, 6 * h)
        dense("router", "routing", e, h, bits=8)
        elementwise("top-k, counting sort, tile maps", "routing", 4 * 3 * e + 8 * 4 * k, 30 * e)
        dense("shared gate|up", "shared expert", 2 * si, h)
        dense("shared down", "shared expert", h, si)
        S = M * k
        reached = _reached(M, c)
        T = 32
        tiles = S / T + reached / 2  # full tiles, and each reached expert's last tile ~half padded
        elementwise("gather rows", "routed experts", 2 * 2 * k * h, 0)
        for name, n, kk in (("experts gate|up", 2 * mi, h), ("experts down", h, mi)):
            plan.gemm(name, "routed experts", tiles * T, n, kk, bm=T, tg_memory=T * 72 * 2 + 64 * 72 * 2,
                      step=_PPLX_STEP, weight_bytes=reached * _q4(n, kk), act_bytes=2.0 * S * (kk + n), tiles=tiles)
        elementwise("swiglu, combine", "routed experts", 2 * (3 * k * mi + k * h + 2 * h), 6 * k * mi + 2 * k * h)
    elementwise("embedding", "norms, residual", 2 * h + 4, 3 * h)
    return plan.records


# ---- the fit ----------------------------------------------------------------------------

#: engine -> (its chunk, the attention parameter fitted, its grid's range): the tensor
#: efficiency of the attention's products (MLX-LM: the plain bf16 steel GEMMs of the unfused
#: attention; pplx-garden: its NAX flash attention).
ENGINES = {"mlx_lm": (MLX_CHUNK, "attention_efficiency", (0.2, 1.0)),
           "pplx_garden": (PPLX_CHUNK, "attention_efficiency", (0.2, 1.0))}


def _chunks(engine: str, L: int) -> list:
    """(rows, start) of each chunk of an ``L``-token prompt: MLX-LM runs chunks of 2048 while
    more than one token is left and the last token as a decode step; pplx-garden runs chunks
    of 4096 over the whole prompt (model.rs), the last token's step included in the last."""
    chunk = ENGINES[engine][0]
    todo = L - 1 if engine == "mlx_lm" else L
    return [(min(chunk, todo - s), s) for s in range(0, todo, chunk)]


_RECORDS: dict = {}


def _chunk_records(engine: str, rows: int, p0: int) -> list:
    key = (engine, rows, p0)
    if key not in _RECORDS:
        cfg = estimate.model_config()
        _RECORDS[key] = (mlx_prefill_chunk(cfg, rows, p0) if engine == "mlx_lm" else pplx_prefill_chunk(cfg, rows, p0))
    return _RECORDS[key]


def engine_gpu_seconds(engine: str, m: estimate.Machine, L: int, param: float) -> tuple[float, int]:
    """(seconds of GPU work without stage gaps, chunks) of ``engine``'s prefill of ``L`` tokens
    on ``m`` (its GEMMs' tensor efficiency set by the caller), with ``param`` the tensor
    efficiency of the attention's products."""
    mm = replace(m, stage_gap=0.0, path_efficiency={**m.path_efficiency, "tensor_bf16": param})
    chunks = _chunks(engine, L)
    # chunks at many positions: time a geometric sample and interpolate in the start position
    # (within a chunk size a chunk's cost is linear in its start: only attention depends on it)
    full = [(r, s) for r, s in chunks if r == ENGINES[engine][0]]
    rest = [(r, s) for r, s in chunks if r != ENGINES[engine][0]]
    total = 0.0
    if full:
        starts = [s for _, s in full]
        pick = sorted({starts[0], starts[-1], *starts[:: max(1, len(starts) // 6)]})
        times = {s: estimate.time_records(mm, _chunk_records(engine, full[0][0], s)).seconds for s in pick}
        total += float(np.sum(np.interp(starts, pick, [times[s] for s in pick])))
    for r, s in rest:
        total += estimate.time_records(mm, _chunk_records(engine, r, s)).seconds
    return total, len(chunks)


def fit_engine(engine: str, m: estimate.Machine | None = None, run: str = "2026-09-02",
               tensor_grid=None, param_grid=None, lengths=None) -> dict:
    """The tensor efficiency of ``engine``'s GEMMs (``"mlx_lm"`` or ``"pplx_garden"``) and its
    attention parameter fitted to its published M5 Max prefill (pplx-garden's table of ``run``)
    with the likely constants of ``m`` (default: the published M5 Max): per (GEMM efficiency,
    attention efficiency) on the grids the per-chunk cost in closed form (relative least squares, at least
    0), the pair by the smallest rms relative error; ``lengths``: the published lengths fitted
    (default all ten). MLX-LM's last token is its published decode
    step at that length (pplx-garden's: its own), as both measure to the first generated token.
    Returns ``tensor_efficiency``, ``attention_efficiency``, ``chunk_ms``,
    ``rms_relative_error`` and per-length ``rows`` (measured, modelled tok/s)."""
    from lily.lab.calibration import published
    m = m or estimate.scenarios(estimate.machine("m5max"))["likely"][0]
    table = published(run)
    col = 3 if engine == "mlx_lm" else 2
    lengths = sorted(table) if lengths is None else sorted(lengths)
    measured = np.array([L / table[L][col] for L in lengths])
    # the first generated token's step: both engines' prefill figure runs to it (their decode
    # table at that length)
    tail = np.array([1 / table[L][1 if engine == "mlx_lm" else 0] for L in lengths])
    tensor_grid = np.arange(0.20, 1.001, 0.05) if tensor_grid is None else np.asarray(tensor_grid)
    lo, hi = ENGINES[engine][2]
    param_grid = np.linspace(lo, hi, 9) if param_grid is None else np.asarray(param_grid)
    best = None
    for x in tensor_grid:
        mx = replace(m, path_efficiency={**m.path_efficiency, "tensor_f16": float(x)})
        for p in param_grid:
            gpu, n = zip(*(engine_gpu_seconds(engine, mx, L, float(p)) for L in lengths))
            base, n = np.array(gpu) + tail, np.array(n, dtype=float)
            c = max(0.0, float((n * (measured - base) / measured ** 2).sum() / (n ** 2 / measured ** 2).sum()))
            err = float(np.sqrt((((base + n * c - measured) / measured) ** 2).mean()))
            if best is None or err < best[0]:
                best = (err, float(x), float(p), c, base + n * c)
    err, x, p, c, model = best
    return {"engine": engine, "run": run, "tensor_efficiency": x, "attention_efficiency": p,
            "chunk_ms": c * 1e3, "rms_relative_error": err, "source": SOURCES[engine],
            "rows": [{"prompt": L, "measured_tok_s": L / t, "modelled_tok_s": L / mm_}
                     for L, t, mm_ in zip(lengths, measured, model)]}
