// Full-attention decode kernels (docs/model.md, "Full attention"; docs/goals.md, fusion (3),
// coalesced KV reads, GQA packing, attention layout switch).
//
//   attn_qk_prep              q/k RMSNorm + partial RoPE at the position in a device buffer,
//                             k/v appended to the bf16 KV cache, q and gate out (fp32).
//   attn_decode_d<D>_g<G>     softmax attention of the new query over cache rows [0, pos]:
//                             one threadgroup per G query heads sharing a KV head, each KV
//                             row read once for all G; online softmax; output * sigmoid(gate).
//   attn_decode_split_d<D>_g<G> + attn_combine_d<D>
//                             long-context path: the row range is cut into fixed blocks of B
//                             rows, one threadgroup per (head group, block) writes a partial
//                             (max, sum, unnormalised accumulator); the combine kernel merges
//                             them per head and applies the gate.
//   attn_decode_fused_d<D>_g<G>, attn_decode_split_fused_d<D>_g<G>
//                             attn_qk_prep + attn_decode(_split) in one dispatch (one barrier
//                             stage less per attention layer): each threadgroup prepares its own
//                             G query heads and the new token's k/v of its KV head, attends rows
//                             [0, pos) from the cache and row pos from threadgroup memory; one
//                             threadgroup per KV head appends row pos.
//
// KV cache layout per layer: K and V each bf16 [Hkv, capacity, D]. Reads are coalesced: lane l
// of a simdgroup reads the bf16 pairs at c*64 + 2l (c < D/64) of a row, so each load
// instruction of the simdgroup covers 128 contiguous bytes of the row.
#include <metal_stdlib>
#include "common.h"  // sigmoid
#include "mixer_args.h"
using namespace metal;

// ---- attn_qk_prep ---------------------------------------------------------------------------
// Grid: Hq + Hkv threadgroups of D threads (threadgroup t < Hq: query head t; else KV head
// t - Hq). D is a multiple of 32, at most 1024.
[[max_total_threads_per_threadgroup(256)]] kernel void attn_qk_prep(device const float* qg [[buffer(0)]],         // [Hq, 2*D] q_proj output: query | gate per head
                         device const float* k [[buffer(1)]],          // [Hkv, D] k_proj output
                         device const float* v [[buffer(2)]],          // [Hkv, D] v_proj output
                         device const bfloat* q_norm_w [[buffer(3)]],  // [D]
                         device const bfloat* k_norm_w [[buffer(4)]],  // [D]
                         device const uint* position [[buffer(5)]],    // [1] absolute position of the token
                         device bfloat* k_cache [[buffer(6)]],         // [Hkv, capacity, D], row pos written
                         device bfloat* v_cache [[buffer(7)]],         // [Hkv, capacity, D], row pos written
                         device float* q_out [[buffer(8)]],            // [Hq, D] normed, rotated query
                         device float* gate_out [[buffer(9)]],         // [Hq, D] gate (raw, sigmoid applied later)
                         constant AttnPrepArgs& args [[buffer(10)]],
                         uint head [[threadgroup_position_in_grid]],
                         uint i [[thread_index_in_threadgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float xs[1024];
  threadgroup float partial[32];
  const uint D = args.head_dim;
  const bool is_q = head < args.num_q_heads;
  const uint kvh = head - args.num_q_heads;
  const uint pos = position[0];

  const float x = is_q ? qg[head * 2 * D + i] : k[kvh * D + i];
  const float ss = simd_sum(x * x);
  if (lane == 0) {
    partial[sg] = ss;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint s = 0; s < nsg; ++s) {
    total += partial[s];
  }
  const float w = float(is_q ? q_norm_w[i] : k_norm_w[i]);
  const float xn = x / sqrt(total / float(D) + args.norm_eps) * w;
  xs[i] = xn;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float y = xn;
  const uint rot = args.rotary_dim;
  const uint half_rot = rot / 2;
  if (i < rot) {
    const uint j = i < half_rot ? i : i - half_rot;
    const float inv_freq = exp2(-(float(2 * j) / float(rot)) * args.log2_theta);
    const float ang = float(pos) * inv_freq;
    const float c = cos(ang);
    const float s = sin(ang);
    y = i < half_rot ? xn * c - xs[i + half_rot] * s : xn * c + xs[i - half_rot] * s;
  }
  if (is_q) {
    q_out[head * D + i] = y;
    gate_out[head * D + i] = qg[head * 2 * D + D + i];
  } else if (pos < args.capacity) {
    const ulong row = (ulong(kvh) * args.capacity + pos) * D;
    k_cache[row + i] = bfloat(y);
    v_cache[row + i] = bfloat(v[kvh * D + i]);
  }
}

// ---- decode attention core -------------------------------------------------------------------
constant constexpr uint kAttnSimdgroups = 8;  // threadgroup = 256 threads

// Lane layout of a D-element row: lane l holds the NE = D/32 contiguous elements
// [l*NE, (l+1)*NE), loaded as NC vectors of W elements (D = 256: two bfloat4, one 16-byte
// load per lane, 512 contiguous bytes per simdgroup; D = 64: one bfloat2).
template <uint D>
struct AttnLane {
  static constant constexpr uint NE = D / 32;
  static constant constexpr uint W = NE >= 4 ? 4 : NE;
  static constant constexpr uint NC = NE / W;
};

// Attends query heads h0..h0+G-1 (sharing KV head kvh) over rows [r0, r1) (r0 < r1) and leaves
// per head g: m_out[g] = max score, l_out[g] = sum of exp(score - m), and the unnormalised
// accumulator sum exp(score - m) * v in acc_out[g * D + d] (threadgroup memory).
// The query of head h0 + g is q[g * q_stride + d] (device or threadgroup memory: QPtr). Row
// `pos_row` (if in range) is taken from kcur / vcur (threadgroup, fp32 of the bf16 values)
// instead of the cache: the fused kernels attend the new token before it is in the cache.
// Simdgroup s takes rows r0 + s, r0 + s + 8, ...; each keeps an online softmax per head; the
// simdgroups are merged through red_acc, double-buffered so each head costs one barrier.
// acc_out may alias the query (threadgroup) once every thread has loaded it: it is first
// written after the barrier that follows the row loop.
template <uint D, uint G, typename QPtr>
static inline void attend_rows(QPtr q, uint q_stride, device const bfloat* k_cache,
                               device const bfloat* v_cache, threadgroup const float* kcur,
                               threadgroup const float* vcur, uint pos_row, uint kvh,
                               uint capacity, float scale, uint r0, uint r1,
                               threadgroup float* red_m,    // [kAttnSimdgroups * G]
                               threadgroup float* red_l,    // [kAttnSimdgroups * G]
                               threadgroup float* red_acc,  // [2 * kAttnSimdgroups * D]
                               threadgroup float* m_out,    // [G]
                               threadgroup float* l_out,    // [G]
                               threadgroup float* acc_out,  // [G * D]
                               uint tid, uint sg, uint lane) {
  constexpr uint NE = AttnLane<D>::NE;
  constexpr uint W = AttnLane<D>::W;
  constexpr uint NC = AttnLane<D>::NC;
  constexpr uint NT = kAttnSimdgroups * 32;
  typedef vec<float, W> fvec;
  typedef vec<bfloat, W> bvec;
  const uint e0 = lane * NE;  // first element of this lane
  fvec qv[G][NC];
  for (uint g = 0; g < G; ++g) {
    for (uint c = 0; c < NC; ++c) {
      for (uint j = 0; j < W; ++j) {
        qv[g][c][j] = q[g * q_stride + e0 + c * W + j] * scale;
      }
    }
  }
  float m[G];
  float l[G];
  fvec acc[G][NC];
  for (uint g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (uint c = 0; c < NC; ++c) {
      acc[g][c] = fvec(0.0f);
    }
  }
  device const bvec* kbase = (device const bvec*)(k_cache + ulong(kvh) * capacity * D);
  device const bvec* vbase = (device const bvec*)(v_cache + ulong(kvh) * capacity * D);
  for (uint t = r0 + sg; t < r1; t += kAttnSimdgroups) {
    fvec kk[NC];
    fvec vv[NC];
    if (t == pos_row) {  // uniform across the simdgroup
      for (uint c = 0; c < NC; ++c) {
        for (uint j = 0; j < W; ++j) {
          kk[c][j] = kcur[e0 + c * W + j];
          vv[c][j] = vcur[e0 + c * W + j];
        }
      }
    } else {
      device const bvec* krow = kbase + ulong(t) * (D / W) + lane * NC;
      device const bvec* vrow = vbase + ulong(t) * (D / W) + lane * NC;
      for (uint c = 0; c < NC; ++c) {
        kk[c] = fvec(krow[c]);
        vv[c] = fvec(vrow[c]);
      }
    }
    float s[G];
    for (uint g = 0; g < G; ++g) {
      float acc_s = 0.0f;
      for (uint c = 0; c < NC; ++c) {
        acc_s += dot(qv[g][c], kk[c]);
      }
      s[g] = acc_s;
    }
    for (uint g0 = 0; g0 < G; g0 += 4) {  // scores of 4 heads per simd_sum, in every lane
      float4 s4 = float4(0.0f);
      for (uint j = 0; j < 4 && g0 + j < G; ++j) {
        s4[j] = s[g0 + j];
      }
      s4 = simd_sum(s4);
      for (uint j = 0; j < 4 && g0 + j < G; ++j) {
        s[g0 + j] = s4[j];
      }
    }
    for (uint g = 0; g < G; ++g) {
      const float mn = max(m[g], s[g]);
      const float corr = exp(m[g] - mn);
      const float p = exp(s[g] - mn);
      l[g] = l[g] * corr + p;
      for (uint c = 0; c < NC; ++c) {
        acc[g][c] = acc[g][c] * corr + p * vv[c];
      }
      m[g] = mn;
    }
  }

  // merge the simdgroups: global max, rescaled sums
  if (lane == 0) {
    for (uint g = 0; g < G; ++g) {
      red_m[sg * G + g] = m[g];
      red_l[sg * G + g] = l[g];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint g = 0; g < G; ++g) {
    threadgroup float* buf = red_acc + (g % 2) * (kAttnSimdgroups * D);
    float M = -INFINITY;
    for (uint s = 0; s < kAttnSimdgroups; ++s) {
      M = max(M, red_m[s * G + g]);
    }
    const float mine = exp(m[g] - M);  // 0 for a simdgroup that saw no rows
    for (uint c = 0; c < NC; ++c) {
      for (uint j = 0; j < W; ++j) {
        buf[sg * D + e0 + c * W + j] = acc[g][c][j] * mine;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint d = tid; d < D; d += NT) {
      float sum = 0.0f;
      for (uint s = 0; s < kAttnSimdgroups; ++s) {
        sum += buf[s * D + d];
      }
      acc_out[g * D + d] = sum;
    }
    if (tid == 0) {
      float L = 0.0f;
      for (uint s = 0; s < kAttnSimdgroups; ++s) {
        L += red_l[s * G + g] * exp(red_m[s * G + g] - M);
      }
      m_out[g] = M;
      l_out[g] = L;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// ---- attn_decode -------------------------------------------------------------------------------
// Grid: Hq / G threadgroups of 256 threads; threadgroup j serves query heads j*G .. j*G+G-1.
template <uint D, uint G>
[[max_total_threads_per_threadgroup(256)]] kernel void attn_decode(device const float* q [[buffer(0)]],          // [Hq, D] from attn_qk_prep
                        device const float* gate [[buffer(1)]],       // gate of head h at h * gate_stride
                        device const bfloat* k_cache [[buffer(2)]],   // [Hkv, capacity, D]
                        device const bfloat* v_cache [[buffer(3)]],   // [Hkv, capacity, D]
                        device const uint* position [[buffer(4)]],    // [1] pos: rows [0, pos] attended
                        device float* out [[buffer(5)]],              // [Hq, D] attention * sigmoid(gate)
                        constant AttnDecodeArgs& args [[buffer(6)]],
                        uint grp [[threadgroup_position_in_grid]],
                        uint tid [[thread_index_in_threadgroup]],
                        uint sg [[simdgroup_index_in_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint NRED = kAttnSimdgroups * G;
  constexpr uint NACC = 2 * kAttnSimdgroups * D;
  constexpr uint NOUT = G * D;
  threadgroup float red_m[NRED];
  threadgroup float red_l[NRED];
  threadgroup float red_acc[NACC];
  threadgroup float m_out[G];
  threadgroup float l_out[G];
  threadgroup float acc_out[NOUT];
  const uint h0 = grp * G;
  const uint kvh = h0 / (args.num_q_heads / args.num_kv_heads);
  const uint n = position[0] + 1;
  attend_rows<D, G>(q + h0 * D, D, k_cache, v_cache, red_m, red_m, 0xFFFFFFFFu, kvh, args.capacity,
                    args.scale, 0, n, red_m, red_l, red_acc, m_out, l_out, acc_out, tid, sg, lane);
  for (uint e = tid; e < G * D; e += kAttnSimdgroups * 32) {
    const uint g = e / D;
    const uint d = e % D;
    const float o = acc_out[e] / l_out[g];
    out[(h0 + g) * D + d] = o * sigmoid(gate[(h0 + g) * args.gate_stride + d]);
  }
}

// ---- attn_decode_split -------------------------------------------------------------------------
// Grid: (Hq / G, nblocks) threadgroups of 256 threads, nblocks >= ceil((pos + 1) / B) and
// <= max_blocks; blocks past the last row return at once. Partials, per head h and block b
// (slot h * max_blocks + b): part_ml[2*slot] = max score, part_ml[2*slot+1] = sum of exp,
// part_acc[slot * D + d] = unnormalised accumulator.
template <uint D, uint G>
[[max_total_threads_per_threadgroup(256)]] kernel void attn_decode_split(device const float* q [[buffer(0)]],         // [Hq, D]
                              device const bfloat* k_cache [[buffer(1)]],  // [Hkv, capacity, D]
                              device const bfloat* v_cache [[buffer(2)]],  // [Hkv, capacity, D]
                              device const uint* position [[buffer(3)]],   // [1]
                              device float* part_ml [[buffer(4)]],         // [Hq, max_blocks, 2]
                              device float* part_acc [[buffer(5)]],        // [Hq, max_blocks, D]
                              constant AttnDecodeArgs& args [[buffer(6)]],
                              uint2 tg [[threadgroup_position_in_grid]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint NRED = kAttnSimdgroups * G;
  constexpr uint NACC = 2 * kAttnSimdgroups * D;
  constexpr uint NOUT = G * D;
  threadgroup float red_m[NRED];
  threadgroup float red_l[NRED];
  threadgroup float red_acc[NACC];
  threadgroup float m_out[G];
  threadgroup float l_out[G];
  threadgroup float acc_out[NOUT];
  const uint n = position[0] + 1;
  const uint blk = tg.y;
  const uint r0 = blk * args.block_rows;
  if (r0 >= n || blk >= args.max_blocks) {
    return;  // uniform across the threadgroup
  }
  const uint r1 = min(n, r0 + args.block_rows);
  const uint h0 = tg.x * G;
  const uint kvh = h0 / (args.num_q_heads / args.num_kv_heads);
  attend_rows<D, G>(q + h0 * D, D, k_cache, v_cache, red_m, red_m, 0xFFFFFFFFu, kvh, args.capacity,
                    args.scale, r0, r1, red_m, red_l, red_acc, m_out, l_out, acc_out, tid, sg, lane);
  for (uint e = tid; e < G * D; e += kAttnSimdgroups * 32) {
    const uint g = e / D;
    const uint d = e % D;
    const ulong slot = ulong(h0 + g) * args.max_blocks + blk;
    part_acc[slot * D + d] = acc_out[e];
    if (d == 0) {
      part_ml[2 * slot] = m_out[g];
      part_ml[2 * slot + 1] = l_out[g];
    }
  }
}

// ---- attn_combine ------------------------------------------------------------------------------
// Grid (Hq, D / 32) threadgroups of up to 256 threads (8 simdgroups): threadgroup (h, c) merges
// columns [32 c, 32 c + 32) of head h from the ceil((pos+1)/B) partials. Every simdgroup takes
// the largest block max itself, its lanes loading the blocks' maxima side by side (lane l the
// blocks l, l + 32, ...) and simd_max joining them, so the loads are in flight together
// instead of one after another (a max is exact in any order). Simdgroup s then sums the
// blocks b = s, s + 8, ... (lane = column), and simdgroup 0 adds the 8 sums in order: the
// partials are read by 8x as many threads as with one thread per column, so the dispatch fills
// the GPU (16 heads x 256 columns would be 4096 threads).
constant constexpr uint kCombineSimdgroups = 8;

template <uint D>
[[max_total_threads_per_threadgroup(256)]] kernel void attn_combine(device const float* part_ml [[buffer(0)]],   // [Hq, max_blocks, 2]
                         device const float* part_acc [[buffer(1)]],  // [Hq, max_blocks, D]
                         device const float* gate [[buffer(2)]],      // gate of head h at h * gate_stride
                         device const uint* position [[buffer(3)]],   // [1]
                         device float* out [[buffer(4)]],             // [Hq, D]
                         constant AttnCombineArgs& args [[buffer(5)]],
                         uint2 tg [[threadgroup_position_in_grid]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint nsg [[simdgroups_per_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float o_part[kCombineSimdgroups][32];
  threadgroup float l_part[kCombineSimdgroups];
  const uint h = tg.x;
  const uint d = tg.y * 32 + lane;
  if (tg.y * 32 >= D) {
    return;  // the whole threadgroup: past the head's columns
  }
  const uint n = position[0] + 1;
  const uint nb = min((n + args.block_rows - 1) / args.block_rows, args.max_blocks);
  const ulong base = ulong(h) * args.max_blocks;
  float M = -INFINITY;
  for (uint b = lane; b < nb; b += 32) {
    M = max(M, part_ml[2 * (base + b)]);
  }
  M = simd_max(M);
  float L = 0.0f;
  float o = 0.0f;
  for (uint b = sg; b < nb; b += nsg) {
    const float w = exp(part_ml[2 * (base + b)] - M);
    L += part_ml[2 * (base + b) + 1] * w;
    o += part_acc[(base + b) * D + d] * w;
  }
  o_part[sg][lane] = o;
  if (lane == 0) {
    l_part[sg] = L;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    float Lt = 0.0f;
    float ot = 0.0f;
    for (uint s = 0; s < nsg; ++s) {
      Lt += l_part[s];
      ot += o_part[s][lane];
    }
    out[h * D + d] = ot / Lt * sigmoid(gate[h * args.gate_stride + d]);
  }
}

// ---- fused prep + decode -----------------------------------------------------------------------
// attn_qk_prep and attn_decode in one dispatch (no barrier stage between them). Every
// threadgroup recomputes what it needs of the prep: RMSNorm + RoPE of its own G query heads
// (from the q_proj output) and, if it attends the new row, the new token's k (RMSNorm + RoPE)
// and v of its KV head (duplicated across the threadgroups of that KV head: D elements). The
// new row is used from threadgroup memory as bf16-rounded values (exactly what the cache will
// hold), rows [0, pos) come from the cache, and one threadgroup per KV head appends row pos.
// The arithmetic of the prep is that of attn_qk_prep term for term (same sums in the same
// order), and the attention is attend_rows' with the new row substituted, so the results are
// those of attn_qk_prep + attn_decode.
namespace attn_detail {

constant constexpr uint kFusedThreads = kAttnSimdgroups * 32;  // 256

// Prep of vectors j = 0..G (j < G: query head h0 + j; j == G: the new k of head kvh, only
// with_k), one simdgroup per vector (simdgroup j % 8: the new k shares simdgroup 0 with query
// head 0 when G = 8), without threadgroup barriers: lane l holds elements l, l + 32, ... of its
// vector, so the simd_sum of register e is attn_qk_prep's partial sum of its simdgroup e (the
// same 32 values in the same lanes) and the partials are added in the same order. Every load
// (the vectors, their norm weights, the new v) is issued before any arithmetic: one round trip.
// The RoPE partner i +- rotary/2 of element i lies in another lane or register: each vector's
// normalised values go to its own slot of qs (or kcur) first and are read back after a
// simdgroup barrier. Leaves qs[j * D + i] (fp32, as attn_qk_prep's q_out) and, with_k,
// kcur[i] = float(bfloat(k rotated)), vcur[i] = float(bfloat(v)); ends with a threadgroup
// barrier (every vector visible to every thread).
template <uint D, uint G>
static inline void fused_prep(device const float* qg, device const float* k, device const float* v,
                              device const bfloat* q_norm_w, device const bfloat* k_norm_w,
                              uint pos, uint h0, uint kvh, uint rot, float norm_eps,
                              float log2_theta, bool with_k,
                              threadgroup float* qs,       // [G * D]
                              threadgroup float* kcur,     // [D]
                              threadgroup float* vcur,     // [D]
                              uint sg, uint lane) {
  constexpr uint E = D / 32;                                  // elements per lane
  constexpr uint NV = (G + kAttnSimdgroups) / kAttnSimdgroups;  // vectors per simdgroup at most
  const uint nvec = with_k ? G + 1 : G;
  const uint half_rot = rot / 2;
  float x[NV][E];
  float w[NV][E];
  float vv[E];
  for (uint n = 0; n < NV; ++n) {
    const uint j = sg + n * kAttnSimdgroups;  // uniform over the simdgroup
    const bool is_q = j < G;
    device const float* src = is_q ? qg + (h0 + j) * 2 * D : k + kvh * D;
    device const bfloat* nw = is_q ? q_norm_w : k_norm_w;
    for (uint e = 0; e < E; ++e) {
      x[n][e] = j < nvec ? src[e * 32 + lane] : 0.0f;
      w[n][e] = j < nvec ? float(nw[e * 32 + lane]) : 0.0f;
      if (j == G && with_k) {
        vv[e] = v[kvh * D + e * 32 + lane];
      }
    }
  }
  for (uint n = 0; n < NV; ++n) {
    const uint j = sg + n * kAttnSimdgroups;
    if (j < nvec) {
      float total = 0.0f;
      for (uint e = 0; e < E; ++e) {
        total += simd_sum(x[n][e] * x[n][e]);
      }
      threadgroup float* dst = j < G ? qs + j * D : kcur;
      for (uint e = 0; e < E; ++e) {
        dst[e * 32 + lane] = x[n][e] / sqrt(total / float(D) + norm_eps) * w[n][e];
      }
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  float y[NV][E];
  for (uint n = 0; n < NV; ++n) {
    const uint j = sg + n * kAttnSimdgroups;
    threadgroup const float* xs = j < G ? qs + j * D : kcur;
    for (uint e = 0; e < E; ++e) {
      const uint i = e * 32 + lane;
      const float xn = j < nvec ? xs[i] : 0.0f;
      y[n][e] = xn;
      if (j < nvec && i < rot) {
        const uint jj = i < half_rot ? i : i - half_rot;
        const float inv_freq = exp2(-(float(2 * jj) / float(rot)) * log2_theta);
        const float ang = float(pos) * inv_freq;
        const float c = cos(ang);
        const float s = sin(ang);
        y[n][e] = i < half_rot ? xn * c - xs[i + half_rot] * s : xn * c + xs[i - half_rot] * s;
      }
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // every partner read before it is overwritten
  for (uint n = 0; n < NV; ++n) {
    const uint j = sg + n * kAttnSimdgroups;
    for (uint e = 0; e < E; ++e) {
      const uint i = e * 32 + lane;
      if (j < G) {
        qs[j * D + i] = y[n][e];
      } else if (j < nvec) {
        kcur[i] = float(bfloat(y[n][e]));
        vcur[i] = float(bfloat(vv[e]));
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Row pos of KV head kvh into both caches (skipped when pos >= capacity, as attn_qk_prep).
template <uint D>
static inline void append_row(device bfloat* k_cache, device bfloat* v_cache,
                              threadgroup const float* kcur, threadgroup const float* vcur,
                              uint kvh, uint pos, uint capacity, uint tid) {
  if (pos >= capacity) {
    return;
  }
  const ulong row = (ulong(kvh) * capacity + pos) * D;
  for (uint d = tid; d < D; d += kFusedThreads) {
    k_cache[row + d] = bfloat(kcur[d]);
    v_cache[row + d] = bfloat(vcur[d]);
  }
}

}  // namespace attn_detail

// ---- attn_decode_fused ---------------------------------------------------------------------
// Grid: Hq / G threadgroups of 256 threads; threadgroup j serves query heads j*G .. j*G+G-1
// (KV head kvh = j*G / (Hq/Hkv)); the first threadgroup of each KV head (j*G a multiple of
// Hq/Hkv) appends row pos of that KV head to both caches.
template <uint D, uint G>
[[max_total_threads_per_threadgroup(256)]] kernel void attn_decode_fused(device const float* qg [[buffer(0)]],         // [Hq, 2*D] q_proj output: query | gate per head
                              device const float* k [[buffer(1)]],          // [Hkv, D] k_proj output
                              device const float* v [[buffer(2)]],          // [Hkv, D] v_proj output
                              device const bfloat* q_norm_w [[buffer(3)]],  // [D]
                              device const bfloat* k_norm_w [[buffer(4)]],  // [D]
                              device const uint* position [[buffer(5)]],    // [1] pos: rows [0, pos) read, row pos written
                              device bfloat* k_cache [[buffer(6)]],         // [Hkv, capacity, D]
                              device bfloat* v_cache [[buffer(7)]],         // [Hkv, capacity, D]
                              device float* out [[buffer(8)]],              // [Hq, D] attention * sigmoid(gate)
                              constant AttnFusedArgs& args [[buffer(9)]],
                              uint grp [[threadgroup_position_in_grid]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint NRED = kAttnSimdgroups * G;
  constexpr uint NACC = 2 * kAttnSimdgroups * D;
  constexpr uint NOUT = G * D;
  threadgroup float red_m[NRED];
  threadgroup float red_l[NRED];
  threadgroup float red_acc[NACC];
  threadgroup float m_out[G];
  threadgroup float l_out[G];
  threadgroup float qs[NOUT];  // the prepared queries, then (aliased) the merged accumulators
  threadgroup float kcur[D];
  threadgroup float vcur[D];
  const uint group = args.num_q_heads / args.num_kv_heads;
  const uint h0 = grp * G;
  const uint kvh = h0 / group;
  const uint pos = position[0];
  attn_detail::fused_prep<D, G>(qg, k, v, q_norm_w, k_norm_w, pos, h0, kvh, args.rotary_dim,
                                args.norm_eps, args.log2_theta, true, qs, kcur, vcur, sg, lane);
  if (h0 % group == 0) {
    attn_detail::append_row<D>(k_cache, v_cache, kcur, vcur, kvh, pos, args.capacity, tid);
  }
  attend_rows<D, G>((threadgroup const float*)qs, D, k_cache, v_cache, kcur, vcur, pos, kvh,
                    args.capacity, args.scale, 0, pos + 1, red_m, red_l, red_acc, m_out, l_out, qs,
                    tid, sg, lane);
  threadgroup const float* acc_out = qs;
  for (uint e = tid; e < G * D; e += attn_detail::kFusedThreads) {
    const uint g = e / D;
    const uint d = e % D;
    const float o = acc_out[e] / l_out[g];
    out[(h0 + g) * D + d] = o * sigmoid(qg[(h0 + g) * 2 * D + D + d]);
  }
}

// ---- attn_decode_split_fused -------------------------------------------------------------------
// Grid: (Hq / G, nblocks) threadgroups of 256 threads, nblocks >= ceil((pos + 1) / B) and
// <= max_blocks; blocks past the last row return at once. Every block threadgroup prepares
// its G query heads; only the block holding row pos computes the new k/v (and, for the first
// head group of each KV head, appends row pos); the other blocks only read the cache.
// Partials as attn_decode_split; merge with attn_combine (gate: the q_proj output at element
// offset D, gate_stride 2*D).
template <uint D, uint G>
[[max_total_threads_per_threadgroup(256)]] kernel void attn_decode_split_fused(device const float* qg [[buffer(0)]],         // [Hq, 2*D]
                                    device const float* k [[buffer(1)]],          // [Hkv, D]
                                    device const float* v [[buffer(2)]],          // [Hkv, D]
                                    device const bfloat* q_norm_w [[buffer(3)]],  // [D]
                                    device const bfloat* k_norm_w [[buffer(4)]],  // [D]
                                    device const uint* position [[buffer(5)]],    // [1]
                                    device bfloat* k_cache [[buffer(6)]],         // [Hkv, capacity, D]
                                    device bfloat* v_cache [[buffer(7)]],         // [Hkv, capacity, D]
                                    device float* part_ml [[buffer(8)]],          // [Hq, max_blocks, 2]
                                    device float* part_acc [[buffer(9)]],         // [Hq, max_blocks, D]
                                    constant AttnFusedArgs& args [[buffer(10)]],
                                    uint2 tg [[threadgroup_position_in_grid]],
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint sg [[simdgroup_index_in_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint NRED = kAttnSimdgroups * G;
  constexpr uint NACC = 2 * kAttnSimdgroups * D;
  constexpr uint NOUT = G * D;
  threadgroup float red_m[NRED];
  threadgroup float red_l[NRED];
  threadgroup float red_acc[NACC];
  threadgroup float m_out[G];
  threadgroup float l_out[G];
  threadgroup float qs[NOUT];  // the prepared queries, then (aliased) the merged accumulators
  threadgroup float kcur[D];
  threadgroup float vcur[D];
  const uint pos = position[0];
  const uint n = pos + 1;
  const uint blk = tg.y;
  const uint r0 = blk * args.block_rows;
  if (r0 >= n || blk >= args.max_blocks) {
    return;  // uniform across the threadgroup
  }
  const uint r1 = min(n, r0 + args.block_rows);
  const bool has_new_row = r1 == n;  // this block holds row pos
  const uint group = args.num_q_heads / args.num_kv_heads;
  const uint h0 = tg.x * G;
  const uint kvh = h0 / group;
  attn_detail::fused_prep<D, G>(qg, k, v, q_norm_w, k_norm_w, pos, h0, kvh, args.rotary_dim,
                                args.norm_eps, args.log2_theta, has_new_row, qs, kcur, vcur, sg,
                                lane);
  if (has_new_row && h0 % group == 0) {
    attn_detail::append_row<D>(k_cache, v_cache, kcur, vcur, kvh, pos, args.capacity, tid);
  }
  attend_rows<D, G>((threadgroup const float*)qs, D, k_cache, v_cache, kcur, vcur, pos, kvh,
                    args.capacity, args.scale, r0, r1, red_m, red_l, red_acc, m_out, l_out, qs,
                    tid, sg, lane);
  threadgroup const float* acc_out = qs;
  for (uint e = tid; e < G * D; e += attn_detail::kFusedThreads) {
    const uint g = e / D;
    const uint d = e % D;
    const ulong slot = ulong(h0 + g) * args.max_blocks + blk;
    part_acc[slot * D + d] = acc_out[e];
    if (d == 0) {
      part_ml[2 * slot] = m_out[g];
      part_ml[2 * slot + 1] = l_out[g];
    }
  }
}

// Instantiations: D = 256 with all 8 query heads of a KV head per threadgroup (the model and the
// "dims" preset: each KV row is read once per step), 4 or 2 for smaller groups; D = 64 (the
// "tiny" preset) with 2 or 4.
template [[host_name("attn_decode_d256_g8")]] [[kernel]] decltype(attn_decode<256, 8>) attn_decode<256, 8>;
template [[host_name("attn_decode_d256_g4")]] [[kernel]] decltype(attn_decode<256, 4>) attn_decode<256, 4>;
template [[host_name("attn_decode_d256_g2")]] [[kernel]] decltype(attn_decode<256, 2>) attn_decode<256, 2>;
template [[host_name("attn_decode_d64_g4")]] [[kernel]] decltype(attn_decode<64, 4>) attn_decode<64, 4>;
template [[host_name("attn_decode_d64_g2")]] [[kernel]] decltype(attn_decode<64, 2>) attn_decode<64, 2>;
template [[host_name("attn_decode_split_d256_g8")]] [[kernel]] decltype(attn_decode_split<256, 8>) attn_decode_split<256, 8>;
template [[host_name("attn_decode_split_d256_g4")]] [[kernel]] decltype(attn_decode_split<256, 4>) attn_decode_split<256, 4>;
template [[host_name("attn_decode_split_d256_g2")]] [[kernel]] decltype(attn_decode_split<256, 2>) attn_decode_split<256, 2>;
template [[host_name("attn_decode_split_d64_g4")]] [[kernel]] decltype(attn_decode_split<64, 4>) attn_decode_split<64, 4>;
template [[host_name("attn_decode_split_d64_g2")]] [[kernel]] decltype(attn_decode_split<64, 2>) attn_decode_split<64, 2>;
template [[host_name("attn_combine_d256")]] [[kernel]] decltype(attn_combine<256>) attn_combine<256>;
template [[host_name("attn_combine_d64")]] [[kernel]] decltype(attn_combine<64>) attn_combine<64>;
template [[host_name("attn_decode_fused_d256_g8")]] [[kernel]] decltype(attn_decode_fused<256, 8>) attn_decode_fused<256, 8>;
template [[host_name("attn_decode_fused_d256_g4")]] [[kernel]] decltype(attn_decode_fused<256, 4>) attn_decode_fused<256, 4>;
template [[host_name("attn_decode_fused_d256_g2")]] [[kernel]] decltype(attn_decode_fused<256, 2>) attn_decode_fused<256, 2>;
template [[host_name("attn_decode_fused_d64_g4")]] [[kernel]] decltype(attn_decode_fused<64, 4>) attn_decode_fused<64, 4>;
template [[host_name("attn_decode_fused_d64_g2")]] [[kernel]] decltype(attn_decode_fused<64, 2>) attn_decode_fused<64, 2>;
template [[host_name("attn_decode_split_fused_d256_g8")]] [[kernel]] decltype(attn_decode_split_fused<256, 8>) attn_decode_split_fused<256, 8>;
template [[host_name("attn_decode_split_fused_d256_g4")]] [[kernel]] decltype(attn_decode_split_fused<256, 4>) attn_decode_split_fused<256, 4>;
template [[host_name("attn_decode_split_fused_d256_g2")]] [[kernel]] decltype(attn_decode_split_fused<256, 2>) attn_decode_split_fused<256, 2>;
template [[host_name("attn_decode_split_fused_d64_g4")]] [[kernel]] decltype(attn_decode_split_fused<64, 4>) attn_decode_split_fused<64, 4>;
template [[host_name("attn_decode_split_fused_d64_g2")]] [[kernel]] decltype(attn_decode_split_fused<64, 2>) attn_decode_split_fused<64, 2>;
