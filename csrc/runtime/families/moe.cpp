#include "runtime/families/moe.h"

#include <algorithm>
#include <cmath>

#include "runtime/cost.h"
#include "runtime/encoder.h"
#include "runtime/runtime.h"

namespace lily::runtime {

namespace args = lily::kernels;

namespace {

// Bytes of a 4-bit [rows, cols] matrix: weights, then bf16 scales and biases per kQuantGroup
// columns.
uint64_t q4_bytes(uint64_t rows, uint64_t cols) {
  return rows * args::q4_row_bytes(uint32_t(cols));
}

// Bytes one GEMV pass over the picked experts of `n` rows and the shared expert reads (the
// declared ranges cover whole stacks): one row's k experts, or the union expected for several.
uint64_t expert_bytes(const MoeShape& s, uint32_t n) {
  const uint64_t expert = q4_bytes(s.inter, s.hidden), shared = q4_bytes(s.inter_shared, s.hidden);
  const uint64_t routed =
      n > 1 ? uint64_t(std::llround(expected_experts(n, s.top_k, s.experts) * double(expert)))
            : uint64_t(s.top_k) * expert;
  return routed + shared;
}

// Bytes from row 0 to the end of row n - 1's `bytes` with rows `stride` floats apart.
size_t span(uint32_t n, uint32_t stride, size_t bytes) {
  return size_t(n - 1) * stride * sizeof(float) + bytes;
}

}  // namespace

void encode_moe_route_gate_up(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                              const MoeBlock& w, const MoeBuffers& io, const MoeShape& s,
                              const args::MoeBatchArgs& b, bool batched, uint32_t threads, Traffic* traffic) {
  const size_t f = sizeof(float), n = batched ? b.rows : 1;
  const uint32_t per_group = args::kGateUpRowsPerSimdgroup * threads / 32;
  Op op(kernel, label);
  const uint32_t groups = ceil_div(std::max(s.inter, s.inter_shared), per_group);
  op.groups({groups, uint32_t(n * s.top_k + 1), 1}, {threads, 1, 1})
      .in(0, io.xn, 0, span(n, b.x_stride, s.hidden * f))
      .in(1, io.logits, 0, span(n, b.logits_stride, (s.experts + 1) * f))
      .in(2, w.experts_gate_proj)
      .in(5, w.experts_up_proj)
      .in(8, w.shared_gate_proj)
      .in(11, w.shared_up_proj)
      .out(14, io.h, 0, span(n, b.h_stride, s.hidden_floats() * f))
      .out(15, io.ids, 0, span(n, b.ids_stride, s.top_k * sizeof(uint32_t)))
      .out(16, io.weights, 0, span(n, b.w_stride, (s.top_k + 1) * f))
      .args(17,
            args::MoeRouteArgs{s.hidden, s.inter, s.inter_shared, s.experts, s.top_k, s.norm_topk ? 1u : 0u});
  if (batched) op.args(18, b);
  op.run(pass);
  if (traffic) traffic->weight_bytes += 2 * expert_bytes(s, n);  // gate and up
}

void encode_moe_down(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                     const MoeBlock& w, const MoeBuffers& io, const MoeShape& s, const args::MoeBatchArgs& b,
                     bool batched, uint32_t threads, Traffic* traffic) {
  const size_t f = sizeof(float), n = batched ? b.rows : 1;
  const uint32_t per_group = args::kGemvRowsPerSimdgroup * threads / 32 / args::kGemvSplitK;
  Op op(kernel, label);
  op.groups({ceil_div(s.hidden, per_group), 1, 1}, {threads, 1, 1})
      .in(0, io.h, 0, span(n, b.h_stride, s.hidden_floats() * f))
      .in(1, io.ids, 0, span(n, b.ids_stride, s.top_k * sizeof(uint32_t)))
      .in(2, io.weights, 0, span(n, b.w_stride, (s.top_k + 1) * f))
      .in(3, w.experts_down_proj)
      .in(6, w.shared_down_proj)
      .inout(9, io.residual, 0, span(n, b.x_stride, s.hidden * f))
      .args(10, args::MoeArgs{s.hidden, s.inter, s.inter_shared, s.experts, s.top_k});
  if (batched) op.args(11, b);
  op.run(pass);
  if (traffic) traffic->weight_bytes += expert_bytes(s, n);
}

}  // namespace lily::runtime
