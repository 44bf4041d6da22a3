// Argument structs of the prefill kernels (docs/prefill.md), shared by the kernels and the
// host runtime: the host includes this file too, so every field is a 32-bit `uint` or
// `float` (the host defines `uint` as uint32_t) and the file includes nothing. Each struct is
// bound as `constant T& args [[buffer(n)]]` (setBytes).
#ifndef LILY_PREFILL_ARGS_H
#define LILY_PREFILL_ARGS_H

// ---- GEMM (metal/gemm.metal, tensor-op path) ------------------------------------------

// gemm_q4, gemm_q8, gemm_q4_add, gemm_swiglu_q4 (and their *_tensor twins): dense GEMMs over
// a quantized weight W [n, k] (MLX affine layout): y[m, n] (=|+=) x[m, k] W^T, or
// y = silu(x Wg^T) * (x Wu^T). x and y are fp32 row-major with their own row strides, so a
// dispatch may read a column block of a wider matrix and write a column block of another.
struct GemmArgs {
  uint m;    // rows of x and y (tokens of the chunk); any >= 1
  uint n;    // output columns (W's out dimension); any >= 1
  uint k;    // inner dimension (W's in dimension); a multiple of 64
  uint lda;  // row stride of x in floats; a multiple of 4, >= k
  uint ldy;  // row stride of y in floats; >= n (y[r, c] is at y[r * ldy + c])
};

// moe_gemm_gate_up_q4_t*, moe_gemm_down_q4_t* (and their *_tensor twins): grouped expert
// GEMMs over the tile map (MoeTile below; docs/prefill.md). Slot s of a tile holds the
// assignment perm[s] = row * top_k + j of expert tile.expert.
//   gate/up: hx[s, :n] = silu(x[perm[s] / top_k] Wg_e^T) * (x[perm[s] / top_k] Wu_e^T)
//   down:    yx[perm[s], :n] = hx[s] Wd_e^T
struct MoeGemmArgs {
  uint n;        // output columns: inter (gate/up) or hidden (down); any >= 1
  uint k;        // inner dimension: hidden (gate/up) or inter (down); a multiple of 64
  uint m;        // rows (tokens) of the chunk: x has m rows, perm and hx/yx m * top_k
  uint top_k;    // routed experts per row (num_experts_per_tok, 8)
  uint experts;  // experts stacked in the weight tensors; tile expert ids are clamped below it
  uint lda;      // row stride in floats of the A operand (gate/up: x; down: hx); multiple of 4, >= k
  uint ldy;      // row stride in floats of the output (gate/up: hx; down: yx); >= n
};

// ---- expert routing --------------------------------------------------------------------

// One tile of the grouped expert GEMMs: slots [begin, begin + rows) of the grouped order,
// all routed to `expert`; 1 <= rows <= the tile height.
struct MoeTile {
  uint expert;
  uint begin;
  uint rows;
  uint pad;  // 0; keeps the struct 16 bytes
};

// ---- Gated DeltaNet --------------------------------------------------------------------

// ---- attention -------------------------------------------------------------------------

#endif  // LILY_PREFILL_ARGS_H
