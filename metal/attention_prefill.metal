// Full-attention prefill kernels (docs/model.md, "Full attention"; docs/goals.md, prefill
// attention). One chunk: M rows at absolute positions p0 .. p0 + M - 1 (docs/prefill.md).
//
//   attn_prefill_prep_d<D>    per row: q/k RMSNorm, partial RoPE at the row's position, bf16
//                             K and V rows p0 + i written to the KV cache, q out fp32 [M, Hq, D].
//                             Reads the projections as bfloat (q_proj, k_proj, v_proj store them
//                             so), then the float32 arithmetic of attn_qk_prep term for term: on
//                             the same values the cache rows (and q) equal the ones decode
//                             writes, bit for bit.
//   attn_prefill_prep_d<D>_qbf the same with q out as the tensor-op attention's operand
//                             (attention_prefill_tensor.metal): bfloat(q * q_scale), laid out
//                             [Hq / G, M, G, D] (G = q_group).
//   attn_prefill_d<D>_g<G>    causal flash attention: chunk row i attends cache rows [0, p0 + i]
//                             (rows < p0 from earlier chunks, the rest from this chunk's prep),
//                             online softmax in fp32, output * sigmoid(gate) -> bfloat
//                             [M, Hq*D] (o_proj's input); the gate read as bfloat (qg).
//                             One threadgroup per (block of 64/G chunk rows, G query heads of one
//                             KV head): every 32-row K/V tile is copied once into threadgroup
//                             memory for all 64 (row, head) pairs; Q K^T and P V on bfloat
//                             simdgroup_matrix operands (q * scale and P rounded to bf16, K/V
//                             as cached) with fp32 accumulation.
//   attn_prefill_split_d<D>_g<G> + attn_prefill_combine_d<D>
//                             the same with the KV range cut into splits of S rows (a third grid
//                             dimension) writing partials (max, sum, unnormalised output); the
//                             combine merges them per (row, head) and applies the gate (bfloat out). For
//                             short chunks after a long prefix, where the plain grid has too few
//                             threadgroups to fill the GPU.
//
// KV cache layout per layer: K and V each bf16 [Hkv, capacity, D] (metal/attention.metal).
#include <metal_stdlib>
#include "common.h"  // sigmoid
#include "prefill_args.h"
#include "attention_prefill.h"
using namespace metal;

namespace attn_prefill_detail {


// ---- prep ----

// Element i of query head h of chunk row `row` out: fp32 [M, Hq, D] as computed, or bfloat
// q * q_scale (round to nearest even; bf16 has fp32's range: no clamp) in the tensor-op
// layout [Hq / G, M, G, D].
inline void prep_q_out(device float* q, constant AttnPrefillPrepArgs& args, uint D, uint row, uint h, uint i, float y) {
  q[(ulong(row) * args.num_q_heads + h) * D + i] = y;
}
inline void prep_q_out(device bfloat* q, constant AttnPrefillPrepArgs& args, uint D, uint row, uint h, uint i, float y) {
  const uint G = args.q_group;
  q[((ulong(h / G) * args.rows + row) * G + h % G) * D + i] = bfloat(y * args.q_scale);
}

// ---- attention ----
constant constexpr uint kThreads = kAttnPrefillThreads;  // 8 simdgroups (prefill_args.h)
constant constexpr uint kRows = kAttnPrefillPairs;       // (chunk row, head) pairs: 8 per simdgroup
using namespace attn_prefill_shared;

// Chunk rows per threadgroup: pair r is chunk row r % BQ of the block, head r / BQ.
template <uint G>
struct QRows {
  static constant constexpr uint BQ = kRows / G;
};

// Per-simdgroup scratch (threadgroup memory, private to one simdgroup: only simdgroup
// barriers order it): scores, P as bfloat, diag(corr), staging of Q and O fragments.
// Its layout: prefill_args.h (kAttnPrefillSg*, read by the cost table).
struct SgScratch {
  static constant constexpr uint s = 0;                     // float [8, kTile] scores
  static constant constexpr uint d = kAttnPrefillSgCorr;    // float [8, 8] diag(corr), off-diagonal 0
  static constant constexpr uint l = kAttnPrefillSgSums;    // float [8] row sums, then 1 / l
  static constant constexpr uint m = kAttnPrefillSgMax;     // float [8] row reference max
  static constant constexpr uint floats = kAttnPrefillSgFloats;
  static constant constexpr uint bfloats = kAttnPrefillSgBfloats;  // bfloat [8, kTile] P, also Q staging
};

// The attention of one threadgroup over cache rows [kbeg, kend) (clipped per row to the causal
// limit). SPLIT = false: writes out = O / l * sigmoid(gate); SPLIT = true: writes the partials
// of split `split`.
//
// Pair r < kRows of the threadgroup is chunk row row0 + r % BQ of query head h0 + r / BQ
// (BQ = kRows / G >= 8): simdgroup sg owns pairs 8 sg .. 8 sg + 7 (one head, 8 consecutive
// chunk rows) for the whole tile loop, so only the K/V tile is shared. Per tile:
//   load K (all threads), barrier;
//   S = Q K^T   each simdgroup its 8 x kTile block over all D (Q in bfloat registers), into its
//               scratch; barrier (K no longer read), then V is loaded into the same buffer
//               while each simdgroup runs its online softmax:
//   softmax     lane owns row lane / 4, columns 8 (lane % 4) .. +7; row max and sum by xor
//               shuffles over 4 lanes; m, l in those lanes' registers; P rounded to bf16;
//   barrier (V complete); O (8 x D, fp32, in registers) = diag(corr) O + P V; barrier.
// Four threadgroup barriers per 32 KV rows (two per 16, half of the fp32 16-row design).
template <uint D, uint G, bool SPLIT>
static inline void attend(device const float* q, device const bfloat* qg,
                          device const bfloat* k_cache, device const bfloat* v_cache,
                          device bfloat* out, device float* part_ml, device float* part_o,
                          constant AttnPrefillArgs& args, uint block, uint h0, uint split,
                          threadgroup bfloat* kv,        // [kTile * D] K or V tile
                          threadgroup float* scratch,    // [8 * SgScratch::floats]
                          threadgroup bfloat* pscratch,  // [8 * SgScratch::bfloats]
                          uint tid, uint sg, uint lane) {
  constexpr uint BQ = QRows<G>::BQ;
  constexpr uint NF = D / 8;  // Q and O fragments of a simdgroup
  constexpr uint KB = kTile / 8;
  const uint Hq = args.num_q_heads;
  const uint M = args.rows;
  const uint group = Hq / args.num_kv_heads;
  const uint kvh = h0 / group;
  const uint row0 = block * BQ;
  const uint last = min(row0 + BQ, M) - 1;  // last chunk row of the block
  uint kbeg;
  uint kend;
  if (!kv_range<SPLIT>(args, last, split, kbeg, kend)) {
    return;  // uniform: no row of this block reaches split `split`
  }
  const uint h = h0 + (8 * sg) / BQ;        // the simdgroup's head
  const uint srow0 = row0 + (8 * sg) % BQ;  // its first chunk row
  threadgroup float* sc = scratch + sg * SgScratch::floats;
  threadgroup bfloat* ph = pscratch + sg * SgScratch::bfloats;

  // Q (times the scale, as attend_rows) into bfloat registers, one 8x8 fragment at a time
  // through the simdgroup's scratch; rows past the chunk are zero.
  simdgroup_bfloat8x8 qf[NF];
  {
    const uint r = lane / 4;
    const uint c2 = 2 * (lane % 4);
    const uint row = srow0 + r;
    for (uint c = 0; c < NF; ++c) {
      float2 x = float2(0.0f);
      if (row < M) {
        x = float2(*(device const float2*)(q + (ulong(row) * Hq + h) * D + c * 8 + c2)) * args.scale;
      }
      ph[r * 8 + c2] = bfloat(x.x);
      ph[r * 8 + c2 + 1] = bfloat(x.y);
      simdgroup_barrier(mem_flags::mem_threadgroup);
      simdgroup_load(qf[c], ph, 8);
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
  for (uint e = lane; e < 64; e += 32) {
    sc[SgScratch::d + e] = 0.0f;  // diag(corr): the diagonal is rewritten every tile
  }

  // softmax role: row sr of the slab, columns 8*su .. 8*su+7 of the tile
  const uint sr = lane / 4;
  const uint su = lane % 4;
  const uint srow = min(srow0 + sr, M - 1);  // rows past the chunk copy the last one
  const uint spos = args.p0 + srow;          // keys <= spos are attended
  float m = -INFINITY;
  float l = 0.0f;

  simdgroup_float8x8 of[NF];
  for (uint i = 0; i < NF; ++i) {
    of[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  device const bfloat* khead = k_cache + ulong(kvh) * args.capacity * D;
  device const bfloat* vhead = v_cache + ulong(kvh) * args.capacity * D;

  for (uint t0 = kbeg; t0 < kend; t0 += kTile) {
    load_tile<D, kThreads>(khead, t0, kend, kv, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kb = 0; kb < KB; ++kb) {  // S[:, 8 kb .. 8 kb + 7] = Q K_kb^T
      simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      threadgroup const bfloat* kt0 = kv + kb * 8 * D;
      for (uint c = 0; c < NF; ++c) {
        simdgroup_bfloat8x8 kt;
        simdgroup_load(kt, kt0 + c * 8, D, ulong2(0, 0), true);  // kt[d][key] = K[key][c*8 + d]
        simdgroup_multiply_accumulate(acc, qf[c], kt, acc);
      }
      simdgroup_store(acc, sc + SgScratch::s + kb * 8, kTile);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with K
    load_tile<D, kThreads>(vhead, t0, kend, kv, tid);
    simdgroup_barrier(mem_flags::mem_threadgroup);    // this simdgroup's scores are visible
    float corr;
    {  // online softmax of row sr over the tile
      float s[8];
      for (uint j = 0; j < 8; ++j) {
        const uint key = t0 + 8 * su + j;
        const float x = sc[SgScratch::s + sr * kTile + 8 * su + j];
        s[j] = (key <= spos && key < kend) ? x : -INFINITY;
      }
      corr = softmax_row<8, 3, bfloat>(s, m, l, ph + sr * kTile + 8 * su);
      if (su == 0) {
        sc[SgScratch::d + sr * 9] = corr;
      }
    }
    const bool rescale = simd_any(corr != 1.0f);
    simdgroup_barrier(mem_flags::mem_threadgroup);  // P and diag(corr) are visible
    if (rescale) {  // uniform across the simdgroup
      simdgroup_float8x8 dm;
      simdgroup_load(dm, sc + SgScratch::d, 8);
      for (uint i = 0; i < NF; ++i) {
        simdgroup_multiply(of[i], dm, of[i]);
      }
    }
    simdgroup_bfloat8x8 pf[KB];
    for (uint kb = 0; kb < KB; ++kb) {
      simdgroup_load(pf[kb], ph + kb * 8, kTile);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the V tile is complete
    for (uint i = 0; i < NF; ++i) {  // O[:, 8i .. 8i+7] += P V[:, 8i .. 8i+7]
      for (uint kb = 0; kb < KB; ++kb) {
        simdgroup_bfloat8x8 vf;
        simdgroup_load(vf, kv + kb * 8 * D + i * 8, D);
        simdgroup_multiply_accumulate(of[i], pf[kb], vf, of[i]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // kv free for the next tile
  }

  // O out one 8x8 fragment at a time through the simdgroup's scratch (no threadgroup barrier)
  if (su == 0) {
    sc[SgScratch::l + sr] = SPLIT ? l : 1.0f / l;
    sc[SgScratch::m + sr] = m;
  }
  const uint r = lane / 4;
  const uint c2 = 2 * (lane % 4);
  const uint row = srow0 + r;
  simdgroup_barrier(mem_flags::mem_threadgroup);
  if (SPLIT && row < M && lane % 4 == 0) {
    const ulong slot = (ulong(split) * M + row) * Hq + h;
    part_ml[2 * slot] = sc[SgScratch::m + r];
    part_ml[2 * slot + 1] = sc[SgScratch::l + r];
  }
  for (uint i = 0; i < NF; ++i) {
    simdgroup_store(of[i], sc + SgScratch::s, 8);
    simdgroup_barrier(mem_flags::mem_threadgroup);
    const float2 o = float2(sc[SgScratch::s + r * 8 + c2], sc[SgScratch::s + r * 8 + c2 + 1]);
    if (row < M) {
      const uint d = i * 8 + c2;
      if (SPLIT) {
        const ulong slot = (ulong(split) * M + row) * Hq + h;
        *(device float2*)(part_o + slot * D + d) = o;
      } else {
        const float2 gate = float2(*(device const bfloat2*)(qg + (ulong(row) * Hq + h) * 2 * D + D + d));
        const float2 y = o * sc[SgScratch::l + r];
        *(device bfloat2*)(out + (ulong(row) * Hq + h) * D + d) =
            bfloat2(float2(y.x * sigmoid(gate.x), y.y * sigmoid(gate.y)));
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // the fragment is read before the next store
  }
}

}  // namespace attn_prefill_detail

// ---- attn_prefill_prep -----------------------------------------------------------------------
// Grid: (ceil(M / 8), Hq + Hkv) threadgroups of 256 threads. Threadgroup (x, t): chunk rows
// 8x .. 8x+7 (simdgroup s takes row 8x + s), vector t (t < Hq: query head t; else KV head
// t - Hq). Lane l holds elements l, l + 32, ... of the row's vector (coalesced), so each
// simd_sum covers the same 32 consecutive elements as attn_qk_prep's simdgroups and the
// partial sums are added in the same order: the results are attn_qk_prep's bit for bit.
template <uint D, typename QT>
[[max_total_threads_per_threadgroup(kAttnPrefillPrepThreads)]] kernel void attn_prefill_prep(device const bfloat* qg [[buffer(0)]],        // bfloat [M, Hq*2*D] q_proj output: query | gate per head
                              device const bfloat* k [[buffer(1)]],         // bfloat [M, Hkv*D] k_proj output
                              device const bfloat* v [[buffer(2)]],         // bfloat [M, Hkv*D] v_proj output
                              device const bfloat* q_norm_w [[buffer(3)]],  // [D]
                              device const bfloat* k_norm_w [[buffer(4)]],  // [D]
                              device bfloat* k_cache [[buffer(5)]],         // [Hkv, capacity, D], rows p0 .. p0+M-1 written
                              device bfloat* v_cache [[buffer(6)]],         // [Hkv, capacity, D], rows p0 .. p0+M-1 written
                              device QT* q_out [[buffer(7)]],               // normed, rotated queries (prep_q_out)
                              constant AttnPrefillPrepArgs& args [[buffer(8)]],
                              uint2 tg [[threadgroup_position_in_grid]],
                              uint sg [[simdgroup_index_in_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint NC = D / 32;
  constexpr uint NXS = kAttnPrefillPrepRows * D;
  threadgroup float xs[NXS];
  const uint row = tg.x * kAttnPrefillPrepRows + sg;
  if (row >= args.rows) {
    return;  // the whole simdgroup; the kernel has no threadgroup barrier
  }
  const uint Hq = args.num_q_heads;
  const uint Hkv = args.num_kv_heads;
  const uint head = tg.y;
  const bool is_q = head < Hq;
  const uint kvh = head - Hq;
  const uint pos = args.p0 + row;
  device const bfloat* src = is_q ? qg + (ulong(row) * Hq + head) * 2 * D
                                   : k + (ulong(row) * Hkv + kvh) * D;
  float x[NC];
  float total = 0.0f;
  for (uint c = 0; c < NC; ++c) {
    x[c] = float(src[c * 32 + lane]);
    total += simd_sum(x[c] * x[c]);
  }
  const float den = sqrt(total / float(D) + args.norm_eps);
  threadgroup float* xr = xs + sg * D;
  const uint rot = args.rotary_dim;
  const uint half_rot = rot / 2;
  float xn[NC];
  for (uint c = 0; c < NC; ++c) {
    const uint i = c * 32 + lane;
    const float w = float(is_q ? q_norm_w[i] : k_norm_w[i]);
    xn[c] = x[c] / den * w;
    xr[i] = xn[c];
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (uint c = 0; c < NC; ++c) {
    const uint i = c * 32 + lane;
    float y = xn[c];
    if (i < rot) {
      const uint j = i < half_rot ? i : i - half_rot;
      const float inv_freq = exp2(-(float(2 * j) / float(rot)) * args.log2_theta);
      const float ang = float(pos) * inv_freq;
      const float cs = cos(ang);
      const float sn = sin(ang);
      y = i < half_rot ? xn[c] * cs - xr[i + half_rot] * sn : xn[c] * cs + xr[i - half_rot] * sn;
    }
    if (is_q) {
      attn_prefill_detail::prep_q_out(q_out, args, D, row, head, i, y);
    } else if (pos < args.capacity) {
      const ulong crow = (ulong(kvh) * args.capacity + pos) * D;
      k_cache[crow + i] = bfloat(y);
      v_cache[crow + i] = bfloat(float(v[(ulong(row) * Hkv + kvh) * D + i]));
    }
  }
}

// ---- attn_prefill ------------------------------------------------------------------------------
// Grid: (ceil(M / BQ), Hq / G) threadgroups of 256 threads, BQ = 64 / G chunk rows per
// threadgroup. Threadgroup (x, y): query heads y*G .. y*G+G-1 (KV head y*G / (Hq/Hkv)), chunk
// rows block*BQ .. block*BQ+BQ-1 with block = ceil(M/BQ) - 1 - x (the longest causal ranges
// are dispatched first).
template <uint D, uint G>
[[max_total_threads_per_threadgroup(kAttnPrefillThreads)]] kernel void attn_prefill(device const float* q [[buffer(0)]],          // [M, Hq, D] from attn_prefill_prep
                         device const bfloat* qg [[buffer(1)]],        // bfloat [M, Hq*2*D] q_proj output (gate: second D of each head)
                         device const bfloat* k_cache [[buffer(2)]],   // [Hkv, capacity, D], rows [0, p0 + M) read
                         device const bfloat* v_cache [[buffer(3)]],   // [Hkv, capacity, D], rows [0, p0 + M) read
                         device bfloat* out [[buffer(4)]],             // bfloat [M, Hq*D] attention * sigmoid(gate)
                         constant AttnPrefillArgs& args [[buffer(5)]],
                         uint2 tg [[threadgroup_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  using namespace attn_prefill_detail;
  static_assert(G == 2 || G == 4 || G == 8, "G: 2, 4 or 8 query heads per threadgroup");
  static_assert(D % 16 == 0 && D <= 256, "D: a multiple of 16, at most 256");
  threadgroup bfloat4 kv4[kTile * D / 4];  // bfloat4: load_tile writes it as bfloat4
  threadgroup float scratch[kThreads / 32 * SgScratch::floats];
  threadgroup bfloat pscratch[kThreads / 32 * SgScratch::bfloats];
  const uint nblocks = (args.rows + QRows<G>::BQ - 1) / QRows<G>::BQ;
  if (tg.x >= nblocks) {
    return;
  }
  attend<D, G, false>(q, qg, k_cache, v_cache, out, nullptr, nullptr, args, nblocks - 1 - tg.x, tg.y * G,
                      0, (threadgroup bfloat*)kv4, scratch, pscratch, tid, sg, lane);
}

// ---- attn_prefill_split ----------------------------------------------------------------------
// Grid: (ceil(M / BQ), Hq / G, num_splits) threadgroups of 256 threads; split z attends cache
// rows [z*S, min((z+1)*S, p0 + i + 1)) for chunk row i. Threadgroups whose block has no row
// reaching split z return at once. Partials per split z, chunk row i, head h (slot
// (z*M + i)*Hq + h): part_ml[2*slot] = max score, part_ml[2*slot+1] = sum of exp,
// part_o[slot*D + d] = unnormalised output. Merge with attn_prefill_combine_d<D>.
template <uint D, uint G>
[[max_total_threads_per_threadgroup(kAttnPrefillThreads)]] kernel void attn_prefill_split(device const float* q [[buffer(0)]],         // [M, Hq, D]
                               device const bfloat* k_cache [[buffer(1)]],  // [Hkv, capacity, D]
                               device const bfloat* v_cache [[buffer(2)]],  // [Hkv, capacity, D]
                               device float* part_ml [[buffer(3)]],         // [num_splits, M, Hq, 2]
                               device float* part_o [[buffer(4)]],          // [num_splits, M, Hq, D]
                               constant AttnPrefillArgs& args [[buffer(5)]],
                               uint3 tg [[threadgroup_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  using namespace attn_prefill_detail;
  static_assert(G == 2 || G == 4 || G == 8, "G: 2, 4 or 8 query heads per threadgroup");
  static_assert(D % 16 == 0 && D <= 256, "D: a multiple of 16, at most 256");
  threadgroup bfloat4 kv4[kTile * D / 4];  // bfloat4: load_tile writes it as bfloat4
  threadgroup float scratch[kThreads / 32 * SgScratch::floats];
  threadgroup bfloat pscratch[kThreads / 32 * SgScratch::bfloats];
  const uint nblocks = (args.rows + QRows<G>::BQ - 1) / QRows<G>::BQ;
  if (tg.x >= nblocks || tg.z >= args.num_splits) {
    return;
  }
  attend<D, G, true>(q, nullptr, k_cache, v_cache, nullptr, part_ml, part_o, args, nblocks - 1 - tg.x,
                     tg.y * G, tg.z, (threadgroup bfloat*)kv4, scratch, pscratch, tid, sg, lane);
}

// ---- attn_prefill_combine --------------------------------------------------------------------
// Grid: (Hq, M) threadgroups of D threads. Threadgroup (h, i) merges the partials of the
// splits that hold cache rows <= p0 + i (z < min(floor((p0 + i) / S) + 1, num_splits)).
template <uint D>
[[max_total_threads_per_threadgroup(256)]] kernel void attn_prefill_combine(device const float* part_ml [[buffer(0)]],  // [num_splits, M, Hq, 2]
                                 device const float* part_o [[buffer(1)]],   // [num_splits, M, Hq, D]
                                 device const bfloat* qg [[buffer(2)]],      // bfloat [M, Hq*2*D] (gate)
                                 device bfloat* out [[buffer(3)]],           // bfloat [M, Hq*D]
                                 constant AttnPrefillArgs& args [[buffer(4)]],
                                 uint2 tg [[threadgroup_position_in_grid]],
                                 uint d [[thread_index_in_threadgroup]]) {
  const uint Hq = args.num_q_heads;
  const uint h = tg.x;
  const uint row = tg.y;
  if (h >= Hq || row >= args.rows) {
    return;
  }
  const uint pos = args.p0 + row;
  const uint ns = min(pos / args.split_rows + 1, args.num_splits);
  float mx = -INFINITY;
  for (uint z = 0; z < ns; ++z) {
    mx = max(mx, part_ml[2 * ((ulong(z) * args.rows + row) * Hq + h)]);
  }
  float L = 0.0f;
  float o = 0.0f;
  for (uint z = 0; z < ns; ++z) {
    const ulong slot = (ulong(z) * args.rows + row) * Hq + h;
    const float w = exp(part_ml[2 * slot] - mx);
    L += part_ml[2 * slot + 1] * w;
    o += part_o[slot * D + d] * w;
  }
  const float gate = float(qg[(ulong(row) * Hq + h) * 2 * D + D + d]);
  out[(ulong(row) * Hq + h) * D + d] = bfloat(o / L * sigmoid(gate));
}

// Instantiations: D = 256 (the model and the "dims" preset: G = 8, one threadgroup column per KV
// head), D = 64 (the "tiny" preset, G = 2); every G in {8, 4, 2} for both head dims.
template [[host_name("attn_prefill_prep_d256")]] [[kernel]] decltype(attn_prefill_prep<256, float>) attn_prefill_prep<256, float>;
template [[host_name("attn_prefill_prep_d64")]] [[kernel]] decltype(attn_prefill_prep<64, float>) attn_prefill_prep<64, float>;
template [[host_name("attn_prefill_prep_d256_qbf")]] [[kernel]] decltype(attn_prefill_prep<256, bfloat>) attn_prefill_prep<256, bfloat>;
template [[host_name("attn_prefill_prep_d64_qbf")]] [[kernel]] decltype(attn_prefill_prep<64, bfloat>) attn_prefill_prep<64, bfloat>;
template [[host_name("attn_prefill_d256_g8")]] [[kernel]] decltype(attn_prefill<256, 8>) attn_prefill<256, 8>;
template [[host_name("attn_prefill_d256_g4")]] [[kernel]] decltype(attn_prefill<256, 4>) attn_prefill<256, 4>;
template [[host_name("attn_prefill_d256_g2")]] [[kernel]] decltype(attn_prefill<256, 2>) attn_prefill<256, 2>;
template [[host_name("attn_prefill_d64_g8")]] [[kernel]] decltype(attn_prefill<64, 8>) attn_prefill<64, 8>;
template [[host_name("attn_prefill_d64_g4")]] [[kernel]] decltype(attn_prefill<64, 4>) attn_prefill<64, 4>;
template [[host_name("attn_prefill_d64_g2")]] [[kernel]] decltype(attn_prefill<64, 2>) attn_prefill<64, 2>;
template [[host_name("attn_prefill_split_d256_g8")]] [[kernel]] decltype(attn_prefill_split<256, 8>) attn_prefill_split<256, 8>;
template [[host_name("attn_prefill_split_d256_g4")]] [[kernel]] decltype(attn_prefill_split<256, 4>) attn_prefill_split<256, 4>;
template [[host_name("attn_prefill_split_d256_g2")]] [[kernel]] decltype(attn_prefill_split<256, 2>) attn_prefill_split<256, 2>;
template [[host_name("attn_prefill_split_d64_g8")]] [[kernel]] decltype(attn_prefill_split<64, 8>) attn_prefill_split<64, 8>;
template [[host_name("attn_prefill_split_d64_g4")]] [[kernel]] decltype(attn_prefill_split<64, 4>) attn_prefill_split<64, 4>;
template [[host_name("attn_prefill_split_d64_g2")]] [[kernel]] decltype(attn_prefill_split<64, 2>) attn_prefill_split<64, 2>;
template [[host_name("attn_prefill_combine_d256")]] [[kernel]] decltype(attn_prefill_combine<256>) attn_prefill_combine<256>;
template [[host_name("attn_prefill_combine_d64")]] [[kernel]] decltype(attn_prefill_combine<64>) attn_prefill_combine<64>;
