// The k loop of the prefill GEMMs on the Metal 4 tensor-operation path (apple10-family GPUs,
// M5: per-core neural accelerators), shared by the dense kernels (metal/gemm_tensor.metal)
// and the grouped expert kernels (metal/moe_prefill_tensor.metal) (docs/prefill.md, "GEMM:
// Metal 4 tensor-operation path"). Per step of kGemmBK = 64 columns of k a threadgroup fills
// the half tiles of gemm_tiles.h, then runs one mpp::tensor_ops::matmul2d per weight tile,
// either all its simdgroups together (execution_simdgroups<N>) or each simdgroup on its own
// band of rows (execution_simdgroup): half x half operands into fp32 cooperative tensors
// (registers), the floating combination of Apple's operand table
// (MetalPerformancePrimitives MPPTensorOpsMatMul2d.h: half, half -> float). At the end each
// thread writes its own elements from the registers (no staging in threadgroup memory).
// MSL 4.0 only: included by the *_tensor.metal files.
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

// The probe's staged fp32 output block b (gemm_tensor.metal, tensor_ops_probe): extents
// (BN, BM), row stride ldc.
template <uint BM, uint BN, uint NB>
inline tensor<threadgroup float, extents<int32_t, BN, BM>, tensor_inline> gemm_tensor_stage(threadgroup float* smem,
                                                                                            uint b) {
  constexpr uint ldc = GemmSmem<BM, BN, NB>::ldc;
  return tensor<threadgroup float, extents<int32_t, BN, BM>, tensor_inline>(smem + b * BM * ldc, extents<int32_t, BN, BM>(),
                                                                            array<int, 2>{1, int(ldc)});
}

// Threadgroup memory of a tensor-op GEMM with NB weight tiles: the half A and W tiles only
// (the results leave from the cooperative tensors, never staged). Declared as float4.
template <uint BM, uint BN, uint NB>
struct GemmTensorSmem {
  static constant constexpr uint bytes = (BM + NB * BN) * kGemmLd * 2;
  static constant constexpr uint float4s = (bytes + 15) / 16;
  static_assert(bytes <= 32768, "a GEMM's threadgroup memory must fit 32 KiB");
};

// Who runs the tensor operations of a threadgroup of NSG simdgroups:
//   BANDED = false: one BM x BN operation per weight tile on execution_simdgroups<NSG> (all
//                   simdgroups together, the whole A tile);
//   BANDED = true:  each simdgroup s its own (BM / NSG) x BN operation on execution_simdgroup
//                   over its band of A rows [s BM / NSG, (s + 1) BM / NSG); a band whose rows
//                   all lie past the tile's valid rows is skipped (no tensor work for the
//                   padding of a partial tile, at band granularity).
template <bool BANDED, uint NSG>
struct GemmTensorScope {
  using type = execution_simdgroups<NSG>;
};
template <uint NSG>
struct GemmTensorScope<true, NSG> {
  using type = execution_simdgroup;
};

// Where the results go: GemmRowSink (gemm_tiles.h), shared with the simdgroup_matrix GEMMs.

// One threadgroup's GEMM: NB products of the A rows `a` of source x (gemm_tiles.h; rows valid rows) with weight rows
// [n0, n0 + BN) of (w_b, s_b, b_b), b < NB, over the whole of k, in fp32 cooperative tensors
// (registers); then every thread hands its own valid elements to `sink`: the product, or
// silu(gate) * up for NB = 2 (the same fp32 operations as the simdgroup_matrix twins'
// gemm_staged). Results are never staged in threadgroup memory, so a tile needs only
// GemmTensorSmem<BM, BN, NB> (a 128-row tile fits 32 KiB).
template <int BITS, uint NB, uint BM, uint BN, uint NSG, bool BANDED, typename XS, typename Sink>
inline void gemm_tensor_gemm(threadgroup float4* smem4, XS x, thread const GemmARows<BM, 32 * NSG>& a,
                             device const uint* w0, device const bfloat* s0, device const bfloat* b0,
                             device const uint* w1, device const bfloat* s1, device const bfloat* b1, uint n0,
                             uint n, uint k, uint rows, uint tid, uint sg, thread const Sink& sink) {
  constexpr uint NT = 32 * NSG;
  constexpr uint R = BANDED ? BM / NSG : BM;  // A rows per operation
  static_assert(R % 16 == 0, "a tensor operation covers a multiple of 16 rows");
  // R x BN block, transpose_right, relaxed_precision off, multiply_accumulate
  constexpr auto desc = matmul2d_descriptor(R, BN, kGemmBK, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, typename GemmTensorScope<BANDED, NSG>::type> op;
  auto acc0 = op.template get_destination_cooperative_tensor<GemmTensorTile<R>, GemmTensorTile<BN>, float>();
  auto acc1 = op.template get_destination_cooperative_tensor<GemmTensorTile<R>, GemmTensorTile<BN>, float>();
  threadgroup half* As = (threadgroup half*)smem4;
  threadgroup half* Ws = As + BM * kGemmLd;
  const uint r0 = BANDED ? sg * R : 0u;  // the operation's first tile row
  const bool live = r0 < rows;           // uniform over the operation's scope
  auto tA = gemm_tensor_tile<R>(As + r0 * kGemmLd);
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
    if (live) {
      op.run(tA, tW0, acc0);
      if (NB == 2) {
        op.run(tA, tW1, acc1);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tiles are refilled next step
  }
  if (!live) {
    return;
  }
  const uint cols = min(BN, n - n0);
  for (uint16_t i = 0; i < acc0.get_capacity(); ++i) {
    if (!acc0.is_valid_element(i)) {
      continue;
    }
    const auto at = acc0.get_multidimensional_index(i);  // {column, row} in the operation's block
    const uint r = r0 + uint(at[1]);
    const uint c = uint(at[0]);
    if (r < rows && c < cols) {
      sink.put(r, c, NB == 2 ? silu(acc0[i]) * acc1[i] : acc0[i]);
    }
  }
}
