#include "runtime/families/norm.h"

#include "runtime/encoder.h"
#include "runtime/kernel_args.h"
#include "runtime/runtime.h"

namespace lily::runtime {

void encode_rms_norm(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                     gpu::Buffer& x, const TensorRef& w, gpu::Buffer& out, uint32_t rows, uint32_t n, float eps,
                     uint32_t out_bytes, uint32_t threads, Traffic* traffic) {
  const size_t values = size_t(rows) * n;
  Op(kernel, label)
      .groups({rows, 1, 1}, {threads, 1, 1})
      .in(0, x, 0, values * sizeof(float))
      .in(1, w, traffic ? &traffic->weight_bytes : nullptr)
      .out(2, out, 0, values * out_bytes)
      .args(3, lily::kernels::NormArgs{n, eps})
      .run(pass);
}

}  // namespace lily::runtime
