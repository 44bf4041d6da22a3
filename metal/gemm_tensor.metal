// Prefill GEMMs on MLX affine-quantized weights, Metal 4 tensor-operation path for
// apple10-family GPUs (M5: per-core neural accelerators) (docs/prefill.md, "GEMM: Metal 4
// tensor-operation path"). Twins of metal/gemm.metal with identical bindings, argument
// structs and outputs, on 128-row blocks of 256 threads (gemm.metal: 64 rows, 128 threads):
//   gemm_q4_tensor, gemm_q8_tensor, gemm_q4_add_h_tensor     y[m, n] (=|+=) x[m, k] W[n, k]^T
//   gemm_q4_add_hs_tensor                                   y += (x * s) W^T  (the GDN out_proj)
//   gemm_q4_half_tensor                                     y = half(x W^T)  (saturated)
//   gemm_swiglu_q4_tensor                                   y = half(g[m] * silu(x Wg^T) * (x Wu^T))
// The k loop (half tiles, half x half -> float matmul2d) is gemm_tensor.h's, shared with the
// grouped expert twins in moe_prefill_tensor.metal. MSL 4.0: built into lily_tensor.metallib.
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

#include "gemm_tensor.h"

// ---- dense GEMMs -------------------------------------------------------------------------
// As gemm_dense (gemm.metal), in taller blocks: grid (ceil(n / BN), ceil(m / BM))
// threadgroups of 32 * NSG threads; threadgroup (i, j) computes y rows [j BM, j BM + BM) x
// columns [i BN, i BN + BN), each simdgroup a band of BM / NSG rows.
template <int BITS, uint NB, bool ADD, uint BM, uint BN, uint NSG, typename XS, typename Y>
inline void gemm_dense_tensor(threadgroup float4* smem4, device const uint* w0, device const bfloat* s0,
                              device const bfloat* b0, device const uint* w1, device const bfloat* s1,
                              device const bfloat* b1, XS x, device Y* y,
                              constant GemmArgs& args, uint2 tgp, uint tid, uint sg,
                              device const float* g = nullptr, uint ldg = 0) {
  constexpr uint NT = 32 * NSG;
  const uint n0 = tgp.x * BN;
  const uint m0 = tgp.y * BM;
  if (n0 >= args.n || m0 >= args.m) {
    return;  // the whole threadgroup (a grid larger than needed)
  }
  const uint rows = min(BM, args.m - m0);
  const GemmARows<BM, NT> a = gemm_a_rows_dense<BM, NT>(m0, args.m, args.lda, tid);
  const GemmRowSink<ADD, Y> sink{y + m0 * args.ldy + n0, args.ldy, g ? g + m0 * ldg : nullptr, ldg};
  gemm_tensor_gemm<BITS, NB, BM, BN, NSG, true>(smem4, x, a, w0, s0, b0, w1, s1, b1, n0, args.n, args.k, rows,
                                                tid, sg, sink);
}

// Dense configuration: 128-row blocks of 8 simdgroups (256 threads), a 16-row band each;
// 64 output columns, SwiGLU 32 of gate and of up. Twice the rows of gemm.metal's 64 x 64
// blocks: every weight tile is dequantized half as often (docs/prefill.md), and the tiles
// take 27 KiB of threadgroup memory (GemmTensorSmem).
constant constexpr uint kGemmTensorBM = 128;
constant constexpr uint kGemmTensorBN = 64;
constant constexpr uint kGemmTensorSwigluBN = 32;
constant constexpr uint kGemmTensorSimdgroups = 8;

// X4: half4 (gemm_q4, gemm_q8: the normed rows xn, the shared hidden hs; gemm_q4_add_h: the
// attention output and the shared expert's hidden). Y: float, or half (gemm_q4_half: stored
// with gemm_half; never ADD).
template <int BITS, bool ADD, typename X4, typename Y = float>
[[max_total_threads_per_threadgroup(256)]] kernel void gemm_q_tensor(device const uint4* w [[buffer(0)]],        // W.weight uint32 [n, k*BITS/32]
                          device const bfloat* scales [[buffer(1)]],  // [n, k/64]
                          device const bfloat* biases [[buffer(2)]],  // [n, k/64]
                          device const X4* x [[buffer(3)]],           // half [m, lda]
                          device Y* y [[buffer(4)]],                  // fp32 or half [m, ldy] (read too when ADD)
                          constant GemmArgs& args [[buffer(5)]],
                          uint2 tgp [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 smem4[GemmTensorSmem<kGemmTensorBM, kGemmTensorBN, 1>::float4s];
  device const uint* wu = (device const uint*)w;
  gemm_dense_tensor<BITS, 1, ADD, kGemmTensorBM, kGemmTensorBN, kGemmTensorSimdgroups>(
      smem4, wu, scales, biases, wu, scales, biases, x, y, args, tgp, tid, sg);
}
template [[host_name("gemm_q4_tensor")]] [[kernel]] decltype(gemm_q_tensor<4, false, half4>) gemm_q_tensor<4, false, half4>;
template [[host_name("gemm_q8_tensor")]] [[kernel]] decltype(gemm_q_tensor<8, false, half4>) gemm_q_tensor<8, false, half4>;
template [[host_name("gemm_q4_add_h_tensor")]] [[kernel]] decltype(gemm_q_tensor<4, true, half4>) gemm_q_tensor<4, true, half4>;
template [[host_name("gemm_q4_half_tensor")]] [[kernel]] decltype(gemm_q_tensor<4, false, half4, half>) gemm_q_tensor<4, false, half4, half>;

// y += (x * s) W^T, as gemm_q4_add_hs (gemm.metal): the GDN out_proj.
[[max_total_threads_per_threadgroup(256)]] kernel void gemm_q4_add_hs_tensor(device const uint4* w [[buffer(0)]],        // W.weight uint32 [n, k/8]
                                  device const bfloat* scales [[buffer(1)]],  // [n, k/64]
                                  device const bfloat* biases [[buffer(2)]],  // [n, k/64]
                                  device const half4* x [[buffer(3)]],        // half [m, lda]
                                  device float* y [[buffer(4)]],              // fp32 [m, ldy], read and written
                                  constant GemmArgs& args [[buffer(5)]],
                                  device const half* s [[buffer(6)]],         // half [m, lda >> shift]
                                  constant GemmAScaleArgs& sa [[buffer(7)]],
                                  uint2 tgp [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 smem4[GemmTensorSmem<kGemmTensorBM, kGemmTensorBN, 1>::float4s];
  device const uint* wu = (device const uint*)w;
  gemm_dense_tensor<4, 1, true, kGemmTensorBM, kGemmTensorBN, kGemmTensorSimdgroups>(
      smem4, wu, scales, biases, wu, scales, biases, GemmAScaled{x, s, sa.shift}, y, args, tgp, tid, sg);
}

// The shared expert's gate/up times the shared expert gate, as gemm_swiglu_q4 (gemm.metal).
[[max_total_threads_per_threadgroup(256)]] kernel void gemm_swiglu_q4_tensor(device const uint4* wg [[buffer(0)]],       // gate_proj.weight [n, k/8]
                                  device const bfloat* gs [[buffer(1)]],      // gate_proj.scales [n, k/64]
                                  device const bfloat* gb [[buffer(2)]],      // gate_proj.biases [n, k/64]
                                  device const uint4* wu [[buffer(3)]],       // up_proj.weight [n, k/8]
                                  device const bfloat* us [[buffer(4)]],      // up_proj.scales
                                  device const bfloat* ub [[buffer(5)]],      // up_proj.biases
                                  device const half4* x [[buffer(6)]],        // half [m, lda]
                                  device half* y [[buffer(7)]],               // half [m, ldy] (saturated)
                                  constant GemmArgs& args [[buffer(8)]],
                                  device const float* g [[buffer(9)]],        // row scale, row r at g[r * ldg]
                                  constant GemmRowScaleArgs& gs_args [[buffer(10)]],
                                  uint2 tgp [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 smem4[GemmTensorSmem<kGemmTensorBM, kGemmTensorSwigluBN, 2>::float4s];
  gemm_dense_tensor<4, 2, false, kGemmTensorBM, kGemmTensorSwigluBN, kGemmTensorSimdgroups>(
      smem4, (device const uint*)wg, gs, gb, (device const uint*)wu, us, ub, x, y, args, tgp, tid, sg, g,
      gs_args.ldg);
}


// ---- start-up probe of the Metal backend: the GEMMs' tensor operations ------------------
// The Metal device builds this pipeline when it loads lily_tensor.metallib: every kind of
// tensor operation of the GEMMs (half operands; the attention's bfloat ones have their own
// probe, tensor_ops_probe_bfloat in attention_prefill_tensor.metal). If it does not build,
// the tensor path is reported unavailable and prefill runs the simdgroup_matrix kernels,
// instead of failing at load. As a kernel (one threadgroup of 128 threads; x fp32 [64, 64],
// h = gemm_half):
//   out[32, 64] = h(x[0:32]) h(x)^T   half threadgroup tiles, transpose_right,
//                                     multiply_accumulate into an fp32 cooperative tensor,
//                                     by the whole threadgroup, then again by 16-row bands
//                                     of one simdgroup each, written from the registers
[[max_total_threads_per_threadgroup(128)]] kernel void tensor_ops_probe(device const float* x [[buffer(0)]],
                             device float* out [[buffer(1)]],
                             uint tid [[thread_index_in_threadgroup]]) {
  constexpr uint BM = 32, BN = 64;
  threadgroup float4 smem4[GemmSmem<BM, BN, 1>::float4s];
  threadgroup half* As = (threadgroup half*)smem4;
  threadgroup half* Ws = As + BM * kGemmLd;
  for (uint i = tid; i < (BM + BN) * kGemmBK / 4; i += 128) {
    const uint r = i / kGemmRow4, c4 = i % kGemmRow4;
    const float4 v = ((device const float4*)x)[(r < BM ? r : r - BM) * kGemmRow4 + c4];
    *(threadgroup half4*)((r < BM ? As + r * kGemmLd : Ws + (r - BM) * kGemmLd) + 4 * c4) = gemm_half(v);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  constexpr auto desc = matmul2d_descriptor(BM, BN, kGemmBK, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<4>> op;
  auto tA = gemm_tensor_tile<BM>(As);
  auto tW = gemm_tensor_tile<BN>(Ws);
  auto acc = op.get_destination_cooperative_tensor<decltype(tA), decltype(tW), float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) {
      acc[i] = 0.0f;
    }
  }
  op.run(tA, tW, acc);
  // the same product by 16-row bands (simdgroups 0 and 1, each on execution_simdgroup), kept
  // in registers and written over out below: the banded GEMMs' form (gemm_tensor_gemm)
  constexpr auto band_desc = matmul2d_descriptor(16, BN, kGemmBK, false, true, false,
                                                 matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<band_desc, execution_simdgroup> band;
  auto tB = gemm_tensor_tile<16>(As + (tid / 32 % 2) * 16 * kGemmLd);
  auto bacc = band.get_destination_cooperative_tensor<decltype(tB), decltype(tW), float>();
  for (uint16_t i = 0; i < bacc.get_capacity(); ++i) {
    if (bacc.is_valid_element(i)) {
      bacc[i] = 0.0f;
    }
  }
  if (tid < 64) {
    band.run(tB, tW, bacc);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  threadgroup float* smem = (threadgroup float*)smem4;
  auto st = gemm_tensor_stage<BM, BN, 1>(smem, 0);
  acc.store(st);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < BM * BN; i += 128) {
    out[i] = smem[(i / BN) * GemmSmem<BM, BN, 1>::ldc + i % BN];
  }
  threadgroup_barrier(mem_flags::mem_device);  // those writes of out ordered before the bands'
  for (uint16_t i = 0; tid < 64 && i < bacc.get_capacity(); ++i) {
    if (bacc.is_valid_element(i)) {
      const auto at = bacc.get_multidimensional_index(i);  // {column, row}
      out[(tid / 32 * 16 + uint(at[1])) * BN + uint(at[0])] = bacc[i];
    }
  }
}
