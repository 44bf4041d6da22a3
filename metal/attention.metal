// Full-attention decode kernels (docs/model.md, "Full attention"; docs/goals.md, fusion (3),
// coalesced KV reads, GQA packing, attention layout switch).
//
//   attn_qk_prep              q/k RMSNorm + partial RoPE at the position in a device buffer,
//                             k/v appended to the bf16 KV cache, q and gate out (fp32).
//   attn_decode_d<D>_g<G>     softmax attention of the new query over cache rows [0, pos]:
//                             one threadgroup per G query heads sharing a KV head, each KV
//                             row read once for all G; online softmax over blocks of 32 / G
//                             rows per simdgroup; output * sigmoid(gate).
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
// (kAttnSimdgroups per threadgroup of kAttnDecodeThreads threads: mixer_args.h)

// Lane layout of a D-element row: lane l holds the NE = D/32 contiguous elements
// [l*NE, (l+1)*NE), loaded as NC vectors of W elements (D = 256: two bfloat4, one 16-byte
// load per lane, 512 contiguous bytes per simdgroup; D = 64: one bfloat2).
template <uint D>
struct AttnLane {
  static constant constexpr uint NE = D / 32;
  static constant constexpr uint W = NE >= 4 ? 4 : NE;
  static constant constexpr uint NC = NE / W;
};

// After a block's reduce-scatter lane l holds the score of pair attn_bitrev5(l) = t * G + g
// (row t of the block, head g); the reversal of 5 bits is its own inverse.
inline uint attn_bitrev5(uint x) {
  return ((x & 1u) << 4) | ((x & 2u) << 2) | (x & 4u) | ((x & 8u) >> 2) | ((x & 16u) >> 4);
}

// Keeps H of this lane's 2H values, adding the partner's (lane ^ mask) copy of them: the lane
// with the mask bit set keeps the upper half, its partner the lower one. H a multiple of 4.
template <uint H>
inline void attn_rs_half(thread float* v, ushort mask, bool up) {
  for (uint i = 0; i < H; i += 4) {
    const float4 lo = float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
    const float4 hi = float4(v[H + i], v[H + i + 1], v[H + i + 2], v[H + i + 3]);
    const float4 r = (up ? hi : lo) + simd_shuffle_xor(up ? lo : hi, mask);
    v[i] = r.x;
    v[i + 1] = r.y;
    v[i + 2] = r.z;
    v[i + 3] = r.w;
  }
}

// Sums each of v[0..32) over the simdgroup and returns, in each lane, the total of pair
// attn_bitrev5(lane): five levels, at level b the lanes differing in bit b trade halves of
// what they still hold (31 shuffled values per lane, where 32 whole-simdgroup sums take 160).
// Each pair's additions follow a fixed tree over the lanes, the same in every simdgroup.
inline float attn_reduce_scatter(thread float* v, uint lane) {
  attn_rs_half<16>(v, 1, (lane & 1u) != 0);
  attn_rs_half<8>(v, 2, (lane & 2u) != 0);
  attn_rs_half<4>(v, 4, (lane & 4u) != 0);
  const bool up3 = (lane & 8u) != 0;
  const float2 lo = float2(v[0], v[1]);
  const float2 hi = float2(v[2], v[3]);
  const float2 r = (up3 ? hi : lo) + simd_shuffle_xor(up3 ? lo : hi, 8);
  const bool up4 = (lane & 16u) != 0;
  return (up4 ? r.y : r.x) + simd_shuffle_xor(up4 ? r.x : r.y, 16);
}

// Attends query heads h0..h0+G-1 (sharing KV head kvh) over rows [r0, r1) (r0 < r1) and hands
// each head's result to out.put(g, d, acc, M, L) for d < D: acc the unnormalised accumulator
// sum_t exp(s_t - M) v_t[d], M the largest score, L = sum_t exp(s_t - M) (head by head; for
// each head every thread calls it for its elements d = tid, tid + 256, ...).
// The query of head h0 + g is q[g * q_stride + d] (device or threadgroup memory: QPtr); red may
// alias it (it is first written after the barrier that follows the row loop). Row `pos_row` (if
// in range) is taken from kcur / vcur (threadgroup, fp32 of the bf16 values) instead of the
// cache: the fused kernels attend the new token before it is in the cache.
// Rows: simdgroup s takes blocks of RB = 32 / G consecutive rows (r0 + (8 i + s) RB, ...) and
// issues the loads of a block's RB rows together. The RB x G scores of a block (32: one per
// lane) are reduce-scattered, so lane l holds the score of one (row t, head g) pair; the head's
// block max is taken over the RB lanes holding it (shuffles) and each lane computes one
// probability and its head's correction (exp(m - m') and exp(s - m'): one pair of exps per
// lane and block, where a lane took 2 G per row). The probabilities and corrections reach every
// lane through the simdgroup's 32 + G floats of xch for the V accumulation. The simdgroups are
// merged at the end through red, a head at a time (two barriers each: red holds one head, so
// the threadgroup fits in a quarter of a core's threadgroup memory).
template <uint D, uint G, typename QPtr, typename Out>
static inline void attend_rows(QPtr q, uint q_stride, device const bfloat* k_cache,
                               device const bfloat* v_cache, threadgroup const float* kcur,
                               threadgroup const float* vcur, uint pos_row, uint kvh,
                               uint capacity, float scale, uint r0, uint r1,
                               threadgroup float* red_m,  // [kAttnSimdgroups * G]
                               threadgroup float* red_l,  // [kAttnSimdgroups * G]
                               threadgroup float* red,    // [kAttnSimdgroups * D]
                               threadgroup float* xch,    // [kAttnSimdgroups * (32 + G)]
                               Out out, uint tid, uint sg, uint lane) {
  constexpr uint NE = AttnLane<D>::NE;
  constexpr uint W = AttnLane<D>::W;
  constexpr uint NC = AttnLane<D>::NC;
  constexpr uint NT = kAttnSimdgroups * 32;
  constexpr uint RB = 32 / G;  // rows per block: RB x G scores, one per lane
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
  fvec acc[G][NC];
  for (uint g = 0; g < G; ++g) {
    for (uint c = 0; c < NC; ++c) {
      acc[g][c] = fvec(0.0f);
    }
  }
  const uint pair = attn_bitrev5(lane);  // this lane's (row, head) of every block
  const uint my_t = pair / G;
  const uint my_g = pair % G;
  float m = -INFINITY;  // head my_g's running max
  float l = 0.0f;       // this lane's rows' share of head my_g's sum of exp (scaled to m)
  threadgroup float* xs = xch + sg * (32 + G);
  device const bvec* kbase = (device const bvec*)(k_cache + ulong(kvh) * capacity * D);
  device const bvec* vbase = (device const bvec*)(v_cache + ulong(kvh) * capacity * D);
  for (uint t0 = r0 + sg * RB; t0 < r1; t0 += kAttnSimdgroups * RB) {
    bvec kk[RB][NC];  // the block's rows, as the cache holds them (past r1: zeros, not read)
    bvec vv[RB][NC];
    for (uint t = 0; t < RB; ++t) {
      const uint row = t0 + t;  // uniform across the simdgroup
      device const bvec* krow = kbase + ulong(row) * (D / W) + lane * NC;
      device const bvec* vrow = vbase + ulong(row) * (D / W) + lane * NC;
      for (uint c = 0; c < NC; ++c) {
        if (row >= r1) {  // kcur / vcur hold nothing in a block without the new row
          kk[t][c] = bvec(fvec(0.0f));
          vv[t][c] = bvec(fvec(0.0f));
        } else if (row == pos_row) {
          fvec kf, vf;
          for (uint j = 0; j < W; ++j) {
            kf[j] = kcur[e0 + c * W + j];
            vf[j] = vcur[e0 + c * W + j];
          }
          kk[t][c] = bvec(kf);  // exact: bf16 values
          vv[t][c] = bvec(vf);
        } else {
          kk[t][c] = krow[c];
          vv[t][c] = vrow[c];
        }
      }
    }
    float part[32];  // this lane's share of the score of pair t * G + g
    for (uint t = 0; t < RB; ++t) {
      for (uint g = 0; g < G; ++g) {
        float acc_s = 0.0f;
        for (uint c = 0; c < NC; ++c) {
          acc_s += dot(qv[g][c], fvec(kk[t][c]));
        }
        part[t * G + g] = acc_s;
      }
    }
    float s = attn_reduce_scatter(part, lane);
    s = t0 + my_t < r1 ? s : -INFINITY;
    float bm = s;  // the block's max of head my_g: over the RB lanes holding it (lane bits 0..)
    for (ushort mk = 1; mk < RB; mk <<= 1) {
      bm = max(bm, simd_shuffle_xor(bm, mk));
    }
    const float mn = max(m, bm);  // finite: row t0 is in range
    const float corr = exp(m - mn);
    const float p = exp(s - mn);
    l = l * corr + p;
    m = mn;
    xs[pair] = p;
    if (my_t == 0) {
      xs[32 + my_g] = corr;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    for (uint g = 0; g < G; ++g) {
      const float cg = xs[32 + g];
      for (uint c = 0; c < NC; ++c) {
        acc[g][c] *= cg;
      }
    }
    for (uint t = 0; t < RB; ++t) {
      for (uint c = 0; c < NC; ++c) {
        const fvec v4 = fvec(vv[t][c]);
        for (uint g = 0; g < G; ++g) {
          acc[g][c] += xs[t * G + g] * v4;
        }
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // xs read by every lane before the next block
  }
  for (ushort mk = 1; mk < RB; mk <<= 1) {  // head my_g's sum over its RB lanes
    l += simd_shuffle_xor(l, mk);
  }

  // merge the simdgroups: global max, rescaled sums, a head at a time
  if (my_t == 0) {
    red_m[sg * G + my_g] = m;
    red_l[sg * G + my_g] = l;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // also: every simdgroup holds its query
  for (uint g = 0; g < G; ++g) {
    float M = -INFINITY;
    for (uint s = 0; s < kAttnSimdgroups; ++s) {
      M = max(M, red_m[s * G + g]);
    }
    const float mine = exp(red_m[sg * G + g] - M);  // 0 for a simdgroup that saw no rows
    for (uint c = 0; c < NC; ++c) {
      for (uint j = 0; j < W; ++j) {
        red[sg * D + e0 + c * W + j] = acc[g][c][j] * mine;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float L = 0.0f;
    for (uint s = 0; s < kAttnSimdgroups; ++s) {
      L += red_l[s * G + g] * exp(red_m[s * G + g] - M);
    }
    for (uint d = tid; d < D; d += NT) {
      float sum = 0.0f;
      for (uint s = 0; s < kAttnSimdgroups; ++s) {
        sum += red[s * D + d];
      }
      out.put(g, d, sum, M, L);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // red holds the next head
  }
}

// attend_rows' results as the gated attention output of heads h0 ..: out = acc / L * sigmoid(gate).
template <uint D>
struct AttnGatedOut {
  device float* out;          // [Hq, D]
  device const float* gate;   // head h's gate at h * gate_stride
  uint gate_stride;
  uint h0;
  void put(uint g, uint d, float acc, float, float L) const {
    const float o = acc / L;
    out[(h0 + g) * D + d] = o * sigmoid(gate[(h0 + g) * gate_stride + d]);
  }
};

// attend_rows' results as block blk's partials (slot h * max_blocks + blk per head h): the max
// and the sum of exp in part_ml, the unnormalised accumulator in part_acc.
template <uint D>
struct AttnPartialOut {
  device float* part_ml;   // [Hq, max_blocks, 2]
  device float* part_acc;  // [Hq, max_blocks, D]
  uint max_blocks;
  uint blk;
  uint h0;
  void put(uint g, uint d, float acc, float M, float L) const {
    const ulong slot = ulong(h0 + g) * max_blocks + blk;
    part_acc[slot * D + d] = acc;
    if (d == 0) {
      part_ml[2 * slot] = M;
      part_ml[2 * slot + 1] = L;
    }
  }
};

// ---- attn_decode -------------------------------------------------------------------------------
// Grid: Hq / G threadgroups of 256 threads; threadgroup j serves query heads j*G .. j*G+G-1.
template <uint D, uint G>
[[max_total_threads_per_threadgroup(kAttnDecodeThreads)]] kernel void attn_decode(device const float* q [[buffer(0)]],          // [Hq, D] from attn_qk_prep
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
  threadgroup float red_m[attn_red_floats(G)];
  threadgroup float red_l[attn_red_floats(G)];
  threadgroup float red[attn_rows_floats(D)];
  threadgroup float xch[attn_xch_floats(G)];
  const uint h0 = grp * G;
  const uint kvh = h0 / (args.num_q_heads / args.num_kv_heads);
  const uint n = position[0] + 1;
  attend_rows<D, G>(q + h0 * D, D, k_cache, v_cache, red_m, red_m, 0xFFFFFFFFu, kvh, args.capacity,
                    args.scale, 0, n, red_m, red_l, red, xch,
                    AttnGatedOut<D>{out, gate, args.gate_stride, h0}, tid, sg, lane);
}

// ---- attn_decode_split -------------------------------------------------------------------------
// Grid: (Hq / G, nblocks) threadgroups of 256 threads, nblocks >= ceil((pos + 1) / B) and
// <= max_blocks; blocks past the last row return at once. Partials, per head h and block b
// (slot h * max_blocks + b): part_ml[2*slot] = max score, part_ml[2*slot+1] = sum of exp,
// part_acc[slot * D + d] = unnormalised accumulator.
template <uint D, uint G>
[[max_total_threads_per_threadgroup(kAttnDecodeThreads)]] kernel void attn_decode_split(device const float* q [[buffer(0)]],         // [Hq, D]
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
  threadgroup float red_m[attn_red_floats(G)];
  threadgroup float red_l[attn_red_floats(G)];
  threadgroup float red[attn_rows_floats(D)];
  threadgroup float xch[attn_xch_floats(G)];
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
                    args.scale, r0, r1, red_m, red_l, red, xch,
                    AttnPartialOut<D>{part_ml, part_acc, args.max_blocks, blk, h0}, tid, sg, lane);
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
// (kCombineSimdgroups: mixer_args.h)

template <uint D>
[[max_total_threads_per_threadgroup(kAttnCombineThreads)]] kernel void attn_combine(device const float* part_ml [[buffer(0)]],   // [Hq, max_blocks, 2]
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

constant constexpr uint kFusedThreads = kAttnDecodeThreads;

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
[[max_total_threads_per_threadgroup(kAttnDecodeThreads)]] kernel void attn_decode_fused(device const float* qg [[buffer(0)]],         // [Hq, 2*D] q_proj output: query | gate per head
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
  threadgroup float red_m[attn_red_floats(G)];
  threadgroup float red_l[attn_red_floats(G)];
  threadgroup float qs[attn_rows_floats(D)];  // the prepared queries (G * D), then attend_rows' red
  threadgroup float kcur[D];
  threadgroup float vcur[D];
  threadgroup float xch[attn_xch_floats(G)];
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
                    args.capacity, args.scale, 0, pos + 1, red_m, red_l, qs, xch,
                    AttnGatedOut<D>{out, qg + D, 2 * D, h0}, tid, sg, lane);
}

// ---- attn_decode_split_fused -------------------------------------------------------------------
// Grid: (Hq / G, nblocks) threadgroups of 256 threads, nblocks >= ceil((pos + 1) / B) and
// <= max_blocks; blocks past the last row return at once. Every block threadgroup prepares
// its G query heads; only the block holding row pos computes the new k/v (and, for the first
// head group of each KV head, appends row pos); the other blocks only read the cache.
// Partials as attn_decode_split; merge with attn_combine (gate: the q_proj output at element
// offset D, gate_stride 2*D).
template <uint D, uint G>
[[max_total_threads_per_threadgroup(kAttnDecodeThreads)]] kernel void attn_decode_split_fused(device const float* qg [[buffer(0)]],         // [Hq, 2*D]
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
  threadgroup float red_m[attn_red_floats(G)];
  threadgroup float red_l[attn_red_floats(G)];
  threadgroup float qs[attn_rows_floats(D)];  // the prepared queries (G * D), then attend_rows' red
  threadgroup float kcur[D];
  threadgroup float vcur[D];
  threadgroup float xch[attn_xch_floats(G)];
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
                    args.capacity, args.scale, r0, r1, red_m, red_l, qs, xch,
                    AttnPartialOut<D>{part_ml, part_acc, args.max_blocks, blk, h0}, tid, sg, lane);
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
