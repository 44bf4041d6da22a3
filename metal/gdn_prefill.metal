// Gated DeltaNet prefill: one chunk of M tokens (docs/model.md, "Gated DeltaNet"; docs/goals.md
// section 3, "Register-resident Gated DeltaNet scan"; docs/prefill.md).
//
// Two dispatches per layer and chunk, after the projections (qkv, z, b, a: fp32 [M, ...]):
//
//   gdn_conv_chunk   causal depthwise conv of every channel over [conv state | qkv rows],
//                    SiLU, new conv state. One thread per (channel, block of RB rows);
//                    the thread of the first row block owns the channel's conv state: it
//                    reads the state column before writing it, so the state may be updated
//                    in place (input and output the same bytes).
//   gdn_scan         one threadgroup (32 simdgroups) per value head h, for the whole chunk.
//                    Simdgroup s owns state rows s*R .. s*R+R-1 (R = Dv/32) of head h; lane l
//                    holds elements l, l+32, ... of each row (Dk/32 of them). The state is
//                    loaded into registers once, carried through all M tokens (dot products
//                    exchanged with simd_sum, never through threadgroup memory) and written
//                    back once. Threadgroup memory holds only activations, in blocks of TB
//                    tokens: normalised q and k, v, g, beta (staged, coalesced) and the
//                    per-row outputs y for the gated RMSNorm. Per block:
//                      | gated RMSNorm of block j-1 (y -> out)  and  stage block j |
//                      barrier | delta rule over the tokens of block j | barrier
//
// Per token the arithmetic is gdn_decode_step's (metal/gdn.metal), operation for operation and
// in the same order (same lane distribution, same simd_sum reductions), so on the simulator a
// chunk of M tokens gives bit for bit the outputs and states of M decode steps.
#include <metal_stdlib>
#include "common.h"  // silu, softplus: the decode step's (metal/gdn.metal)
#include "prefill_args.h"
using namespace metal;

// ---------------------------------------------------------------- gdn_conv_chunk

// out[t, c] = silu(sum_j w[c, j] * x[t - (K-1) + j, c]), x = [conv_in | qkv] along rows;
// conv_out = the last K-1 rows of [conv_in | qkv]. Thread (c, y) convolves rows
// [y*RB, min((y+1)*RB, M)) of channel c with a K-1 value window in registers; adjacent threads
// take adjacent channels, so every row access of a simdgroup is 128 contiguous bytes.
template <uint K>
[[max_total_threads_per_threadgroup(256)]] kernel void gdn_conv_chunk(device const float* qkv [[buffer(0)]],      // [M, C] in_proj_qkv output, q | k | v
                           device const bfloat* conv_w [[buffer(1)]],  // [C, K] conv1d.weight
                           device const float* conv_in [[buffer(2)]],  // [K-1, C] conv state (oldest first)
                           device float* conv_out [[buffer(3)]],       // [K-1, C] next conv state; may be conv_in
                           device float* out [[buffer(4)]],            // [M, C] silu(conv)
                           constant GdnConvChunkArgs& args [[buffer(5)]],
                           uint2 gid [[thread_position_in_grid]]) {
  static_assert(K >= 2, "the conv state holds K-1 >= 1 rows");
  const uint C = args.conv_dim;
  const uint M = args.rows;
  const uint RB = max(args.rows_per_thread, K - 1);
  const uint c = gid.x;
  const uint r0 = gid.y * RB;
  if (c >= C || r0 >= M) {
    return;
  }
  const uint r1 = min(r0 + RB, M);

  float w[K];
  for (uint j = 0; j < K; ++j) {
    w[j] = float(conv_w[c * K + j]);
  }
  // win[j] = input row r0 - (K-1) + j: from the state for the first block (the only reader
  // and the only writer of the state column), else from qkv (r0 >= RB >= K-1).
  float win[K - 1];
  for (uint j = 0; j + 1 < K; ++j) {
    win[j] = r0 == 0 ? conv_in[j * C + c] : qkv[(r0 - (K - 1) + j) * C + c];
  }
  for (uint t = r0; t < r1; ++t) {
    const float x = qkv[t * C + c];
    // gdn_decode_step's order: the newest tap first, then the window oldest first.
    float acc = x * w[K - 1];
    for (uint j = 0; j + 1 < K; ++j) {
      acc += win[j] * w[j];
    }
    out[t * C + c] = silu(acc);
    for (uint j = 0; j + 2 < K; ++j) {
      win[j] = win[j + 1];
    }
    win[K - 2] = x;
  }
  if (r0 == 0) {
    // The state column has been read (all of it, above): now replace it.
    for (uint j = 0; j + 1 < K; ++j) {
      conv_out[j * C + c] = r1 == M ? win[j] : qkv[(M - (K - 1) + j) * C + c];
    }
  }
}

template [[host_name("gdn_conv_chunk")]] [[kernel]] decltype(gdn_conv_chunk<4>) gdn_conv_chunk<4>;

// ---------------------------------------------------------------- gdn_scan

constant constexpr uint kGdnScanSimdgroups = 32;  // threadgroup = 1024 threads

// DK, DV: head dims (multiples of 32). TB: tokens per threadgroup-memory block, <= 16 so the
// 2*TB tasks of an interval (TB norms, TB stagings) need at most one pass of the 32
// simdgroups when DK = DV = 128 (threadgroup memory: TB * (2*DK + 2*DV + 2) * 4 bytes).
template <uint DK, uint DV, uint TB>
[[max_total_threads_per_threadgroup(1024)]] kernel void gdn_scan(device const float* conv [[buffer(0)]],       // [M, C] gdn_conv_chunk output, q | k | v
                     device const float* z [[buffer(1)]],          // [M, Hv*Dv] in_proj_z output
                     device const float* b [[buffer(2)]],          // [M, Hv] in_proj_b output
                     device const float* a [[buffer(3)]],          // [M, Hv] in_proj_a output
                     device const float* A_log [[buffer(4)]],      // [Hv]
                     device const bfloat* dt_bias [[buffer(5)]],   // [Hv]
                     device const bfloat* norm_w [[buffer(6)]],    // [Dv] norm.weight
                     device float* state [[buffer(7)]],            // [Hv, Dv, Dk] recurrent state, in place
                     device float* out [[buffer(8)]],              // [M, Hv*Dv] gated RMSNorm output
                     constant GdnScanArgs& args [[buffer(9)]],
                     uint h [[threadgroup_position_in_grid]],
                     uint sg [[simdgroup_index_in_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]]) {
  static_assert(DK % 32 == 0 && DV % kGdnScanSimdgroups == 0, "head dims are multiples of 32");
  constexpr uint E = DK / 32;                   // state elements per lane per row
  constexpr uint R = DV / kGdnScanSimdgroups;   // state rows per simdgroup
  constexpr uint EV = DV / 32;                  // v / y / out elements per lane of a token row
  threadgroup float q_s[TB * DK];               // normalised q (also / sqrt(Dk)) per token
  threadgroup float k_s[TB * DK];               // normalised k
  threadgroup float v_s[TB * DV];               // v of head h
  threadgroup float y_s[TB * DV];               // S q per row, for the gated RMSNorm
  threadgroup float g_s[TB];                    // decay g
  threadgroup float beta_s[TB];                 // beta

  const uint Hk = args.num_k_heads;
  const uint Hv = args.num_v_heads;
  const uint M = args.rows;
  const uint kh = h / (Hv / Hk);
  const uint C = 2 * Hk * DK + Hv * DV;
  const uint HVD = Hv * DV;
  const float A = exp(A_log[h]);
  const float dtb = float(dt_bias[h]);

  // ---- the state rows of this simdgroup, into registers (once) ---------------------------
  device float* rows = state + (ulong(h) * DV + sg * R) * DK;
  float s[R][E];
  for (uint r = 0; r < R; ++r) {
    for (uint e = 0; e < E; ++e) {
      s[r][e] = rows[r * DK + e * 32 + lane];
    }
  }

  const uint nblocks = (M + TB - 1) / TB;
  for (uint blk = 0;; ++blk) {
    // ---- gated RMSNorm of block blk-1 (tasks 0..TB-1) and staging of block blk (TB..2TB-1),
    //      one token per simdgroup and task: no dependency between the tasks of an interval.
    for (uint task = sg; task < 2 * TB; task += kGdnScanSimdgroups) {
      if (task < TB) {
        if (blk == 0 || (blk - 1) * TB + task >= M) {
          continue;
        }
        const uint i = task;
        const uint t = (blk - 1) * TB + i;
        float ss = 0.0f;
        for (uint j = lane; j < DV; j += 32) {
          ss += y_s[i * DV + j] * y_s[i * DV + j];
        }
        ss = simd_sum(ss);
        const float inv = 1.0f / sqrt(ss / float(DV) + args.norm_eps);
        const uint o = t * HVD + h * DV;
        for (uint j = lane; j < DV; j += 32) {
          out[o + j] = y_s[i * DV + j] * inv * float(norm_w[j]) * silu(z[o + j]);
        }
      } else {
        const uint i = task - TB;
        const uint t = blk * TB + i;
        if (blk == nblocks || t >= M) {
          continue;
        }
        device const float* row = conv + ulong(t) * C;
        float qr[E];
        float kr[E];
        float sq = 0.0f;
        float sk = 0.0f;
        for (uint e = 0; e < E; ++e) {
          qr[e] = row[kh * DK + e * 32 + lane];
          kr[e] = row[Hk * DK + kh * DK + e * 32 + lane];
          sq += qr[e] * qr[e];
          sk += kr[e] * kr[e];
        }
        sq = simd_sum(sq);
        sk = simd_sum(sk);
        const float qscale = 1.0f / (sqrt(sq + args.l2_eps) * sqrt(float(DK)));
        const float kscale = 1.0f / sqrt(sk + args.l2_eps);
        for (uint e = 0; e < E; ++e) {
          q_s[i * DK + e * 32 + lane] = qr[e] * qscale;
          k_s[i * DK + e * 32 + lane] = kr[e] * kscale;
        }
        for (uint e = 0; e < EV; ++e) {
          v_s[i * DV + e * 32 + lane] = row[2 * Hk * DK + h * DV + e * 32 + lane];
        }
        if (lane == 0) {
          g_s[i] = exp(-A * softplus(a[t * Hv + h] + dtb));
          beta_s[i] = 1.0f / (1.0f + exp(-b[t * Hv + h]));
        }
      }
    }
    if (blk == nblocks) {
      break;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // ---- delta rule over the tokens of block blk, state in registers ----------------------
    const uint n = min(TB, M - blk * TB);
    for (uint i = 0; i < n; ++i) {
      const float g = g_s[i];
      const float beta = beta_s[i];
      float qr[E];
      float kr[E];
      for (uint e = 0; e < E; ++e) {
        qr[e] = q_s[i * DK + e * 32 + lane];
        kr[e] = k_s[i * DK + e * 32 + lane];
      }
      float sk_dot[R];
      for (uint r = 0; r < R; ++r) {
        sk_dot[r] = 0.0f;
        for (uint e = 0; e < E; ++e) {
          s[r][e] *= g;
          sk_dot[r] += s[r][e] * kr[e];
        }
      }
      for (uint r = 0; r < R; ++r) {
        sk_dot[r] = simd_sum(sk_dot[r]);
      }
      float y[R];
      for (uint r = 0; r < R; ++r) {
        const float delta = (v_s[i * DV + sg * R + r] - sk_dot[r]) * beta;
        y[r] = 0.0f;
        for (uint e = 0; e < E; ++e) {
          s[r][e] += delta * kr[e];
          y[r] += s[r][e] * qr[e];
        }
      }
      for (uint r = 0; r < R; ++r) {
        y[r] = simd_sum(y[r]);
        if (lane == r) {
          y_s[i * DV + sg * R + r] = y[r];
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // ---- the state back (once) ---------------------------------------------------------------
  for (uint r = 0; r < R; ++r) {
    for (uint e = 0; e < E; ++e) {
      rows[r * DK + e * 32 + lane] = s[r][e];
    }
  }
}

// The model (Hk=16, Hv=32) and the "dims" preset: TB = 12 (24.1 KiB of threadgroup memory);
// the "tiny" preset: TB = 32 (16.3 KiB).
template [[host_name("gdn_scan_k128_v128")]] [[kernel]] decltype(gdn_scan<128, 128, 12>) gdn_scan<128, 128, 12>;
template [[host_name("gdn_scan_k32_v32")]] [[kernel]] decltype(gdn_scan<32, 32, 32>) gdn_scan<32, 32, 32>;
