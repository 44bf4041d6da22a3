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

// ---- attention -------------------------------------------------------------------------

#endif  // LILY_PREFILL_ARGS_H
