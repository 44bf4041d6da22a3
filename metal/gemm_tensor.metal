// Prefill GEMMs on MLX affine-quantized weights, Metal 4 tensor-operation path for
// apple10-family GPUs (M5: per-core neural accelerators) (docs/prefill.md, "GEMM: Metal 4
// tensor-operation path"). Twins of metal/gemm.metal with identical bindings, argument
// structs, grids and outputs:
//   gemm_q4_tensor, gemm_q8_tensor, gemm_q4_add_tensor   y[m, n] (=|+=) x[m, k] W[n, k]^T
//   gemm_swiglu_q4_tensor                                y = silu(x Wg^T) * (x Wu^T)
//   moe_gemm_gate_up_q4_t{16,32}_tensor                  hx[s] = silu(x[perm[s] / top_k] Wg_e^T) * (x[...] Wu_e^T)
//   moe_gemm_down_q4_t{16,32}_tensor                     yx[perm[s]] = hx[s] Wd_e^T
// Per step of kGemmBK = 32 columns of k a threadgroup fills the same threadgroup tiles as the
// simdgroup_matrix kernels (gemm_tiles.h: BM activation rows, BN dequantized weight rows,
// fp32), then all its simdgroups run one mpp::tensor_ops::matmul2d (execution_simdgroups<N>)
// per weight tile, accumulating into fp32 cooperative tensors (registers). At the end the
// accumulators are stored into threadgroup memory and written out as in gemm.metal.
// MSL 4.0: built into lily_tensor.metallib (macOS 26.1 SDK: float x float tensor ops).
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

#include "common.h"
#include "gemm_tiles.h"
#include "prefill_args.h"

// Threadgroup memory (floats) of a tensor GEMM with NB weight tiles: the A and W tiles of a
// step, reused at the end for the NB staged BM x (BN + 4) output blocks (as gemm.metal).
template <uint BM, uint BN, uint NB>
struct GemmTensorSmem {
  static constant constexpr uint ldc = BN + 4;
  static constant constexpr uint tiles = (BM + NB * BN) * kGemmLd;
  static constant constexpr uint staged = NB * BM * ldc;
  static constant constexpr uint floats = tiles > staged ? tiles : staged;
};

// A gemm_tiles.h tile of ROWS rows as a tensor operand: extents (kGemmBK, ROWS) (k
// innermost), row stride kGemmLd. The A tile is the left operand (m = BM rows of k), a W
// tile the right one with transpose_right (n = BN rows of k). Static extents: rows past the
// valid ones are zero in the tiles, so the operation never needs edge handling.
template <uint ROWS>
using GemmTensorTile = tensor<threadgroup float, extents<int32_t, kGemmBK, ROWS>, tensor_inline>;

template <uint ROWS>
inline GemmTensorTile<ROWS> gemm_tensor_tile(threadgroup float* t) {
  return GemmTensorTile<ROWS>(t, extents<int32_t, kGemmBK, ROWS>(), array<int, 2>{1, int(kGemmLd)});
}

// The staged output block b: extents (BN, BM), row stride ldc.
template <uint BM, uint BN, uint NB>
inline tensor<threadgroup float, extents<int32_t, BN, BM>, tensor_inline> gemm_tensor_stage(threadgroup float* smem,
                                                                                            uint b) {
  constexpr uint ldc = GemmTensorSmem<BM, BN, NB>::ldc;
  return tensor<threadgroup float, extents<int32_t, BN, BM>, tensor_inline>(smem + b * BM * ldc, extents<int32_t, BN, BM>(),
                                                                            array<int, 2>{1, int(ldc)});
}

// The k loop of one threadgroup: NB products of the A rows `a` with weight rows
// [n0, n0 + BN) of (w_b, s_b, b_b), b < NB, over the whole of k, accumulated by `op` (a
// matmul2d (BM, BN, kGemmBK) with transpose_right and multiply_accumulate) in acc0 / acc1.
// Leaves the fp32 results in smem: block b, row r, column c at b * BM * ldc + r * ldc + c
// (rows past the tile's and columns past n - n0 are zero), after a barrier.
template <int BITS, uint NB, uint BM, uint BN, uint NT, typename Op, typename Acc>
inline void gemm_tensor_accumulate(thread const Op& op, thread Acc& acc0, thread Acc& acc1,
                                   threadgroup float* smem, device const float4* x,
                                   thread const GemmARows<BM, NT>& a, device const uint* w0,
                                   device const bfloat* s0, device const bfloat* b0,
                                   device const uint* w1, device const bfloat* s1,
                                   device const bfloat* b1, uint n0, uint n, uint k, uint tid) {
  threadgroup float* As = smem;
  threadgroup float* Ws = smem + BM * kGemmLd;
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
    gemm_load_a<float, BM, NT>(As, x, a, k0, tid);
    gemm_load_w<BITS, float, BN, NT>(Ws, w0, s0, b0, n0, n, k, k0, tid);
    if (NB == 2) {
      gemm_load_w<BITS, float, BN, NT>(Ws + BN * kGemmLd, w1, s1, b1, n0, n, k, k0, tid);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    op.run(tA, tW0, acc0);
    if (NB == 2) {
      op.run(tA, tW1, acc1);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tiles are refilled next step
  }
  auto st0 = gemm_tensor_stage<BM, BN, NB>(smem, 0);
  acc0.store(st0);
  if (NB == 2) {
    auto st1 = gemm_tensor_stage<BM, BN, NB>(smem, 1);
    acc1.store(st1);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Staged result of tile row r, column c: the product, or silu(gate) * up for NB = 2.
template <uint NB, uint BM, uint BN>
inline float gemm_tensor_staged(const threadgroup float* smem, uint r, uint c) {
  constexpr uint ldc = GemmTensorSmem<BM, BN, NB>::ldc;
  const float v = smem[r * ldc + c];
  return NB == 2 ? silu(v) * smem[BM * ldc + r * ldc + c] : v;
}

// ---- dense GEMMs -------------------------------------------------------------------------
// As gemm_dense (gemm.metal): grid (ceil(n / BN), ceil(m / BM)) threadgroups of 32 * NSG
// threads; threadgroup (i, j) computes y rows [j BM, j BM + BM) x columns [i BN, i BN + BN).
template <int BITS, uint NB, bool ADD, uint BM, uint BN, uint NSG>
inline void gemm_dense_tensor(threadgroup float* smem, device const uint* w0, device const bfloat* s0,
                              device const bfloat* b0, device const uint* w1, device const bfloat* s1,
                              device const bfloat* b1, device const float4* x, device float* y,
                              constant GemmArgs& args, uint2 tgp, uint tid) {
  constexpr uint NT = 32 * NSG;
  const uint n0 = tgp.x * BN;
  const uint m0 = tgp.y * BM;
  if (n0 >= args.n || m0 >= args.m) {
    return;  // the whole threadgroup (a grid larger than needed)
  }
  constexpr auto desc = matmul2d_descriptor(BM, BN, kGemmBK, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<NSG>> op;
  auto acc0 = op.template get_destination_cooperative_tensor<GemmTensorTile<BM>, GemmTensorTile<BN>, float>();
  auto acc1 = op.template get_destination_cooperative_tensor<GemmTensorTile<BM>, GemmTensorTile<BN>, float>();
  const uint rows = min(BM, args.m - m0);
  const GemmARows<BM, NT> a = gemm_a_rows_dense<BM, NT>(m0, args.m, args.lda, tid);
  gemm_tensor_accumulate<BITS, NB, BM, BN, NT>(op, acc0, acc1, smem, x, a, w0, s0, b0, w1, s1, b1, n0,
                                               args.n, args.k, tid);
  for (uint i = tid; i < BM * BN; i += NT) {
    const uint r = i / BN;
    const uint c = i % BN;
    if (r < rows && n0 + c < args.n) {
      const float v = gemm_tensor_staged<NB, BM, BN>(smem, r, c);
      device float* dst = y + (m0 + r) * args.ldy + n0 + c;
      *dst = ADD ? *dst + v : v;
    }
  }
}

// Dense configuration: 32 x 64 output blocks, 4 simdgroups (128 threads), as gemm.metal.
constant constexpr uint kGemmTensorBM = 32;
constant constexpr uint kGemmTensorBN = 64;

template <int BITS, bool ADD>
[[max_total_threads_per_threadgroup(128)]] kernel void gemm_q_tensor(device const uint4* w [[buffer(0)]],        // W.weight uint32 [n, k*BITS/32]
                          device const bfloat* scales [[buffer(1)]],  // [n, k/64]
                          device const bfloat* biases [[buffer(2)]],  // [n, k/64]
                          device const float4* x [[buffer(3)]],       // fp32 [m, lda]
                          device float* y [[buffer(4)]],              // fp32 [m, ldy] (read too when ADD)
                          constant GemmArgs& args [[buffer(5)]],
                          uint2 tgp [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float4 smem4[(GemmTensorSmem<kGemmTensorBM, kGemmTensorBN, 1>::floats + 3) / 4];  // float4: the tiles are read as float4
  threadgroup float* smem = (threadgroup float*)smem4;
  device const uint* wu = (device const uint*)w;
  gemm_dense_tensor<BITS, 1, ADD, kGemmTensorBM, kGemmTensorBN, 4>(smem, wu, scales, biases, wu, scales, biases,
                                                                   x, y, args, tgp, tid);
}
template [[host_name("gemm_q4_tensor")]] [[kernel]] decltype(gemm_q_tensor<4, false>) gemm_q_tensor<4, false>;
template [[host_name("gemm_q8_tensor")]] [[kernel]] decltype(gemm_q_tensor<8, false>) gemm_q_tensor<8, false>;
template [[host_name("gemm_q4_add_tensor")]] [[kernel]] decltype(gemm_q_tensor<4, true>) gemm_q_tensor<4, true>;

// The shared expert's gate/up: y = silu(x Wg^T) * (x Wu^T), Wg and Wu both [n, k].
[[max_total_threads_per_threadgroup(128)]] kernel void gemm_swiglu_q4_tensor(device const uint4* wg [[buffer(0)]],       // gate_proj.weight [n, k/8]
                                  device const bfloat* gs [[buffer(1)]],      // gate_proj.scales [n, k/64]
                                  device const bfloat* gb [[buffer(2)]],      // gate_proj.biases [n, k/64]
                                  device const uint4* wu [[buffer(3)]],       // up_proj.weight [n, k/8]
                                  device const bfloat* us [[buffer(4)]],      // up_proj.scales
                                  device const bfloat* ub [[buffer(5)]],      // up_proj.biases
                                  device const float4* x [[buffer(6)]],       // fp32 [m, lda]
                                  device float* y [[buffer(7)]],              // fp32 [m, ldy]
                                  constant GemmArgs& args [[buffer(8)]],
                                  uint2 tgp [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float4 smem4[(GemmTensorSmem<kGemmTensorBM, kGemmTensorBN, 2>::floats + 3) / 4];  // float4: the tiles are read as float4
  threadgroup float* smem = (threadgroup float*)smem4;
  gemm_dense_tensor<4, 2, false, kGemmTensorBM, kGemmTensorBN, 4>(smem, (device const uint*)wg, gs, gb,
                                                                  (device const uint*)wu, us, ub, x, y, args,
                                                                  tgp, tid);
}

// ---- grouped expert GEMMs ------------------------------------------------------------------
// As moe_gemm_*_q4 (gemm.metal): grid (max_tiles, ceil(n / BN)) threadgroups of 32 * NSG
// threads; threadgroup (t, j) computes output columns [j BN, j BN + BN) of the slots of tile
// t; threadgroups with t >= tile_count return at once. BM = T, the tile height.
struct GemmTensorTileInfo {
  uint expert;
  uint begin;
  uint rows;
};

inline GemmTensorTileInfo gemm_tensor_tile_info(device const MoeTile* tiles, uint t, uint T,
                                                constant MoeGemmArgs& args) {
  const MoeTile tile = tiles[t];
  GemmTensorTileInfo info;
  info.expert = min(tile.expert, args.experts - 1u);
  info.begin = tile.begin;
  // clamp to the tile height and to the slots of the chunk (a malformed map reads no further)
  const uint slots = args.m * args.top_k;
  info.rows = tile.begin < slots ? min(min(tile.rows, T), slots - tile.begin) : 0u;
  return info;
}

template <uint T, uint BN, uint NSG>
[[max_total_threads_per_threadgroup(128)]] kernel void moe_gemm_gate_up_q4_tensor(device const float4* x [[buffer(0)]],        // fp32 [m, lda]
                                       device const uint* perm [[buffer(1)]],        // [m * top_k] slot -> row * top_k + j
                                       device const MoeTile* tiles [[buffer(2)]],    // [max_tiles]
                                       device const uint* tile_count [[buffer(3)]],  // [1]
                                       device const uint4* wg [[buffer(4)]],         // gate_proj.weight [E, n, k/8]
                                       device const bfloat* gs [[buffer(5)]],        // gate_proj.scales [E, n, k/64]
                                       device const bfloat* gb [[buffer(6)]],        // gate_proj.biases [E, n, k/64]
                                       device const uint4* wu [[buffer(7)]],         // up_proj.weight [E, n, k/8]
                                       device const bfloat* us [[buffer(8)]],        // up_proj.scales
                                       device const bfloat* ub [[buffer(9)]],        // up_proj.biases
                                       device float* hx [[buffer(10)]],              // fp32 [m * top_k, ldy], slot order
                                       constant MoeGemmArgs& args [[buffer(11)]],
                                       uint2 tgp [[threadgroup_position_in_grid]],
                                       uint tid [[thread_index_in_threadgroup]]) {
  constexpr uint NT = 32 * NSG;
  threadgroup float4 smem4[(GemmTensorSmem<T, BN, 2>::floats + 3) / 4];  // float4: the tiles are read as float4
  threadgroup float* smem = (threadgroup float*)smem4;
  const uint n0 = tgp.y * BN;
  if (tgp.x >= tile_count[0] || n0 >= args.n) {
    return;  // the whole threadgroup
  }
  constexpr auto desc = matmul2d_descriptor(T, BN, kGemmBK, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<NSG>> op;
  auto acc0 = op.template get_destination_cooperative_tensor<GemmTensorTile<T>, GemmTensorTile<BN>, float>();
  auto acc1 = op.template get_destination_cooperative_tensor<GemmTensorTile<T>, GemmTensorTile<BN>, float>();
  const GemmTensorTileInfo tile = gemm_tensor_tile_info(tiles, tgp.x, T, args);
  const uint wstride = args.n * (args.k / 8);  // uint32 per expert
  const uint gstride = args.n * (args.k / kQuantGroup);
  const GemmARows<T, NT> a = gemm_a_rows_tile<T, NT, true>(perm, tile.begin, tile.rows, args.top_k,
                                                           args.m, args.lda, tid);
  const uint e = tile.expert;
  gemm_tensor_accumulate<4, 2, T, BN, NT>(op, acc0, acc1, smem, x, a, (device const uint*)wg + e * wstride,
                                          gs + e * gstride, gb + e * gstride, (device const uint*)wu + e * wstride,
                                          us + e * gstride, ub + e * gstride, n0, args.n, args.k, tid);
  for (uint i = tid; i < T * BN; i += NT) {
    const uint r = i / BN;
    const uint c = i % BN;
    if (r < tile.rows && n0 + c < args.n) {
      hx[(tile.begin + r) * args.ldy + n0 + c] = gemm_tensor_staged<2, T, BN>(smem, r, c);
    }
  }
}

template <uint T, uint BN, uint NSG>
[[max_total_threads_per_threadgroup(128)]] kernel void moe_gemm_down_q4_tensor(device const float4* hx [[buffer(0)]],       // fp32 [m * top_k, lda], slot order
                                    device const uint* perm [[buffer(1)]],       // [m * top_k]
                                    device const MoeTile* tiles [[buffer(2)]],   // [max_tiles]
                                    device const uint* tile_count [[buffer(3)]], // [1]
                                    device const uint4* wd [[buffer(4)]],        // down_proj.weight [E, n, k/8]
                                    device const bfloat* sd [[buffer(5)]],       // down_proj.scales [E, n, k/64]
                                    device const bfloat* bd [[buffer(6)]],       // down_proj.biases [E, n, k/64]
                                    device float* yx [[buffer(7)]],              // fp32 [m * top_k, ldy], by row * top_k + j
                                    constant MoeGemmArgs& args [[buffer(8)]],
                                    uint2 tgp [[threadgroup_position_in_grid]],
                                    uint tid [[thread_index_in_threadgroup]]) {
  constexpr uint NT = 32 * NSG;
  threadgroup float4 smem4[(GemmTensorSmem<T, BN, 1>::floats + 3) / 4];  // float4: the tiles are read as float4
  threadgroup float* smem = (threadgroup float*)smem4;
  const uint n0 = tgp.y * BN;
  if (tgp.x >= tile_count[0] || n0 >= args.n) {
    return;  // the whole threadgroup
  }
  constexpr auto desc = matmul2d_descriptor(T, BN, kGemmBK, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<NSG>> op;
  auto acc0 = op.template get_destination_cooperative_tensor<GemmTensorTile<T>, GemmTensorTile<BN>, float>();
  auto acc1 = op.template get_destination_cooperative_tensor<GemmTensorTile<T>, GemmTensorTile<BN>, float>();
  const GemmTensorTileInfo tile = gemm_tensor_tile_info(tiles, tgp.x, T, args);
  const uint wstride = args.n * (args.k / 8);
  const uint gstride = args.n * (args.k / kQuantGroup);
  const GemmARows<T, NT> a = gemm_a_rows_tile<T, NT, false>(perm, tile.begin, tile.rows,
                                                            args.top_k, args.m, args.lda, tid);
  const uint e = tile.expert;
  device const uint* w = (device const uint*)wd + e * wstride;
  gemm_tensor_accumulate<4, 1, T, BN, NT>(op, acc0, acc1, smem, hx, a, w, sd + e * gstride, bd + e * gstride, w,
                                          sd, bd, n0, args.n, args.k, tid);
  const uint slots = args.m * args.top_k;
  for (uint i = tid; i < T * BN; i += NT) {
    const uint r = i / BN;
    const uint c = i % BN;
    if (r < tile.rows && n0 + c < args.n) {
      const uint dst = perm[tile.begin + r];
      if (dst < slots) {  // a malformed perm entry writes nothing
        yx[dst * args.ldy + n0 + c] = gemm_tensor_staged<1, T, BN>(smem, r, c);
      }
    }
  }
}

// T = 16: 16 x 64 blocks, 2 simdgroups (64 threads); T = 32: 32 x 64 blocks, 4 simdgroups
// (128 threads); T = 64: 64 x 32 blocks, 4 simdgroups (128 threads): the blocks and
// threadgroup sizes of the simdgroup_matrix twins.
template [[host_name("moe_gemm_gate_up_q4_t16_tensor")]] [[kernel]] decltype(moe_gemm_gate_up_q4_tensor<16, 64, 2>) moe_gemm_gate_up_q4_tensor<16, 64, 2>;
template [[host_name("moe_gemm_gate_up_q4_t32_tensor")]] [[kernel]] decltype(moe_gemm_gate_up_q4_tensor<32, 64, 4>) moe_gemm_gate_up_q4_tensor<32, 64, 4>;
template [[host_name("moe_gemm_gate_up_q4_t64_tensor")]] [[kernel]] decltype(moe_gemm_gate_up_q4_tensor<64, 32, 4>) moe_gemm_gate_up_q4_tensor<64, 32, 4>;
template [[host_name("moe_gemm_down_q4_t16_tensor")]] [[kernel]] decltype(moe_gemm_down_q4_tensor<16, 64, 2>) moe_gemm_down_q4_tensor<16, 64, 2>;
template [[host_name("moe_gemm_down_q4_t32_tensor")]] [[kernel]] decltype(moe_gemm_down_q4_tensor<32, 64, 4>) moe_gemm_down_q4_tensor<32, 64, 4>;

// ---- start-up probe of the Metal backend -------------------------------------------------
// The Metal device builds this pipeline when it loads lily_tensor.metallib: the operation
// every kernel above uses (fp32 threadgroup tiles, transpose_right, multiply_accumulate into
// an fp32 cooperative tensor, stored to threadgroup memory). If the OS's tensor-op library
// lacks it, the tensor path is reported unavailable instead of failing at the first
// prefill. As a kernel: out[32, 64] = x[0:32, 0:32] x[0:64, 0:32]^T for x fp32 [64, 32];
// one threadgroup of 128 threads.
[[max_total_threads_per_threadgroup(128)]] kernel void tensor_ops_probe(device const float* x [[buffer(0)]],
                             device float* out [[buffer(1)]],
                             uint tid [[thread_index_in_threadgroup]]) {
  constexpr uint BM = 32, BN = 64;
  threadgroup float4 smem4[(GemmTensorSmem<BM, BN, 1>::floats + 3) / 4];  // float4: the tiles are read as float4
  threadgroup float* smem = (threadgroup float*)smem4;
  threadgroup float* As = smem;
  threadgroup float* Ws = smem + BM * kGemmLd;
  for (uint i = tid; i < (BM + BN) * kGemmBK; i += 128) {
    const uint r = i / kGemmBK, c = i % kGemmBK;
    (r < BM ? As + r * kGemmLd : Ws + (r - BM) * kGemmLd)[c] = x[(r < BM ? r : r - BM) * kGemmBK + c];
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
  threadgroup_barrier(mem_flags::mem_threadgroup);
  auto st = gemm_tensor_stage<BM, BN, 1>(smem, 0);
  acc.store(st);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < BM * BN; i += 128) {
    out[i] = smem[(i / BN) * GemmTensorSmem<BM, BN, 1>::ldc + i % BN];
  }
}
template [[host_name("moe_gemm_down_q4_t64_tensor")]] [[kernel]] decltype(moe_gemm_down_q4_tensor<64, 32, 4>) moe_gemm_down_q4_tensor<64, 32, 4>;
