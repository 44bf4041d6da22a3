// Router softmax + top-k of one row, shared by the decode MoE kernels (metal/moe.metal) and
// the prefill routing kernels (metal/moe_prefill.metal), so decode and prefill pick the same
// experts with bit-identical weights from the same logits.
#pragma once

#include <metal_stdlib>
using namespace metal;

#include "common.h"

// ---- router softmax + top-k -----------------------------------------------------------
// p = softmax(logits[0..n)) in fp32 into probs, then `rounds` rounds of a threadgroup
// argmax (the largest p, ties to the lower index; a chosen expert's p becomes -1). The
// softmax sum is taken in an order that does not depend on the threadgroup size (rows of
// 32 consecutive experts summed by simd_sum, then the row sums in row order), so every
// kernel and threadgroup size gets bit-identical probabilities, picks and weights.
// Threadgroup arrays: probs [kRouteMaxExperts], rowsum, scratch, best_p, best_i [32].
// `want` < rounds: the round whose pick every thread gets back in want_id.
struct RoutePicks {
  uint my_id;     // thread j < rounds: the expert of round j
  float my_p;     // thread j < rounds: its probability
  float top_sum;  // every thread: the sum of the picked probabilities
  uint want_id;   // every thread: the expert of round `want` (0xFFFFFFFF if not run)
};

// Records round j's pick (expert wi, probability wp) in the picks of thread `me`.
inline void route_take(thread RoutePicks& out, uint j, uint want, uint me, uint wi, float wp) {
  if (me == j) {
    out.my_id = wi;
    out.my_p = wp;
  }
  out.top_sum += wp;
  out.want_id = j == want ? wi : out.want_id;
}

inline RoutePicks route_topk(device const float* logits, uint n, uint rounds, uint want,
                             threadgroup float* probs, threadgroup float* rowsum,
                             threadgroup float* scratch, threadgroup float* best_p,
                             threadgroup uint* best_i, uint tid, uint tcount, uint sg,
                             uint lane, uint nsg) {
  // softmax (fp32)
  float m = -INFINITY;
  for (uint i = tid; i < n; i += tcount) {
    m = max(m, logits[i]);
  }
  m = threadgroup_max(m, scratch, sg, lane, nsg);
  const uint nrow = (n + 31) / 32;
  for (uint r = sg; r < nrow; r += nsg) {  // uniform over the simdgroup
    const uint i = r * 32 + lane;
    const float e = i < n ? exp(logits[i] - m) : 0.0f;
    if (i < n) {
      probs[i] = e;
    }
    const float rs = simd_sum(e);
    if (lane == 0) {
      rowsum[r] = rs;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float s = 0.0f;
  for (uint r = 0; r < nrow; ++r) {
    s += rowsum[r];
  }
  // each thread rescales the experts of its own rows (written by itself above)
  for (uint r = sg; r < nrow; r += nsg) {
    const uint i = r * 32 + lane;
    if (i < n) {
      probs[i] = probs[i] / s;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  RoutePicks out = {0u, 0.0f, 0.0f, 0xFFFFFFFFu};
  for (uint j = 0; j < rounds; ++j) {
    float bp = -1.0f;
    uint bi = 0xFFFFFFFFu;
    for (uint i = tid; i < n; i += tcount) {  // increasing i: keeps the lowest index on ties
      const float p = probs[i];
      if (p > bp) {
        bp = p;
        bi = i;
      }
    }
    const float sp = simd_max(bp);
    const uint si = simd_min(bp == sp ? bi : 0xFFFFFFFFu);
    if (lane == 0) {
      best_p[sg] = sp;
      best_i[sg] = si;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float wp = best_p[0];
    uint wi = best_i[0];
    for (uint g = 1; g < nsg; ++g) {
      if (best_p[g] > wp || (best_p[g] == wp && best_i[g] < wi)) {
        wp = best_p[g];
        wi = best_i[g];
      }
    }
    route_take(out, j, want, tid, wi, wp);
    if (tid == 0 && wi < n) {
      probs[wi] = -1.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  return out;
}

// ---- router softmax + top-k in one simdgroup ------------------------------------------
// route_topk's arithmetic without threadgroup memory or barriers: each simdgroup computes
// the routing on its own, lane l holding the probabilities of experts r * 32 + l in its RPL
// registers (RPL >= ceil(n / 32); the caller instantiates the smallest of a few, so a round
// walks only the registers the expert count needs). The maximum is exact whatever the order,
// the row sums are the same simd_sums added in the same row order, and a round's winner
// (largest p, ties to the lower index) does not depend on how the search is split, so the
// picks and weights are bit-identical to route_topk's. A lane finds its own best by a tree
// over its registers (log2 RPL levels), then simd_max / simd_min pick the simdgroup's. Used
// by the decode gate/up kernel, whose every simdgroup needs its slot's expert before its
// first weight load: a few shuffles per round instead of barrier-separated threadgroup
// rounds. n <= 32 * RPL <= kRouteMaxExperts; `rounds` is uniform over the simdgroup.
// The registers per lane of its instantiations (kRouteSimdRowsSmall, kRouteSimdRowsMax) are in
// decode_args.h (the cost table reads them).

// The probabilities of route_topk_simd: lane l's register r holds p of expert r * 32 + l
// (softmax in fp32), -1 past n and for NaN.
template <uint RPL>
inline void route_probs_simd(device const float* logits, uint n, uint lane, thread float* p) {
  const uint nrow = (n + 31) / 32;
  float m = -INFINITY;
  for (uint r = 0; r < RPL; ++r) {
    const uint i = r * 32 + lane;
    p[r] = (r < nrow && i < n) ? logits[i] : -INFINITY;
    m = max(m, p[r]);
  }
  m = simd_max(m);
  float s = 0.0f;
  for (uint r = 0; r < RPL; ++r) {
    if (r < nrow) {  // uniform over the simdgroup
      const uint i = r * 32 + lane;
      const float e = i < n ? exp(p[r] - m) : 0.0f;
      p[r] = e;
      s += simd_sum(e);
    }
  }
  for (uint r = 0; r < RPL; ++r) {
    const uint i = r * 32 + lane;
    const float q = (r < nrow && i < n) ? p[r] / s : -1.0f;  // past n: never picked
    p[r] = q > -1.0f ? q : -1.0f;  // NaN, which no round picks, as -1 (the tree compares)
  }
}

// The round at which route_topk_simd would pick expert e (< n) from the probabilities p of
// route_probs_simd: the experts ahead of it in the rounds' order (larger p, or equal p and a
// lower index). e is among the top k iff the result is < k. Uniform e; every lane gets it.
template <uint RPL>
inline uint route_rank_simd(thread const float* p, uint e, uint lane) {
  float pe = 0.0f;
  for (uint r = 0; r < RPL; ++r) {
    pe = r == e / 32 ? p[r] : pe;
  }
  pe = simd_shuffle(pe, ushort(e % 32));
  uint ahead = 0;
  for (uint r = 0; r < RPL; ++r) {
    const uint i = r * 32 + lane;
    ahead += (p[r] > pe || (p[r] == pe && i < e)) ? 1u : 0u;
  }
  return simd_sum(ahead);
}

template <uint RPL>
inline RoutePicks route_topk_simd(device const float* logits, uint n, uint rounds, uint want,
                                  uint lane) {
  float p[RPL];
  route_probs_simd<RPL>(logits, n, lane, p);

  RoutePicks out = {0u, 0.0f, 0.0f, 0xFFFFFFFFu};
  for (uint j = 0; j < rounds; ++j) {
    // this lane's largest p, the lowest register (= expert index) on ties
    float tp[RPL];
    uint tr[RPL];
    for (uint r = 0; r < RPL; ++r) {
      tp[r] = p[r];
      tr[r] = r;
    }
    for (uint w = RPL / 2; w >= 1; w /= 2) {
      for (uint r = 0; r < w; ++r) {
        const bool hi = tp[r + w] > tp[r] || (tp[r + w] == tp[r] && tr[r + w] < tr[r]);
        tp[r] = hi ? tp[r + w] : tp[r];
        tr[r] = hi ? tr[r + w] : tr[r];
      }
    }
    const float bp = tp[0] > -1.0f ? tp[0] : -1.0f;
    const uint bi = tp[0] > -1.0f ? tr[0] * 32 + lane : 0xFFFFFFFFu;
    const float wp = simd_max(bp);
    const uint wi = simd_min(bp == wp ? bi : 0xFFFFFFFFu);
    if (wi < n && wi % 32 == lane) {
      for (uint r = 0; r < RPL; ++r) {
        p[r] = r == wi / 32 ? -1.0f : p[r];
      }
    }
    route_take(out, j, want, lane, wi, wp);
  }
  return out;
}
