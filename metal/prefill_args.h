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

// ---- Gated DeltaNet --------------------------------------------------------------------

// ---- attention -------------------------------------------------------------------------
// metal/attention_prefill.metal; host facts in docs/prefill.md ("Attention: chunk q/k
// preparation and causal flash attention"). The chunk is M rows at absolute positions
// p0 .. p0 + M - 1; D (head_dim) and G (query heads per threadgroup) are template parameters.

// attn_prefill_prep_d<D>: q/k RMSNorm + partial RoPE per row, bf16 K/V rows p0 .. p0+M-1
// written to the cache, q out fp32 [M, Hq, D]. Same float32 arithmetic as attn_qk_prep.
struct AttnPrefillPrepArgs {
  uint num_q_heads;   // Hq (16)
  uint num_kv_heads;  // Hkv (2)
  uint rotary_dim;    // leading dims that get RoPE (64), even, <= D; dim i pairs with i + rotary_dim / 2
  uint capacity;      // rows per KV head in the cache ([Hkv, capacity, D]); rows >= capacity are not written
  uint p0;            // absolute position of chunk row 0
  uint rows;          // M: rows in the chunk (>= 1)
  float norm_eps;     // q_norm / k_norm epsilon (1e-6)
  float log2_theta;   // log2(rope_theta) (log2(1e7)); frequency of pair i: theta^(-2i/rotary_dim)
};

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

#endif  // LILY_PREFILL_ARGS_H
