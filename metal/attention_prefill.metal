// Full-attention prefill kernels (docs/model.md, "Full attention"; docs/goals.md, prefill
// attention). One chunk: M rows at absolute positions p0 .. p0 + M - 1 (docs/prefill.md).
//
//   attn_prefill_prep_d<D>    per row: q/k RMSNorm, partial RoPE at the row's position, bf16
//                             K and V rows p0 + i written to the KV cache, q out fp32 [M, Hq, D].
//                             The float32 arithmetic of attn_qk_prep term for term, so the cache
//                             rows (and q) equal the ones decode writes, bit for bit.
//   attn_prefill_d<D>_g<G>    causal flash attention: chunk row i attends cache rows [0, p0 + i]
//                             (rows < p0 from earlier chunks, the rest from this chunk's prep),
//                             online softmax in fp32, output * sigmoid(gate) -> fp32 [M, Hq*D].
//                             One threadgroup per (block of 32/G chunk rows, G query heads of one
//                             KV head): every K/V tile is loaded once into threadgroup memory for
//                             all 32 (row, head) pairs; Q K^T and P V on simdgroup_matrix.
//   attn_prefill_split_d<D>_g<G> + attn_prefill_combine_d<D>
//                             the same with the KV range cut into splits of S rows (a third grid
//                             dimension) writing partials (max, sum, unnormalised output); the
//                             combine merges them per (row, head) and applies the gate. For
//                             short chunks after a long prefix, where the plain grid has too few
//                             threadgroups to fill the GPU.
//
// KV cache layout per layer: K and V each bf16 [Hkv, capacity, D] (metal/attention.metal).
#include <metal_stdlib>
#include "common.h"  // sigmoid
#include "prefill_args.h"
using namespace metal;

namespace attn_prefill_detail {


// ---- prep ----
constant constexpr uint kPrepRows = 8;  // rows per prep threadgroup: one simdgroup per row

// ---- attention ----
constant constexpr uint kThreads = 256;  // 8 simdgroups
constant constexpr uint kRows = 32;      // (chunk row, head) pairs per threadgroup: 4 slabs of 8
constant constexpr uint kTile = 16;      // KV rows per tile

// K or V rows [t0, t0 + kTile) of one KV head into kv [kTile, D] as float; rows >= kend are
// zero (they are masked, and a zero row keeps 0 * v finite in P V). Lane-adjacent threads read
// adjacent 8-byte chunks of a row: each load instruction of a simdgroup covers 256 bytes.
template <uint D>
static inline void load_tile(device const bfloat* head, uint t0, uint kend, threadgroup float* kv,
                             uint tid) {
  constexpr uint N4 = kTile * D / 4;
  threadgroup float4* kv4 = (threadgroup float4*)kv;
  for (uint e = tid; e < N4; e += kThreads) {
    const uint r = (4 * e) / D;
    const uint d = (4 * e) % D;
    const uint key = t0 + r;
    float4 x = float4(0.0f);
    if (key < kend) {
      x = float4(((device const bfloat4*)(head + ulong(key) * D))[d / 4]);
    }
    kv4[e] = x;
  }
}

// Row r of the threadgroup's query matrix (r < kRows) is chunk row row0 + r % BQ of query head
// h0 + r / BQ (BQ = kRows / G); slab s = rows 8s .. 8s+7 (G <= 4: one head, 8 consecutive chunk
// rows; G = 8: two heads, 4 rows each).
template <uint G>
struct QRows {
  static constant constexpr uint BQ = kRows / G;
};

// The attention of one threadgroup over cache rows [kbeg, kend) (clipped per row to the causal
// limit). SPLIT = false: writes out = O / l * sigmoid(gate); SPLIT = true: writes the partials
// of split `split`.
//
// Work split (8 simdgroups, slab = sg / 2, kh = sg % 2):
//   S = Q K^T   simdgroup sg computes the 8 x 8 block (slab, keys 8*kh .. 8*kh+7) of the
//               32 x 16 score tile over all D (Q of its slab in registers, K^T from the tile);
//   softmax     thread t owns row t / 8, columns 2*(t % 8), +1 of the tile; row max and sum
//               by xor shuffles over the 8 lanes of the row; m, l stay in those lanes' registers;
//   P V         simdgroup sg owns columns [kh*D/2, (kh+1)*D/2) of O for its slab's 8 rows
//               (D/16 8x8 accumulators in registers); the running rescale diag(corr) * O is an
//               8x8 product, skipped when no row of the slab changed its max (exactly diag(1)).
template <uint D, uint G, bool SPLIT>
static inline void attend(device const float* q, device const float* qg,
                          device const bfloat* k_cache, device const bfloat* v_cache,
                          device float* out, device float* part_ml, device float* part_o,
                          constant AttnPrefillArgs& args, uint block, uint h0, uint split,
                          threadgroup float* kv,     // [kTile * D]: Q staging, K or V tile, O staging
                          threadgroup float* sbuf,   // [kRows * kTile]: scores, then P
                          threadgroup float* diag,   // [4 * 64]: diag(corr) per slab
                          threadgroup float* mrow,   // [kRows]
                          threadgroup float* lrow,   // [kRows]
                          uint tid, uint sg, uint lane) {
  constexpr uint BQ = QRows<G>::BQ;
  constexpr uint NQF = D / 8;   // Q fragments of a slab
  constexpr uint NOF = D / 16;  // O fragments of a simdgroup
  const uint Hq = args.num_q_heads;
  const uint M = args.rows;
  const uint group = Hq / args.num_kv_heads;
  const uint kvh = h0 / group;
  const uint row0 = block * BQ;
  const uint last = min(row0 + BQ, M) - 1;  // last chunk row of the block
  uint kbeg = 0;
  uint kend = args.p0 + last + 1;           // keys needed by the block's last row
  if (SPLIT) {
    kbeg = split * args.split_rows;
    if (kbeg >= kend) {
      return;  // uniform: no row of this block reaches split `split`
    }
    kend = min(kend, kbeg + args.split_rows);
  }
  const uint slab = sg / 2;
  const uint kh = sg % 2;    // S: key block of the tile; P V: column half of O

  // Q of the slab (pre-multiplied by the scale, as attend_rows) into registers, staged through
  // kv in two passes of 16 rows; rows past the chunk are zero.
  simdgroup_float8x8 qf[NQF];
  for (uint pass = 0; pass < 2; ++pass) {
    for (uint e = tid; e < 16 * D / 4; e += kThreads) {
      const uint r = pass * 16 + (4 * e) / D;
      const uint d = (4 * e) % D;
      const uint row = row0 + r % BQ;
      const uint h = h0 + r / BQ;
      float4 x = float4(0.0f);
      if (row < M) {
        x = ((device const float4*)(q + (ulong(row) * Hq + h) * D))[d / 4] * args.scale;
      }
      ((threadgroup float4*)kv)[e] = x;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (slab / 2 == pass) {
      for (uint c = 0; c < NQF; ++c) {
        simdgroup_load(qf[c], kv + (slab % 2) * 8 * D + c * 8, D);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // softmax role: row sr, columns 2*su, 2*su + 1 of the tile
  const uint sr = tid / 8;
  const uint su = tid % 8;
  const uint srow = min(row0 + sr % BQ, M - 1);  // rows past the chunk copy the last one
  const uint spos = args.p0 + srow;              // keys <= spos are attended
  float m = -INFINITY;
  float l = 0.0f;

  simdgroup_float8x8 of[NOF];
  for (uint i = 0; i < NOF; ++i) {
    of[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  device const bfloat* khead = k_cache + ulong(kvh) * args.capacity * D;
  device const bfloat* vhead = v_cache + ulong(kvh) * args.capacity * D;

  for (uint t0 = kbeg; t0 < kend; t0 += kTile) {
    load_tile<D>(khead, t0, kend, kv, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    {  // S block (slab, kh) = Q_slab K_kh^T
      simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      threadgroup const float* kb = kv + kh * 8 * D;
      for (uint c = 0; c < NQF; ++c) {
        simdgroup_float8x8 kt;
        simdgroup_load(kt, kb + c * 8, D, ulong2(0, 0), true);  // kt[d][key] = K[key][c*8 + d]
        simdgroup_multiply_accumulate(acc, qf[c], kt, acc);
      }
      simdgroup_store(acc, sbuf + slab * 8 * kTile + kh * 8, kTile);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // scores complete, K no longer read
    load_tile<D>(vhead, t0, kend, kv, tid);
    {  // online softmax of row sr over the tile
      const uint key = t0 + 2 * su;
      float s0 = sbuf[sr * kTile + 2 * su];
      float s1 = sbuf[sr * kTile + 2 * su + 1];
      s0 = (key <= spos && key < kend) ? s0 : -INFINITY;
      s1 = (key + 1 <= spos && key + 1 < kend) ? s1 : -INFINITY;
      float mx = max(s0, s1);
      mx = max(mx, simd_shuffle_xor(mx, ushort(1)));
      mx = max(mx, simd_shuffle_xor(mx, ushort(2)));
      mx = max(mx, simd_shuffle_xor(mx, ushort(4)));
      const float mn = max(m, mx);
      const float mref = mn == -INFINITY ? 0.0f : mn;  // a row with nothing attended yet
      const float corr = exp(m - mref);
      const float p0 = exp(s0 - mref);
      const float p1 = exp(s1 - mref);
      float ps = p0 + p1;
      ps += simd_shuffle_xor(ps, ushort(1));
      ps += simd_shuffle_xor(ps, ushort(2));
      ps += simd_shuffle_xor(ps, ushort(4));
      l = l * corr + ps;
      m = mn;
      sbuf[sr * kTile + 2 * su] = p0;
      sbuf[sr * kTile + 2 * su + 1] = p1;
      diag[(sr / 8) * 64 + (sr % 8) * 8 + su] = su == sr % 8 ? corr : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // P, diag and the V tile complete
    {  // O_slab[:, kh] = diag(corr) O + P V
      threadgroup const float* dg = diag + slab * 64;
      bool rescale = false;
      for (uint j = 0; j < 8; ++j) {
        rescale = rescale || dg[j * 9] != 1.0f;
      }
      if (rescale) {  // uniform across the simdgroup
        simdgroup_float8x8 dm;
        simdgroup_load(dm, dg, 8);
        for (uint i = 0; i < NOF; ++i) {
          simdgroup_multiply(of[i], dm, of[i]);
        }
      }
      simdgroup_float8x8 pf0;
      simdgroup_float8x8 pf1;
      simdgroup_load(pf0, sbuf + slab * 8 * kTile, kTile);
      simdgroup_load(pf1, sbuf + slab * 8 * kTile + 8, kTile);
      for (uint i = 0; i < NOF; ++i) {
        const uint col = (kh * NOF + i) * 8;
        simdgroup_float8x8 vf0;
        simdgroup_float8x8 vf1;
        simdgroup_load(vf0, kv + col, D);
        simdgroup_load(vf1, kv + 8 * D + col, D);
        simdgroup_multiply_accumulate(of[i], pf0, vf0, of[i]);
        simdgroup_multiply_accumulate(of[i], pf1, vf1, of[i]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // kv, sbuf and diag free for the next tile
  }

  if (su == 0) {
    mrow[sr] = m;
    lrow[sr] = l;
  }
  // O out through kv in two passes of 16 rows (slabs 0-1, then 2-3)
  for (uint pass = 0; pass < 2; ++pass) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (slab / 2 == pass) {
      for (uint i = 0; i < NOF; ++i) {
        simdgroup_store(of[i], kv + (slab % 2) * 8 * D + (kh * NOF + i) * 8, D);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = tid; e < 16 * D / 4; e += kThreads) {
      const uint r = pass * 16 + (4 * e) / D;
      const uint d = (4 * e) % D;
      const uint row = row0 + r % BQ;
      const uint h = h0 + r / BQ;
      if (row >= M) {
        continue;
      }
      const float4 o = ((threadgroup const float4*)kv)[e];
      if (SPLIT) {
        const ulong slot = (ulong(split) * M + row) * Hq + h;
        ((device float4*)(part_o + slot * D))[d / 4] = o;
        if (d == 0) {
          part_ml[2 * slot] = mrow[r];
          part_ml[2 * slot + 1] = lrow[r];
        }
      } else {
        const float4 gate = ((device const float4*)(qg + (ulong(row) * Hq + h) * 2 * D + D))[d / 4];
        const float4 y = o / lrow[r];
        ((device float4*)(out + (ulong(row) * Hq + h) * D))[d / 4] =
            float4(y.x * sigmoid(gate.x), y.y * sigmoid(gate.y), y.z * sigmoid(gate.z),
                   y.w * sigmoid(gate.w));
      }
    }
  }
}

}  // namespace attn_prefill_detail

// ---- attn_prefill_prep -----------------------------------------------------------------------
// Grid: (ceil(M / 8), Hq + Hkv) threadgroups of 256 threads. Threadgroup (x, t): chunk rows
// 8x .. 8x+7 (simdgroup s takes row 8x + s), vector t (t < Hq: query head t; else KV head
// t - Hq). Lane l holds elements l, l + 32, ... of the row's vector (coalesced), so each
// simd_sum covers the same 32 consecutive elements as attn_qk_prep's simdgroups and the
// partial sums are added in the same order: the results are attn_qk_prep's bit for bit.
template <uint D>
[[max_total_threads_per_threadgroup(256)]] kernel void attn_prefill_prep(device const float* qg [[buffer(0)]],         // [M, Hq*2*D] q_proj output: query | gate per head
                              device const float* k [[buffer(1)]],          // [M, Hkv*D] k_proj output
                              device const float* v [[buffer(2)]],          // [M, Hkv*D] v_proj output
                              device const bfloat* q_norm_w [[buffer(3)]],  // [D]
                              device const bfloat* k_norm_w [[buffer(4)]],  // [D]
                              device bfloat* k_cache [[buffer(5)]],         // [Hkv, capacity, D], rows p0 .. p0+M-1 written
                              device bfloat* v_cache [[buffer(6)]],         // [Hkv, capacity, D], rows p0 .. p0+M-1 written
                              device float* q_out [[buffer(7)]],            // [M, Hq, D] normed, rotated queries
                              constant AttnPrefillPrepArgs& args [[buffer(8)]],
                              uint2 tg [[threadgroup_position_in_grid]],
                              uint sg [[simdgroup_index_in_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint NC = D / 32;
  constexpr uint NXS = attn_prefill_detail::kPrepRows * D;
  threadgroup float xs[NXS];
  const uint row = tg.x * attn_prefill_detail::kPrepRows + sg;
  if (row >= args.rows) {
    return;  // the whole simdgroup; the kernel has no threadgroup barrier
  }
  const uint Hq = args.num_q_heads;
  const uint Hkv = args.num_kv_heads;
  const uint head = tg.y;
  const bool is_q = head < Hq;
  const uint kvh = head - Hq;
  const uint pos = args.p0 + row;
  device const float* src = is_q ? qg + (ulong(row) * Hq + head) * 2 * D
                                 : k + (ulong(row) * Hkv + kvh) * D;
  float x[NC];
  float total = 0.0f;
  for (uint c = 0; c < NC; ++c) {
    x[c] = src[c * 32 + lane];
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
      q_out[(ulong(row) * Hq + head) * D + i] = y;
    } else if (pos < args.capacity) {
      const ulong crow = (ulong(kvh) * args.capacity + pos) * D;
      k_cache[crow + i] = bfloat(y);
      v_cache[crow + i] = bfloat(v[(ulong(row) * Hkv + kvh) * D + i]);
    }
  }
}

// ---- attn_prefill ------------------------------------------------------------------------------
// Grid: (ceil(M / BQ), Hq / G) threadgroups of 256 threads, BQ = 32 / G chunk rows per
// threadgroup. Threadgroup (x, y): query heads y*G .. y*G+G-1 (KV head y*G / (Hq/Hkv)), chunk
// rows block*BQ .. block*BQ+BQ-1 with block = ceil(M/BQ) - 1 - x (the longest causal ranges
// are dispatched first).
template <uint D, uint G>
[[max_total_threads_per_threadgroup(256)]] kernel void attn_prefill(device const float* q [[buffer(0)]],          // [M, Hq, D] from attn_prefill_prep
                         device const float* qg [[buffer(1)]],         // [M, Hq*2*D] q_proj output (gate: second D of each head)
                         device const bfloat* k_cache [[buffer(2)]],   // [Hkv, capacity, D], rows [0, p0 + M) read
                         device const bfloat* v_cache [[buffer(3)]],   // [Hkv, capacity, D], rows [0, p0 + M) read
                         device float* out [[buffer(4)]],              // [M, Hq*D] attention * sigmoid(gate)
                         constant AttnPrefillArgs& args [[buffer(5)]],
                         uint2 tg [[threadgroup_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  using namespace attn_prefill_detail;
  static_assert(G == 2 || G == 4 || G == 8, "G: 2, 4 or 8 query heads per threadgroup");
  static_assert(D % 16 == 0 && D <= 256, "D: a multiple of 16, at most 256");
  constexpr uint NKV = kTile * D;
  constexpr uint NS = kRows * kTile;
  constexpr uint ND = 4 * 64;
  threadgroup float4 kv4[NKV / 4];  // float4: load_tile writes it as float4
  threadgroup float* kv = (threadgroup float*)kv4;
  threadgroup float sbuf[NS];
  threadgroup float diag[ND];
  threadgroup float mrow[kRows];
  threadgroup float lrow[kRows];
  const uint nblocks = (args.rows + QRows<G>::BQ - 1) / QRows<G>::BQ;
  if (tg.x >= nblocks) {
    return;
  }
  attend<D, G, false>(q, qg, k_cache, v_cache, out, out, out, args, nblocks - 1 - tg.x, tg.y * G,
                      0, kv, sbuf, diag, mrow, lrow, tid, sg, lane);
}

// ---- attn_prefill_split ----------------------------------------------------------------------
// Grid: (ceil(M / BQ), Hq / G, num_splits) threadgroups of 256 threads; split z attends cache
// rows [z*S, min((z+1)*S, p0 + i + 1)) for chunk row i. Threadgroups whose block has no row
// reaching split z return at once. Partials per split z, chunk row i, head h (slot
// (z*M + i)*Hq + h): part_ml[2*slot] = max score, part_ml[2*slot+1] = sum of exp,
// part_o[slot*D + d] = unnormalised output. Merge with attn_prefill_combine_d<D>.
template <uint D, uint G>
[[max_total_threads_per_threadgroup(256)]] kernel void attn_prefill_split(device const float* q [[buffer(0)]],         // [M, Hq, D]
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
  constexpr uint NKV = kTile * D;
  constexpr uint NS = kRows * kTile;
  constexpr uint ND = 4 * 64;
  threadgroup float4 kv4[NKV / 4];  // float4: load_tile writes it as float4
  threadgroup float* kv = (threadgroup float*)kv4;
  threadgroup float sbuf[NS];
  threadgroup float diag[ND];
  threadgroup float mrow[kRows];
  threadgroup float lrow[kRows];
  const uint nblocks = (args.rows + QRows<G>::BQ - 1) / QRows<G>::BQ;
  if (tg.x >= nblocks || tg.z >= args.num_splits) {
    return;
  }
  attend<D, G, true>(q, q, k_cache, v_cache, part_o, part_ml, part_o, args, nblocks - 1 - tg.x,
                     tg.y * G, tg.z, kv, sbuf, diag, mrow, lrow, tid, sg, lane);
}

// ---- attn_prefill_combine --------------------------------------------------------------------
// Grid: (Hq, M) threadgroups of D threads. Threadgroup (h, i) merges the partials of the
// splits that hold cache rows <= p0 + i (z < min(floor((p0 + i) / S) + 1, num_splits)).
template <uint D>
[[max_total_threads_per_threadgroup(256)]] kernel void attn_prefill_combine(device const float* part_ml [[buffer(0)]],  // [num_splits, M, Hq, 2]
                                 device const float* part_o [[buffer(1)]],   // [num_splits, M, Hq, D]
                                 device const float* qg [[buffer(2)]],       // [M, Hq*2*D] (gate)
                                 device float* out [[buffer(3)]],            // [M, Hq*D]
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
  const float gate = qg[(ulong(row) * Hq + h) * 2 * D + D + d];
  out[(ulong(row) * Hq + h) * D + d] = o / L * sigmoid(gate);
}

// Instantiations: D = 256 (the model and the "dims" preset: G = 8, one threadgroup column per KV
// head), D = 64 (the "tiny" preset, G = 2); every G in {8, 4, 2} for both head dims.
template [[host_name("attn_prefill_prep_d256")]] [[kernel]] decltype(attn_prefill_prep<256>) attn_prefill_prep<256>;
template [[host_name("attn_prefill_prep_d64")]] [[kernel]] decltype(attn_prefill_prep<64>) attn_prefill_prep<64>;
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
