// Gated DeltaNet decode step (docs/model.md, "Gated DeltaNet"; docs/goals.md, fusion (4)).
//
// Grid (Hv, NS): threadgroup (h, j) owns state rows j*RV .. j*RV+RV-1 (RV = Dv/NS) of value
// head h, so the recurrence spreads over Hv*NS threadgroups (NS = 4: 128, every core of a
// 40-core GPU) instead of one per head. Its simdgroups own RV/simdgroups rows each. No
// dependency crosses threadgroups: the gated RMSNorm, which needs all Dv outputs of a head,
// is applied by the out_proj GEMV while it loads its input (gemv_gated_q<BITS>,
// metal/gemv.metal) from y and the per-(head, split) sums of squares written here.
//   1. conv: the Dk q + Dk k channels of key head h / (Hv/Hk) and the RV v channels of the
//      slice: causal depthwise conv over [conv state | new input] + SiLU, into threadgroup
//      memory; the new conv state goes to a *separate* output buffer (conv_out): the q/k
//      channels are read by every split of the Hv/Hk value heads sharing the key head, so an
//      in-place update would race. Split 0 of the first value head of each key head writes
//      them, each threadgroup its v channels: every channel exactly once. The runtime
//      alternates two conv-state buffers per layer (ping-pong).
//   2. q/k L2 norm (eps on the sum of squares; q also / sqrt(Dk)), g and beta (scalars),
//      redundantly in every simdgroup of every split.
//   3. delta rule, fp32 state in registers: lane l holds elements l, l+32, ... of a row
//      (Dk/32 of them), so every load/store instruction of a simdgroup touches 128
//      contiguous bytes. S = g*S; delta = (v - S k) * beta; S += delta k^T; y = S q, the dot
//      products as simd_sum; the state is read once and written at most once. The state buffer
//      holds S' and a pending decay c per row (S = c S', gdn_scan's lazy decay,
//      metal/gdn_prefill.metal): the step decays by c*g instead of g and writes S back with
//      c = 1 (on a write-back step), so it costs no extra pass (c = 0, a zeroed state, gives S = 0). A row's c is
//      read and written by the one threadgroup owning the row.
//   4. out: y of the slice's rows; ssq[h*NS + j]: sum of y^2 over them.
//
// Write-back window (args.pending, args.write_back; docs/decode.md "The recurrent state's
// write-back window"): the state is written back only on every W-th step. A step that does
// not write it back appends its update instead, delta per row, the normalised k per key head
// and g per value head, to the layer's ring (slot `pending`), and leaves S' and c untouched;
// every step first replays the `pending` ring entries onto the S' it read, with the step's
// own operations in the step's order (gdn_replay), so what it computes, and the state a
// write-back leaves, are bit for bit those of writing the state back every step. The state
// is read every step and written 1/W of them: the traffic the window saves. The runtime
// writes back whatever is pending before anything else reads the state
// (gdn_state_writeback, below).
#include <metal_stdlib>
#include "common.h"  // silu, softplus (shared with gdn_prefill.metal: same results bit for bit)
#include "mixer_args.h"
using namespace metal;

// The two operations of one delta-rule update of a state row slice (this lane's E elements),
// shared by the step and the replay. The add is an explicit fma and the decay a separate,
// rounded product: how a compiler contracts `s * decay + delta * k` would otherwise depend on
// how many uses the decayed value has (the step's S k reads it, the replay's nothing).
template <uint E>
inline void gdn_decay(thread float* s, float decay) {
  for (uint e = 0; e < E; ++e) {
    s[e] = s[e] * decay;
  }
}

template <uint E>
inline void gdn_add_delta(thread float* s, float delta, thread const float* k) {
  for (uint e = 0; e < E; ++e) {
    s[e] = fma(delta, k[e], s[e]);
  }
}

// Replays the ring's first `pending` updates onto the nb <= kGdnRowBatch rows row0.. (of head h,
// key head kh) of the written state: row i held in s[i * E ..] (S' as read) with its pending
// decay c[i]. Entry j's decay is c * g_j for the first (the step that read c) and 1 * g_j after
// (it wrote c = 1), as the steps computed it; c[i] ends as the factor the next update multiplies
// g by: c, or 1 after a replay. An entry's g and k are loaded once for the batch, its deltas
// side by side; each row gets exactly the operations, in the order, of replaying it alone.
// Ring entry layout: GdnRing (mixer_args.h).
template <uint DK, uint E>
inline void gdn_replay(thread float* s, thread float* c, uint nb, device const float* ring, uint pending,
                       GdnRing rg, uint h, uint kh, uint row0, uint lane) {
  for (uint j = 0; j < pending; ++j) {
    device const float* entry = ring + ulong(j) * rg.entry;
    const float g = entry[rg.g_at + h];
    float k[E];
    for (uint e = 0; e < E; ++e) {
      k[e] = entry[rg.k_at + kh * DK + e * 32 + lane];
    }
    float delta[kGdnRowBatch];
    for (uint i = 0; i < kGdnRowBatch; ++i) {
      delta[i] = i < nb ? entry[rg.delta_at + row0 + i] : 0.0f;
    }
    for (uint i = 0; i < kGdnRowBatch; ++i) {
      if (i < nb) {  // uniform over the simdgroup
        gdn_decay<E>(s + i * E, c[i] * g);
        gdn_add_delta<E>(s + i * E, delta[i], k);
        c[i] = 1.0f;
      }
    }
  }
}

// Loads the nb rows v0 + v.. of head h (S' into s[i * E ..], their pending decay into c[i]).
template <uint DK, uint DV, uint E>
inline void gdn_load_rows(device const float* state, uint Hv, uint h, uint v0, uint v, uint nb, uint lane,
                          thread float* s, thread float* c) {
  device const float* c_head = state + ulong(Hv) * DV * DK + h * DV;
  for (uint i = 0; i < kGdnRowBatch; ++i) {
    if (i < nb) {
      device const float* row = state + (ulong(h) * DV + v0 + v + i) * DK;
      for (uint e = 0; e < E; ++e) {
        s[i * E + e] = row[e * 32 + lane];
      }
      c[i] = c_head[v0 + v + i];
    }
  }
}

template <uint DK, uint DV>
[[max_total_threads_per_threadgroup(1024)]] kernel void gdn_decode_step(device const float* qkv [[buffer(0)]],        // [conv_dim] in_proj_qkv output, q | k | v
                            device const float* b [[buffer(1)]],          // [Hv] in_proj_b output
                            device const float* a [[buffer(2)]],          // [Hv] in_proj_a output
                            device const bfloat* conv_w [[buffer(3)]],    // [conv_dim, K] conv1d.weight
                            device const float* A_log [[buffer(4)]],      // [Hv]
                            device const bfloat* dt_bias [[buffer(5)]],   // [Hv]
                            device const float* conv_in [[buffer(6)]],    // [K-1, conv_dim] conv state (oldest first)
                            device float* conv_out [[buffer(7)]],         // [K-1, conv_dim] next conv state
                            device float* state [[buffer(8)]],            // [Hv, Dv, Dk] S' then [Hv, Dv] c (S = c S'), in place
                            device float* out [[buffer(9)]],              // [Hv*Dv] y = S q (before the gated norm)
                            device float* ssq [[buffer(10)]],             // [Hv, NS] sum of y^2 over each split's rows
                            constant GdnDecodeArgs& args [[buffer(11)]],
                            device float* ring [[buffer(12)]],            // [W-1, GdnRing entry] pending updates
                            uint2 tgp [[threadgroup_position_in_grid]],
                            uint2 ntg [[threadgroups_per_grid]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint2 tpt [[threads_per_threadgroup]],  // (threads, 1)
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint nsg [[simdgroups_per_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint E = DK / 32;                // state elements per lane per row
  threadgroup float act[2 * DK + DV];        // conv+SiLU output: q | k | v of the slice
  threadgroup float y_s[DV];                 // S q per row of the slice

  const uint h = tgp.x;
  const uint tcount = tpt.x;
  const uint split = tgp.y;
  const uint NS = ntg.y;                     // divides DV; RV a multiple of the simdgroups
  const uint RV = DV / NS;                   // rows of this threadgroup
  const uint R = RV / nsg;                   // rows per simdgroup
  const uint v0 = split * RV;                // first row of the slice
  const uint Hk = args.num_k_heads;
  const uint Hv = args.num_v_heads;
  const uint K = args.conv_kernel;
  const uint rep = Hv / Hk;
  const uint kh = h / rep;
  const uint conv_dim = 2 * Hk * DK + Hv * DV;

  // ---- 1. conv + SiLU, conv state shift -------------------------------------------------
  for (uint i = tid; i < 2 * DK + RV; i += tcount) {
    uint c;
    bool writes_state;
    if (i < DK) {
      c = kh * DK + i;
      writes_state = h % rep == 0 && split == 0;
    } else if (i < 2 * DK) {
      c = Hk * DK + kh * DK + (i - DK);
      writes_state = h % rep == 0 && split == 0;
    } else {
      c = 2 * Hk * DK + h * DV + v0 + (i - 2 * DK);
      writes_state = true;
    }
    const float x = qkv[c];
    float acc = x * float(conv_w[c * K + (K - 1)]);
    for (uint j = 0; j + 1 < K; ++j) {
      acc += conv_in[j * conv_dim + c] * float(conv_w[c * K + j]);
    }
    act[i] = silu(acc);
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

  // ---- 3. delta rule on this simdgroup's rows, kGdnRowBatch at a time ----------------------
  const GdnRing rg = gdn_ring(Hk, Hv, DK, DV);
  const uint P = args.pending;
  device float* slot = ring + ulong(P) * rg.entry;  // this step's entry when it does not write back
  device float* c_head = state + ulong(Hv) * DV * DK + h * DV;  // c of the head's rows
  for (uint b0 = 0; b0 < R; b0 += kGdnRowBatch) {
    const uint v = sg * R + b0;                // first row of the batch within the slice
    const uint nb = min(kGdnRowBatch, R - b0);  // uniform over the simdgroup
    float s[kGdnRowBatch * E];
    float c[kGdnRowBatch];
    gdn_load_rows<DK, DV, E>(state, Hv, h, v0, v, nb, lane, s, c);
    gdn_replay<DK, E>(s, c, nb, ring, P, rg, h, kh, h * DV + v0 + v, lane);
    float sk_dot[kGdnRowBatch];
    for (uint i = 0; i < kGdnRowBatch; ++i) {
      sk_dot[i] = 0.0f;
      if (i < nb) {
        gdn_decay<E>(s + i * E, c[i] * g);
        for (uint e = 0; e < E; ++e) {
          sk_dot[i] += s[i * E + e] * kr[e];
        }
      }
    }
    for (uint i = 0; i < kGdnRowBatch; ++i) {
      if (i < nb) {
        sk_dot[i] = simd_sum(sk_dot[i]);
      }
    }
    float y[kGdnRowBatch];
    for (uint i = 0; i < kGdnRowBatch; ++i) {
      y[i] = 0.0f;
      if (i < nb) {
        const float delta = (act[2 * DK + v + i] - sk_dot[i]) * beta;
        gdn_add_delta<E>(s + i * E, delta, kr);
        for (uint e = 0; e < E; ++e) {
          y[i] += s[i * E + e] * qr[e];
        }
        if (args.write_back) {
          device float* row = state + (ulong(h) * DV + v0 + v + i) * DK;
          for (uint e = 0; e < E; ++e) {
            row[e * 32 + lane] = s[i * E + e];
          }
        } else if (lane == 0) {
          slot[rg.delta_at + h * DV + v0 + v + i] = delta;
        }
      }
    }
    for (uint i = 0; i < kGdnRowBatch; ++i) {
      if (i < nb) {
        y[i] = simd_sum(y[i]);
        if (lane == 0) {
          y_s[v + i] = y[i];
          out[h * DV + v0 + v + i] = y[i];
        }
      }
    }
  }
  if (!args.write_back) {
    // k once per key head (split 0 of its first value head), g once per value head
    if (sg == 0 && split == 0 && h % rep == 0) {
      for (uint e = 0; e < E; ++e) {
        slot[rg.k_at + kh * DK + e * 32 + lane] = kr[e];
      }
    }
    if (tid == 0 && split == 0) {
      slot[rg.g_at + h] = g;
    }
  }
  // device too: it orders the c reads above before the c writes below
  threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
  if (args.write_back) {
    for (uint i = tid; i < RV; i += tcount) {  // after the barrier: every c of the slice has been read
      c_head[v0 + i] = 1.0f;
    }
  }

  // ---- 4. the slice's sum of squares for the gated RMSNorm in out_proj -------------------
  if (sg == 0) {
    float ss = 0.0f;
    for (uint i = lane; i < RV; i += 32) {
      ss += y_s[i] * y_s[i];
    }
    ss = simd_sum(ss);
    if (lane == 0) {
      ssq[h * NS + split] = ss;
    }
  }
}

// Writes back what the ring holds: the state after the `pending` updates (gdn_replay), c = 1,
// on the step's grid (Hv, NS) and threadgroups. The runtime runs it before a prefill, a
// snapshot or anything else that reads the state while steps are pending.
template <uint DK, uint DV>
[[max_total_threads_per_threadgroup(1024)]] kernel void gdn_state_writeback(device float* state [[buffer(0)]],     // as gdn_decode_step's
                                device const float* ring [[buffer(1)]],  // [W-1, GdnRing entry]
                                constant GdnDecodeArgs& args [[buffer(2)]],
                                uint2 tgp [[threadgroup_position_in_grid]],
                                uint2 ntg [[threadgroups_per_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint2 tpt [[threads_per_threadgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]],
                                uint nsg [[simdgroups_per_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint E = DK / 32;
  if (args.pending == 0) {  // nothing to fold in (c = 1 alone would drop a row's pending decay)
    return;
  }
  const uint h = tgp.x;
  const uint RV = DV / ntg.y;
  const uint R = RV / nsg;
  const uint v0 = tgp.y * RV;
  const uint Hk = args.num_k_heads;
  const uint Hv = args.num_v_heads;
  const uint kh = h / (Hv / Hk);
  const GdnRing rg = gdn_ring(Hk, Hv, DK, DV);
  device float* c_head = state + ulong(Hv) * DV * DK + h * DV;
  for (uint b0 = 0; b0 < R; b0 += kGdnRowBatch) {
    const uint v = sg * R + b0;
    const uint nb = min(kGdnRowBatch, R - b0);
    float s[kGdnRowBatch * E];
    float c[kGdnRowBatch];
    gdn_load_rows<DK, DV, E>(state, Hv, h, v0, v, nb, lane, s, c);
    gdn_replay<DK, E>(s, c, nb, ring, args.pending, rg, h, kh, h * DV + v0 + v, lane);
    for (uint i = 0; i < kGdnRowBatch; ++i) {
      if (i < nb) {
        device float* row = state + (ulong(h) * DV + v0 + v + i) * DK;
        for (uint e = 0; e < E; ++e) {
          row[e * 32 + lane] = s[i * E + e];
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_device);  // every c of the slice read before any is set
  for (uint i = tid; i < RV; i += tpt.x) {
    c_head[v0 + i] = 1.0f;
  }
}

// The model (Hk=16, Hv=32) and the "dims" preset; the "tiny" preset.
template [[host_name("gdn_decode_step_k128_v128")]] [[kernel]] decltype(gdn_decode_step<128, 128>) gdn_decode_step<128, 128>;
template [[host_name("gdn_decode_step_k32_v32")]] [[kernel]] decltype(gdn_decode_step<32, 32>) gdn_decode_step<32, 32>;
template [[host_name("gdn_state_writeback_k128_v128")]] [[kernel]] decltype(gdn_state_writeback<128, 128>) gdn_state_writeback<128, 128>;
template [[host_name("gdn_state_writeback_k32_v32")]] [[kernel]] decltype(gdn_state_writeback<32, 32>) gdn_state_writeback<32, 32>;
