#include "runtime/families/gdn_prefill.h"

#include <algorithm>

#include "runtime/encoder.h"
#include "runtime/kernel_args.h"
#include "runtime/runtime.h"

namespace lily::runtime {

namespace args = lily::kernels;

namespace {
constexpr size_t kValueBytes = 2;  // u and z (bfloat), the norm factors (half): 2 bytes each
}  // namespace

void encode_gdn_scan(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                     const GdnShape& s, const DeltaNetLayer& w, const GdnScanBuffers& io, uint32_t M,
                     uint32_t rv, float norm_eps, Traffic* traffic) {
  Traffic local;
  Traffic& t = traffic ? *traffic : local;
  const size_t f = sizeof(float), C = s.conv_dim(), values = size_t(M) * s.Hv * s.Dv;
  const size_t conv_bytes = size_t(s.K - 1) * C * f;
  // conv inline; each head split into Dv / rv threadgroups of rv state rows; y leaves as u and
  // the splits' sums of y^2 (docs/prefill.md)
  Op(kernel, label)
      .groups({s.Hv, s.Dv / rv, 1}, {rv * args::kGdnScanLanesPerRow, 1, 1})
      .in(0, io.qkv, 0, M * C * f)
      .in(1, *w.conv1d, &t.weight_bytes)
      .in(2, io.conv_in, 0, conv_bytes)
      .in(3, io.b, 0, size_t(M) * s.Hv * f)
      .in(4, io.a, 0, size_t(M) * s.Hv * f)
      .in(5, *w.A_log, &t.weight_bytes)
      .in(6, *w.dt_bias, &t.weight_bytes)
      .inout(7, io.state, 0, s.state_bytes())
      .out(8, io.u, 0, values * kValueBytes)
      .args(9, args::GdnScanArgs{s.Hk, s.Hv, M, norm_eps, args::kGdnL2Eps})
      .in(10, io.z, 0, values * kValueBytes)
      .in(11, *w.norm, &t.weight_bytes)
      .out(12, io.ss, 0, size_t(M) * s.Hv * (s.Dv / rv) * f)
      .run(pass);
  t.state_bytes += conv_bytes + 2 * s.state_bytes();  // the conv state read, the state read and written
}

void encode_gdn_norm_scale(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                           const GdnShape& s, gpu::Buffer& ss, gpu::Buffer& f_out, uint32_t M, uint32_t rv,
                           float norm_eps, uint32_t threads) {
  const size_t factors = size_t(M) * s.Hv * (s.Dv / rv);
  Op(kernel, label)
      .threads({M * s.Hv, 1, 1}, {threads, 1, 1})
      .in(0, ss, 0, factors * sizeof(float))
      .out(1, f_out, 0, factors * kValueBytes)
      .args(2, args::GdnScanArgs{s.Hk, s.Hv, M, norm_eps, args::kGdnL2Eps})
      .run(pass);
}

void encode_gdn_conv_state(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                           const GdnShape& s, gpu::Buffer& qkv, gpu::Buffer& conv_in, gpu::Buffer& conv_out,
                           uint32_t M, uint32_t threads, Traffic* traffic) {
  const size_t f = sizeof(float), C = s.conv_dim(), conv_bytes = size_t(s.K - 1) * C * f;
  // after the scan, which reads the old state (the same bytes when M is even)
  const uint32_t tail = std::min(M, s.K - 1);  // the qkv rows it copies
  Op op(kernel, label);
  op.threads({uint32_t(C), 1, 1}, {threads, 1, 1})
      .bind(0, qkv)
      .read(qkv, size_t(M - tail) * C * f, tail * C * f);
  if (&conv_in == &conv_out) op.inout(2, conv_out, 0, conv_bytes).bind(1, conv_in);
  else op.in(1, conv_in, 0, conv_bytes).out(2, conv_out, 0, conv_bytes);
  op.args(3, args::GdnConvStateArgs{uint32_t(C), M}).run(pass);
  if (traffic) traffic->state_bytes += conv_bytes;  // the new conv state (the old one: the scan's)
}

}  // namespace lily::runtime
