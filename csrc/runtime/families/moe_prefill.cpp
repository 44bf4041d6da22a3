#include "runtime/families/moe_prefill.h"

#include <algorithm>

#include "runtime/encoder.h"
#include "runtime/families/norm.h"

namespace lily::runtime {

namespace args = lily::kernels;

MoeGeometry moe_geometry(uint32_t T, bool tensor) {
  return {args::moe_gemm_threads(T, tensor, 2), args::moe_gemm_bn(T, tensor, 2),  // gate/up
          args::moe_gemm_threads(T, tensor, 1), args::moe_gemm_bn(T, tensor, 1)};  // down
}

void encode_moe_gemm(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                     const MoeGeometry& g, const QuantLinear& gate, const QuantLinear* up,
                     const MoeGemmBuffers& io, const args::MoeGemmArgs& a, uint32_t tiles, uint32_t disjoint,
                     uint64_t* weight_bytes) {
  const size_t bf = 2, u32 = sizeof(uint32_t), slots = size_t(a.m) * a.top_k;
  const bool gate_up = up != nullptr;
  const size_t x_rows = gate_up ? a.m : slots;  // gate/up reads the chunk's rows, down the slots
  Op op(kernel, label);
  op.groups({tiles, ceil_div(a.n, gate_up ? g.gate_up_bn : g.down_bn), 1},
            {gate_up ? g.gate_up_threads : g.down_threads, 1, 1})
      .in(0, io.x, 0, ((x_rows - 1) * a.lda + a.k) * bf)
      .in(1, io.perm, 0, slots * u32)
      .in(2, io.tiles, io.tiles_at, size_t(tiles) * sizeof(args::MoeTile))
      .in(3, io.tile_count, io.count_at, u32);
  // the bytes of the experts the assignments can reach, of each whole stack declared read
  auto stack = [&](uint32_t i, const QuantLinear& w) {
    uint64_t bytes = 0;
    op.in(i, w, &bytes);
    if (weight_bytes) *weight_bytes += bytes / a.experts * std::min<uint64_t>(a.experts, slots);
  };
  stack(4, gate);
  if (gate_up) stack(7, *up);
  const uint32_t y = gate_up ? 10 : 7;
  op.out_disjoint(y, io.y, 0, ((slots - 1) * a.ldy + a.n) * bf, disjoint).args(y + 1, a).run(pass);
}

uint32_t moe_route_threads(uint32_t experts) {
  return std::min<uint32_t>(args::kMoeRouteMaxThreads, ceil_div(experts, 32) * 32);
}

uint32_t moe_map_entries(uint32_t assignments, uint32_t experts, uint32_t T) {
  return args::moe_class_base(assignments, experts, T, args::moe_tile_classes(T));
}

namespace {
size_t block_count_bytes(const args::MoeRoutePrefillArgs& a) {
  return size_t(ceil_div(a.rows, a.block_rows)) * a.experts * sizeof(uint32_t);
}
}  // namespace

void encode_moe_route_clear(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                            gpu::Buffer& block_counts, const args::MoeRoutePrefillArgs& a) {
  Op(kernel, label)
      .threads({ceil_div(a.rows, a.block_rows) * a.experts, 1, 1}, {args::kMoeRouteClearThreads, 1, 1})
      .out(0, block_counts, 0, block_count_bytes(a))
      .args(1, a)
      .run(pass);
}

void encode_moe_route_topk(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                           gpu::Buffer& logits, gpu::Buffer& ids, gpu::Buffer& w, gpu::Buffer& block_counts,
                           const args::MoeRoutePrefillArgs& a, uint32_t threads) {
  const size_t M = a.rows, f = sizeof(float), u32 = sizeof(uint32_t);
  Op(kernel, label)
      .groups({a.rows, 1, 1}, {threads ? threads : moe_route_threads(a.experts), 1, 1})
      .in(0, logits, 0, M * (a.experts + 1) * f)
      .out(1, ids, 0, M * a.top_k * u32)
      .out(2, w, 0, M * (a.top_k + 1) * f)
      .inout(3, block_counts, 0, block_count_bytes(a))
      .args(4, a)
      .run(pass);
}

void encode_moe_route_scatter(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                              gpu::Buffer& ids, gpu::Buffer& block_counts, gpu::Buffer& perm,
                              gpu::Buffer& tiles, gpu::Buffer& tile_count, gpu::Buffer& hist,
                              const args::MoeRoutePrefillArgs& a, uint32_t threads) {
  const size_t slots = size_t(a.rows) * a.top_k, u32 = sizeof(uint32_t);
  const size_t map_bytes =
      size_t(moe_map_entries(a.rows * a.top_k, a.experts, a.tile_rows)) * sizeof(args::MoeTile);
  Op(kernel, label)
      .groups({ceil_div(a.rows, a.block_rows), 1, 1}, {threads ? threads : moe_route_threads(a.experts), 1, 1})
      .in(0, ids, 0, slots * u32)
      .in(1, block_counts, 0, block_count_bytes(a))
      .out(2, perm, 0, slots * u32)
      .out(3, tiles, 0, map_bytes)
      .out(4, tile_count, 0, args::moe_tile_classes(a.tile_rows) * u32)
      .out(5, hist, 0, a.experts * u32)
      .args(6, a)
      .run(pass);
}

void encode_moe_combine(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                        gpu::Buffer& h, gpu::Buffer& yx, gpu::Buffer& w, const args::MoeCombineArgs& a,
                        const TensorRef* norm, gpu::Buffer* xn, float eps, uint32_t threads,
                        uint64_t* weight_bytes) {
  const size_t M = a.rows, H = a.hidden, f = sizeof(float), bf = 2;
  Op op(kernel, label);
  if (!norm) op.threads({a.hidden / 4, a.rows, 1}, {threads ? threads : args::kMoeCombineThreads, 1, 1});
  else op.groups({a.rows, 1, 1}, {threads ? threads : kNormThreads, 1, 1});
  op.inout(0, h, 0, M * H * f).in(1, yx, 0, M * a.top_k * H * bf).in(2, w, 0, M * (a.top_k + 1) * f).args(3, a);
  if (norm) op.in(4, *norm, weight_bytes).out(5, *xn, 0, M * H * bf).args(6, args::NormArgs{a.hidden, eps});
  op.run(pass);
}

}  // namespace lily::runtime
