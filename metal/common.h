// Shared by Lily's decode kernels: argument structs (one per kernel family, every field
// commented) and the dequantisation helpers of the MLX affine 4/8-bit layout.
//
// Data conventions of the decode step (batch 1):
//   * activations between kernels: float32 vectors;
//   * weights: the checkpoint's packed tensors as-is. A quantized linear X of logical shape
//     [out, in] is three bindings: X.weight uint32 [out, in*bits/32] (codes low bits first),
//     X.scales and X.biases bf16 [out, in/64]; w[o, i] = scale * q + bias. Experts are
//     stacked with a leading [E] axis. Kernels read the weight as uint4 (16-byte chunks):
//     a weight binding must start at a 16-byte aligned address;
//   * KV cache bf16; recurrent state fp32.
//
// Host side: these structs are plain 32-bit fields (uint = uint32_t, float) with no
// padding, so the host can mirror them field by field (static_assert the size).
#pragma once

#include <metal_stdlib>
using namespace metal;

// ---------------------------------------------------------------- constants

// The decode kernels' argument structs and the constants the host shares with them (rows
// per simdgroup of the GEMVs, split-K, the routing and norm_gemv limits): host-includable.
#include "decode_args.h"

// ---------------------------------------------------------------- bf16 activations
// Prefill's intermediate activations (the GEMMs' inputs xn, hs, hx, u, attn, and the GEMM
// outputs only a following kernel reads: yx, z, q|gate, k, v) are stored as bfloat, rounded
// to nearest even from the fp32 value: bf16 has fp32's range, so nothing is clipped (a
// value beyond the half range stays what it is, to 8 significant bits). MLX-LM and
// pplx-garden keep these activations in bf16 too (docs/prefill.md, "Operand precision").
// A GEMM output element: fp32 (ADD: y += v), or bfloat (never ADD).
inline void gemm_put(device float* dst, float v, bool add) {
  *dst = add ? *dst + v : v;
}
inline void gemm_put(device bfloat* dst, float v, bool) { *dst = bfloat(v); }

// ---------------------------------------------------------------- small helpers

inline float silu(float x) { return x / (1.0f + exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + exp(-x)); }
// log(1 + e^x) without overflow; matches numpy's logaddexp(0, x) to float precision.
inline float softplus(float x) {
  if (x > 20.0f) {
    return x;
  }
  if (x < -15.0f) {
    return exp(x);
  }
  return log(1.0f + exp(x));
}

// Sum over a whole threadgroup; every thread gets the same value (same summation order).
// scratch holds >= 32 floats; it may be reused by the next call (the first barrier
// protects it).
inline float threadgroup_sum(float v, threadgroup float* scratch, uint sg, uint lane, uint nsg) {
  v = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) {
    scratch[sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float t = 0.0f;
  for (uint i = 0; i < nsg; ++i) {
    t += scratch[i];
  }
  return t;
}

// RMSNorm of one row by a whole threadgroup: out[i] = x[i] * rsqrt(mean(x^2) + eps) * w[i]
// (T: float, or bfloat rounded from the fp32 value: gemm_put). Thread tid squares and adds x[tid], x[tid + tcount],
// ... in that order, then threadgroup_sum: the same thread count gives the same bits
// (rms_norm_t of norm.metal, and moe_combine_norm, which normalises the residual it just
// updated). XPtr: a device pointer to x.
template <typename XPtr, typename T>
inline void rms_row(XPtr x, device const bfloat* w, device T* out, uint n, float eps,
                    threadgroup float* scratch, uint tid, uint tcount, uint sg, uint lane, uint nsg) {
  float ss = 0.0f;
  for (uint i = tid; i < n; i += tcount) {
    const float v = x[i];
    ss += v * v;
  }
  ss = threadgroup_sum(ss, scratch, sg, lane, nsg);
  const float inv = rsqrt(ss / float(n) + eps);
  for (uint i = tid; i < n; i += tcount) {
    gemm_put(out + i, x[i] * inv * float(w[i]), false);
  }
}

inline float threadgroup_max(float v, threadgroup float* scratch, uint sg, uint lane, uint nsg) {
  v = simd_max(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) {
    scratch[sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float t = scratch[0];
  for (uint i = 1; i < nsg; ++i) {
    t = max(t, scratch[i]);
  }
  return t;
}

// ---------------------------------------------------------------- quantized dot products
//
// A row of a BITS-bit matrix is read in 16-byte chunks (one uint4): 32 codes at 4 bits,
// 16 at 8 bits. A chunk never straddles a quantization group, so one scale and one bias
// apply to the whole chunk and the bias folds out:
//     sum_i (s*q_i + b) x_i = s * (q . x) + b * sum(x).
// The codes are not shifted down: the field is masked in place (float(w & (15 << 4j)) =
// q * 16^j exactly) and the matching x values are pre-multiplied by 16^-j (powers of two:
// the products q*x are exactly the same), so x is prepared once per chunk and reused for
// every row that reads the chunk.

// Values of one chunk and float4s needed to hold them.
template <int BITS> struct QChunk {
  static constant constexpr uint values = 128 / BITS;
  static constant constexpr uint float4s = 32 / BITS;
};

// Float4 i of a chunk of x times the in-word position factors of its codes (powers of two).
template <int BITS>
inline float4 q_position_scale(float4 v, uint i) {
  if (BITS == 4) {
    // word i/2 holds values 8*(i/2)..+7; float4 i covers nibbles 4*(i%2)..+3
    return (i % 2 == 0) ? v * float4(1.0f, 0.0625f, 0.00390625f, 0.000244140625f)
                        : v * float4(1.52587890625e-05f, 9.5367431640625e-07f,
                                       5.9604644775390625e-08f, 3.7252902984619140625e-09f);
  } else {
    return v * float4(1.0f, 0.00390625f, 1.52587890625e-05f, 5.9604644775390625e-08f);
  }
}

// Loads chunk c of x (x4 points at float4 0 of the vector), multiplies it by mult and the
// in-word position factors into xs, and returns mult * sum of the chunk.
template <int BITS>
inline float q_load_x(device const float4* x4, uint c, float mult, thread float4* xs) {
  constexpr uint nf4 = QChunk<BITS>::float4s;
  float s = 0.0f;
  for (uint i = 0; i < nf4; ++i) {
    float4 v = x4[c * nf4 + i] * mult;
    s += (v.x + v.y) + (v.z + v.w);
    xs[i] = q_position_scale<BITS>(v, i);
  }
  return s;
}

// RMS-normalised float4 j of x: (x * inv) * w with w the bf16 norm weight (the same
// expression, in the same order, as rms_norm). nw points at element 0 of the weight.
inline float4 rms_apply4(float4 x, float inv, device const bfloat* nw, uint j) {
  const float4 w = float4(float(nw[4 * j]), float(nw[4 * j + 1]), float(nw[4 * j + 2]),
                          float(nw[4 * j + 3]));
  return (x * inv) * w;
}

// q_load_x for the normalised input: chunk c of rms_apply4(x, inv, nw) into xs; returns
// the sum of the chunk's normalised values. XPtr: a device or threadgroup float4 pointer.
template <int BITS, typename XPtr>
inline float q_load_x_norm(XPtr x4, device const bfloat* nw, uint c, float inv,
                           thread float4* xs) {
  constexpr uint nf4 = QChunk<BITS>::float4s;
  float s = 0.0f;
  for (uint i = 0; i < nf4; ++i) {
    const float4 v = rms_apply4(x4[c * nf4 + i], inv, nw, c * nf4 + i);
    s += (v.x + v.y) + (v.z + v.w);
    xs[i] = q_position_scale<BITS>(v, i);
  }
  return s;
}

// q . x for one chunk of codes and a chunk of x prepared by q_load_x.
template <int BITS>
inline float q_dot_chunk(uint4 w, thread const float4* xs) {
  float d = 0.0f;
  for (uint k = 0; k < 4; ++k) {
    uint4 wk = uint4(w[k]);
    if (BITS == 4) {
      float4 lo = float4(wk & uint4(0xFu, 0xF0u, 0xF00u, 0xF000u));
      float4 hi = float4(wk & uint4(0xF0000u, 0xF00000u, 0xF000000u, 0xF0000000u));
      d += dot(lo, xs[2 * k]) + dot(hi, xs[2 * k + 1]);
    } else {
      float4 b = float4(wk & uint4(0xFFu, 0xFF00u, 0xFF0000u, 0xFF000000u));
      d += dot(b, xs[k]);
    }
  }
  return d;
}

// Chunk c of up to 8 consecutive rows of a quantized matrix as loaded: the codes, the scale
// and the bias of each row (q_chunk_load), consumed by q_chunk_fma. Loading a chunk early (a
// kernel's first chunk before its prologue) keeps its round trip off the prologue's path.
struct QChunkRows {
  uint4 q[8];
  float s[8];
  float b[8];
};

//   w       the matrix as uint4 chunks, row-major [rows, chunks]
//   scales  bf16 [rows, groups], biases likewise
template <int BITS>
inline void q_chunk_load(device const uint4* w, device const bfloat* scales,
                         device const bfloat* biases, uint chunks, uint groups, uint row0,
                         uint nrows, uint c, thread QChunkRows& out) {
  const uint g = c * QChunk<BITS>::values / kQuantGroup;
  for (uint r = 0; r < 8; ++r) {
    if (r < nrows) {
      const uint row = row0 + r;
      out.q[r] = w[row * chunks + c];
      out.s[r] = float(scales[row * groups + g]);
      out.b[r] = float(biases[row * groups + g]);
    }
  }
}

// acc[r] += scale * (q . x) + bias * sum(x), for r < nrows, on a chunk of x prepared by
// q_load_x (or q_load_x_norm) and the same chunk of the rows.
template <int BITS>
inline void q_chunk_fma(thread const QChunkRows& wr, uint nrows, thread const float4* xs, float xsum,
                        thread float* acc) {
  for (uint r = 0; r < 8; ++r) {
    if (r < nrows) {
      acc[r] += wr.s[r] * q_dot_chunk<BITS>(wr.q[r], xs) + wr.b[r] * xsum;
    }
  }
}

// One chunk c of x against up to 8 consecutive rows row0.. of a quantized matrix:
// acc[r] += scale * (q . x) + bias * sum(x), for r < nrows.
template <int BITS>
inline void q_chunk_rows(device const uint4* w, device const bfloat* scales,
                         device const bfloat* biases, uint chunks, uint groups, uint row0,
                         uint nrows, uint c, thread const float4* xs, float xsum,
                         thread float* acc) {
  QChunkRows wr;
  q_chunk_load<BITS>(w, scales, biases, chunks, groups, row0, nrows, c, wr);
  q_chunk_fma<BITS>(wr, nrows, xs, xsum, acc);
}

// Team geometry: a simdgroup splits into teams of `size` lanes (a power of two, 4..32);
// the lanes of a team share the rows of the team and stride over their chunks.
struct QTeam {
  uint size;  // lanes per team
  uint lane;  // this lane's index within its team
  uint team;  // this lane's team within the simdgroup
  uint rows;  // rows per team (= rows_per_simdgroup * size / 32)
};

// The largest power of two <= chunks, clamped to [32 / rows_per_simdgroup, 32].
inline QTeam q_team(uint chunks, uint rows_per_simdgroup, uint simd_lane) {
  const uint min_size = 32 / rows_per_simdgroup;
  uint size = 32;
  while (size > min_size && size > chunks) {
    size >>= 1;
  }
  QTeam t;
  t.size = size;
  t.lane = simd_lane & (size - 1);
  t.team = simd_lane / size;
  t.rows = rows_per_simdgroup * size / 32;
  return t;
}

// Sum over the lanes of a team (xor butterfly: every lane of the team gets the sum).
// All lanes of the simdgroup must call it (team sizes are uniform).
inline float4 team_sum(float4 v, uint size) {
  for (ushort m = 1; m < size; m <<= 1) {
    v += simd_shuffle_xor(v, m);
  }
  return v;
}

// Split-K: `splits` simdgroups computed partial sums of the same rows, split ks over the chunk
// runs ks, ks + splits, ... After team_reduce_rows, lane r < nrows of a team holds its split's
// sum of the team's row r (slot + r within the threadgroup). Splits > 0 hand their sums to
// split 0 through part [rows of the threadgroup x splits]; split 0 adds them in split order and
// gets true (it stores the rows), the others false. A barrier: every thread of the threadgroup
// calls it (splits uniform; nothing for splits = 1).
inline bool q_split_join(thread float& v, threadgroup float* part, uint lane_in_team, uint nrows,
                         uint slot, uint ks, uint splits) {
  if (splits == 1) {
    return true;
  }
  if (ks > 0 && lane_in_team < nrows) {
    part[(slot + lane_in_team) * splits + ks] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (ks > 0) {
    return false;
  }
  if (lane_in_team < nrows) {
    for (uint s = 1; s < splits; ++s) {
      v += part[(slot + lane_in_team) * splits + s];
    }
  }
  return true;
}

// Reduces acc[0..8) over the team and returns the value of row `team lane` (lane r of a
// team holds the total of the team's row r, for r < 8).
inline float team_reduce_rows(thread const float* acc, QTeam t) {
  const float4 lo = team_sum(float4(acc[0], acc[1], acc[2], acc[3]), t.size);
  // t.rows is uniform over the simdgroup: every lane skips (or runs) the same collectives
  const float4 hi = t.rows > 4 ? team_sum(float4(acc[4], acc[5], acc[6], acc[7]), t.size)
                               : float4(0.0f);
  const uint r = t.lane;
  float v = 0.0f;
  for (uint i = 0; i < 4; ++i) {
    v = (r == i) ? lo[i] : v;
    v = (r == i + 4) ? hi[i] : v;
  }
  return v;
}
