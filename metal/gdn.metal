// Gated DeltaNet decode step (docs/model.md, "Gated DeltaNet"; docs/goals.md, fusion (4)).
//
// One threadgroup per value head h (grid: Hv threadgroups of 1024 threads = 32 simdgroups).
// The threadgroup owns everything of its head, so no dependency crosses threadgroups:
//   1. conv: one thread per channel it needs (Dk q + Dk k channels of key head
//      h / (Hv/Hk), Dv v channels of head h): causal depthwise conv over
//      [conv state | new input] + SiLU, into threadgroup memory; the new conv state goes to
//      a *separate* output buffer (conv_out). The q/k channels are read by the Hv/Hk value
//      heads sharing the key head, in other threadgroups, so an in-place update would race;
//      the first value head of each key head writes them, every head writes its v channels.
//      The runtime alternates two conv-state buffers per layer (ping-pong).
//   2. q/k L2 norm (eps on the sum of squares; q also / sqrt(Dk)), g and beta (scalars).
//   3. delta rule, fp32 state in registers: simdgroup s owns state rows
//      v = s*R .. s*R+R-1 (R = Dv/32) of head h; lane l holds elements l, l+32, ... of each
//      row (Dk/32 of them), so every load/store instruction of a simdgroup touches 128
//      contiguous bytes. S = g*S; delta = (v - S k) * beta; S += delta k^T; y = S q, the dot
//      products as simd_sum; the state is read once and written once. The state buffer
//      holds S' and a pending decay c per row (S = c S', gdn_scan's lazy decay,
//      metal/gdn_prefill.metal): the step decays by c*g instead of g and writes S back with
//      c = 1, so it costs no extra pass (c = 0, a zeroed state, gives S = 0).
//   4. gated RMSNorm over the head's Dv outputs, times silu(z).
#include <metal_stdlib>
#include "common.h"  // silu, softplus (shared with gdn_prefill.metal: same results bit for bit)
#include "mixer_args.h"
using namespace metal;

constant constexpr uint kGdnSimdgroups = 32;  // threadgroup = 1024 threads

template <uint DK, uint DV>
[[max_total_threads_per_threadgroup(1024)]] kernel void gdn_decode_step(device const float* qkv [[buffer(0)]],        // [conv_dim] in_proj_qkv output, q | k | v
                            device const float* z [[buffer(1)]],          // [Hv*Dv] in_proj_z output
                            device const float* b [[buffer(2)]],          // [Hv] in_proj_b output
                            device const float* a [[buffer(3)]],          // [Hv] in_proj_a output
                            device const bfloat* conv_w [[buffer(4)]],    // [conv_dim, K] conv1d.weight
                            device const float* A_log [[buffer(5)]],      // [Hv]
                            device const bfloat* dt_bias [[buffer(6)]],   // [Hv]
                            device const bfloat* norm_w [[buffer(7)]],    // [Dv] norm.weight
                            device const float* conv_in [[buffer(8)]],    // [K-1, conv_dim] conv state (oldest first)
                            device float* conv_out [[buffer(9)]],         // [K-1, conv_dim] next conv state
                            device float* state [[buffer(10)]],           // [Hv, Dv, Dk] S' then [Hv, Dv] c (S = c S'), in place
                            device float* out [[buffer(11)]],             // [Hv*Dv] gated RMSNorm output
                            constant GdnDecodeArgs& args [[buffer(12)]],
                            uint h [[threadgroup_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint E = DK / 32;                // state elements per lane per row
  constexpr uint R = DV / kGdnSimdgroups;    // state rows per simdgroup
  constexpr uint NACT = 2 * DK + DV;         // channels this head needs
  threadgroup float act[NACT];               // conv+SiLU output: q | k | v of this head
  threadgroup float y_s[DV];                 // S q per row

  const uint Hk = args.num_k_heads;
  const uint Hv = args.num_v_heads;
  const uint K = args.conv_kernel;
  const uint rep = Hv / Hk;
  const uint kh = h / rep;
  const uint conv_dim = 2 * Hk * DK + Hv * DV;

  // ---- 1. conv + SiLU, conv state shift -------------------------------------------------
  if (tid < 2 * DK + DV) {
    uint c;
    bool writes_state;
    if (tid < DK) {
      c = kh * DK + tid;
      writes_state = h % rep == 0;
    } else if (tid < 2 * DK) {
      c = Hk * DK + kh * DK + (tid - DK);
      writes_state = h % rep == 0;
    } else {
      c = 2 * Hk * DK + h * DV + (tid - 2 * DK);
      writes_state = true;
    }
    const float x = qkv[c];
    float acc = x * float(conv_w[c * K + (K - 1)]);
    for (uint j = 0; j + 1 < K; ++j) {
      acc += conv_in[j * conv_dim + c] * float(conv_w[c * K + j]);
    }
    act[tid] = silu(acc);
    if (writes_state) {
      for (uint j = 0; j + 2 < K; ++j) {
        conv_out[j * conv_dim + c] = conv_in[(j + 1) * conv_dim + c];
      }
      conv_out[(K - 2) * conv_dim + c] = x;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // ---- 2. q/k L2 norm (every simdgroup, redundantly: no extra barrier), g, beta ----------
  float qr[E];
  float kr[E];
  float sq = 0.0f;
  float sk = 0.0f;
  for (uint e = 0; e < E; ++e) {
    qr[e] = act[e * 32 + lane];
    kr[e] = act[DK + e * 32 + lane];
    sq += qr[e] * qr[e];
    sk += kr[e] * kr[e];
  }
  sq = simd_sum(sq);
  sk = simd_sum(sk);
  const float qscale = 1.0f / (sqrt(sq + args.l2_eps) * sqrt(float(DK)));
  const float kscale = 1.0f / sqrt(sk + args.l2_eps);
  for (uint e = 0; e < E; ++e) {
    qr[e] *= qscale;
    kr[e] *= kscale;
  }
  const float g = exp(-exp(A_log[h]) * softplus(a[h] + float(dt_bias[h])));
  const float beta = 1.0f / (1.0f + exp(-b[h]));

  // ---- 3. delta rule on this simdgroup's rows ----------------------------------------------
  device float* c_head = state + ulong(Hv) * DV * DK + h * DV;  // c of the head's rows
  for (uint r = 0; r < R; ++r) {
    const uint v = sg * R + r;
    device float* row = state + (ulong(h) * DV + v) * DK;
    const float decay = c_head[v] * g;
    float s[E];
    float sk_dot = 0.0f;
    for (uint e = 0; e < E; ++e) {
      s[e] = row[e * 32 + lane] * decay;
      sk_dot += s[e] * kr[e];
    }
    sk_dot = simd_sum(sk_dot);
    const float delta = (act[2 * DK + v] - sk_dot) * beta;
    float y = 0.0f;
    for (uint e = 0; e < E; ++e) {
      s[e] += delta * kr[e];
      row[e * 32 + lane] = s[e];
      y += s[e] * qr[e];
    }
    y = simd_sum(y);
    if (lane == 0) {
      y_s[v] = y;
    }
  }
  // device too: it orders the c reads above before the c writes below
  threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
  if (tid < DV) {  // after the barrier: every c of the head has been read
    c_head[tid] = 1.0f;
  }

  // ---- 4. gated RMSNorm: rmsnorm(y, norm_w) * silu(z) ------------------------------------
  if (sg < DV / 32) {
    float ss = 0.0f;
    for (uint i = lane; i < DV; i += 32) {
      ss += y_s[i] * y_s[i];
    }
    ss = simd_sum(ss);
    const float inv = 1.0f / sqrt(ss / float(DV) + args.norm_eps);
    const float zz = z[h * DV + tid];
    out[h * DV + tid] = y_s[tid] * inv * float(norm_w[tid]) * silu(zz);
  }
}

// The model (Hk=16, Hv=32) and the "dims" preset; the "tiny" preset.
template [[host_name("gdn_decode_step_k128_v128")]] [[kernel]] decltype(gdn_decode_step<128, 128>) gdn_decode_step<128, 128>;
template [[host_name("gdn_decode_step_k32_v32")]] [[kernel]] decltype(gdn_decode_step<32, 32>) gdn_decode_step<32, 32>;
