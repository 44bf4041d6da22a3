#include "runtime/families/gemv.h"

#include <stdexcept>
#include <string>

#include "runtime/encoder.h"
#include "runtime/kernel_args.h"
#include "runtime/runtime.h"

namespace lily::runtime {

namespace args = lily::kernels;

void encode_gemv_add(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                     const QuantLinear& w, gpu::Buffer& x, gpu::Buffer& y, uint32_t rows, uint32_t cols,
                     const GemvRows& b, const GatedNorm* gated, uint32_t threads, Traffic* traffic) {
  Traffic local;
  Traffic& t = traffic ? *traffic : local;
  const size_t f = sizeof(float), n = b.rows;
  const uint32_t per_group = args::kGemvRowsPerSimdgroup * threads / 32 / args::kGemvSplitK;
  const size_t x_span = ((n - 1) * b.x_stride + cols) * f;
  Op op(kernel, label);
  op.groups({ceil_div(rows, per_group), 1, 1}, {threads, 1, 1});
  op.in(0, w, &t.weight_bytes).in(3, x, 0, x_span).bind(4, y, 0);
  for (size_t r = 0; r < n; ++r)
    op.write(y, r * b.y_stride * f, rows * f).read(y, r * b.y_stride * f, rows * f);
  op.args(5, args::GemvArgs{rows, cols});
  t.other_bytes += n * (cols * f + rows * f * 2);
  if (gated) {
    const size_t ssq_bytes = ((n - 1) * b.ssq_stride + size_t(cols / gated->head_dim) * gated->splits) * f;
    op.in(6, gated->ssq, 0, ssq_bytes)
        .in(7, gated->z, 0, x_span)
        .in(8, gated->norm, &t.weight_bytes)
        .args(9, args::GatedNormArgs{gated->head_dim, gated->splits, gated->eps});
    t.other_bytes += n * cols * f;  // z
  }
  if (b.batched) op.args(gated ? 10 : 6, args::GemvBatchArgs{b.rows, b.x_stride, b.y_stride, b.ssq_stride});
  op.run(pass);
}

void encode_norm_gemv(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                      gpu::Buffer& x, size_t x_at, const TensorRef& norm, gpu::Buffer& xn,
                      const std::vector<NormGemvMatrix>& mats, uint32_t cols, float eps, bool write_xn,
                      uint32_t rps, uint32_t splits, const GemvRows& b, uint32_t threads,
                      const EmbedLookup* embed, uint32_t extra_groups, Traffic* traffic) {
  if (mats.empty() || mats.size() > args::kNormGemvMaxMatrices)
    throw std::invalid_argument("norm_gemv: 1 to " + std::to_string(args::kNormGemvMaxMatrices) +
                                " matrices, got " + std::to_string(mats.size()));
  Traffic local;
  Traffic& t = traffic ? *traffic : local;
  const size_t f = sizeof(float), n = b.rows;
  const size_t x_span = ((n - 1) * b.x_stride + cols) * f;
  const uint32_t per_group = rps * threads / 32 / splits;
  args::NormGemvArgs na{{0, 0, 0, 0}, cols, eps, write_xn ? 1u : 0u, rps, splits};
  args::NormGemvBatchArgs nb{b.rows, b.x_stride, {0, 0, 0, 0}};
  Op op(kernel, label);
  if (embed) {
    const QuantLinear& e = embed->table;
    op.in(20, *e.weight).in(21, *e.scales).in(22, *e.biases);
    op.in(23, embed->tokens, embed->token_at, sizeof(uint32_t))
        .args(24, args::EmbedArgs{cols, embed->vocab})
        .out(0, x, x_at, x_span);
    t.weight_bytes += args::q4_row_bytes(cols);  // the row it really reads
  } else {
    op.in(0, x, x_at, x_span);
  }
  op.in(1, norm, &t.weight_bytes);
  if (write_xn) op.out(2, xn, x_at, x_span);
  else op.bind(2, xn);
  uint32_t groups = extra_groups, m = 0;
  for (const NormGemvMatrix& mat : mats) {
    const uint32_t base = 3 + 4 * m;
    nb.y_stride[m] = mat.y_stride;
    na.rows[m++] = mat.rows;
    groups += ceil_div(mat.rows, per_group);
    if (!mat.rows) {  // an unused slot before a used one: bound, nothing declared
      op.bind(base, *mat.w.weight->buffer, mat.w.weight->offset)
          .bind(base + 1, *mat.w.scales->buffer, mat.w.scales->offset)
          .bind(base + 2, *mat.w.biases->buffer, mat.w.biases->offset)
          .bind(base + 3, mat.y, mat.y_at);
      continue;
    }
    op.in(base, mat.w, &t.weight_bytes).bind(base + 3, mat.y, mat.y_at);
    for (size_t r = 0; r < n; ++r) op.write(mat.y, mat.y_at + r * mat.y_stride * f, size_t(mat.rows) * f);
    t.other_bytes += n * size_t(mat.rows) * f;
  }
  // unused slot: bound (every argument must be), nothing declared
  for (; m < args::kNormGemvMaxMatrices; ++m) {
    const uint32_t base = 3 + 4 * m;
    op.bind(base, x).bind(base + 1, x).bind(base + 2, x).bind(base + 3, xn);
  }
  op.groups({groups, 1, 1}, {threads, 1, 1}).args(19, na);
  if (b.batched) op.args(20, nb);
  op.run(pass);
  t.other_bytes += n * cols * f * (write_xn ? 2 : 1);
}

}  // namespace lily::runtime
