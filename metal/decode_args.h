// Argument structs of the decode GEMV / norm / embedding / MoE kernels (metal/gemv.metal,
// norm.metal, embed.metal, moe.metal) and the constants the host shares with them, included by
// the kernels (through common.h) and the host runtime (csrc/runtime/kernel_args.h): every
// field is a 32-bit `uint` or `float` and the file includes nothing (the host defines `uint`,
// and `constant` as nothing). Each struct is bound as `constant T& args [[buffer(n)]]`
// (setBytes). LILY_ARGS_<T> lists a struct's fields in order and the LILY_*_ARG_STRUCTS /
// LILY_*_CONSTANTS lists at the end name what the host reflects (kernel_args.h checks each
// field list against the struct's offsets and size; lily._core.KERNEL_ARGS / CONSTANTS
// export them to Python, which packs arguments by field name).
#ifndef LILY_DECODE_ARGS_H
#define LILY_DECODE_ARGS_H

// MLX affine quantization: 64 consecutive weights of a row share one scale and one bias
// (the host checks a checkpoint against it: csrc/runtime/model.h QuantFormat).
constant constexpr uint kQuantGroup = 64;
// Bytes of one 4-bit row of `cols` weights in that layout: the codes and a bf16 scale and
// bias per group (the decode families' weight traffic: gemv.cpp, embed.cpp, moe.cpp).
constexpr uint q4_row_bytes(uint cols) { return cols / 2 + 2 * 2 * (cols / kQuantGroup); }
// Threads of the GEMV-like decode kernels' threadgroups in the decode step (two simdgroups;
// the host's choice) and moe_down_batch_q4's limit.
constant constexpr uint kGemvThreads = 64;
// Rows of W handled by one simdgroup in gemv_q* and moe_down_q4 (host: grid size). 4, not
// 8: a 2048-row GEMV then runs 512 simdgroups, enough threads to keep every core of a
// 40-core GPU loading (docs/performance.md); norm_gemv_q* take theirs from NormGemvArgs.
constant constexpr uint kGemvRowsPerSimdgroup = 4;
// Rows handled by one simdgroup in moe_gate_up_swiglu_q4 (each row: a gate and an up dot).
constant constexpr uint kGateUpRowsPerSimdgroup = 4;
// Simdgroups sharing a group of rows in gemv_q* and moe_down_q4, each over every
// kGemvSplitK-th run of a row's chunks (q_split_join): a 2048-row output then runs 1024
// simdgroups (32K threads, 820 per core of a 40-core GPU) for the same weight and x bytes per
// simdgroup as 4 rows each, so the cores keep enough loads in flight even if a core needs
// 512 threads to hide the latency (docs/performance.md).
constant constexpr uint kGemvSplitK = 2;
// The largest rows x splits a threadgroup hands through q_split_join (256 threads).
constant constexpr uint kSplitJoinMax = 64;
// Limits of the kernels that take the structs below.
constant constexpr uint kRouteMaxExperts = 1024;   // moe_route*: router logits at most
// The registers per lane of route_topk_simd's instantiations (metal/route.h): up to 256 experts
// (the model's), and up to kRouteMaxExperts.
constant constexpr uint kRouteSimdRowsSmall = 8;
constant constexpr uint kRouteSimdRowsMax = kRouteMaxExperts / 32;
constant constexpr uint kNormGemvMaxMatrices = 4;  // norm_gemv_q*: matrices per dispatch
// embed_q4 / embed_rows_q4: threads per threadgroup, and embedding values per thread (one
// 32-bit word of 4-bit codes: the kernels' per_word = 32 / BITS).
constant constexpr uint kEmbedThreads = 64;
constant constexpr uint kEmbedValuesPerThread = 32 / 4;

// gemv_q4, gemv_q8, gemv_q4_add, gemv_q8_add: y[rows] (=|+=) W[rows, cols] x[cols].
struct GemvArgs {
  uint rows;  // output rows (W's out dimension)
  uint cols;  // input length (W's in dimension); a multiple of 64
};
#define LILY_ARGS_GemvArgs(F) F(rows) F(cols)

// gemv_gated_q4_add, gemv_gated_q8_add: gemv_q*_add on the Gated DeltaNet's gated RMSNorm
// applied while x is loaded: x'[i] = y[i] / sqrt(ss(h) / head_dim + eps) * w[i % head_dim]
// * silu(z[i]), h = i / head_dim, ss(h) = sum of the head's `splits` partial sums of y^2
// (gdn_decode_step's ssq). cols = heads * head_dim.
struct GatedNormArgs {
  uint head_dim;  // Dv (128); a multiple of 32 (the 32 (q4) / 16 (q8) x values of a chunk lie inside one head)
  uint splits;    // NS: partial sums of squares per head (gdn_decode_step's grid y)
  float eps;      // added to the mean of squares (rms_norm_eps, 1e-6)
};
#define LILY_ARGS_GatedNormArgs(F) F(head_dim) F(splits) F(eps)

// embed_q4: out[cols] = dequantized row token[0] of the embedding table [vocab, cols];
// embed_rows_q4: out[r, :] = row tokens[r], for each row r of the grid.
struct EmbedArgs {
  uint cols;   // hidden size; a multiple of 64
  uint vocab;  // rows of the table; a token id >= vocab is clamped to vocab - 1
};
#define LILY_ARGS_EmbedArgs(F) F(cols) F(vocab)

// rms_norm: out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w, for r < rows.
struct NormArgs {
  uint n;     // row length (elements normalised together)
  float eps;  // added to the mean of squares (rms_norm_eps, 1e-6)
};
#define LILY_ARGS_NormArgs(F) F(n) F(eps)

// moe_route: router softmax + top-k + renormalisation, and the shared-expert gate.
struct RouteArgs {
  uint experts;    // router logits (num_experts, 256); at most kRouteMaxExperts
  uint top_k;      // experts kept (num_experts_per_tok, 8); at most 32 and <= experts
  uint hidden;     // length of x and of the 8-bit shared_expert_gate row; multiple of 64
  uint norm_topk;  // 1: weights renormalised over the k kept experts (norm_topk_prob)
};
#define LILY_ARGS_RouteArgs(F) F(experts) F(top_k) F(hidden) F(norm_topk)

// moe_gate_up_swiglu_q4 and moe_down_q4.
struct MoeArgs {
  uint hidden;        // model width (2048); a multiple of 64
  uint inter;         // routed expert intermediate size (moe_intermediate_size, 512); multiple of 64
  uint inter_shared;  // shared expert intermediate size (512); a multiple of 64
  uint experts;       // experts stacked in the switch_mlp tensors (256); ids are clamped below it
  uint top_k;         // routed experts per token (8)
};
#define LILY_ARGS_MoeArgs(F) F(hidden) F(inter) F(inter_shared) F(experts) F(top_k)

// norm_gemv_q4 / norm_gemv_q8: RMSNorm fused into up to kNormGemvMaxMatrices GEMVs that
// share the normalised input: y_m[rows[m]] = W_m (x * rsqrt(mean(x^2) + eps) * w), m < 4.
// Matrix m owns the threadgroups [sum_{i<m} t_i, sum_{i<=m} t_i) of the grid, with
// t_i = ceil(rows[i] / (rows_per_simdgroup * simdgroups per threadgroup / k_splits)).
struct NormGemvArgs {
  uint rows[kNormGemvMaxMatrices];  // output rows of matrices 0..3 (their out dimensions); 0 = slot unused
  uint cols;      // length of x, of the norm weight and of every matrix row (hidden, 2048); multiple of 64
  float eps;      // added to the mean of squares (rms_norm_eps, 1e-6)
  uint write_xn;  // 1: threadgroup 0 also stores the normalised vector to xn [cols]; 0: xn untouched
  uint rows_per_simdgroup;  // 1, 2, 4 or 8: rows each simdgroup computes (the grid follows)
  uint k_splits;  // 1 or 2: simdgroups sharing a group of rows, each over every k_splits-th run of chunks
};
#define LILY_ARGS_NormGemvArgs(F) F(rows) F(cols) F(eps) F(write_xn) F(rows_per_simdgroup) F(k_splits)

// moe_route_gate_up_swiglu_q4: moe_route fused into moe_gate_up_swiglu_q4.
struct MoeRouteArgs {
  uint hidden;        // model width (2048); a multiple of 64
  uint inter;         // routed expert intermediate size (512); a multiple of 64
  uint inter_shared;  // shared expert intermediate size (512); a multiple of 64
  uint experts;       // router logits / experts stacked (256); at most kRouteMaxExperts
  uint top_k;         // routed experts per token (8); at most 32 and <= experts
  uint norm_topk;     // 1: weights renormalised over the k kept experts (norm_topk_prob)
};
#define LILY_ARGS_MoeRouteArgs(F) F(hidden) F(inter) F(inter_shared) F(experts) F(top_k) F(norm_topk)

#define LILY_DECODE_ARG_STRUCTS(S) \
  S(GemvArgs) S(GatedNormArgs) S(EmbedArgs) S(NormArgs) S(RouteArgs) S(MoeArgs) S(NormGemvArgs) S(MoeRouteArgs)
#define LILY_DECODE_CONSTANTS(C) \
  C(kQuantGroup) C(kGemvRowsPerSimdgroup) C(kGateUpRowsPerSimdgroup) C(kGemvSplitK) C(kSplitJoinMax) C(kRouteMaxExperts) \
  C(kRouteSimdRowsSmall) C(kRouteSimdRowsMax) \
  C(kNormGemvMaxMatrices) C(kEmbedThreads) C(kEmbedValuesPerThread) C(kGemvThreads)

#endif  // LILY_DECODE_ARGS_H
