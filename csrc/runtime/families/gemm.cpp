#include "runtime/families/gemm.h"

#include "runtime/encoder.h"
#include "runtime/runtime.h"

namespace lily::runtime {

namespace args = lily::kernels;

GemmBlock gemm_block(bool tensor_ops) {
  return tensor_ops ? GemmBlock{args::kGemmTensorBM, args::kGemmTensorBN, args::kGemmTensorSwigluBN,
                                args::kGemmTensorThreads}
                    : GemmBlock{args::kGemmBM, args::kGemmBN, args::kGemmSwigluBN, args::kGemmThreads};
}

std::string gemm_suffix(GemmOut out, bool tensor_ops) {
  const char* s = out == GemmOut::store_bf16   ? "_bf16"
                  : out == GemmOut::add        ? "_add_h"
                  : out == GemmOut::add_scaled ? "_add_hs"
                                               : "";
  return std::string(s) + (tensor_ops ? "_tensor" : "");
}

void encode_gemm(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                 const GemmBlock& block, const QuantLinear& w, GemmOut out, const GemmOperands& io,
                 const args::GemmArgs& a, Traffic* traffic) {
  const size_t bf = 2, x_elems = size_t(a.m - 1) * a.lda + a.k;
  const size_t yb = out == GemmOut::store_bf16 ? bf : sizeof(float),
               y_bytes = (size_t(a.m - 1) * a.ldy + a.n) * yb;
  Op op(kernel, label);
  op.groups({ceil_div(a.n, block.cols), ceil_div(a.m, block.rows), 1}, {block.threads, 1, 1});
  op.in(0, w, traffic ? &traffic->weight_bytes : nullptr).in(3, io.x, io.x_at, x_elems * bf);
  if (out == GemmOut::add_scaled)
    op.in(6, *io.x_scale, 0, (x_elems >> io.x_shift) * bf).args(7, args::GemmAScaleArgs{io.x_shift});
  if (out == GemmOut::add || out == GemmOut::add_scaled) op.inout(4, io.y, io.y_at, y_bytes);
  else if (io.disjoint) op.out_disjoint(4, io.y, io.y_at, y_bytes, io.disjoint);
  else op.out(4, io.y, io.y_at, y_bytes);
  op.args(5, a).run(pass);
}

void encode_gemm_swiglu(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                        const GemmBlock& block, const QuantLinear& gate, const QuantLinear& up, gpu::Buffer& x,
                        gpu::Buffer& h, const args::GemmArgs& a, gpu::Buffer& scale, size_t scale_at,
                        uint32_t ldg, Traffic* traffic) {
  const size_t bf = 2;
  uint64_t* weights = traffic ? &traffic->weight_bytes : nullptr;
  Op(kernel, label)
      .groups({ceil_div(a.n, block.swiglu_cols), ceil_div(a.m, block.rows), 1}, {block.threads, 1, 1})
      .in(0, gate, weights)
      .in(3, up, weights)
      .in(6, x, 0, (size_t(a.m - 1) * a.lda + a.k) * bf)
      .out(7, h, 0, (size_t(a.m - 1) * a.ldy + a.n) * bf)
      .args(8, a)
      .in(9, scale, scale_at, (size_t(a.m - 1) * ldg + 1) * sizeof(float))
      .args(10, args::GemmRowScaleArgs{ldg})
      .run(pass);
}

}  // namespace lily::runtime
