// The prefill GEMMs' geometry that the host shares with the kernels (metal/gemm.metal,
// gemm_tensor.metal, gemm_tiles.h; docs/prefill.md, "GEMM"): the k step, the tile row
// stride and the output blocks and threads of both paths. The host (csrc/runtime/
// kernel_args.h: the prefill plan's grids, the cost table's tiles) and Python
// (lily._core.CONSTANTS) read them from here; like the *_args.h headers this file includes
// nothing and holds only `constant constexpr uint` values and constexpr functions of them.
#ifndef LILY_GEMM_ARGS_H
#define LILY_GEMM_ARGS_H

// k elements per GEMM step (= kQuantGroup: one scale/bias per weight row and step).
constant constexpr uint kGemmBK = 64;
// Row stride of the bfloat A and W tiles, in elements: 16 padding bytes shift consecutive rows
// across the memory banks and keep every row 16-byte aligned (gemm_tiles.h).
constant constexpr uint kGemmLd = kGemmBK + 8;

// simdgroup_matrix path (gemm.metal): 64 x 64 output blocks of 2 x 2 simdgroups (kGemmSM,
// kGemmSN); SwiGLU 64 x 32 of gate and of up (4 x 1: kGemmSwigluSM, kGemmSwigluSN; two staged
// 64 x 64 fp32 blocks would exceed 32 KiB). 4 simdgroups either way: both give kGemmThreads.
constant constexpr uint kGemmBM = 64;
constant constexpr uint kGemmBN = 64;
constant constexpr uint kGemmSwigluBN = 32;
constant constexpr uint kGemmSM = 2;
constant constexpr uint kGemmSN = 2;
constant constexpr uint kGemmSwigluSM = 4;
constant constexpr uint kGemmSwigluSN = 1;
constant constexpr uint kGemmThreads = 32 * kGemmSM * kGemmSN;
static_assert(32 * kGemmSwigluSM * kGemmSwigluSN == kGemmThreads,
              "the SwiGLU GEMM's simdgroups fill kGemmThreads");

// Tensor-op path (gemm_tensor.metal): 128 x 64 blocks of 4 x 2 simdgroups, 32 x 32 each as in
// MLX's qmm_t_nax (whose 64 x 64 blocks have 2 x 2): twice the rows per dequantized weight
// tile halves the dequantization per product; SwiGLU 128 x 32 of gate and of up.
constant constexpr uint kGemmTensorBM = 128;
constant constexpr uint kGemmTensorSM = 4;
constant constexpr uint kGemmTensorSN = 2;
constant constexpr uint kGemmTensorBN = 64;
constant constexpr uint kGemmTensorSwigluBN = 32;
constant constexpr uint kGemmTensorThreads = 32 * kGemmTensorSM * kGemmTensorSN;

// Threadgroup memory of one GEMM threadgroup with NB weight tiles, in bytes: the kernels
// declare it (GemmSmem of gemm_tiles.h, GemmTensorSmem of gemm_tensor.h), the cost table
// reads it. simdgroup_matrix path: the bfloat A (BM rows) and NB W tiles (BN rows each) of a
// step, reused at the end for the NB staged fp32 BM x gemm_staged_ld(BN) output blocks;
// tensor-op path: the W tiles alone (A goes from device memory into registers and the results
// leave from them).
constexpr uint gemm_staged_ld(uint bn) { return bn + 4; }
constexpr uint gemm_tile_bytes(uint bm, uint bn, uint nb) { return (bm + nb * bn) * kGemmLd * 2; }
constexpr uint gemm_staged_bytes(uint bm, uint bn, uint nb) { return nb * bm * gemm_staged_ld(bn) * 4; }
constexpr uint gemm_smem_bytes(uint bm, uint bn, uint nb) {
  return gemm_tile_bytes(bm, bn, nb) > gemm_staged_bytes(bm, bn, nb) ? gemm_tile_bytes(bm, bn, nb)
                                                                      : gemm_staged_bytes(bm, bn, nb);
}
constexpr uint gemm_tensor_smem_bytes(uint bn, uint nb) { return nb * bn * kGemmLd * 2; }

#define LILY_GEMM_CONSTANTS(C)                                                                  \
  C(kGemmBK) C(kGemmLd) C(kGemmBM) C(kGemmBN) C(kGemmSwigluBN) C(kGemmSM) C(kGemmSN) C(kGemmSwigluSM)   \
  C(kGemmSwigluSN) C(kGemmThreads) C(kGemmTensorBM) C(kGemmTensorSM) C(kGemmTensorSN) C(kGemmTensorBN)   \
  C(kGemmTensorSwigluBN) C(kGemmTensorThreads)

#endif  // LILY_GEMM_ARGS_H
