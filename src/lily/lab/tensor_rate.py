"""The tensor rate from designs measured on M5: MLX-LM's and pplx-garden's published M5 Max
prefill, modelled through their kernels' structure and timed by lily.lab.estimate's model, so the
tensor-op efficiency our estimate uses is fitted to engines that ran, not assumed
(docs/performance.md, "The tensor rate from designs measured on M5"). An ESTIMATE's
foundation: nothing here measures anything.

Each engine's prefill of a prompt is restated as per-chunk dispatch records (the GEMMs with
their tile shapes, threadgroups, threadgroup memory and k-loop chains; the attention; the
Gated DeltaNet scan; the elementwise traffic between them as one bandwidth-bound record per
layer), timed with a machine's constants and no stage gap, plus a fitted cost per chunk
(dispatch gaps and the host work the engine does between chunks) and the engine's published
decode step for the last token. The fit (:func:`fit_engine`): the tensor efficiency of their
GEMMs and that of the attention's products, by the smallest rms relative error over the
published lengths, the per-chunk cost in closed form. :func:`cross_engine` fits one engine
and predicts the other: how far a tensor efficiency fitted through one design carries to
another (the design-transfer margins of lily.lab.estimate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from lily.lab import estimate

#: Where each engine's structure was read (the files, at the versions of the published runs).
SOURCES = {
    "mlx_lm": ("ml-explore/mlx (the 0.32.2 release: after the 0.32.2 version bump #4333 of 2026-08-18, which "
               "followed the v0.32.1 tag, and after #3842 and #4352 of 2026-08-20, no v0.32.2 tag by 2026-08-22; "
               "the v0.31.2 tag for the 2026-09-01 run): mlx/backend/metal/quantized.cpp qmm_nax and "
               "gather_qmm_rhs_nax, kernels/quantized_nax.h, scaled_dot_product_attention.cpp use_fallback and "
               "sdpa_full_self_attention_nax, kernels/steel/attn/kernels/steel_attention_nax.h "
               "attention_nax_dsplit; ml-explore/mlx-lm v0.31.3 (generate.py generate_step, models/qwen3_5.py, "
               "qwen3_next.py, cache.py make_mask: mask \"causal\", gated_delta.py, switch_layers.py)"),
    "pplx_garden": ("perplexityai/pplx-garden lily/ at f263d07 (src/model.rs PREFILL_CHUNK, "
                    "kernels/metal/attention.metal sdpa_nax_body, gdn.metal gdn_prefill_regscan, "
                    "gemm.metal gemm_bf16_nt_nax, quant.metal gemm_q4_nt_nax_grouped and dequant_q4_bf16, "
                    "kernels/quant.rs MOE_TILE_MROUTE_DEFAULT)"),
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
            tg_memory=0, chain=None, loop=None, lead=None, path: str = "tensor_bf16") -> None:
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


# ---- MLX-LM (mlx-lm 0.31.3 on mlx 0.32.2 or 0.31.2) -------------------------------------

#: MLX-LM's prompt chunk (generate_step's prefill_step_size).
MLX_CHUNK = 2048


@dataclass(frozen=True)
class MlxBuild:
    """What an MLX release runs for this model's prefill, where the two published runs differ:
    ``fused_d256``: head_dim-256 causal attention of at least ``fused_min_queries`` queries in
    one fused NAX kernel (attention_nax_dsplit, #3842), else unfused; ``expert_skip``: in the
    sorted expert GEMM a simdgroup whose band of a tile holds no row of the tile's current
    expert skips its products (#4352: padding per expert at the band's granularity, half the
    tile); ``gather_rows_by_load``: 32-row expert tiles when fewer than 64 rows per expert
    (#4023), else always 64; ``dense_small_block``: a 32-row block when one block covers every
    row (#4171)."""

    version: str
    fused_d256: bool
    expert_skip: bool
    gather_rows_by_load: bool
    dense_small_block: bool
    fused_min_queries: int = 1024


#: The MLX of each published run (pplx-garden's report names it): the 2026-09-02 run's 0.32.2
#: release has the fused head_dim-256 attention and the expert-GEMM skip (both merged after
#: the 0.32.2 version bump, before the release: MLX bumps the version right after a release,
#: as #3816 did after v0.32.0); the 2026-09-01 run's 0.31.2 has neither, nor the 32-row tiles.
MLX_BUILDS = {"2026-09-02": MlxBuild("0.32.2", True, True, True, True),
              "2026-09-01": MlxBuild("0.31.2", False, False, False, False)}

# qmm_t_nax / gather_qmm_rhs_nax (quantized_nax.h): 2 x 2 simdgroups, 64 x 64 output tiles (32
# rows where the build picks them), k steps of 64: per step two barriers around the weight
# tile's load into threadgroup memory (BN x (BK + 8) half: 9 KiB), then two 32-deep sub-steps
# that each load their A fragments straight from device memory (a volatile compiler barrier
# keeps each sub-step's loads behind the one before).
_MLX_STEP = _chain(dram=1, mem=2, barrier=2)
_MLX_TG = 64 * 72 * 2
#: attention_nax_dsplit (steel_attention_nax.h, instantiated 64 queries x 32 keys x 256 on
#: 4 x 2 simdgroups): Q in registers, per 32-key block the K fragments from device memory, the
#: two halves' partial scores exchanged through threadgroup memory between two barriers
#: (4 x 2 slots of 2 x 8 x 32 floats: 16 KiB), the online softmax on each half, the V
#: fragments from device memory; key blocks past the query block's diagonal skipped.
_MLX_ATTN_TG = 4 * 2 * 2 * 8 * 32 * 4
_MLX_ATTN_BLOCK = _chain(mem=2, barrier=2, alu=20)

#: Bytes each attention score moves in MLX's unfused head_dim-256 attention: written by the
#: Q K^T matmul (bf16), read and written by the causal mask's `where`, read and written by the
#: softmax, read by the P V matmul (fast.cpp's fallback composes them as separate ops).
MLX_SCORE_BYTES = 12.0


def mlx_prefill_chunk(cfg, rows: int, p0: int, build: MlxBuild = MLX_BUILDS["2026-09-02"],
                      score_bytes: float = MLX_SCORE_BYTES) -> list:
    """One MLX-LM prefill chunk of ``rows`` tokens at position ``p0`` on MLX ``build`` as
    records (the model's layers in mlx-lm's order; the last token's logits are not computed:
    generate_step evaluates only the cache between chunks). The attention: fused
    (attention_nax_dsplit) where ``build`` has it and the chunk has enough queries (mlx-lm
    passes mask "causal"), else unfused: the scores [heads, rows, keys] written by one matmul,
    masked, soft-maxed and read by the next (``score_bytes`` per score)."""
    c, (h, e, k, mi, si, hk, hv, dk, dv, nq, nkv, d) = _dims(cfg)
    plan, M = _Plan(rows), rows
    elementwise = plan.elementwise

    def dense(name, family, n, kk, bits=4):
        bm = 32 if build.dense_small_block and M <= 32 else 64
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
            if build.fused_d256 and M >= build.fused_min_queries:
                # the query block at q0 attends keys [0, p0 + q0 + 64) in 32-key blocks
                qb, kb = 64, 32
                blocks = math.ceil(M / qb)
                scores = nq * qb * sum(min(keys, kb * math.ceil((p0 + (b + 1) * qb) / kb)) for b in range(blocks))
                plan.add("attention (attention_nax_dsplit)", "attention", nq * blocks, 256,
                         4.0 * nkv * keys * d + 4.0 * M * nq * d, tensor=4.0 * scores * d, alu=12.0 * scores,
                         tg_memory=_MLX_ATTN_TG, chain={x: v * math.ceil(keys / kb) for x, v in _MLX_ATTN_BLOCK.items()},
                         path="tensor_bf16")
            else:
                scores = nq * M * keys
                # unfused: Q K^T and P V as bf16 GEMMs (steel_gemm_fused_nax) over every key of
                # the cache (the causal mask is applied to the scores, not skipped), the scores
                # in between
                plan.add("attention Q K^T", "attention", nq * math.ceil(M / 64) * math.ceil(keys / 64), 128,
                         2.0 * (nq * M * d + nkv * keys * d) + 2.0 * scores, tensor=2.0 * scores * d,
                         tg_memory=2 * 64 * 72 * 2, chain=_chain(mem=d / 32, barrier=2 * d / 32), path="tensor_bf16")
                plan.add("attention scores (mask, softmax)", "attention", scores / 4096, 256,
                         score_bytes * scores, alu=12.0 * scores)
                plan.add("attention P V", "attention", nq * math.ceil(M / 64) * math.ceil(d / 64), 128,
                         2.0 * scores + 2.0 * (nkv * keys * d + nq * M * d), tensor=2.0 * scores * d,
                         tg_memory=2 * 64 * 72 * 2, chain=_chain(mem=keys / 32, barrier=2 * keys / 32),
                         path="tensor_bf16")
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
        # once per expert segment it covers (every segment dequantizes its expert's weights),
        # over all its rows: ~bm - 1 padded rows per reached expert and matrix, or with the
        # skip ~bm / 2 - 1 (only the 2 x 2 simdgroups' row bands that hold the expert's rows
        # multiply)
        S = M * k
        reached = _reached(M, c)
        bm = 32 if build.gather_rows_by_load and S // e < 64 else 64
        band = bm // 2 if build.expert_skip else bm
        computed = S + (band - 1) * reached
        segments = (S + (bm - 1) * reached) / bm  # (tile, expert) pairs
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
#: Rows of a chunk from which their grouped expert GEMM takes 64-row tiles instead of 32
#: (quant.rs MOE_TILE_MROUTE_DEFAULT).
PPLX_MOE_TILE_ROWS_FROM = 3072
# Their dense projections: a dequantization pass of the weights to bf16 (dequant_q4_bf16), then
# gemm_bf16_nt_nax: one MPP matmul2d of a 64 x 64 tile on execution_simdgroups<4> over device
# tensors with a dynamic K (no threadgroup memory, no barrier of theirs; the op's own schedule
# is Apple's: taken as one dependent operand load per 64-deep step).
_PPLX_DENSE_STEP = _chain(mem=1)
# Their grouped expert GEMM (gemm_q4_nt_nax_grouped): per 64-deep k step the tile's 64 x 64 weights
# loaded and dequantized into threadgroup memory (bf16: 8 KiB), a barrier, matmul2d over the
# A slice from device memory, a barrier.
_PPLX_GROUPED_STEP = _chain(dram=1, mem=1, barrier=2)
_PPLX_GROUPED_TG = 64 * 64 * 2


def pplx_prefill_chunk(cfg, rows: int, p0: int) -> list:
    """One pplx-garden prefill chunk of ``rows`` tokens at position ``p0`` as records: the
    dense projections as a dequantization pass plus a bf16 GEMM over device tensors, the routed
    experts as grouped GEMMs of 32-row tiles (64-row from 3072-row chunks; each reached
    expert's last tile padded), the causal NAX attention (sdpa_nax_body: 16 queries x 128 keys
    per step on 4 simdgroups, keys past the block's last query skipped), the register scan
    (gdn_prefill_regscan: one simdgroup per state column, tokens in order, two simd_sums
    each), and the elementwise traffic per layer."""
    c, (h, e, k, mi, si, hk, hv, dk, dv, nq, nkv, d) = _dims(cfg)
    plan, M = _Plan(rows), rows
    elementwise = plan.elementwise

    def dense(name, family, n, kk, bits=4):
        # the dequantization pass (weights to bf16, written and read back), then the GEMM
        plan.add(f"{name} dequant", family, n * kk / 4096, 256, _q4(n, kk, bits) + 2.0 * n * kk, alu=3.0 * n * kk)
        plan.gemm(name, family, math.ceil(M / 64) * 64, n, kk, bm=64, tg_memory=0, step=_PPLX_DENSE_STEP,
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
        T = 64 if M >= PPLX_MOE_TILE_ROWS_FROM else 32
        tiles = S / T + reached / 2  # full tiles, and each reached expert's last tile ~half padded
        elementwise("gather rows", "routed experts", 2 * 2 * k * h, 0)
        for name, n, kk in (("experts gate|up", 2 * mi, h), ("experts down", h, mi)):
            plan.gemm(name, "routed experts", tiles * T, n, kk, bm=T, tg_memory=_PPLX_GROUPED_TG,
                      step=_PPLX_GROUPED_STEP, weight_bytes=reached * _q4(n, kk), act_bytes=2.0 * S * (kk + n),
                      tiles=tiles)
        elementwise("swiglu, combine", "routed experts", 2 * (3 * k * mi + k * h + 2 * h), 6 * k * mi + 2 * k * h)
    elementwise("embedding", "norms, residual", 2 * h + 4, 3 * h)
    return plan.records


# ---- the fit ----------------------------------------------------------------------------

#: engine -> its prompt chunk.
ENGINES = {"mlx_lm": MLX_CHUNK, "pplx_garden": PPLX_CHUNK}
#: The grids the fits search (0.01 apart): the GEMMs' tensor efficiency and the attention's.
TENSOR_GRID = np.round(np.arange(0.30, 1.0001, 0.01), 2)
ATTENTION_GRID = np.round(np.arange(0.20, 1.0001, 0.01), 2)


def _check(engine: str) -> None:
    if engine not in ENGINES:
        raise estimate.InvalidParameterError(f"unknown engine {engine!r} (known: {', '.join(ENGINES)})")


def _chunks(engine: str, L: int) -> list:
    """(rows, start) of each chunk of an ``L``-token prompt: MLX-LM runs chunks of 2048 while
    more than one token is left and the last token as a decode step; pplx-garden runs chunks
    of 4096 over the whole prompt (model.rs), the last token's step included in the last."""
    chunk = ENGINES[engine]
    todo = L - 1 if engine == "mlx_lm" else L
    return [(min(chunk, todo - s), s) for s in range(0, todo, chunk)]


def _weights(engine: str, L: int) -> dict:
    """{(rows, start): weight} with sum(weight x chunk time) the prefill of ``L`` tokens: full
    chunks at a sample of starts (the first, the last, every sixth) and linear interpolation in
    the start between them (within a chunk size only the attention depends on the start, and
    linearly), the other chunks as they are."""
    chunks = _chunks(engine, L)
    size = ENGINES[engine]
    full = [s for r, s in chunks if r == size]
    out: dict = {}
    if full:
        pick = sorted({full[0], full[-1], *full[:: max(1, len(full) // 6)]})
        for s in full:
            i = min(np.searchsorted(pick, s), len(pick) - 1)
            if pick[i] == s:
                out[(size, s)] = out.get((size, s), 0.0) + 1.0
                continue
            lo, hi = pick[i - 1], pick[i]
            a = (s - lo) / (hi - lo)
            out[(size, lo)] = out.get((size, lo), 0.0) + 1 - a
            out[(size, hi)] = out.get((size, hi), 0.0) + a
    for r, s in chunks:
        if r != size:
            out[(r, s)] = out.get((r, s), 0.0) + 1.0
    return out


_RECORDS: dict = {}


def _chunk_records(engine: str, run: str, rows: int, p0: int) -> list:
    key = (engine, run if engine == "mlx_lm" else None, rows, p0)
    if key not in _RECORDS:
        cfg = estimate.model_config()
        _RECORDS[key] = (mlx_prefill_chunk(cfg, rows, p0, MLX_BUILDS[run]) if engine == "mlx_lm"
                         else pplx_prefill_chunk(cfg, rows, p0))
    return _RECORDS[key]


def _parts(engine: str, run: str, m: estimate.Machine, rows: int, p0: int, tensor, attention) -> tuple:
    """A chunk's GPU seconds on ``m`` (no stage gap) in three parts: (the records without
    tensor-op work, [the GEMMs' at each tensor efficiency of ``tensor``], [the attention
    family's at each of ``attention``]). Every record of the restatements is a stage of its
    own, so the chunk's time is their sum at any pair of efficiencies."""
    plan = estimate.make_plan(_chunk_records(engine, run, rows, p0))
    if plan.stages != len(plan.bytes):
        raise AssertionError("an engine restatement has one dispatch per stage")
    tensor_work = plan.flops[:, [estimate.PATHS.index(p) for p in estimate.TENSOR_PATHS]].sum(axis=1) > 0
    gemm, att = tensor_work & ~plan.attention, tensor_work & plan.attention
    base = estimate.dispatch_times(m, plan)[:, 0]
    g = estimate.dispatch_times(m, plan, "gemms", tensor)
    a = estimate.dispatch_times(m, plan, "attention", attention)
    return float(base[~tensor_work].sum()), g[gemm].sum(axis=0), a[att].sum(axis=0)


def engine_seconds(engine: str, m: estimate.Machine, lengths, run: str = "2026-09-02", tensor=None,
                   attention=None) -> tuple:
    """GPU seconds (no stage gap, no per-chunk cost) of ``engine``'s prefill of each of
    ``lengths`` tokens on ``m`` (its decode calibration; its stage gap is not used), as three
    parts: (fixed [L], GEMMs [L, tensor], attention [L, attention]) at each tensor efficiency of
    ``tensor`` and each attention efficiency of ``attention`` (default: ``m``'s), and the
    chunks of each length ([L]). ``run``: the published run (MLX-LM: which MLX build)."""
    _check(engine)
    tensor = np.atleast_1d(np.asarray(m.path_efficiency["tensor_bf16"] if tensor is None else tensor, dtype=float))
    attention = np.atleast_1d(np.asarray(m.attention_efficiency if attention is None else attention, dtype=float))
    mm = replace(m, stage_gap=0.0)
    cache: dict = {}
    fixed, gemm, attn, n = [], [], [], []
    for L in lengths:
        f, g, a = 0.0, np.zeros(len(tensor)), np.zeros(len(attention))
        for (rows, p0), w in _weights(engine, L).items():
            if (rows, p0) not in cache:
                cache[(rows, p0)] = _parts(engine, run, mm, rows, p0, tensor, attention)
            pf, pg, pa = cache[(rows, p0)]
            f, g, a = f + w * pf, g + w * pg, a + w * pa
        fixed.append(f)
        gemm.append(g)
        attn.append(a)
        n.append(len(_chunks(engine, L)))
    return np.array(fixed), np.array(gemm), np.array(attn), np.array(n, dtype=float)


def _published(engine: str, run: str, lengths) -> tuple:
    """(measured seconds to the first token, the first generated token's step) per length."""
    from lily.lab.calibration import published
    table = published(run)
    missing = [L for L in lengths if L not in table]
    if missing:
        raise estimate.InvalidParameterError(f"run {run} has no prefill figure at {missing}")
    col, dcol = (3, 1) if engine == "mlx_lm" else (2, 0)
    # both engines' prefill figure runs to the first generated token (their decode at that length)
    return (np.array([L / table[L][col] for L in lengths]), np.array([1 / table[L][dcol] for L in lengths]))


def _chunk_cost(base: np.ndarray, n: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """The per-chunk cost (at least 0) minimising the relative squared error of base + n c
    against measured, in closed form; ``base`` [..., L]."""
    num = (n * (measured - base) / measured ** 2).sum(axis=-1)
    return np.maximum(0.0, num / (n ** 2 / measured ** 2).sum())


def fit_engine(engine: str, m: estimate.Machine | None = None, run: str = "2026-09-02", tensor_grid=None,
               attention_grid=None, lengths=None) -> dict:
    """The tensor efficiency of ``engine``'s GEMMs (``"mlx_lm"`` or ``"pplx_garden"``) and that of
    its attention's products fitted to its published M5 Max prefill (pplx-garden's table of
    ``run``) with the constants of ``m`` (default: the likely scenario machine of the M5 Max):
    per pair of the grids (default :data:`TENSOR_GRID`, :data:`ATTENTION_GRID`) the per-chunk
    cost in closed form (relative least squares, at least 0), the pair by the smallest rms
    relative error; ``lengths``: the published lengths fitted (default all ten). The last
    token's step is the engine's published decode at that length. Returns
    ``tensor_efficiency``, ``attention_efficiency``, ``chunk_ms``, ``rms_relative_error``,
    ``max_relative_error``, ``at_bound`` (the efficiencies that hit their grid's end), per-length
    ``rows`` (measured, modelled tok/s) and the ``source`` of the restatement."""
    from lily.lab.calibration import published
    _check(engine)
    m = m or estimate.likely_machine(estimate.machine("m5max"))
    lengths = sorted(published(run)) if lengths is None else sorted(lengths)
    tg = TENSOR_GRID if tensor_grid is None else np.asarray(tensor_grid, dtype=float)
    ag = ATTENTION_GRID if attention_grid is None else np.asarray(attention_grid, dtype=float)
    measured, tail = _published(engine, run, lengths)
    fixed, gemm, attn, n = engine_seconds(engine, m, lengths, run, tg, ag)
    base = (fixed + tail)[None, None, :] + gemm.T[:, None, :] + attn.T[None, :, :]  # [tensor, attention, L]
    c = _chunk_cost(base, n, measured)
    model = base + c[..., None] * n
    err = np.sqrt((((model - measured) / measured) ** 2).mean(axis=-1))
    i, j = np.unravel_index(int(np.argmin(err)), err.shape)
    best = model[i, j]
    rel = (best - measured) / measured
    bound = [name for name, grid, x in (("tensor_efficiency", tg, i), ("attention_efficiency", ag, j))
             if len(grid) > 1 and x in (0, len(grid) - 1)]
    return {"engine": engine, "run": run, "tensor_efficiency": float(tg[i]), "attention_efficiency": float(ag[j]),
            "chunk_ms": float(c[i, j]) * 1e3, "rms_relative_error": float(err[i, j]),
            "max_relative_error": float(np.abs(rel).max()), "at_bound": bound, "source": SOURCES[engine],
            "rows": [{"prompt": L, "measured_tok_s": L / t, "modelled_tok_s": L / x}
                     for L, t, x in zip(lengths, measured, best)]}


def predict_engine(engine: str, m: estimate.Machine, run: str = "2026-09-02", *, tensor: float, attention: float,
                   lengths=None) -> dict:
    """``engine``'s published prefill (``run``) predicted with the given efficiencies on ``m``:
    only the per-chunk cost is fitted (closed form; it is the engine's host and dispatch
    behaviour, not its kernels'). Returns ``chunk_ms``, per-length ``errors`` (model - measured)
    / measured of the throughput, their ``rms`` and ``max_abs``, and ``rms_time``, the rms
    relative error of the time (what :func:`fit_engine` minimises and reports)."""
    from lily.lab.calibration import published
    lengths = sorted(published(run)) if lengths is None else sorted(lengths)
    measured, tail = _published(engine, run, lengths)
    fixed, gemm, attn, n = engine_seconds(engine, m, lengths, run, [tensor], [attention])
    base = fixed + tail + gemm[:, 0] + attn[:, 0]
    c = float(_chunk_cost(base, n, measured))
    t = base + c * n
    errors = {L: float(x / y - 1) for L, x, y in zip(lengths, measured, t)}
    e = np.array(list(errors.values()))
    return {"engine": engine, "run": run, "chunk_ms": c * 1e3, "errors": errors,
            "rms": float(np.sqrt((e ** 2).mean())), "max_abs": float(np.abs(e).max()),
            "rms_time": float(np.sqrt((((t - measured) / measured) ** 2).mean()))}


def cross_engine(m: estimate.Machine | None = None, run: str = "2026-09-02") -> dict:
    """The design-transfer test (docs/performance.md, "Out of sample: across engines"): each
    engine's efficiencies fitted on its published prefill (``run``) with the constants of ``m``
    (default: the likely scenario machine), then used to predict the other engine's (only its
    per-chunk cost fitted). Returns the two ``fits``, the two ``predictions`` ("pplx_garden->mlx_lm"
    and the reverse) and the ``spread`` of the fitted efficiencies, |MLX-LM / pplx-garden - 1|
    for the GEMMs (``tensor``) and the attention (``attention``)."""
    m = m or estimate.likely_machine(estimate.machine("m5max"))
    fits = {e: fit_engine(e, m, run) for e in ENGINES}
    pred = {}
    for src, dst in (("pplx_garden", "mlx_lm"), ("mlx_lm", "pplx_garden")):
        f = fits[src]
        pred[f"{src}->{dst}"] = predict_engine(dst, m, run, tensor=f["tensor_efficiency"],
                                               attention=f["attention_efficiency"])
    p, x = fits["pplx_garden"], fits["mlx_lm"]
    return {"fits": fits, "predictions": pred,
            "spread": {"tensor": abs(x["tensor_efficiency"] / p["tensor_efficiency"] - 1),
                       "attention": abs(x["attention_efficiency"] / p["attention_efficiency"] - 1)}}


#: The hold-out splits of :func:`held_out`: (fitted on, predicted) as slices of the ten
#: published lengths in order: the six up to 8K predicting the four from 16K (extrapolation
#: into the attention-bound lengths), the four longest predicting the six shortest, and
#: alternate lengths either way.
HOLDOUT_SPLITS = {"short->long": (slice(0, 6), slice(6, None)), "long->short": (slice(6, None), slice(0, 6)),
                  "even->odd": (slice(0, None, 2), slice(1, None, 2)),
                  "odd->even": (slice(1, None, 2), slice(0, None, 2))}


def held_out(engine: str = "pplx_garden", m: estimate.Machine | None = None, run: str = "2026-09-02") -> dict:
    """``engine``'s prefill fit checked on published lengths it was not fitted to: per split of
    :data:`HOLDOUT_SPLITS` the efficiencies and the per-chunk cost fitted (:func:`fit_engine`)
    on one part of ``run``'s lengths, then, all three held, the other part predicted. ``m``:
    default the likely scenario machine. Returns per split ``fitted_on``, the fitted
    ``tensor_efficiency``, ``attention_efficiency`` and ``chunk_ms``, the predicted lengths'
    ``errors`` (model - measured) / measured of the throughput, their ``rms`` and ``max_abs``."""
    from lily.lab.calibration import published
    _check(engine)
    m = m or estimate.likely_machine(estimate.machine("m5max"))
    lengths = sorted(published(run))
    out = {}
    for name, (fit_on, predict) in HOLDOUT_SPLITS.items():
        f = fit_engine(engine, m, run, lengths=lengths[fit_on])
        target = lengths[predict]
        measured, tail = _published(engine, run, target)
        fixed, gemm, attn, n = engine_seconds(engine, m, target, run, [f["tensor_efficiency"]],
                                              [f["attention_efficiency"]])
        t = fixed + tail + gemm[:, 0] + attn[:, 0] + n * f["chunk_ms"] * 1e-3
        errors = {L: float(x / y - 1) for L, x, y in zip(target, measured, t)}
        e = np.array(list(errors.values()))
        out[name] = {"fitted_on": lengths[fit_on], "tensor_efficiency": f["tensor_efficiency"],
                     "attention_efficiency": f["attention_efficiency"], "chunk_ms": f["chunk_ms"],
                     "fit_rms": f["rms_relative_error"], "errors": errors, "rms": float(np.sqrt((e ** 2).mean())),
                     "max_abs": float(np.abs(e).max())}
    return out
