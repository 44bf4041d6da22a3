#include "runtime/families/moe_prefill.h"

#include <algorithm>

#include "runtime/encoder.h"

namespace lily::runtime {

namespace args = lily::kernels;

MoeGeometry moe_geometry(uint32_t T, bool tensor) {
  if (tensor) {
    const uint32_t threads = T == 128 ? 256 : T == 16 ? 64 : 128;
    return {threads, 32, threads, 64};
  }
  if (T == 64) return {128, 32, 128, 64};
  const uint32_t threads = T == 32 ? 128 : 64;
  return {threads, 64, threads, 64};
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

}  // namespace lily::runtime
