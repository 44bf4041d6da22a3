// Dispatch builders of the prefill chunk's grouped expert GEMMs (metal/moe_prefill.metal,
// moe_prefill_tensor.metal; docs/prefill.md): moe_gemm_gate_up_q4_t<T>[_tensor] and
// moe_gemm_down_q4_t<T>[_tensor] over the tiles of one tile class, with their geometry. The
// prefill plan (prefill.cpp) encodes with them and lily._core binds them (moe_geometry,
// encode_moe_gemm), so the kernel tests and lily doctor dispatch exactly what the runtime does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gpu/device.h"
#include "runtime/kernel_args.h"
#include "runtime/model.h"

namespace lily::runtime {

// Threads and output columns per threadgroup of gate/up and of down for tile height T.
// simdgroup_matrix path (moe_prefill.metal): T = 16 and 32 64 columns of 64 / 128 threads;
// T = 64 gate/up 64 x 32 blocks, so that its two staged fp32 result blocks fit 32 KiB of
// threadgroup memory, down 64 x 64. Tensor-op path (moe_prefill_tensor.metal): 32 columns of
// gate and of up, 64 of down, on 64 (T = 16), 128 or 256 (T = 128, this path only) threads:
// one 9 KiB weight tile at every T.
struct MoeGeometry {
  uint32_t gate_up_threads, gate_up_bn, down_threads, down_bn;
};
MoeGeometry moe_geometry(uint32_t T, bool tensor);

// A grouped GEMM's buffers: x (bfloat rows of args.lda: the chunk's xn for gate/up, hx for
// down), the grouped order perm (uint32 [m * top_k]), the tile map (MoeTile entries from
// `tiles_at`) and its count (uint32 at `count_at`), and y (bfloat rows of args.ldy: hx or yx),
// each bound from offset 0 but the map and count.
struct MoeGemmBuffers {
  gpu::Buffer &x, &perm, &tiles, &tile_count, &y;
  size_t tiles_at = 0, count_at = 0;
};

// `kernel` (moe_gemm_gate_up_q4_t<T>* with `up`, else moe_gemm_down_q4_t<T>* with gate = the
// down stack) over `tiles` map entries: grid (tiles, ceil(args.n / columns)) of the geometry's
// threads; y declared written with the disjoint tag `disjoint` (the tile classes of one
// projection share a stage). With `weight_bytes`, adds the bytes of the experts the chunk's
// m * top_k assignments can reach (each stack's share of min(experts, m * top_k) experts).
void encode_moe_gemm(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                     const MoeGeometry& geometry, const QuantLinear& gate, const QuantLinear* up,
                     const MoeGemmBuffers& io, const lily::kernels::MoeGemmArgs& args, uint32_t tiles,
                     uint32_t disjoint, uint64_t* weight_bytes = nullptr);

}  // namespace lily::runtime
