// Argument structs of the prefill kernels (docs/prefill.md), shared by the kernels and the
// host runtime: the host includes this file too, so every field is a 32-bit `uint` or
// `float` (the host defines `uint` as uint32_t) and the file includes nothing. Each struct is
// bound as `constant T& args [[buffer(n)]]` (setBytes).
#ifndef LILY_PREFILL_ARGS_H
#define LILY_PREFILL_ARGS_H

// ---- GEMM (metal/gemm.metal, tensor-op path) ------------------------------------------

// ---- expert routing --------------------------------------------------------------------

// One tile of the grouped expert GEMMs: slots [begin, begin + rows) of the grouped order,
// all routed to `expert`; 1 <= rows <= the tile height.
struct MoeTile {
  uint expert;
  uint begin;
  uint rows;
  uint pad;  // 0; keeps the struct 16 bytes
};

// Assignments of one block of the routing histogram, at most (threadgroup memory of
// moe_route_scatter): block_rows * top_k <= kMoeRouteMaxBlockSlots.
enum : uint { kMoeRouteMaxBlockSlots = 1024 };

// moe_route_clear, moe_route_topk, moe_route_scatter (metal/moe_prefill.metal): the expert
// routing of one chunk. blocks = ceil(rows / block_rows) rows of the histogram.
struct MoeRoutePrefillArgs {
  uint rows;        // M: rows (tokens) of the chunk, >= 1
  uint experts;     // E: router logits per row before the shared-gate logit (256); <= 1024
  uint top_k;       // k: experts per row (8); 1..32 and <= experts
  uint norm_topk;   // 1: weights renormalised over the k kept experts (norm_topk_prob)
  uint block_rows;  // rows per histogram block / moe_route_scatter threadgroup (64); >= 1
  uint tile_rows;   // T: tile height of the grouped GEMMs (16 or 32); >= 1
};

// moe_combine: h[row] += sum_j w[row, j] yx[row*k + j] + w[row, k] ys[row].
struct MoeCombineArgs {
  uint rows;    // M: rows of the chunk
  uint hidden;  // H: row length (2048); a multiple of 4
  uint top_k;   // k: routed experts per row (8); >= 1
};

// ---- Gated DeltaNet --------------------------------------------------------------------

// gdn_conv_chunk (metal/gdn_prefill.metal): causal depthwise conv (K = 4 taps) of one chunk
// over [conv state | qkv rows], then SiLU; the conv state is carried in and out (the output
// may be the input state's own bytes). Grid: ceil(C / tg) x ceil(M / RB) threadgroups.
struct GdnConvChunkArgs {
  uint conv_dim;         // C = 2*Hk*Dk + Hv*Dv channels per row (8192); row stride of qkv and out
  uint rows;             // M: tokens in the chunk, >= 1; M * C < 2^32
  uint rows_per_thread;  // RB: consecutive rows one thread convolves (grid y = ceil(M / RB)); < K-1 acts as K-1
};

// gdn_scan_k<Dk>_v<Dv> (metal/gdn_prefill.metal): L2 norms, gates, delta rule over the chunk
// with the recurrent state held in registers, gated RMSNorm. Grid: Hv threadgroups x 1024.
struct GdnScanArgs {
  uint num_k_heads;  // Hk: key heads (16)
  uint num_v_heads;  // Hv: value heads (32), a multiple of Hk; value head h uses key head h / (Hv / Hk)
  uint rows;         // M: tokens in the chunk, >= 1
  float norm_eps;    // eps of the gated RMSNorm over Dv (1e-6)
  float l2_eps;      // eps added to the sum of squares in the q/k L2 norm (1e-6)
};

// ---- attention -------------------------------------------------------------------------

#endif  // LILY_PREFILL_ARGS_H
