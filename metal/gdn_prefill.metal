// Gated DeltaNet prefill: one chunk of M tokens (docs/model.md, "Gated DeltaNet"; docs/goals.md
// section 3, "Register-resident Gated DeltaNet scan"; docs/prefill.md).
//
// Three dispatches per layer and chunk, after the projections (qkv, b, a: fp32 [M, ...]; z:
// bfloat [M, Hv*Dv], stored by gemm_q4_bf16):
//
//   gdn_scan         causal conv + SiLU of the channels it needs (inline, from qkv and the
//                    conv state: the conv output never goes through device memory), L2 norms,
//                    gates and the delta rule over the whole chunk. Value head h is split into
//                    DV / RV threadgroups of RV state rows each (rows of S are independent:
//                    row v only sees v[v]), so the model's 32 heads give 128 threadgroups.
//                    Four adjacent lanes share a row (two shuffle-add levels per dot
//                    product instead of a 32-lane simd_sum). The state is loaded into
//                    registers once, carried through all M tokens and written back once,
//                    with the decay applied lazily (S = c S', below).
//                    Threadgroup memory holds only activations, in blocks of TB tokens:
//                    normalised q and k, v of the threadgroup's rows, g, beta and y = S q:
//                      | y of block j-1 out  and  stage block j |
//                      barrier | delta rule over the tokens of block j | barrier
//                    y leaves through the per-element part of the gated RMSNorm (below): u
//                    (bfloat, out_proj's input) and the sum of y^2 over the threadgroup's RV rows.
//   gdn_norm_scale   per (token, head, split): the factor f that turns the split's u into the
//                    head's gated RMSNorm (the RMS needs the whole head, which no scan
//                    threadgroup holds); out_proj (gemm_q4_add_hs) multiplies u by f while
//                    it stages its A tile, so the normed rows never go through device memory.
//   gdn_conv_state   the next conv state (the last K-1 rows of [conv state | qkv]); after the
//                    scan, which reads the old one (they may be the same bytes).
//
// The gated RMSNorm, split: for token t, head h and split s (rows [s RV, s RV + RV)) with
// p_s = sum of y^2 over the split's rows (fp32) and P = p_0 + ... + p_{S-1}:
//   scan:        a_s = 1 / sqrt(p_s / Dv + eps),  u = bfloat(y * a_s * w * silu(z))
//   norm scale:  f_s = half(sqrt(p_s / Dv + eps) * inv),  inv = 1 / sqrt(P / Dv + eps)  (f_s = inv / a_s <= 1)
//   out_proj:    A = bfloat(u * f_s)                                       (an fp32 multiply)
// i.e. y * inv * w * silu(z), the gated RMSNorm, as the fp32 math of one pass gives it but for
// two bfloat roundings and a half one instead of one bfloat rounding (u, f_s, the product).
// bfloat has fp32's range: u is never clipped, whatever w and z (the factor f_s is in [0, 1]).
// The conv is gdn_decode_step's (metal/gdn.metal) operation for operation; the scan sums its
// dot products in another order, so a chunk agrees with decode steps to float32 rounding, and
// two chunks equal one chunk of the same tokens bit for bit (the arithmetic per token does
// not depend on where a chunk starts).
#include <metal_stdlib>
#include "common.h"  // silu, softplus: the decode step's (metal/gdn.metal)
#include "prefill_args.h"
using namespace metal;

// ---------------------------------------------------------------- causal conv

// silu(sum_j w[ch, j] * x[t - (K-1) + j, ch]) with x = [conv state (K-1 rows) | qkv rows]: the
// conv output of channel ch at chunk row t, in gdn_decode_step's order (the newest tap first,
// then the window oldest first), so it equals the decode step's bit for bit on the simulator.
template <uint K>
inline float conv_silu(device const float* qkv, device const float* conv_in, device const bfloat* conv_w,
                       uint C, uint t, uint ch) {
  float acc = qkv[ulong(t) * C + ch] * float(conv_w[ch * K + K - 1]);
  for (uint j = 0; j + 1 < K; ++j) {
    const uint row = t + j;  // row of x: [0, K-1) the state, then qkv row - (K-1)
    const float x = row >= K - 1 ? qkv[ulong(row - (K - 1)) * C + ch] : conv_in[row * C + ch];
    acc += x * float(conv_w[ch * K + j]);
  }
  return silu(acc);
}

// ---------------------------------------------------------------- gdn_conv_state

// conv_out = the last K-1 rows of [conv_in | qkv] (for M < K-1 it keeps old rows). One thread
// per channel reads its whole new column before writing it, so conv_out may be conv_in.
template <uint K>
[[max_total_threads_per_threadgroup(kGdnConvStateThreads)]] kernel void gdn_conv_state(
    device const float* qkv [[buffer(0)]],      // [M, C] in_proj_qkv output
    device const float* conv_in [[buffer(1)]],  // [K-1, C] conv state (oldest first)
    device float* conv_out [[buffer(2)]],       // [K-1, C] next conv state; may be conv_in
    constant GdnConvStateArgs& args [[buffer(3)]],
    uint c [[thread_position_in_grid]]) {
  static_assert(K >= 2, "the conv state holds K-1 >= 1 rows");
  const uint C = args.conv_dim;
  const uint M = args.rows;
  if (c >= C) {
    return;
  }
  float next[K - 1];
  for (uint j = 0; j + 1 < K; ++j) {
    const uint row = M + j;  // row of [conv_in | qkv]
    next[j] = row >= K - 1 ? qkv[ulong(row - (K - 1)) * C + c] : conv_in[row * C + c];
  }
  for (uint j = 0; j + 1 < K; ++j) {
    conv_out[j * C + c] = next[j];
  }
}

template [[host_name("gdn_conv_state")]] [[kernel]] decltype(gdn_conv_state<kGdnConvTaps>) gdn_conv_state<kGdnConvTaps>;

// ---------------------------------------------------------------- gdn_scan

// Lazy decay. The state buffer is [Hv, Dv, Dk] S' followed by [Hv, Dv] c: row v of head h is
// S = c * S'. A token's decay g only multiplies the row's scalar c; S' is scaled (the fold:
// S' *= c g, c = 1) only once c g < kGdnScanFold. Per token and row, with c the new c g:
//   sk = c (S'.k);  delta = (v - sk) beta;  S' += (delta / c) k;  y = c (S'.q)
// i.e. 3 FMAs per state element instead of a multiply and 3 FMAs. The fold depends only on c
// and g, both carried exactly across chunks, so two chunks still equal one bit for bit. c = 0
// (a zeroed state) means S = 0: the first token folds (S' *= 0). gdn_decode_step applies c
// with its own decay and leaves c = 1.
// kGdnScanFold = 2^-40: |S'| = |S| / c < |S| 2^40, and |S| <= sum |v| over the context (unit
// k, beta < 1, g <= 1: ~1e9 at 128K tokens even with |v| ~ 1e4), so S' and its dot products
// stay below ~1.1e21, ~3e17 inside the float32 range; c g reaches 2^-40 only after the row
// has decayed by e^-27.7, so heads that keep memory rarely fold. c is per row, not per head:
// a head's rows are split over threadgroups, and one c per head would be written by one of
// them while the others still read it. (kGdnScanFold is in prefill_args.h: the twins read it.)

// DK, DV: head dims; RV: state rows (value dims) per threadgroup, so a head is DV / RV
// threadgroups. kGdnScanLanesPerRow (L = 4) adjacent lanes share one state row; lane j of a
// row holds its float4 columns j, j + L, j + 2L, ... (E4 = DK / (4L) float4s: 8 at DK = 128),
// so a dot product over the row is a per-lane float4 partial and log2(L) = 2 shuffle-add
// levels. Fewer lanes per row means fewer reduction steps per row and token; more columns
// per lane only lengthens the per-lane loop, which is work the row needs anyway.
// Threadgroup memory reads stay conflict-free: at step e the L lanes of a row read the L
// consecutive float4s j + e*L of k (or q), i.e. 4L = 16 consecutive words, and the 32 / L = 8
// rows of a simdgroup read those same words (one broadcast). Threadgroup memory:
// gdn_scan_smem_bytes(DK, RV) (prefill_args.h): 10.1 KiB at DK = 128, RV = 32.
template <uint DK, uint DV, uint RV, uint TB, uint K>
[[max_total_threads_per_threadgroup(128)]] kernel void gdn_scan(  // RV * L <= 128
    device const float* qkv [[buffer(0)]],        // [M, C] in_proj_qkv output, q | k | v (before the conv)
    device const bfloat* conv_w [[buffer(1)]],    // [C, K] conv1d.weight
    device const float* conv_in [[buffer(2)]],    // [K-1, C] conv state at the chunk's start
    device const float* b [[buffer(3)]],          // [M, Hv] in_proj_b output
    device const float* a [[buffer(4)]],          // [M, Hv] in_proj_a output
    device const float* A_log [[buffer(5)]],      // [Hv]
    device const bfloat* dt_bias [[buffer(6)]],   // [Hv]
    device float* state [[buffer(7)]],            // [Hv, Dv, Dk] S' then [Hv, Dv] c (S = c S'), in place
    device bfloat* u [[buffer(8)]],               // [M, Hv*Dv] bfloat(y a_s w silu(z)) (header)
    constant GdnScanArgs& args [[buffer(9)]],
    device const bfloat* z [[buffer(10)]],        // [M, Hv*Dv] in_proj_z output (bfloat)
    device const bfloat* norm_w [[buffer(11)]],   // [Dv] norm.weight
    device float* ss [[buffer(12)]],              // [M, Hv, Dv/RV] sum of y^2 over each split's rows
    uint2 tgp [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint L = kGdnScanLanesPerRow;
  constexpr uint NT = RV * L;                   // threads
  constexpr uint NS = NT / 32;                  // simdgroups
  constexpr uint E4 = DK / (4 * L);             // float4s of the row per lane
  constexpr uint EQ = DK / 32;                  // q / k elements per lane when staging a token
  static_assert(DK % (4 * L) == 0 && DV % RV == 0 && NT % 32 == 0 && NT <= 128, "scan shape");
  static_assert((L & (L - 1)) == 0 && L <= 32, "the lanes of a row are a power-of-2 block of a simdgroup");
  static_assert(DK % 32 == 0 && RV <= 32, "staging: EQ q/k elements per lane, v by lanes < RV");
  static_assert(32 % RV == 0 && (TB * RV) % NT == 0, "y out: a token's RV rows are an aligned block of one simdgroup");
  threadgroup float4 q_s[TB * DK / 4];          // normalised q (also / sqrt(Dk)) per token
  threadgroup float4 k_s[TB * DK / 4];          // normalised k
  threadgroup float v_s[TB * RV];               // v of this threadgroup's rows
  threadgroup float y_s[TB * RV];               // S q of this threadgroup's rows
  threadgroup float g_s[TB];                    // decay g
  threadgroup float beta_s[TB];                 // beta
  static_assert(TB == kGdnScanTokensPerBlock && sizeof(q_s) + sizeof(k_s) + sizeof(v_s) + sizeof(y_s) +
                    sizeof(g_s) + sizeof(beta_s) == gdn_scan_smem_bytes(DK, RV),
                "gdn_scan_smem_bytes (prefill_args.h, read by the cost table) is these arrays' size");

  const uint h = tgp.x;
  const uint v0 = tgp.y * RV;                   // first value dim (state row) of the threadgroup
  const uint Hk = args.num_k_heads;
  const uint Hv = args.num_v_heads;
  const uint M = args.rows;
  const uint kh = h / (Hv / Hk);
  const uint C = 2 * Hk * DK + Hv * DV;
  const uint HVD = Hv * DV;
  const float A = exp(A_log[h]);
  const float dtb = float(dt_bias[h]);
  const uint r = tid / L;                       // state row of this lane within the threadgroup
  const uint j = tid % L;

  // ---- this lane's part of its state row, into registers (once) ---------------------------
  device float4* row = (device float4*)(state + (ulong(h) * DV + v0 + r) * DK);
  float4 s[E4];
  for (uint e = 0; e < E4; ++e) {
    s[e] = row[j + e * L];
  }
  device float* c_row = state + ulong(Hv) * DV * DK + h * DV + v0 + r;  // this row's c
  float c = *c_row;  // read before the first barrier, written after the last

  const uint nblocks = (M + TB - 1) / TB;
  for (uint blk = 0;; ++blk) {
    // ---- y of block blk-1 out as u and the split's sums of squares (coalesced rows of RV;
    //      a token's RV rows are RV aligned lanes of one simdgroup, every lane in the loop),
    //      and staging of block blk (one token per simdgroup at a time, TB / NS each); the
    //      two touch different threadgroup arrays.
    if (blk > 0) {
      const uint t0 = (blk - 1) * TB;
      for (uint i = tid; i < TB * RV; i += NT) {
        const uint t = t0 + i / RV;
        const uint v = v0 + i % RV;               // value dim within the head
        const bool live = t < M;
        const float yv = live ? y_s[i] : 0.0f;
        float p = yv * yv;
        for (ushort m = 1; m < RV; m <<= 1) {
          p += simd_shuffle_xor(p, m);
        }
        if (live) {
          const ulong o = ulong(t) * HVD + h * DV + v;
          const float a_s = 1.0f / sqrt(p / float(DV) + args.norm_eps);
          u[o] = bfloat(yv * a_s * float(norm_w[v]) * silu(float(z[o])));
          if (i % RV == 0) {
            ss[(ulong(t) * Hv + h) * (DV / RV) + tgp.y] = p;
          }
        }
      }
    }
    if (blk == nblocks) {
      break;
    }
    for (uint i = sg; i < TB; i += NS) {
      const uint t = blk * TB + i;
      if (t >= M) {
        continue;
      }
      float qr[EQ];
      float kr[EQ];
      float sq = 0.0f;
      float sk = 0.0f;
      for (uint e = 0; e < EQ; ++e) {
        qr[e] = conv_silu<K>(qkv, conv_in, conv_w, C, t, kh * DK + e * 32 + lane);
        kr[e] = conv_silu<K>(qkv, conv_in, conv_w, C, t, Hk * DK + kh * DK + e * 32 + lane);
        sq += qr[e] * qr[e];
        sk += kr[e] * kr[e];
      }
      sq = simd_sum(sq);
      sk = simd_sum(sk);
      const float qscale = 1.0f / (sqrt(sq + args.l2_eps) * sqrt(float(DK)));
      const float kscale = 1.0f / sqrt(sk + args.l2_eps);
      threadgroup float* qf = (threadgroup float*)q_s;
      threadgroup float* kf = (threadgroup float*)k_s;
      for (uint e = 0; e < EQ; ++e) {
        qf[i * DK + e * 32 + lane] = qr[e] * qscale;
        kf[i * DK + e * 32 + lane] = kr[e] * kscale;
      }
      if (lane < RV) {
        v_s[i * RV + lane] = conv_silu<K>(qkv, conv_in, conv_w, C, t, 2 * Hk * DK + h * DV + v0 + lane);
      }
      if (lane == 0) {
        g_s[i] = exp(-A * softplus(a[t * Hv + h] + dtb));
        beta_s[i] = 1.0f / (1.0f + exp(-b[t * Hv + h]));
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // ---- delta rule over the tokens of block blk, state in registers ----------------------
    const uint n = min(TB, M - blk * TB);
    for (uint i = 0; i < n; ++i) {
      threadgroup const float4* kq = k_s + i * (DK / 4) + j;
      threadgroup const float4* qq = q_s + i * (DK / 4) + j;
      c *= g_s[i];
      if (c < kGdnScanFold) {  // the fold: uniform over a head's rows (same g, and c equal since reset)
        for (uint e = 0; e < E4; ++e) {
          s[e] *= c;
        }
        c = 1.0f;
      }
      float4 acc = float4(0.0f);
      for (uint e = 0; e < E4; ++e) {
        acc += s[e] * kq[e * L];
      }
      float sk = (acc.x + acc.y) + (acc.z + acc.w);
      for (ushort m = 1; m < L; m <<= 1) {
        sk += simd_shuffle_xor(sk, m);
      }
      const float dc = (v_s[i * RV + r] - c * sk) * beta_s[i] / c;  // delta / c
      acc = float4(0.0f);
      for (uint e = 0; e < E4; ++e) {
        s[e] += dc * kq[e * L];
        acc += s[e] * qq[e * L];
      }
      float yr = (acc.x + acc.y) + (acc.z + acc.w);
      for (ushort m = 1; m < L; m <<= 1) {
        yr += simd_shuffle_xor(yr, m);
      }
      if (j == 0) {
        y_s[i * RV + r] = c * yr;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // ---- the state back (once) ---------------------------------------------------------------
  for (uint e = 0; e < E4; ++e) {
    row[j + e * L] = s[e];
  }
  if (j == 0) {
    *c_row = c;
  }
}

// The model (Hk=16, Hv=32) and the "dims" preset: 4 threadgroups of 128 threads per head
// (128 threadgroups for the model: 3.2 per M5 Max core); the "tiny" preset: 2 of 64 per head.
template [[host_name("gdn_scan_k128_v128_r32")]] [[kernel]] decltype(gdn_scan<128, 128, 32, kGdnScanTokensPerBlock, kGdnConvTaps>) gdn_scan<128, 128, 32, kGdnScanTokensPerBlock, kGdnConvTaps>;
template [[host_name("gdn_scan_k32_v32_r16")]] [[kernel]] decltype(gdn_scan<32, 32, 16, kGdnScanTokensPerBlock, kGdnConvTaps>) gdn_scan<32, 32, 16, kGdnScanTokensPerBlock, kGdnConvTaps>;

// ---------------------------------------------------------------- gdn_norm_scale

// f[t, h, s] = half(sqrt(p_s / DV + eps) / sqrt(P / DV + eps)) from the scan's split sums p
// (P: their sum in split order): the factor out_proj applies to split s of u (header). One
// thread per (token, head).
template <uint DV, uint RV>
[[max_total_threads_per_threadgroup(kGdnNormScaleThreads)]] kernel void gdn_norm_scale(
    device const float* ss [[buffer(0)]],         // [M, Hv, DV/RV] gdn_scan's split sums of y^2
    device half* f [[buffer(1)]],                 // [M, Hv, DV/RV] out_proj's A scale
    constant GdnScanArgs& args [[buffer(2)]],
    uint pair [[thread_position_in_grid]]) {      // t * Hv + h
  constexpr uint S = DV / RV;
  if (pair >= args.rows * args.num_v_heads) {
    return;
  }
  float p[S];
  float P = 0.0f;
  for (uint s = 0; s < S; ++s) {
    p[s] = ss[ulong(pair) * S + s];
    P += p[s];
  }
  const float inv = 1.0f / sqrt(P / float(DV) + args.norm_eps);
  for (uint s = 0; s < S; ++s) {
    f[ulong(pair) * S + s] = half(sqrt(p[s] / float(DV) + args.norm_eps) * inv);  // <= 1 (p_s <= P)
  }
}

// The scan's splits: Dv = 128 in 4 of 32 rows, Dv = 32 in 2 of 16.
template [[host_name("gdn_norm_scale_v128_r32")]] [[kernel]] decltype(gdn_norm_scale<128, 32>) gdn_norm_scale<128, 32>;
template [[host_name("gdn_norm_scale_v32_r16")]] [[kernel]] decltype(gdn_norm_scale<32, 16>) gdn_norm_scale<32, 16>;
