// RMSNorm: fp32 activations, bf16 weight; fp32 out (rms_norm: decode) or bfloat out rounded
// from fp32 (rms_norm_bf16: prefill's xn, the bf16 input of the prefill GEMMs, for layer 0
// and the final norm; the other layers' xn comes from moe_combine_norm,
// metal/moe_prefill.metal, on the same row code: rms_row of common.h).
// Host-side facts: docs/kernels.md.
#include <metal_stdlib>
using namespace metal;

#include "common.h"

// out[r, i] = x[r, i] * rsqrt(mean_i(x[r, :]^2) + eps) * w[i]. One threadgroup per row r
// (grid = rows threadgroups, e.g. 1 for the hidden state, heads for a per-head norm), any
// threadgroup size up to 1024 (256 recommended). out may alias x (each element is read
// and written by the same thread; rms_norm only).
template <typename T>
[[max_total_threads_per_threadgroup(1024)]] kernel void rms_norm_t(device const float* x [[buffer(0)]],    // [rows, n] fp32
                     device const bfloat* w [[buffer(1)]],   // [n] bf16, shared by all rows
                     device T* out [[buffer(2)]],            // [rows, n] fp32 or bfloat
                     constant NormArgs& args [[buffer(3)]],
                     uint row [[threadgroup_position_in_grid]],
                     uint tid [[thread_position_in_threadgroup]],
                     uint tcount [[threads_per_threadgroup]],
                     uint sg [[simdgroup_index_in_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]],
                     uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float scratch[32];
  rms_row(x + row * args.n, w, out + row * args.n, args.n, args.eps, scratch, tid, tcount, sg, lane, nsg);
}
template [[host_name("rms_norm")]] [[kernel]] decltype(rms_norm_t<float>) rms_norm_t<float>;
template [[host_name("rms_norm_bf16")]] [[kernel]] decltype(rms_norm_t<bfloat>) rms_norm_t<bfloat>;
