// Prefill GEMMs on MLX affine-quantized weights, Metal 4 tensor-operation path for
// apple10-family GPUs (M5: per-core neural accelerators) (docs/prefill.md, "GEMM: Metal 4
// tensor-operation path"). Twins of metal/gemm.metal with identical bindings, argument
// structs and outputs; 128-row blocks of 256 threads (the simdgroup_matrix kernels' are 64
// rows of 128), 64 columns, SwiGLU 32 of gate and of up:
//   gemm_q4_tensor, gemm_q8_tensor, gemm_q4_add_h_tensor     y[m, n] (=|+=) x[m, k] W[n, k]^T
//   gemm_q4_add_hs_tensor                                   y += (x * s) W^T  (the GDN out_proj)
//   gemm_q4_bf16_tensor                                     y = bfloat(x W^T)
//   gemm_swiglu_q4_tensor                                   y = bfloat(g[m] * silu(x Wg^T) * (x Wu^T))
// The k loop (MLX qmm_t_nax's structure: the weight tile in threadgroup memory, A from device
// memory into registers, 32 x 32 per simdgroup) is gemm_tensor.h's, shared with the grouped
// expert twins in moe_prefill_tensor.metal. MSL 4.0: built into lily_tensor.metallib.
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

#include "gemm_tensor.h"

// ---- dense GEMMs -------------------------------------------------------------------------
// As gemm_dense (gemm.metal): grid (ceil(n / BN), ceil(m / BM)) threadgroups of 32 SM SN
// threads; threadgroup (i, j) computes y rows [j BM, j BM + BM) x columns [i BN, i BN + BN).
template <int BITS, uint NB, bool ADD, uint BM, uint BN, uint SM, uint SN, typename XS, typename Y>
inline void gemm_dense_tensor(threadgroup float4* smem4, device const uint* w0, device const bfloat* s0,
                              device const bfloat* b0, device const uint* w1, device const bfloat* s1,
                              device const bfloat* b1, XS x, device Y* y,
                              constant GemmArgs& args, uint2 tgp, uint tid, uint sg,
                              device const float* g = nullptr, uint ldg = 0) {
  const uint n0 = tgp.x * BN;
  const uint m0 = tgp.y * BM;
  if (n0 >= args.n || m0 >= args.m) {
    return;  // the whole threadgroup (a grid larger than needed)
  }
  const uint rows = min(BM, args.m - m0);
  const GemmRowSink<ADD, Y> sink{y + m0 * args.ldy + n0, args.ldy, g ? g + m0 * ldg : nullptr, ldg};
  gemm_tensor_gemm<BITS, NB, BM, BN, SM, SN>((threadgroup bfloat*)smem4, x, GemmDenseRows{m0, args.m, args.lda},
                                             w0, s0, b0, w1, s1, b1, n0, args.n, args.k, rows, tid, sg, sink);
}

// Dense configuration (kGemmTensorBM x kGemmTensorBN blocks of kGemmTensorSM x kGemmTensorSN
// simdgroups, SwiGLU kGemmTensorSwigluBN: gemm_args.h): SwiGLU's 32 x 16 of gate and of up per
// simdgroup take the same registers and the same 64 weight rows per step. One 9 KiB weight
// tile (GemmTensorSmem).

// x: bfloat rows (gemm_q4, gemm_q8: the normed rows xn; gemm_q4_add_h: the attention output
// and the shared expert's hidden). Y: float, or bfloat (gemm_q4_bf16; never ADD).
template <int BITS, bool ADD, typename Y = float>
[[max_total_threads_per_threadgroup(kGemmTensorThreads)]] kernel void gemm_q_tensor(device const uint4* w [[buffer(0)]],        // W.weight uint32 [n, k*BITS/32]
                          device const bfloat* scales [[buffer(1)]],  // [n, k/64]
                          device const bfloat* biases [[buffer(2)]],  // [n, k/64]
                          device const bfloat* x [[buffer(3)]],       // bfloat [m, lda]
                          device Y* y [[buffer(4)]],                  // fp32 or bfloat [m, ldy] (read too when ADD)
                          constant GemmArgs& args [[buffer(5)]],
                          uint2 tgp [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 smem4[GemmTensorSmem<kGemmTensorBN, 1>::float4s];
  device const uint* wu = (device const uint*)w;
  gemm_dense_tensor<BITS, 1, ADD, kGemmTensorBM, kGemmTensorBN, kGemmTensorSM, kGemmTensorSN>(
      smem4, wu, scales, biases, wu, scales, biases, x, y, args, tgp, tid, sg);
}
template [[host_name("gemm_q4_tensor")]] [[kernel]] decltype(gemm_q_tensor<4, false>) gemm_q_tensor<4, false>;
template [[host_name("gemm_q8_tensor")]] [[kernel]] decltype(gemm_q_tensor<8, false>) gemm_q_tensor<8, false>;
template [[host_name("gemm_q4_add_h_tensor")]] [[kernel]] decltype(gemm_q_tensor<4, true>) gemm_q_tensor<4, true>;
template [[host_name("gemm_q4_bf16_tensor")]] [[kernel]] decltype(gemm_q_tensor<4, false, bfloat>) gemm_q_tensor<4, false, bfloat>;

// y += (x * s) W^T, as gemm_q4_add_hs (gemm.metal): the GDN out_proj.
[[max_total_threads_per_threadgroup(kGemmTensorThreads)]] kernel void gemm_q4_add_hs_tensor(device const uint4* w [[buffer(0)]],        // W.weight uint32 [n, k/8]
                                  device const bfloat* scales [[buffer(1)]],  // [n, k/64]
                                  device const bfloat* biases [[buffer(2)]],  // [n, k/64]
                                  device const bfloat* x [[buffer(3)]],       // bfloat [m, lda]
                                  device float* y [[buffer(4)]],              // fp32 [m, ldy], read and written
                                  constant GemmArgs& args [[buffer(5)]],
                                  device const half* s [[buffer(6)]],         // half [m, lda >> shift]
                                  constant GemmAScaleArgs& sa [[buffer(7)]],
                                  uint2 tgp [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 smem4[GemmTensorSmem<kGemmTensorBN, 1>::float4s];
  device const uint* wu = (device const uint*)w;
  gemm_dense_tensor<4, 1, true, kGemmTensorBM, kGemmTensorBN, kGemmTensorSM, kGemmTensorSN>(
      smem4, wu, scales, biases, wu, scales, biases, GemmAScaled{x, s, sa.shift}, y, args, tgp, tid, sg);
}

// The shared expert's gate/up times the shared expert gate, as gemm_swiglu_q4 (gemm.metal).
[[max_total_threads_per_threadgroup(kGemmTensorThreads)]] kernel void gemm_swiglu_q4_tensor(device const uint4* wg [[buffer(0)]],       // gate_proj.weight [n, k/8]
                                  device const bfloat* gs [[buffer(1)]],      // gate_proj.scales [n, k/64]
                                  device const bfloat* gb [[buffer(2)]],      // gate_proj.biases [n, k/64]
                                  device const uint4* wu [[buffer(3)]],       // up_proj.weight [n, k/8]
                                  device const bfloat* us [[buffer(4)]],      // up_proj.scales
                                  device const bfloat* ub [[buffer(5)]],      // up_proj.biases
                                  device const bfloat* x [[buffer(6)]],       // bfloat [m, lda]
                                  device bfloat* y [[buffer(7)]],             // bfloat [m, ldy]
                                  constant GemmArgs& args [[buffer(8)]],
                                  device const float* g [[buffer(9)]],        // row scale, row r at g[r * ldg]
                                  constant GemmRowScaleArgs& gs_args [[buffer(10)]],
                                  uint2 tgp [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 smem4[GemmTensorSmem<kGemmTensorSwigluBN, 2>::float4s];
  gemm_dense_tensor<4, 2, false, kGemmTensorBM, kGemmTensorSwigluBN, kGemmTensorSM, kGemmTensorSN>(
      smem4, (device const uint*)wg, gs, gb, (device const uint*)wu, us, ub, x, y, args, tgp, tid, sg, g,
      gs_args.ldg);
}


// ---- start-up probe of the Metal backend: the GEMMs' tensor operations ------------------
// The Metal device builds this pipeline when it loads lily_tensor.metallib: the GEMMs' kind of
// tensor operation (a bfloat cooperative left input filled from device memory, a bfloat
// threadgroup tensor on the right with transpose_right, an fp32 cooperative destination, on
// execution_simdgroup; the attention's forms have their own probe, tensor_ops_probe_bfloat in
// attention_prefill_tensor.metal). If it does not build, the tensor path is reported
// unavailable and prefill runs the simdgroup_matrix kernels, instead of failing at load. As a
// kernel (one threadgroup of 128 threads; x fp32 [64, 64], b = bfloat rounding):
//   out[32, 64] = b(x[0:32]) b(x)^T   each simdgroup a 16 x 32 block, two k = 32 operations,
//                                     written from the registers
[[max_total_threads_per_threadgroup(128)]] kernel void tensor_ops_probe(device const float* x [[buffer(0)]],
                             device float* out [[buffer(1)]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr uint BN = 64;
  threadgroup bfloat Ws[BN * kGemmLd];
  for (uint i = tid; i < BN * kGemmBK; i += 128) {
    Ws[(i / kGemmBK) * kGemmLd + i % kGemmBK] = bfloat(x[i]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  constexpr auto desc = matmul2d_descriptor(16, 32, kGemmTensorK, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroup> op;
  auto a = op.get_left_input_cooperative_tensor<bfloat, bfloat, float>();
  auto acc = op.get_destination_cooperative_tensor<remove_addrspace_t<decltype(a)>, GemmTensorW<32>, float>();
  const uint row0 = (sg / 2) * 16, col0 = (sg % 2) * 32;
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) {
      acc[i] = 0.0f;
    }
  }
  for (uint kk = 0; kk < kGemmBK; kk += kGemmTensorK) {
    for (uint16_t i = 0; i < a.get_capacity(); ++i) {
      if (a.is_valid_element(i)) {
        const auto at = a.get_multidimensional_index(i);  // {k, row}
        a[i] = bfloat(x[(row0 + uint(at[1])) * kGemmBK + kk + uint(at[0])]);
      }
    }
    auto tw = gemm_tensor_w<32>(Ws + col0 * kGemmLd + kk);
    op.run(a, tw, acc);
  }
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) {
      const auto at = acc.get_multidimensional_index(i);  // {column, row}
      out[(row0 + uint(at[1])) * BN + col0 + uint(at[0])] = acc[i];
    }
  }
}
