// Grouped expert GEMMs of a prefill chunk, Metal 4 tensor-operation path for apple10-family
// GPUs (docs/prefill.md, "GEMM: Metal 4 tensor-operation path"): twins of the moe_gemm_*
// kernels of metal/moe_prefill.metal with identical bindings, argument structs, grids and
// outputs, on the k loop of gemm_tensor.h (MLX qmm_t_nax's structure: the dequantized weight
// tile alone in threadgroup memory, each thread's A elements gathered from device memory
// straight into registers, bfloat operands, fp32 accumulation), plus a 128-row tile height
// of their own (no twin):
//   moe_gemm_gate_up_q4_t{16,32,64,128}_tensor  hx[s] = silu(x[perm[s] / top_k] Wg_e^T) * (x[...] Wu_e^T)
//   moe_gemm_down_q4_t{16,32,64,128}_tensor     yx[perm[s]] = bfloat(hx[s] Wd_e^T)
// MSL 4.0: built into lily_tensor.metallib.
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

#include "gemm_tensor.h"

// As moe_gemm_*_q4 (moe_prefill.metal), one dispatch per tile class: grid (max_tiles, ceil(n /
// BN)) threadgroups of 32 SM SN threads, max_tiles the class capacity; threadgroup (t, j)
// computes output columns [j BN, j BN + BN) of the slots of tile t; threadgroups with
// t >= tile_count return at once. BM = T, the class height.
template <uint T>
[[max_total_threads_per_threadgroup(kMoeGemmTensorMaxThreads)]] kernel void moe_gemm_gate_up_q4_tensor(device const bfloat* x [[buffer(0)]],        // bfloat [m, lda] (xn)
                                       device const uint* perm [[buffer(1)]],        // [m * top_k] slot -> row * top_k + j
                                       device const MoeTile* tiles [[buffer(2)]],    // [max_tiles] the class's map
                                       device const uint* tile_count [[buffer(3)]],  // [1] the class's count
                                       device const uint4* wg [[buffer(4)]],         // gate_proj.weight [E, n, k/8]
                                       device const bfloat* gs [[buffer(5)]],        // gate_proj.scales [E, n, k/64]
                                       device const bfloat* gb [[buffer(6)]],        // gate_proj.biases [E, n, k/64]
                                       device const uint4* wu [[buffer(7)]],         // up_proj.weight [E, n, k/8]
                                       device const bfloat* us [[buffer(8)]],        // up_proj.scales
                                       device const bfloat* ub [[buffer(9)]],        // up_proj.biases
                                       device bfloat* hx [[buffer(10)]],             // bfloat [m * top_k, ldy], slot order
                                       constant MoeGemmArgs& args [[buffer(11)]],
                                       uint2 tgp [[threadgroup_position_in_grid]],
                                       uint tid [[thread_index_in_threadgroup]],
                                       uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr uint BN = moe_gemm_bn(T, true, 2), SM = moe_gemm_sm(T, true, 2), SN = moe_gemm_sn(T, true, 2);
  static_assert(moe_gemm_threads(T, true, 2) <= kMoeGemmTensorMaxThreads, "the kernel's declared maximum");
  threadgroup float4 smem4[GemmTensorSmem<BN, 2>::float4s];
  const uint n0 = tgp.y * BN;
  if (tgp.x >= tile_count[0] || n0 >= args.n) {
    return;  // the whole threadgroup
  }
  const GemmTileInfo tile = gemm_tile_info(tiles, tgp.x, T, args);
  const uint wstride = args.n * (args.k / 8);  // uint32 per expert
  const uint gstride = args.n * (args.k / kQuantGroup);
  const uint e = tile.expert;
  const GemmRowSink<false, bfloat> sink{hx + tile.begin * args.ldy + n0, args.ldy};
  gemm_tensor_gemm<4, 2, T, BN, SM, SN>(
      (threadgroup bfloat*)smem4, x, GemmTileRows<true>{perm, tile.begin, tile.rows, args.top_k, args.m, args.lda},
      (device const uint*)wg + e * wstride, gs + e * gstride, gb + e * gstride, (device const uint*)wu + e * wstride,
      us + e * gstride, ub + e * gstride, n0, args.n, args.k, tile.rows, tid, sg, sink);
}

// The down projection's sink: tile row r goes to yx row perm[r] (perm already at the tile's
// first slot, yx at column n0); a malformed perm entry writes nothing.
struct MoeDownSink {
  device bfloat* yx;
  device const uint* perm;
  uint slots;
  uint ldy;
  void put(uint r, uint c, float v) const {
    const uint dst = perm[r];
    if (dst < slots) {
      gemm_put(yx + dst * ldy + c, v, false);
    }
  }
};

template <uint T>
[[max_total_threads_per_threadgroup(kMoeGemmTensorMaxThreads)]] kernel void moe_gemm_down_q4_tensor(device const bfloat* hx [[buffer(0)]],       // bfloat [m * top_k, lda], slot order
                                    device const uint* perm [[buffer(1)]],       // [m * top_k]
                                    device const MoeTile* tiles [[buffer(2)]],   // [max_tiles] the class's map
                                    device const uint* tile_count [[buffer(3)]], // [1] the class's count
                                    device const uint4* wd [[buffer(4)]],        // down_proj.weight [E, n, k/8]
                                    device const bfloat* sd [[buffer(5)]],       // down_proj.scales [E, n, k/64]
                                    device const bfloat* bd [[buffer(6)]],       // down_proj.biases [E, n, k/64]
                                    device bfloat* yx [[buffer(7)]],             // bfloat [m * top_k, ldy], by row * top_k + j
                                    constant MoeGemmArgs& args [[buffer(8)]],
                                    uint2 tgp [[threadgroup_position_in_grid]],
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr uint BN = moe_gemm_bn(T, true, 1), SM = moe_gemm_sm(T, true, 1), SN = moe_gemm_sn(T, true, 1);
  static_assert(moe_gemm_threads(T, true, 1) <= kMoeGemmTensorMaxThreads, "the kernel's declared maximum");
  threadgroup float4 smem4[GemmTensorSmem<BN, 1>::float4s];
  const uint n0 = tgp.y * BN;
  if (tgp.x >= tile_count[0] || n0 >= args.n) {
    return;  // the whole threadgroup
  }
  const GemmTileInfo tile = gemm_tile_info(tiles, tgp.x, T, args);
  const uint wstride = args.n * (args.k / 8);
  const uint gstride = args.n * (args.k / kQuantGroup);
  const uint e = tile.expert;
  device const uint* w = (device const uint*)wd + e * wstride;
  const MoeDownSink sink{yx + n0, perm + tile.begin, args.m * args.top_k, args.ldy};
  gemm_tensor_gemm<4, 1, T, BN, SM, SN>(
      (threadgroup bfloat*)smem4, hx, GemmTileRows<false>{perm, tile.begin, tile.rows, args.top_k, args.m, args.lda},
      w, sd + e * gstride, bd + e * gstride, w, sd, bd, n0, args.n, args.k, tile.rows, tid, sg, sink);
}

// Per tile height the simdgroups SM x SN and output columns BN of moe_gemm_sm / _sn / _bn
// (prefill_args.h, shared with the host's moe_geometry): blocks of moe_gemm_band rows per
// simdgroup (a simdgroup whose rows lie past the tile's runs no tensor operation), 32 x 16
// (gate/up) or 32 x 32 (down, qmm_t_nax's) per simdgroup from T = 64 on, and one weight tile
// of 64 rows (gate/up: 32 of gate and 32 of up) in threadgroup memory, 9 KiB, at every T.
// T = 128 runs on this path only (no simdgroup_matrix twin; its tile classes: prefill_args.h):
// each expert's weight tile serves 128 rows.
template [[host_name("moe_gemm_gate_up_q4_t16_tensor")]] [[kernel]] decltype(moe_gemm_gate_up_q4_tensor<16>) moe_gemm_gate_up_q4_tensor<16>;
template [[host_name("moe_gemm_gate_up_q4_t32_tensor")]] [[kernel]] decltype(moe_gemm_gate_up_q4_tensor<32>) moe_gemm_gate_up_q4_tensor<32>;
template [[host_name("moe_gemm_gate_up_q4_t64_tensor")]] [[kernel]] decltype(moe_gemm_gate_up_q4_tensor<64>) moe_gemm_gate_up_q4_tensor<64>;
template [[host_name("moe_gemm_gate_up_q4_t128_tensor")]] [[kernel]] decltype(moe_gemm_gate_up_q4_tensor<128>) moe_gemm_gate_up_q4_tensor<128>;
template [[host_name("moe_gemm_down_q4_t16_tensor")]] [[kernel]] decltype(moe_gemm_down_q4_tensor<16>) moe_gemm_down_q4_tensor<16>;
template [[host_name("moe_gemm_down_q4_t32_tensor")]] [[kernel]] decltype(moe_gemm_down_q4_tensor<32>) moe_gemm_down_q4_tensor<32>;
template [[host_name("moe_gemm_down_q4_t64_tensor")]] [[kernel]] decltype(moe_gemm_down_q4_tensor<64>) moe_gemm_down_q4_tensor<64>;
template [[host_name("moe_gemm_down_q4_t128_tensor")]] [[kernel]] decltype(moe_gemm_down_q4_tensor<128>) moe_gemm_down_q4_tensor<128>;
