// Dispatch builders of the prefill chunk's MoE (metal/moe_prefill.metal,
// moe_prefill_tensor.metal; docs/prefill.md): the routing (moe_route_clear, moe_route_topk,
// moe_route_scatter), the grouped expert GEMMs moe_gemm_gate_up_q4_t<T>[_tensor] and
// moe_gemm_down_q4_t<T>[_tensor] over the tiles of one tile class, with their geometry, and the
// combine (moe_combine, moe_combine_norm). The prefill plan (prefill.cpp) encodes with them and
// lily._core binds them (encode_moe_route_*, moe_geometry, encode_moe_gemm, encode_moe_combine),
// so the kernel tests and lily doctor dispatch exactly what the runtime does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gpu/device.h"
#include "runtime/kernel_args.h"
#include "runtime/model.h"

namespace lily::runtime {

// Threads and output columns per threadgroup of gate/up and of down for tile height T on a
// path (tensor: moe_prefill_tensor.metal, else moe_prefill.metal): the kernels' own geometry,
// moe_gemm_threads / moe_gemm_bn of metal/prefill_args.h.
struct MoeGeometry {
  uint32_t gate_up_threads, gate_up_bn, down_threads, down_bn;
};
MoeGeometry moe_geometry(uint32_t T, bool tensor);

// Threads per threadgroup of moe_route_topk and moe_route_scatter for E experts: one per
// expert, rounded up to whole simdgroups (at most kMoeRouteMaxThreads).
uint32_t moe_route_threads(uint32_t experts);

// Entries of the tile maps of all tile classes of a height-T tiling of `assignments` (rows *
// top_k) over `experts` (prefill_args.h).
uint32_t moe_map_entries(uint32_t assignments, uint32_t experts, uint32_t T);

// moe_route_clear: zeroes the per-block expert histogram block_counts (uint32 [ceil(rows /
// block_rows), experts]), one thread each, threadgroups of kMoeRouteClearThreads.
void encode_moe_route_clear(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                            gpu::Buffer& block_counts, const lily::kernels::MoeRoutePrefillArgs& args);
// moe_route_topk: one threadgroup of `threads` (0: moe_route_threads) per row reads the router
// logits (fp32 [rows, experts + 1], the last column the shared expert gate) and writes ids
// (uint32 [rows, top_k]), w (fp32 [rows, top_k + 1]) and adds into block_counts.
void encode_moe_route_topk(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                           gpu::Buffer& logits, gpu::Buffer& ids, gpu::Buffer& w, gpu::Buffer& block_counts,
                           const lily::kernels::MoeRoutePrefillArgs& args, uint32_t threads = 0);
// moe_route_scatter: one threadgroup of `threads` (0: moe_route_threads) per histogram block
// reads ids and block_counts, writes the grouped order perm (uint32 [rows * top_k]), the tile
// maps (moe_map_entries MoeTile entries), their counts (uint32 per tile class) and the
// per-expert counts hist (uint32 [experts]).
void encode_moe_route_scatter(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                              gpu::Buffer& ids, gpu::Buffer& block_counts, gpu::Buffer& perm,
                              gpu::Buffer& tiles, gpu::Buffer& tile_count, gpu::Buffer& hist,
                              const lily::kernels::MoeRoutePrefillArgs& args, uint32_t threads = 0);

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

// moe_combine (without `norm`): h (fp32 [rows, hidden]) += the routed outputs yx (bfloat
// [rows * top_k, hidden]) weighted by w (fp32 [rows, top_k + 1]); grid (hidden / 4, rows) of
// `threads` (0: kMoeCombineThreads) threads. moe_combine_norm (with `norm`: the next layer's
// input norm weight, bf16 [hidden]) also writes xn = RMSNorm(h) * norm (bfloat [rows, hidden]);
// one threadgroup of `threads` (0: kNormThreads) per row. The norm's bytes are added to
// `weight_bytes` when given.
void encode_moe_combine(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                        gpu::Buffer& h, gpu::Buffer& yx, gpu::Buffer& w,
                        const lily::kernels::MoeCombineArgs& args, const TensorRef* norm = nullptr,
                        gpu::Buffer* xn = nullptr, float eps = 0, uint32_t threads = 0,
                        uint64_t* weight_bytes = nullptr);

}  // namespace lily::runtime
