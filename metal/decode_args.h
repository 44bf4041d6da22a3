// Argument structs of the decode GEMV / norm / embedding / MoE kernels (metal/gemv.metal,
// norm.metal, embed.metal, moe.metal), shared by the kernels (through common.h) and the host runtime: every field is
// a 32-bit `uint` or `float` and the file includes nothing (the host defines `uint`). Each
// struct is bound as `constant T& args [[buffer(n)]]` (setBytes).
#ifndef LILY_DECODE_ARGS_H
#define LILY_DECODE_ARGS_H

// gemv_q4, gemv_q8, gemv_q4_add, gemv_q8_add: y[rows] (=|+=) W[rows, cols] x[cols].
struct GemvArgs {
  uint rows;  // output rows (W's out dimension)
  uint cols;  // input length (W's in dimension); a multiple of 64
};

// gemv_gated_q4_add, gemv_gated_q8_add: gemv_q*_add on the Gated DeltaNet's gated RMSNorm
// applied while x is loaded: x'[i] = y[i] / sqrt(ss(h) / head_dim + eps) * w[i % head_dim]
// * silu(z[i]), h = i / head_dim, ss(h) = sum of the head's `splits` partial sums of y^2
// (gdn_decode_step's ssq). cols = heads * head_dim.
struct GatedNormArgs {
  uint head_dim;  // Dv (128); a multiple of 32 (the 32 (q4) / 16 (q8) x values of a chunk lie inside one head)
  uint splits;    // NS: partial sums of squares per head (gdn_decode_step's grid y)
  float eps;      // added to the mean of squares (rms_norm_eps, 1e-6)
};

// embed_q4: out[cols] = dequantized row token[0] of the embedding table [vocab, cols];
// embed_rows_q4: out[r, :] = row tokens[r], for each row r of the grid.
struct EmbedArgs {
  uint cols;   // hidden size; a multiple of 64
  uint vocab;  // rows of the table; a token id >= vocab is clamped to vocab - 1
};

// rms_norm: out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w, for r < rows.
struct NormArgs {
  uint n;     // row length (elements normalised together)
  float eps;  // added to the mean of squares (rms_norm_eps, 1e-6)
};

// moe_route: router softmax + top-k + renormalisation, and the shared-expert gate.
struct RouteArgs {
  uint experts;    // router logits (num_experts, 256); at most kRouteMaxExperts
  uint top_k;      // experts kept (num_experts_per_tok, 8); at most 32 and <= experts
  uint hidden;     // length of x and of the 8-bit shared_expert_gate row; multiple of 64
  uint norm_topk;  // 1: weights renormalised over the k kept experts (norm_topk_prob)
};

// moe_gate_up_swiglu_q4 and moe_down_q4.
struct MoeArgs {
  uint hidden;        // model width (2048); a multiple of 64
  uint inter;         // routed expert intermediate size (moe_intermediate_size, 512); multiple of 64
  uint inter_shared;  // shared expert intermediate size (512); a multiple of 64
  uint experts;       // experts stacked in the switch_mlp tensors (256); ids are clamped below it
  uint top_k;         // routed experts per token (8)
};

// norm_gemv_q4 / norm_gemv_q8: RMSNorm fused into up to kNormGemvMaxMatrices GEMVs that
// share the normalised input: y_m[rows[m]] = W_m (x * rsqrt(mean(x^2) + eps) * w), m < 4.
// Matrix m owns the threadgroups [sum_{i<m} t_i, sum_{i<=m} t_i) of the grid, with
// t_i = ceil(rows[i] / (rows_per_simdgroup * simdgroups per threadgroup / k_splits)).
struct NormGemvArgs {
  uint rows[4];   // output rows of matrices 0..3 (their out dimensions); 0 = slot unused
  uint cols;      // length of x, of the norm weight and of every matrix row (hidden, 2048); multiple of 64
  float eps;      // added to the mean of squares (rms_norm_eps, 1e-6)
  uint write_xn;  // 1: threadgroup 0 also stores the normalised vector to xn [cols]; 0: xn untouched
  uint rows_per_simdgroup;  // 1, 2, 4 or 8: rows each simdgroup computes (the grid follows)
  uint k_splits;  // 1 or 2: simdgroups sharing a group of rows, each over every k_splits-th run of chunks
};

// moe_route_gate_up_swiglu_q4: moe_route fused into moe_gate_up_swiglu_q4.
struct MoeRouteArgs {
  uint hidden;        // model width (2048); a multiple of 64
  uint inter;         // routed expert intermediate size (512); a multiple of 64
  uint inter_shared;  // shared expert intermediate size (512); a multiple of 64
  uint experts;       // router logits / experts stacked (256); at most kRouteMaxExperts
  uint top_k;         // routed experts per token (8); at most 32 and <= experts
  uint norm_topk;     // 1: weights renormalised over the k kept experts (norm_topk_prob)
};

#endif  // LILY_DECODE_ARGS_H
