// Pieces of the prefill attention shared by the simdgroup_matrix kernels
// (attention_prefill.metal) and the Metal 4 tensor-operation variants
// (attention_prefill_tensor.metal): the KV tile, its loader, the lazy-rescale threshold and
// the KV range of a query block. Both paths walk the same tiles with the same fp32 online
// softmax per row on bfloat matrix operands (q * scale and P rounded to bf16, K/V as cached:
// no conversion, nothing clipped), as MLX's NAX attention.
#pragma once

#include <metal_stdlib>
using namespace metal;

#include "common.h"
#include "prefill_args.h"

namespace attn_prefill_shared {

constant constexpr uint kTile = kAttnPrefillTile;  // KV rows per tile (prefill_args.h)
// Lazy rescaling (as FlashAttention-4; prefill_args.h kAttnPrefillRescale): a row keeps its
// reference max m until a tile's max exceeds it by more than kRescale, so P = exp(s - m) <= e^8
// ~ 2981 and the O rescale runs only when a row's max jumps. The output O / l is the same for
// any reference: both carry the same factor exp(-m).
constant constexpr float kRescale = kAttnPrefillRescale;

// K or V rows [t0, t0 + kTile) of one KV head into kv [kTile, D], a plain bf16 copy; rows
// >= kend are zero (masked, and a zero row keeps 0 * v finite in P V: the cache past the
// context may hold anything). NT threads; lane-adjacent threads read adjacent 8-byte chunks
// of a row.
template <uint D, uint NT>
static inline void load_tile(device const bfloat* head, uint t0, uint kend, threadgroup bfloat* kv, uint tid) {
  constexpr uint N4 = kTile * D / 4;
  threadgroup bfloat4* kv4 = (threadgroup bfloat4*)kv;
  for (uint e = tid; e < N4; e += NT) {
    const uint r = (4 * e) / D;
    const uint d = (4 * e) % D;
    const uint key = t0 + r;
    bfloat4 x = bfloat4(0.0f);
    if (key < kend) { x = ((device const bfloat4*)(head + ulong(key) * D))[d / 4]; }
    kv4[e] = x;
  }
}

// Cache rows [kbeg, kend) a block of chunk rows [row0, last] attends (clipped per row to its
// causal limit later): all rows up to the last row's position, cut to split `split` on the
// split path. Returns false when no row of the block reaches the split.
template <bool SPLIT>
static inline bool kv_range(constant AttnPrefillArgs& args, uint last, uint split, thread uint& kbeg,
                            thread uint& kend) {
  kbeg = 0;
  kend = args.p0 + last + 1;
  if (SPLIT) {
    kbeg = split * args.split_rows;
    if (kbeg >= kend) {
      return false;
    }
    kend = min(kend, kbeg + args.split_rows);
  }
  return true;
}

// One row's online-softmax update over its scores s[0 .. N) of a tile (masked ones -inf),
// the row spread over the lanes that differ from this one in the bits of LANE_BITS only
// (xor-shuffle reductions, lowest bit first: 1 for two adjacent lanes, 3 for four, 9 for the
// tensor ops' 16 x 16 fragments: attention_prefill_tensor.metal): moves the reference max m by
// the lazy rule, writes P = exp(s - m) rounded to PT (the P V operand type: bfloat) to p
// (threadgroup or thread memory), updates l with the sum of the rounded P, returns the factor
// O must be multiplied by (1: unchanged).
template <uint N, ushort LANE_BITS, typename PT, typename PPtr>
static inline float softmax_row(thread const float* s, thread float& m, thread float& l, PPtr p) {
  float mx = -INFINITY;
  for (uint j = 0; j < N; ++j) {
    mx = max(mx, s[j]);
  }
  for (ushort x = 1; x < 32; x *= 2) {
    if (LANE_BITS & x) {
      mx = max(mx, simd_shuffle_xor(mx, x));
    }
  }
  float corr = 1.0f;
  if (mx > m + kRescale) {  // also the first tile with an attended key (m = -inf)
    corr = m == -INFINITY ? 1.0f : exp(m - mx);  // O and l are still 0 when m = -inf
    m = mx;
  }
  const float mref = m == -INFINITY ? 0.0f : m;  // a row with nothing attended yet
  float ps = 0.0f;
  for (uint j = 0; j < N; ++j) {
    const PT pj = PT(exp(s[j] - mref));
    p[j] = pj;
    ps += float(pj);
  }
  for (ushort x = 1; x < 32; x *= 2) {
    if (LANE_BITS & x) {
      ps += simd_shuffle_xor(ps, x);
    }
  }
  l = l * corr + ps;
  return corr;
}

}  // namespace attn_prefill_shared
