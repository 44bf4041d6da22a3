// Grouped expert GEMMs of a prefill chunk, Metal 4 tensor-operation path for apple10-family
// GPUs (docs/prefill.md, "GEMM: Metal 4 tensor-operation path"): twins of the moe_gemm_*
// kernels of metal/moe_prefill.metal with identical bindings, argument structs, grids and
// outputs, on the k loop of gemm_tensor.h (half operands, fp32 accumulation), plus a 128-row
// tile height of their own (no twin):
//   moe_gemm_gate_up_q4_t{16,32,64,128}_tensor  hx[s] = silu(x[perm[s] / top_k] Wg_e^T) * (x[...] Wu_e^T)
//   moe_gemm_down_q4_t{16,32,64,128}_tensor     yx[perm[s]] = half(hx[s] Wd_e^T)  (saturated)
// MSL 4.0: built into lily_tensor.metallib.
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

#include "gemm_tensor.h"

// As moe_gemm_*_q4 (moe_prefill.metal), one dispatch per tile class: grid (max_tiles, ceil(n /
// BN)) threadgroups of 32 * NSG threads, max_tiles the class capacity; threadgroup (t, j)
// computes output columns [j BN, j BN + BN) of the slots of tile t; threadgroups with
// t >= tile_count return at once. BM = T, the class height; BANDED: gemm_tensor.h.
template <uint T, uint BN, uint NSG, bool BANDED>
[[max_total_threads_per_threadgroup(256)]] kernel void moe_gemm_gate_up_q4_tensor(device const half4* x [[buffer(0)]],         // half [m, lda] (xn)
                                       device const uint* perm [[buffer(1)]],        // [m * top_k] slot -> row * top_k + j
                                       device const MoeTile* tiles [[buffer(2)]],    // [max_tiles] the class's map
                                       device const uint* tile_count [[buffer(3)]],  // [1] the class's count
                                       device const uint4* wg [[buffer(4)]],         // gate_proj.weight [E, n, k/8]
                                       device const bfloat* gs [[buffer(5)]],        // gate_proj.scales [E, n, k/64]
                                       device const bfloat* gb [[buffer(6)]],        // gate_proj.biases [E, n, k/64]
                                       device const uint4* wu [[buffer(7)]],         // up_proj.weight [E, n, k/8]
                                       device const bfloat* us [[buffer(8)]],        // up_proj.scales
                                       device const bfloat* ub [[buffer(9)]],        // up_proj.biases
                                       device half* hx [[buffer(10)]],               // half [m * top_k, ldy], slot order (saturated)
                                       constant MoeGemmArgs& args [[buffer(11)]],
                                       uint2 tgp [[threadgroup_position_in_grid]],
                                       uint tid [[thread_index_in_threadgroup]],
                                       uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr uint NT = 32 * NSG;
  threadgroup float4 smem4[GemmTensorSmem<T, BN, 2>::float4s];
  const uint n0 = tgp.y * BN;
  if (tgp.x >= tile_count[0] || n0 >= args.n) {
    return;  // the whole threadgroup
  }
  const GemmTileInfo tile = gemm_tile_info(tiles, tgp.x, T, args);
  const uint wstride = args.n * (args.k / 8);  // uint32 per expert
  const uint gstride = args.n * (args.k / kQuantGroup);
  const GemmARows<T, NT> a = gemm_a_rows_tile<T, NT, true>(perm, tile.begin, tile.rows, args.top_k,
                                                           args.m, args.lda, tid);
  const uint e = tile.expert;
  const GemmRowSink<false, half> sink{hx + tile.begin * args.ldy + n0, args.ldy};
  gemm_tensor_gemm<4, 2, T, BN, NSG, BANDED>(smem4, x, a, (device const uint*)wg + e * wstride, gs + e * gstride,
                                             gb + e * gstride, (device const uint*)wu + e * wstride,
                                             us + e * gstride, ub + e * gstride, n0, args.n, args.k, tile.rows,
                                             tid, sg, sink);
}

// The down projection's sink: tile row r goes to yx row perm[r] (perm already at the tile's
// first slot, yx at column n0); a malformed perm entry writes nothing.
struct MoeDownSink {
  device half* yx;
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

template <uint T, uint BN, uint NSG, bool BANDED>
[[max_total_threads_per_threadgroup(256)]] kernel void moe_gemm_down_q4_tensor(device const half4* hx [[buffer(0)]],        // half [m * top_k, lda], slot order
                                    device const uint* perm [[buffer(1)]],       // [m * top_k]
                                    device const MoeTile* tiles [[buffer(2)]],   // [max_tiles] the class's map
                                    device const uint* tile_count [[buffer(3)]], // [1] the class's count
                                    device const uint4* wd [[buffer(4)]],        // down_proj.weight [E, n, k/8]
                                    device const bfloat* sd [[buffer(5)]],       // down_proj.scales [E, n, k/64]
                                    device const bfloat* bd [[buffer(6)]],       // down_proj.biases [E, n, k/64]
                                    device half* yx [[buffer(7)]],               // half [m * top_k, ldy], by row * top_k + j (saturated)
                                    constant MoeGemmArgs& args [[buffer(8)]],
                                    uint2 tgp [[threadgroup_position_in_grid]],
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr uint NT = 32 * NSG;
  threadgroup float4 smem4[GemmTensorSmem<T, BN, 1>::float4s];
  const uint n0 = tgp.y * BN;
  if (tgp.x >= tile_count[0] || n0 >= args.n) {
    return;  // the whole threadgroup
  }
  const GemmTileInfo tile = gemm_tile_info(tiles, tgp.x, T, args);
  const uint wstride = args.n * (args.k / 8);
  const uint gstride = args.n * (args.k / kQuantGroup);
  const GemmARows<T, NT> a = gemm_a_rows_tile<T, NT, false>(perm, tile.begin, tile.rows,
                                                            args.top_k, args.m, args.lda, tid);
  const uint e = tile.expert;
  device const uint* w = (device const uint*)wd + e * wstride;
  const MoeDownSink sink{yx + n0, perm + tile.begin, args.m * args.top_k, args.ldy};
  gemm_tensor_gemm<4, 1, T, BN, NSG, BANDED>(smem4, hx, a, w, sd + e * gstride, bd + e * gstride, w, sd, bd, n0,
                                             args.n, args.k, tile.rows, tid, sg, sink);
}

// The blocks and threadgroup sizes of the simdgroup_matrix twins: T = 16: 16 x 64, 2
// simdgroups (64 threads); T = 32: 32 x 64, 4 simdgroups; T = 64: gate/up 64 x 32 of gate and
// of up, down 64 x 64, 4 simdgroups (128 threads); one tensor operation per weight tile for the
// whole threadgroup. T = 128 (this path only, no simdgroup_matrix twin): gate/up 128 x 32,
// down 128 x 64, 8 simdgroups (256 threads) on 16-row bands each, so a partial tile computes
// its live bands only (the tile classes of T = 128: prefill_args.h).
template [[host_name("moe_gemm_gate_up_q4_t16_tensor")]] [[kernel]] decltype(moe_gemm_gate_up_q4_tensor<16, 64, 2, false>) moe_gemm_gate_up_q4_tensor<16, 64, 2, false>;
template [[host_name("moe_gemm_gate_up_q4_t32_tensor")]] [[kernel]] decltype(moe_gemm_gate_up_q4_tensor<32, 64, 4, false>) moe_gemm_gate_up_q4_tensor<32, 64, 4, false>;
template [[host_name("moe_gemm_gate_up_q4_t64_tensor")]] [[kernel]] decltype(moe_gemm_gate_up_q4_tensor<64, 32, 4, false>) moe_gemm_gate_up_q4_tensor<64, 32, 4, false>;
template [[host_name("moe_gemm_gate_up_q4_t128_tensor")]] [[kernel]] decltype(moe_gemm_gate_up_q4_tensor<128, 32, 8, true>) moe_gemm_gate_up_q4_tensor<128, 32, 8, true>;
template [[host_name("moe_gemm_down_q4_t16_tensor")]] [[kernel]] decltype(moe_gemm_down_q4_tensor<16, 64, 2, false>) moe_gemm_down_q4_tensor<16, 64, 2, false>;
template [[host_name("moe_gemm_down_q4_t32_tensor")]] [[kernel]] decltype(moe_gemm_down_q4_tensor<32, 64, 4, false>) moe_gemm_down_q4_tensor<32, 64, 4, false>;
template [[host_name("moe_gemm_down_q4_t64_tensor")]] [[kernel]] decltype(moe_gemm_down_q4_tensor<64, 64, 4, false>) moe_gemm_down_q4_tensor<64, 64, 4, false>;
template [[host_name("moe_gemm_down_q4_t128_tensor")]] [[kernel]] decltype(moe_gemm_down_q4_tensor<128, 64, 8, true>) moe_gemm_down_q4_tensor<128, 64, 8, true>;
