// Argument structs of the prefill kernels (docs/prefill.md), shared by the kernels and the
// host runtime: the host includes this file too, so every field is a 32-bit `uint` or
// `float` (the host defines `uint` as uint32_t) and the file includes nothing. Each struct is
// bound as `constant T& args [[buffer(n)]]` (setBytes). The LILY_ARGS_<T> field lists and the
// constants the host reflects: decode_args.h.
#ifndef LILY_PREFILL_ARGS_H
#define LILY_PREFILL_ARGS_H

// ---- GEMM (metal/gemm.metal, tensor-op path) ------------------------------------------

// gemm_q4, gemm_q8, gemm_q4_add_h, gemm_q4_bf16, gemm_swiglu_q4 (and their *_tensor twins): dense GEMMs over
// a quantized weight W [n, k] (MLX affine layout): y[m, n] (=|+=) x[m, k] W^T, or
// y = silu(x Wg^T) * (x Wu^T). x (bfloat) and y (fp32, or bfloat) are row-major with their own row strides, so a
// dispatch may read a column block of a wider matrix and write a column block of another.
struct GemmArgs {
  uint m;    // rows of x and y (tokens of the chunk); any >= 1
  uint n;    // output columns (W's out dimension); any >= 1
  uint k;    // inner dimension (W's in dimension); a multiple of 64
  uint lda;  // row stride of x in floats; a multiple of 4, >= k
  uint ldy;  // row stride of y in floats; >= n (y[r, c] is at y[r * ldy + c])
};
#define LILY_ARGS_GemmArgs(F) F(m) F(n) F(k) F(lda) F(ldy)

// gemm_swiglu_q4 (and its tensor twin): the row scale g's stride, row r at g[r * ldg]
// (the routing weights [m, top_k + 1] bound at column top_k: ldg = top_k + 1).
struct GemmRowScaleArgs {
  uint ldg;
};
#define LILY_ARGS_GemmRowScaleArgs(F) F(ldg)

// gemm_q4_add_hs (and its tensor twin): y += (x * s) W^T, x bfloat with a half scale per group
// of 2^shift consecutive elements of a row: element i of x (counted from x's start, rows at
// the stride lda, a multiple of 2^shift) is multiplied by s[i >> shift] (s: [m, lda >>
// shift]). The GDN out_proj: u times gdn_norm_scale's per (token, head, scan split) factor.
struct GemmAScaleArgs {
  uint shift;  // log2 of the elements per scale, >= 2 and <= 6 (a group inside one 64-wide k step)
};
#define LILY_ARGS_GemmAScaleArgs(F) F(shift)

// moe_gemm_gate_up_q4_t*, moe_gemm_down_q4_t* (and their *_tensor twins): grouped expert
// GEMMs over the tile map (MoeTile below; docs/prefill.md). Slot s of a tile holds the
// assignment perm[s] = row * top_k + j of expert tile.expert.
//   gate/up: hx[s, :n] = silu(x[perm[s] / top_k] Wg_e^T) * (x[perm[s] / top_k] Wu_e^T)
//   down:    yx[perm[s], :n] = hx[s] Wd_e^T  (fp32 sums, stored as bfloat)
struct MoeGemmArgs {
  uint n;        // output columns: inter (gate/up) or hidden (down); any >= 1
  uint k;        // inner dimension: hidden (gate/up) or inter (down); a multiple of 64
  uint m;        // rows (tokens) of the chunk: x has m rows, perm and hx/yx m * top_k
  uint top_k;    // routed experts per row (num_experts_per_tok, 8)
  uint experts;  // experts stacked in the weight tensors; tile expert ids are clamped below it
  uint lda;      // row stride in floats of the A operand (gate/up: x; down: hx); multiple of 4, >= k
  uint ldy;      // row stride in floats of the output (gate/up: hx; down: yx); >= n
  uint tile_rows;  // T of the chunk's tiling (MoeRoutePrefillArgs::tile_rows): which tile class
                   // this dispatch runs; read by the performance model (cost.cpp), not the kernel
};
#define LILY_ARGS_MoeGemmArgs(F) F(n) F(k) F(m) F(top_k) F(experts) F(lda) F(ldy) F(tile_rows)

// ---- expert routing --------------------------------------------------------------------

// One tile of the grouped expert GEMMs: slots [begin, begin + rows) of the grouped order,
// all routed to `expert`; 1 <= rows <= the tile height.
struct MoeTile {
  uint expert;
  uint begin;
  uint rows;
  uint pad;  // 0; keeps the struct 16 bytes
};
#define LILY_ARGS_MoeTile(F) F(expert) F(begin) F(rows) F(pad)

// Tile classes (docs/prefill.md, "Tile classes"): an expert's assignments are cut into full
// tiles of the chunk's height T (16, 32, 64 or 128) and one last tile of the remainder r
// (1 <= r <= T), which goes to the smallest class that holds it. Class c has height T >> c,
// c < moe_tile_classes(T): with T = 64 the classes are 64, 32, 16 (the heights the grouped
// GEMMs are built for). Each class has its own tile map and count and runs as its own
// dispatch of the moe_gemm_*_t<T >> c> kernels. With r uniform in 1..64 (routing skewed
// enough that counts spread over many tile heights), the last tile holds 11.5 padded rows
// on average instead of 31.5 with 64-row tiles only. T = 128 (tensor-op path only) has one
// class: its kernels compute a partial tile's live blocks of moe_gemm_band rows only (below),
// so a last tile pads 15.5 rows on average without smaller classes. Shared by
// moe_route_scatter and the host (prefill.cpp), the one home of the rule.
enum : uint { kMoeTileClasses = 3 };  // at most
inline uint moe_tile_classes(uint T) { return T >= 128 ? 1u : T >= 64 ? 3u : T >= 32 ? 2u : 1u; }
// The class of an expert's last tile of r rows, 1 <= r <= T.
inline uint moe_tail_class(uint T, uint r) {
  uint c = 0;
  while (c + 1 < moe_tile_classes(T) && r <= (T >> (c + 1))) {
    ++c;
  }
  return c;
}
// The fewest rows a tile of class c holds: one more than the next smaller class, else 1.
inline uint moe_class_min_rows(uint T, uint c) {
  return c + 1 < moe_tile_classes(T) ? (T >> (c + 1)) + 1u : 1u;
}
// Tiles of class c that a chunk of n assignments over E experts can hold at most: each holds
// at least moe_class_min_rows; every class but 0 holds at most one tile per expert, class 0
// also the n / T full tiles.
inline uint moe_class_capacity(uint n, uint E, uint T, uint c) {
  const uint lo = moe_class_min_rows(T, c);
  const uint tails = E < n / lo ? E : n / lo;
  return c > 0 ? tails : (n / lo < n / T + tails ? n / lo : n / T + tails);
}
// First entry of class c's map in the tile-map buffer (the maps lie back to back, by class).
inline uint moe_class_base(uint n, uint E, uint T, uint c) {
  uint base = 0;
  for (uint i = 0; i < c; ++i) {
    base += moe_class_capacity(n, E, T, i);
  }
  return base;
}

// The grouped expert GEMMs' geometry, the one home of the numbers the kernels are
// instantiated with (moe_gemm_*_q4_t<T>, moe_prefill.metal; moe_gemm_*_q4_t<T>_tensor,
// moe_prefill_tensor.metal), the host dispatches (moe_geometry, csrc/runtime/families/
// moe_prefill.cpp) and the cost table models (cost.cpp). The tile heights T, in the order the
// host keeps their pipelines (PrefillPlan; lily._core.EXPERT_TILE_ROWS); those above
// kMoeSimdgroupTileRowsMax exist on the tensor-op path only.
constant constexpr uint kExpertTileRows[] = {16, 32, 64, 128};
enum : uint {
  kMoeSimdgroupTileRowsMax = 64,
  // [[max_total_threads_per_threadgroup]] of moe_gemm_*_q4_t<T> (the most of any T: 4
  // simdgroups at T = 32 and 64) and of the _tensor twins (8 at T = 128)
  kMoeGemmMaxThreads = 128,
  kMoeGemmTensorMaxThreads = 256,
};
// A threadgroup of a tile of height T on a path (tensor: the _tensor kernels) for nb weight
// matrices (2: gate/up, 1: down) is SM x SN simdgroups (32 SM SN threads) computing BN output
// columns of the T rows:
//   simdgroup_matrix  T = 16: 1 x 2, BN 64; T = 32: 2 x 2, BN 64; T = 64: gate/up 4 x 1, BN 32
//                     (two staged 64 x 64 fp32 blocks would exceed 32 KiB), down 2 x 2, BN 64
//   tensor-op         SM = 1, 2, 2, 4 at T = 16, 32, 64, 128, SN = 2; BN gate/up 32, down 64
constexpr uint moe_gemm_sm(uint T, bool tensor, uint nb) {
  return T <= 16 ? 1u : T >= 128 ? 4u : T >= 64 && !tensor && nb == 2 ? 4u : 2u;
}
constexpr uint moe_gemm_sn(uint T, bool tensor, uint nb) { return T >= 64 && !tensor && nb == 2 ? 1u : 2u; }
constexpr uint moe_gemm_bn(uint T, bool tensor, uint nb) { return nb == 2 && (tensor || T >= 64) ? 32u : 64u; }
constexpr uint moe_gemm_threads(uint T, bool tensor, uint nb) {
  return 32u * moe_gemm_sm(T, tensor, nb) * moe_gemm_sn(T, tensor, nb);
}
// Rows of one simdgroup's block, T / SM: on the tensor-op path the granularity at which a
// partial tile's padding rows are skipped (a simdgroup whose rows all lie past the tile's
// runs no tensor operation; gemm_tensor.h).
constexpr uint moe_gemm_band(uint T, bool tensor, uint nb) { return T / moe_gemm_sm(T, tensor, nb); }

// Assignments of one block of the routing histogram, at most (threadgroup memory of
// moe_route_scatter): block_rows * top_k <= kMoeRouteMaxBlockSlots.
enum : uint { kMoeRouteMaxBlockSlots = 1024 };
// Threads per threadgroup: moe_route_topk and moe_route_scatter at most (the host gives one
// per expert, rounded up to whole simdgroups), moe_route_clear and moe_combine as the host
// dispatches them (their declared maxima).
enum : uint { kMoeRouteMaxThreads = 1024, kMoeRouteClearThreads = 256, kMoeCombineThreads = 64 };

// moe_route_clear, moe_route_topk, moe_route_scatter (metal/moe_prefill.metal): the expert
// routing of one chunk. blocks = ceil(rows / block_rows) rows of the histogram.
struct MoeRoutePrefillArgs {
  uint rows;        // M: rows (tokens) of the chunk, >= 1
  uint experts;     // E: router logits per row before the shared-gate logit (256); <= 1024
  uint top_k;       // k: experts per row (8); 1..32 and <= experts
  uint norm_topk;   // 1: weights renormalised over the k kept experts (norm_topk_prob)
  uint block_rows;  // rows per histogram block / moe_route_scatter threadgroup (64); >= 1
  uint tile_rows;   // T: height of the full tiles of the grouped GEMMs: 16, 32, 64 or 128 (tile classes above)
};
#define LILY_ARGS_MoeRoutePrefillArgs(F) F(rows) F(experts) F(top_k) F(norm_topk) F(block_rows) F(tile_rows)

// moe_combine: h[row] += sum_j w[row, j] yx[row*k + j] (yx bfloat, h and w fp32; summed in
// fp32; the shared expert is already in h).
struct MoeCombineArgs {
  uint rows;    // M: rows of the chunk
  uint hidden;  // H: row length (2048); a multiple of 4
  uint top_k;   // k: routed experts per row (8); >= 1
};
#define LILY_ARGS_MoeCombineArgs(F) F(rows) F(hidden) F(top_k)

// ---- Gated DeltaNet --------------------------------------------------------------------

// gdn_conv_state (metal/gdn_prefill.metal): the conv state after a chunk, the last K-1 rows
// of [conv state | qkv rows] (the output may be the input state's own bytes). Grid: C threads.
struct GdnConvStateArgs {
  uint conv_dim;  // C = 2*Hk*Dk + Hv*Dv channels per row (8192); row stride of qkv
  uint rows;      // M: tokens in the chunk, >= 1; M * C < 2^32
};
#define LILY_ARGS_GdnConvStateArgs(F) F(conv_dim) F(rows)
// Threads per threadgroup of gdn_conv_state (one channel each) and gdn_norm_scale (one
// (token, head) each), as the prefill plan dispatches them: the kernels' limits.
constant constexpr uint kGdnConvStateThreads = 256;
constant constexpr uint kGdnNormScaleThreads = 256;
// Causal conv taps of the prefill kernels (the model's linear_conv_kernel_dim).
enum : uint { kGdnConvTaps = 4 };

// gdn_scan_k<Dk>_v<Dv>_r<RV> (metal/gdn_prefill.metal): causal conv + SiLU, L2 norms, gates,
// delta rule over the chunk with the recurrent state held in registers, then the per-element
// part of the gated RMSNorm: writes u (bfloat) and the sums of y^2 of each (token, head, split
// of RV rows). Grid: Hv x Dv/RV threadgroups of RV * kGdnScanLanesPerRow threads.
// gdn_norm_scale_v<Dv>_r<RV>: from those sums, the half factor per (token, head, split) that
// out_proj (gemm_q4_add_hs) applies to u; grid M*Hv threads.
struct GdnScanArgs {
  uint num_k_heads;  // Hk: key heads (16)
  uint num_v_heads;  // Hv: value heads (32), a multiple of Hk; value head h uses key head h / (Hv / Hk)
  uint rows;         // M: tokens in the chunk, >= 1
  float norm_eps;    // eps of the gated RMSNorm over Dv (1e-6)
  float l2_eps;      // eps added to the sum of squares in the q/k L2 norm (1e-6)
};
#define LILY_ARGS_GdnScanArgs(F) F(num_k_heads) F(num_v_heads) F(rows) F(norm_eps) F(l2_eps)
// gdn_scan folds a row's pending decay into S' once c * g < kGdnScanFold (metal/gdn_prefill.metal,
// "Lazy decay", says why 2^-40).
constant constexpr float kGdnScanFold = 1.0f / 1099511627776.0f;  // 2^-40 exactly (no hex float in C++14)
// gdn_scan: lanes sharing one state row (a dot product is log2 4 = 2 shuffle-add levels) and
// tokens per threadgroup-memory block (two staged tokens per simdgroup at RV = 32).
enum : uint { kGdnScanLanesPerRow = 4, kGdnScanTokensPerBlock = 8 };
// gdn_scan_k<dk>_v<dv>_r<rv>'s threadgroup memory, as the kernel declares it: per staged token
// q and k (dk floats each), v and y of its rv rows, g and beta.
constexpr uint gdn_scan_smem_bytes(uint dk, uint rv) { return kGdnScanTokensPerBlock * (2 * dk + 2 * rv + 2) * 4; }

// ---- attention -------------------------------------------------------------------------
// metal/attention_prefill.metal; host facts in docs/prefill.md ("Attention: chunk q/k
// preparation and causal flash attention"). The chunk is M rows at absolute positions
// p0 .. p0 + M - 1; D (head_dim) and G (query heads per threadgroup) are template parameters.

// The attention kernels' shape, shared by both paths and read by the host, the cost table and
// the lab twin (lily._core.CONSTANTS): a threadgroup of kAttnPrefillThreads threads serves
// kAttnPrefillPairs (chunk row, query head) pairs, G heads of one KV head times
// kAttnPrefillPairs / G chunk rows, and walks the cache in tiles of kAttnPrefillTile rows. A
// row keeps its reference max until a tile's max exceeds it by more than kAttnPrefillRescale
// (lazy rescaling, as FlashAttention-4: P = exp(s - m) <= e^8). The tensor-op kernel
// (attention_prefill_tensor.metal) gives each pair of simdgroups a slab of
// kAttnPrefillSlabRows pairs, one half of the head dim each (as MLX's attention_nax_dsplit).
enum : uint {
  kAttnPrefillThreads = 256,
  kAttnPrefillPairs = 64,
  kAttnPrefillTile = 32,
  kAttnPrefillSlabRows = 16,
  // attn_prefill_prep: chunk rows per threadgroup, one simdgroup each
  kAttnPrefillPrepRows = 8,
  kAttnPrefillPrepThreads = kAttnPrefillPrepRows * 32,
  // attn_layout_probe_d<D> (attention_prefill_tensor.metal): one simdgroup records, for each
  // of the register path's kAttnLayoutProbeTensors cooperative tensors (scores, P, O), lane and
  // slot below kAttnLayoutProbeSlots, kAttnLayoutProbeFields ints: {valid, row, column, the
  // fragment layout's row, its column}, and per tensor and lane kAttnLayoutProbeLaneFields
  // ints: {the lane's verdict, the tensor's capacity}
  kAttnLayoutProbeThreads = 32,
  kAttnLayoutProbeTensors = 3,
  kAttnLayoutProbeSlots = 32,
  kAttnLayoutProbeFields = 5,
  kAttnLayoutProbeLaneFields = 2,
};
constant constexpr float kAttnPrefillRescale = 8.0f;
// Threadgroup memory of the attention kernels, declared by them and read by the cost table.
// attention_prefill.metal: the bfloat K/V tile [kAttnPrefillTile, D] of the threadgroup and
// per simdgroup (its 8 pairs) a private scratch of floats (the scores [8, kTile] at 0,
// diag(corr) [8, 8] at kAttnPrefillSgCorr, the row sums [8] at kAttnPrefillSgSums, the
// reference maxima [8] at kAttnPrefillSgMax) and bfloats (P [8, kTile], also Q staging).
// attention_prefill_tensor.metal: the fp32 scores and bfloat P [kAttnPrefillPairs,
// kAttnPrefillTile] and per slab kAttnPrefillSlabValues floats: corr, 1 / l (or l) and m
// [kAttnPrefillSlabRows] each, then the slab's rescale flag (Q, O and V are in registers).
enum : uint {
  kAttnPrefillSgCorr = 8 * kAttnPrefillTile,
  kAttnPrefillSgSums = kAttnPrefillSgCorr + 64,
  kAttnPrefillSgMax = kAttnPrefillSgSums + 8,
  kAttnPrefillSgFloats = kAttnPrefillSgMax + 8,
  kAttnPrefillSgBfloats = 8 * kAttnPrefillTile,
  kAttnPrefillSlabValues = 3 * kAttnPrefillSlabRows + 1,
};
constexpr uint attn_prefill_smem_bytes(uint D) {
  return 2 * kAttnPrefillTile * D +
         kAttnPrefillThreads / 32 * (4 * kAttnPrefillSgFloats + 2 * kAttnPrefillSgBfloats);
}
constexpr uint attn_prefill_tensor_smem_bytes() {
  return (4 + 2) * kAttnPrefillPairs * kAttnPrefillTile +
         4 * (kAttnPrefillPairs / kAttnPrefillSlabRows) * kAttnPrefillSlabValues;
}

// attn_prefill_prep_d<D>[_qbf]: q/k RMSNorm + partial RoPE per row, bf16 K/V rows p0 .. p0+M-1
// written to the cache, q out fp32 [M, Hq, D] (_qbf: bfloat q * q_scale [Hq/G, M, G, D]). Same
// float32 arithmetic as attn_qk_prep.
struct AttnPrefillPrepArgs {
  uint num_q_heads;   // Hq (16)
  uint num_kv_heads;  // Hkv (2)
  uint rotary_dim;    // leading dims that get RoPE (64), even, <= D; dim i pairs with i + rotary_dim / 2
  uint capacity;      // rows per KV head in the cache ([Hkv, capacity, D]); rows >= capacity are not written
  uint p0;            // absolute position of chunk row 0
  uint rows;          // M: rows in the chunk (>= 1)
  float norm_eps;     // q_norm / k_norm epsilon (1e-6)
  float log2_theta;   // log2(rope_theta) (log2(1e7)); frequency of pair i: theta^(-2i/rotary_dim)
  float q_scale;      // _qbf only: factor of q before its bfloat rounding (the softmax scale, head_dim^-0.5)
  uint q_group;       // _qbf only: G, the query heads of one tensor-op attention threadgroup (2, 4 or 8)
};
#define LILY_ARGS_AttnPrefillPrepArgs(F) \
  F(num_q_heads) F(num_kv_heads) F(rotary_dim) F(capacity) F(p0) F(rows) F(norm_eps) F(log2_theta) F(q_scale) \
  F(q_group)

// attn_prefill_d<D>_g<G>, attn_prefill_split_d<D>_g<G>, attn_prefill_combine_d<D>: causal
// attention of chunk row i over cache rows [0, p0 + i]. Split path: KV range cut into
// splits of split_rows rows; split s covers cache rows [s*split_rows, (s+1)*split_rows).
struct AttnPrefillArgs {
  uint num_q_heads;   // Hq (16)
  uint num_kv_heads;  // Hkv (2); Hq / Hkv query heads share a KV head, a multiple of G
  uint capacity;      // rows per KV head in the cache; p0 + M <= capacity
  uint p0;            // absolute position of chunk row 0
  uint rows;          // M: rows in the chunk (>= 1)
  float scale;        // softmax scale, head_dim^-0.5
  uint split_rows;    // split path and combine only: KV rows per split (S >= 1); 0 otherwise
  uint num_splits;    // split path and combine only: splits dispatched, num_splits * S >= p0 + M; 0 otherwise
};
#define LILY_ARGS_AttnPrefillArgs(F) \
  F(num_q_heads) F(num_kv_heads) F(capacity) F(p0) F(rows) F(scale) F(split_rows) F(num_splits)

#define LILY_PREFILL_ARG_STRUCTS(S) \
  S(GemmArgs) S(GemmRowScaleArgs) S(GemmAScaleArgs) S(MoeGemmArgs) S(MoeTile) S(MoeRoutePrefillArgs) \
  S(MoeCombineArgs) S(GdnConvStateArgs) S(GdnScanArgs) S(AttnPrefillPrepArgs) S(AttnPrefillArgs)
#define LILY_PREFILL_CONSTANTS(C) \
  C(kMoeTileClasses) C(kMoeSimdgroupTileRowsMax) C(kMoeGemmMaxThreads) C(kMoeGemmTensorMaxThreads) \
  C(kMoeRouteMaxBlockSlots) C(kMoeRouteMaxThreads) C(kMoeRouteClearThreads) C(kMoeCombineThreads) \
  C(kGdnConvTaps) C(kGdnScanLanesPerRow) C(kGdnConvStateThreads) C(kGdnNormScaleThreads) \
  C(kGdnScanTokensPerBlock) C(kGdnScanFold) C(kAttnPrefillThreads) C(kAttnPrefillPairs) C(kAttnPrefillTile) \
  C(kAttnPrefillPrepRows) C(kAttnPrefillPrepThreads) \
  C(kAttnPrefillSlabRows) C(kAttnPrefillRescale) C(kAttnLayoutProbeThreads) C(kAttnLayoutProbeTensors) \
  C(kAttnLayoutProbeSlots) C(kAttnLayoutProbeFields) C(kAttnLayoutProbeLaneFields)

#endif  // LILY_PREFILL_ARGS_H
