// The k loop of the prefill GEMMs on the Metal 4 tensor-operation path (apple10-family GPUs,
// M5: per-core neural accelerators), shared by the dense kernels (metal/gemm_tensor.metal)
// and the grouped expert kernels (metal/moe_prefill_tensor.metal) (docs/prefill.md, "GEMM:
// Metal 4 tensor-operation path"). The structure of MLX's qmm_t_nax (quantized_nax.h), which
// MLX-LM runs on M5 (docs/performance.md, "The tensor rate from designs measured on M5"):
//   * only the dequantized weight tile lives in threadgroup memory: BN rows x 64 k of
//     bfloat (9 KiB for 64 rows, whatever the tile's height), so several threadgroups share
//     a core and hide each other's loads and barriers;
//   * the A operand goes from device memory straight into registers: each thread fills its
//     slots of the operation's cooperative left input (gemm_tiles.h row sources: dense rows,
//     gathered expert rows, scaled rows; rows past the tile zero), no copy through
//     threadgroup memory and no barrier for it;
//   * each simdgroup owns an (BM / SM) x (BN / SN) block of the output (32 x 32 in the
//     64 x 64 dense tiles, MLX's) and runs its own matmul2d on execution_simdgroup, 32 k at a
//     time: bfloat x bfloat -> float into fp32 cooperative destinations (registers);
//   * per 64-k step: each thread loads its A elements for both 32-deep operations, the weight
//     tile is dequantized by all threads (the A loads in flight meanwhile), a barrier, the
//     products, a barrier (one tile, as MLX's); unlike MLX's, the weight codes of a step are
//     fetched into registers during the step before's products (register-staged double
//     buffering: the tile's footprint stays one step's);
//   * at the end each thread writes its own elements from the registers through the
//     kernel's sink (no staging in threadgroup memory).
// bfloat x bfloat -> float is a row of MacOSX 26.1's MPPTensorOpsMatMul2d.h operand table (26.0
// lists none), so this path needs bfloat tensor operands (Device::supports_bfloat_tensor_ops).
// Differences from qmm_t_nax: relaxed_precision stays false (the simulator cannot model what
// it lets the GPU do), the operation is 16/32 x 16/32 x 32 per simdgroup where MLX issues
// 16 x 32 x 16 steps, and the A fragments' layout is the device's (get_multidimensional_index)
// where MLX hard-codes the M5 one. MSL 4.0 only: included by the *_tensor.metal files.
#pragma once

#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

#include "common.h"
#include "gemm_tiles.h"
#include "prefill_args.h"

// k of one tensor operation: half a GEMM step (an explicit k must be a multiple of 32).
constant constexpr uint kGemmTensorK = 32;

// Threadgroup memory of a tensor-op GEMM with NB weight tiles of BN rows (gemm_tensor_smem_bytes,
// gemm_args.h: the bfloat weight tiles only). Declared as float4.
template <uint BN, uint NB>
struct GemmTensorSmem {
  static constant constexpr uint bytes = gemm_tensor_smem_bytes(BN, NB);
  static constant constexpr uint float4s = (bytes + 15) / 16;
  static_assert(bytes <= 32768, "a GEMM's threadgroup memory must fit 32 KiB");
};

// A W-tile slice as the right operand of a simdgroup's operation: RN weight rows of k columns
// [kk, kk + kGemmTensorK), extents (kGemmTensorK, RN), row stride kGemmLd (transpose_right).
template <uint RN>
using GemmTensorW = tensor<threadgroup bfloat, extents<int32_t, kGemmTensorK, RN>, tensor_inline>;

template <uint RN>
inline GemmTensorW<RN> gemm_tensor_w(threadgroup bfloat* t) {
  return GemmTensorW<RN>(t, extents<int32_t, kGemmTensorK, RN>(), array<int, 2>{1, int(kGemmLd)});
}

// One threadgroup's GEMM of SM x SN simdgroups (32 SM SN threads): NB products of the BM A
// rows given by `rows` (a gemm_tiles.h row source) of source x with weight rows
// [n0, n0 + BN) of (w_b, s_b, b_b), b < NB, over the whole of k, in fp32 cooperative tensors;
// then every thread hands its own valid elements (tile row < valid, column < n - n0) to
// `sink`: the product, or silu(gate) * up for NB = 2 (the same fp32 operations as the
// simdgroup_matrix twins' gemm_staged). A simdgroup whose rows all lie past `valid` runs no
// tensor operation (uniform over it), so a partial tile computes its live row bands only.
// Ws: the GemmTensorSmem<BN, NB> bytes of threadgroup memory.
template <int BITS, uint NB, uint BM, uint BN, uint SM, uint SN, typename XS, typename Rows, typename Sink>
inline void gemm_tensor_gemm(threadgroup bfloat* Ws, XS x, Rows rows, device const uint* w0,
                             device const bfloat* s0, device const bfloat* b0, device const uint* w1,
                             device const bfloat* s1, device const bfloat* b1, uint n0, uint n, uint k,
                             uint valid, uint tid, uint sg, thread const Sink& sink) {
  constexpr uint NT = 32 * SM * SN;
  constexpr uint RM = BM / SM, RN = BN / SN;  // one simdgroup's block
  static_assert(RM % 16 == 0 && RN % 16 == 0, "a tensor operation covers multiples of 16 rows and columns");
  // RM x RN block, transpose_right, relaxed_precision off, multiply_accumulate
  constexpr auto desc = matmul2d_descriptor(RM, RN, kGemmTensorK, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroup> op;
  auto a = op.template get_left_input_cooperative_tensor<bfloat, bfloat, float>();
  auto acc0 = op.template get_destination_cooperative_tensor<remove_addrspace_t<decltype(a)>, GemmTensorW<RN>, float>();
  auto acc1 = op.template get_destination_cooperative_tensor<remove_addrspace_t<decltype(a)>, GemmTensorW<RN>, float>();
  const uint row0 = (sg / SN) * RM, col0 = (sg % SN) * RN;
  const bool live = row0 < valid && col0 < n - n0;  // uniform over the simdgroup
  // Where each slot of the left input comes from: its row's offset plus its k (kGemmNoRow:
  // a row past the tile, zero). Fixed for the whole k loop. A simdgroup's RM x 32 operand
  // is RM elements per thread (the simulator adds one invalid slot; a slot beyond kSlots
  // would stay unfilled, which the simulator's poison reports).
  constexpr uint kSlots = RM * kGemmTensorK / 32 + 1;
  const uint16_t slots = min(a.get_capacity(), uint16_t(kSlots));
  uint src[kSlots];
  for (uint16_t i = 0; i < slots; ++i) {
    src[i] = kGemmNoRow;
    if (live && a.is_valid_element(i)) {
      const auto at = a.get_multidimensional_index(i);  // {k, row}
      const uint off = rows.at(row0 + uint(at[1]));
      src[i] = off == kGemmNoRow ? kGemmNoRow : off + uint(at[0]);
    }
  }
  for (uint16_t i = 0; i < acc0.get_capacity(); ++i) {
    if (acc0.is_valid_element(i)) {
      acc0[i] = 0.0f;
      if (NB == 2) {
        acc1[i] = 0.0f;
      }
    }
  }
  // Per 64-k step: the two A operands (k0 and k0 + 32) are loaded first, then the weight
  // codes fetched a step ahead (gemm_tiles.h GemmWStep: their loads were in flight during the
  // step before's products) are dequantized into the tile; the A loads complete meanwhile, so
  // the products after the barrier wait on no load.
  static_assert(kGemmBK == 2 * kGemmTensorK, "a step is two operations deep");
  auto a1 = op.template get_left_input_cooperative_tensor<bfloat, bfloat, float>();
  GemmWStep<BITS, NB, BN, NT> wn;
  wn.fetch(w0, s0, b0, w1, s1, b1, n0, n, k, 0, tid);
  for (uint k0 = 0; k0 < k; k0 += kGemmBK) {
    if (live) {
      for (uint16_t i = 0; i < slots; ++i) {
        if (a.is_valid_element(i)) {
          a[i] = src[i] == kGemmNoRow ? bfloat(0.0f) : gemm_a_elem(x, src[i] + k0);
          a1[i] = src[i] == kGemmNoRow ? bfloat(0.0f) : gemm_a_elem(x, src[i] + k0 + kGemmTensorK);
        }
      }
    }
    wn.put(Ws, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (k0 + kGemmBK < k) { wn.fetch(w0, s0, b0, w1, s1, b1, n0, n, k, k0 + kGemmBK, tid); }
    if (live) {
      auto w00 = gemm_tensor_w<RN>(Ws + col0 * kGemmLd);
      auto w01 = gemm_tensor_w<RN>(Ws + col0 * kGemmLd + kGemmTensorK);
      op.run(a, w00, acc0);
      op.run(a1, w01, acc0);
      if (NB == 2) {
        auto w10 = gemm_tensor_w<RN>(Ws + (BN + col0) * kGemmLd);
        auto w11 = gemm_tensor_w<RN>(Ws + (BN + col0) * kGemmLd + kGemmTensorK);
        op.run(a, w10, acc1);
        op.run(a1, w11, acc1);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile is refilled next step
  }
  if (!live) {
    return;
  }
  const uint cols = min(BN, n - n0);
  for (uint16_t i = 0; i < acc0.get_capacity(); ++i) {
    if (!acc0.is_valid_element(i)) {
      continue;
    }
    const auto at = acc0.get_multidimensional_index(i);  // {column, row} in the simdgroup's block
    const uint r = row0 + uint(at[1]);
    const uint c = col0 + uint(at[0]);
    if (r < valid && c < cols) { sink.put(r, c, NB == 2 ? silu(acc0[i]) * acc1[i] : acc0[i]); }
  }
}
