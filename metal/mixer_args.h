// Argument structs of the mixer kernels (metal/attention.metal, metal/gdn.metal); the
// sampling kernels' are in sample_args.h. Each is bound as `constant T& args [[buffer(n)]]`
// (setBytes); the host fills the same layout (all fields 4 bytes: uint / float, no padding).
// Host-side facts (grids, threadgroups, buffer ranges) are in docs/kernels.md, "Attention,
// Gated DeltaNet, sampling". The LILY_ARGS_<T> field lists: decode_args.h.
#ifndef LILY_MIXER_ARGS_H
#define LILY_MIXER_ARGS_H

// gdn_decode_step: state rows a simdgroup updates side by side (gdn.metal): their loads are
// issued together and their arithmetic interleaves, so a simdgroup waits for one round trip per
// ring entry and per step rather than one per row. The runtime's 4 rows per simdgroup are one
// batch.
constant constexpr uint kGdnRowBatch = 4;

// gdn_decode_step_k<Dk>_v<Dv>: one Gated DeltaNet decode step (conv, norms, gates,
// delta-rule update; y and its per-split sums of squares: the gated RMSNorm is out_proj's,
// gemv_gated_q*_add). Dk, Dv are template parameters of the kernel; the grid's y is NS.
struct GdnDecodeArgs {
  uint num_k_heads;   // Hk: key heads (16)
  uint num_v_heads;   // Hv: value heads (32), a multiple of Hk; value head h uses key head h / (Hv / Hk)
  uint conv_kernel;   // K: causal conv taps (4), >= 2; conv state holds the last K-1 inputs
  float l2_eps;       // eps added to the sum of squares in the q/k L2 norm (1e-6)
  uint pending;       // steps since the state was last written back: ring entries to replay (< W)
  uint write_back;    // 1: write the state back (S', c = 1); 0: append this step to ring slot `pending`
};
#define LILY_ARGS_GdnDecodeArgs(F) \
  F(num_k_heads) F(num_v_heads) F(conv_kernel) F(l2_eps) F(pending) F(write_back)

// One ring entry of a Gated DeltaNet layer (floats): a decode step's update, delta per state
// row [Hv*Dv], then the normalised k per key head [Hk*Dk], then g per value head [Hv]
// (metal/gdn.metal, "Write-back window"). The one definition of the layout for host and kernels.
struct GdnRing {
  uint entry;     // floats per entry
  uint delta_at;  // offsets within an entry
  uint k_at;
  uint g_at;
};

inline GdnRing gdn_ring(uint Hk, uint Hv, uint Dk, uint Dv) {
  GdnRing r;
  r.delta_at = 0;
  r.k_at = Hv * Dv;
  r.g_at = Hv * Dv + Hk * Dk;
  r.entry = Hv * Dv + Hk * Dk + Hv;
  return r;
}

// attn_qk_prep: q/k RMSNorm, partial RoPE, KV-cache append, q and gate out.
struct AttnPrepArgs {
  uint num_q_heads;   // Hq (16)
  uint num_kv_heads;  // Hkv (2)
  uint head_dim;      // D (256); the threadgroup has D threads
  uint rotary_dim;    // leading dims that get RoPE (64); dim i pairs with i + rotary_dim / 2
  uint capacity;      // rows per KV head in the cache ([Hkv, capacity, D]); rows >= capacity are not written
  float norm_eps;     // q_norm / k_norm epsilon (1e-6)
  float log2_theta;   // log2(rope_theta) (log2(1e7)); frequency of pair i: theta^(-2i/rotary_dim)
};
#define LILY_ARGS_AttnPrepArgs(F) \
  F(num_q_heads) F(num_kv_heads) F(head_dim) F(rotary_dim) F(capacity) F(norm_eps) F(log2_theta)

// attn_decode_d<D>_g<G> and attn_decode_split_d<D>_g<G>: softmax attention of one new query
// per head over cache rows [0, pos], G query heads per threadgroup sharing one KV head.
struct AttnDecodeArgs {
  uint num_q_heads;   // Hq (16)
  uint num_kv_heads;  // Hkv (2); Hq / Hkv query heads share a KV head, a multiple of G
  uint capacity;      // rows per KV head in the cache
  uint gate_stride;   // elements between the gate vectors of consecutive heads (D compact, 2*D in the q_proj output)
  float scale;        // softmax scale, head_dim^-0.5
  uint block_rows;    // split path only: rows per KV block (B); block b covers [b*B, min((b+1)*B, pos+1))
  uint max_blocks;    // split path only: partial slots per head in the partials buffers (>= blocks dispatched)
};
#define LILY_ARGS_AttnDecodeArgs(F) \
  F(num_q_heads) F(num_kv_heads) F(capacity) F(gate_stride) F(scale) F(block_rows) F(max_blocks)

// attn_decode_fused_d<D>_g<G> and attn_decode_split_fused_d<D>_g<G>: attn_qk_prep and the
// decode attention in one dispatch. Each threadgroup normalises and rotates its own G query
// heads from the q_proj output, computes the new token's k (RMSNorm + RoPE) and v of its KV
// head, attends over cache rows [0, pos) plus the new row held in threadgroup memory (as the
// bf16 values the cache will hold); one threadgroup per KV head appends row pos to the cache.
// D (head_dim) is a template parameter; the gate is read from the q_proj output (stride 2*D).
struct AttnFusedArgs {
  uint num_q_heads;   // Hq (16)
  uint num_kv_heads;  // Hkv (2); Hq / Hkv query heads share a KV head, a multiple of G
  uint rotary_dim;    // leading dims that get RoPE (64), even, <= D; dim i pairs with i + rotary_dim / 2
  uint capacity;      // rows per KV head in the cache ([Hkv, capacity, D]); row pos is written only if pos < capacity
  float norm_eps;     // q_norm / k_norm epsilon (1e-6)
  float log2_theta;   // log2(rope_theta) (log2(1e7))
  float scale;        // softmax scale, head_dim^-0.5
  uint block_rows;    // split path only: rows per KV block (B); block b covers [b*B, min((b+1)*B, pos+1))
  uint max_blocks;    // split path only: partial slots per head in the partials buffers (>= blocks dispatched)
};
#define LILY_ARGS_AttnFusedArgs(F) \
  F(num_q_heads) F(num_kv_heads) F(rotary_dim) F(capacity) F(norm_eps) F(log2_theta) F(scale) F(block_rows) \
  F(max_blocks)

// attn_combine_d<D>: merges the split path's per-block partials into the gated output.
struct AttnCombineArgs {
  uint num_q_heads;   // Hq
  uint gate_stride;   // as AttnDecodeArgs::gate_stride
  uint block_rows;    // B, as given to attn_decode_split
  uint max_blocks;    // as given to attn_decode_split
};
#define LILY_ARGS_AttnCombineArgs(F) F(num_q_heads) F(gate_stride) F(block_rows) F(max_blocks)

#define LILY_MIXER_ARG_STRUCTS(S) \
  S(GdnDecodeArgs) S(AttnPrepArgs) S(AttnDecodeArgs) S(AttnFusedArgs) S(AttnCombineArgs)
// Decode attention (attention.metal): simdgroups per threadgroup of attn_decode*,
// attn_decode_fused* and attn_combine; the host's threadgroups are these times 32.
constant constexpr uint kAttnSimdgroups = 8;
constant constexpr uint kAttnDecodeThreads = kAttnSimdgroups * 32;
constant constexpr uint kCombineSimdgroups = 8;
constant constexpr uint kAttnCombineThreads = kCombineSimdgroups * 32;
// Threadgroup arrays of attn_decode* (floats), declared by the kernels and summed for the
// cost table: red_m and red_l (attn_red_floats: a max and a sum per simdgroup and head), red
// (attn_rows_floats: a D row per simdgroup; the fused kernels' qs, the prepared queries first),
// xch (attn_xch_floats: a simdgroup's 32 scores and G weights); the fused kernels add kcur and
// vcur (the new row's k and v, D each).
constexpr uint attn_red_floats(uint G) { return kAttnSimdgroups * G; }
constexpr uint attn_rows_floats(uint D) { return kAttnSimdgroups * D; }
constexpr uint attn_xch_floats(uint G) { return kAttnSimdgroups * (32 + G); }
constexpr uint attn_decode_fused_smem_bytes(uint D, uint G) {
  return 4 * (2 * attn_red_floats(G) + attn_rows_floats(D) + 2 * D + attn_xch_floats(G));
}

// The q/k L2 norm's epsilon of the Gated DeltaNet (decode step and prefill scan), added to
// the sum of squares (as mlx-lm's qwen3_next, whose l2 norm uses 1e-6).
constant constexpr float kGdnL2Eps = 1e-6f;

#define LILY_MIXER_CONSTANTS(C) \
  C(kGdnL2Eps) C(kGdnRowBatch) C(kAttnSimdgroups) C(kAttnDecodeThreads) C(kCombineSimdgroups) C(kAttnCombineThreads)

#endif  // LILY_MIXER_ARGS_H
