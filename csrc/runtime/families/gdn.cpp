#include "runtime/families/gdn.h"

#include "runtime/encoder.h"
#include "runtime/kernel_args.h"
#include "runtime/runtime.h"

namespace lily::runtime {

namespace args = lily::kernels;

namespace {
// The q/k L2 norm's epsilon (the model's; docs/model.md "Gated DeltaNet").
// The step's grid: `splits` threadgroups per value head of 4 state rows per simdgroup.
gpu::Size3 step_grid(const GdnShape& s, uint32_t splits) { return {s.Hv, splits, 1}; }
gpu::Size3 step_threads(const GdnShape& s, uint32_t splits) { return {s.Dv / splits * 8, 1, 1}; }
}  // namespace

size_t GdnShape::ring_entry_bytes() const {
  return size_t(args::gdn_ring(Hk, Hv, Dk, Dv).entry) * sizeof(float);
}

void encode_gdn_decode_step(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                            const GdnShape& s, const DeltaNetLayer& w, const GdnStepBuffers& io,
                            uint32_t splits, uint32_t pending, bool write_back, Traffic* traffic) {
  Traffic local;
  Traffic& t = traffic ? *traffic : local;
  const size_t f = sizeof(float), C = s.conv_dim();
  const size_t conv_bytes = size_t(s.K - 1) * C * f, state_bytes = s.state_bytes();
  const size_t ssq_bytes = size_t(s.Hv) * splits * f, entry_bytes = s.ring_entry_bytes();
  Op op(kernel, label);
  op.groups(step_grid(s, splits), step_threads(s, splits))
      .in(0, io.qkv, io.qkv_at, C * f)
      .in(1, io.b, io.b_at, s.Hv * f)
      .in(2, io.a, io.a_at, s.Hv * f)
      .in(3, *w.conv1d, &t.weight_bytes)
      .in(4, *w.A_log, &t.weight_bytes)
      .in(5, *w.dt_bias, &t.weight_bytes)
      .in(6, io.conv_in, 0, conv_bytes)
      .out(7, io.conv_out, 0, conv_bytes)
      .out(9, io.y, io.y_at, size_t(s.Hv) * s.Dv * f)
      .out(10, io.ssq, io.ssq_at, ssq_bytes)
      .args(11, args::GdnDecodeArgs{s.Hk, s.Hv, s.K, args::kGdnL2Eps, pending, write_back ? 1u : 0u})
      .bind(12, io.ring);
  // the state read, the ring's pending entries replayed; then either the state written back
  // or this step's entry appended (metal/gdn.metal, "Write-back window")
  if (write_back) op.inout(8, io.state, 0, state_bytes);
  else op.in(8, io.state, 0, state_bytes).write(io.ring, pending * entry_bytes, entry_bytes);
  if (pending) op.read(io.ring, 0, pending * entry_bytes);
  op.run(pass);
  t.state_bytes +=
      2 * conv_bytes + state_bytes + (write_back ? state_bytes : entry_bytes) + pending * entry_bytes;
  t.other_bytes += 2 * ssq_bytes;  // written, then read by out_proj
}

void encode_gdn_state_writeback(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                                const GdnShape& s, gpu::Buffer& state, gpu::Buffer& ring, uint32_t splits,
                                uint32_t pending) {
  Op(kernel, label)
      .groups(step_grid(s, splits), step_threads(s, splits))
      .inout(0, state, 0, s.state_bytes())
      .in(1, ring, 0, pending * s.ring_entry_bytes())
      .args(2, args::GdnDecodeArgs{s.Hk, s.Hv, s.K, args::kGdnL2Eps, pending, 1})
      .run(pass);
}

}  // namespace lily::runtime
