// The k loop of the prefill GEMMs on the Metal 4 tensor-operation path (apple10-family GPUs,
// M5: per-core neural accelerators), shared by the dense kernels (metal/gemm_tensor.metal)
// and the grouped expert kernels (metal/moe_prefill_tensor.metal) (docs/prefill.md, "GEMM:
// Metal 4 tensor-operation path"). Per step of kGemmBK = 64 columns of k a threadgroup fills
// the half tiles of gemm_tiles.h, then all its simdgroups run one
// mpp::tensor_ops::matmul2d (execution_simdgroups<N>) per weight tile: half x half operands
// into fp32 cooperative tensors (registers), the floating combination of Apple's operand
// table (MetalPerformancePrimitives MPPTensorOpsMatMul2d.h: half, half -> float). At the end
// the accumulators are stored into threadgroup memory and written out as on the
// simdgroup_matrix path. MSL 4.0 only: included by the *_tensor.metal files.
#pragma once

#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

#include "common.h"
#include "gemm_tiles.h"
#include "prefill_args.h"

// A gemm_tiles.h tile of ROWS rows as a tensor operand: half, extents (kGemmBK, ROWS) (k
// innermost), row stride kGemmLd. The A tile is the left operand (m = BM rows of k), a W
// tile the right one with transpose_right (n = BN rows of k). Static extents: rows past the
// valid ones are zero in the tiles, so the operation never needs edge handling.
template <uint ROWS>
using GemmTensorTile = tensor<threadgroup half, extents<int32_t, kGemmBK, ROWS>, tensor_inline>;

template <uint ROWS>
inline GemmTensorTile<ROWS> gemm_tensor_tile(threadgroup half* t) {
  return GemmTensorTile<ROWS>(t, extents<int32_t, kGemmBK, ROWS>(), array<int, 2>{1, int(kGemmLd)});
}

// The staged fp32 output block b: extents (BN, BM), row stride ldc.
template <uint BM, uint BN, uint NB>
inline tensor<threadgroup float, extents<int32_t, BN, BM>, tensor_inline> gemm_tensor_stage(threadgroup float* smem,
                                                                                            uint b) {
  constexpr uint ldc = GemmSmem<BM, BN, NB>::ldc;
  return tensor<threadgroup float, extents<int32_t, BN, BM>, tensor_inline>(smem + b * BM * ldc, extents<int32_t, BN, BM>(),
                                                                            array<int, 2>{1, int(ldc)});
}

// The k loop of one threadgroup of NSG simdgroups: NB products of the A rows `a` with weight
// rows [n0, n0 + BN) of (w_b, s_b, b_b), b < NB, over the whole of k. Leaves the fp32
// results in smem (as float): block b, row r, column c at b * BM * ldc + r * ldc + c (rows
// past the tile's and columns past n - n0 are zero), after a barrier.
template <int BITS, uint NB, uint BM, uint BN, uint NSG>
inline void gemm_tensor_accumulate(threadgroup float4* smem4, device const float4* x,
                                   thread const GemmARows<BM, 32 * NSG>& a, device const uint* w0,
                                   device const bfloat* s0, device const bfloat* b0,
                                   device const uint* w1, device const bfloat* s1,
                                   device const bfloat* b1, uint n0, uint n, uint k, uint tid) {
  constexpr uint NT = 32 * NSG;
  // BM x BN block, transpose_right, relaxed_precision off, multiply_accumulate
  constexpr auto desc = matmul2d_descriptor(BM, BN, kGemmBK, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<NSG>> op;
  auto acc0 = op.template get_destination_cooperative_tensor<GemmTensorTile<BM>, GemmTensorTile<BN>, float>();
  auto acc1 = op.template get_destination_cooperative_tensor<GemmTensorTile<BM>, GemmTensorTile<BN>, float>();
  threadgroup half* As = (threadgroup half*)smem4;
  threadgroup half* Ws = As + BM * kGemmLd;
  auto tA = gemm_tensor_tile<BM>(As);
  auto tW0 = gemm_tensor_tile<BN>(Ws);
  auto tW1 = gemm_tensor_tile<BN>(Ws + BN * kGemmLd);
  for (uint16_t i = 0; i < acc0.get_capacity(); ++i) {
    if (acc0.is_valid_element(i)) {
      acc0[i] = 0.0f;
      if (NB == 2) {
        acc1[i] = 0.0f;
      }
    }
  }
  for (uint k0 = 0; k0 < k; k0 += kGemmBK) {
    gemm_load_step<BITS, NB, BM, BN, NT>(As, Ws, x, a, w0, s0, b0, w1, s1, b1, n0, n, k, k0, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    op.run(tA, tW0, acc0);
    if (NB == 2) {
      op.run(tA, tW1, acc1);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tiles are refilled next step
  }
  threadgroup float* smem = (threadgroup float*)smem4;
  auto st0 = gemm_tensor_stage<BM, BN, NB>(smem, 0);
  acc0.store(st0);
  if (NB == 2) {
    auto st1 = gemm_tensor_stage<BM, BN, NB>(smem, 1);
    acc1.store(st1);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
