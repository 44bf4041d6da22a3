#include "runtime/families/sample.h"

#include <algorithm>

#include "runtime/encoder.h"

namespace lily::runtime {

namespace args = lily::kernels;

uint32_t sampler_threads(const gpu::Pipeline& p, uint32_t want) {
  const uint32_t cap = std::min<uint32_t>({want, args::kSamplerThreads, p.max_threads_per_threadgroup()});
  uint32_t n = 32;
  while (2 * n <= cap) n *= 2;
  return n;
}

void encode_argmax_partials(gpu::ComputePass& pass, const gpu::Pipeline& partial, const ArgmaxBuffers& io,
                            uint32_t vocab, uint32_t rows, uint32_t slice) {
  const uint32_t parts = ceil_div(vocab, slice);
  const size_t row_bytes = size_t(rows) * sizeof(float);
  Op op(partial, io.bias ? "greedy argmax partials (+ logit bias)" : "greedy argmax partials");
  op.groups({parts, 1, 1}, {args::kArgmaxPartialThreads, 1, 1})
      .in(0, io.logits, io.logits_at, row_bytes)
      .out(1, io.partials, io.partials_at, size_t(parts) * 2 * sizeof(uint32_t))
      .args(2, args::ArgmaxArgs{vocab, slice});
  if (io.bias) op.in(3, *io.bias, 0, row_bytes);
  op.run(pass);
}

void encode_argmax_combine(gpu::ComputePass& pass, const gpu::Pipeline& combine, const ArgmaxBuffers& io,
                           uint32_t vocab, uint32_t slice, uint32_t combine_threads) {
  const size_t u32 = sizeof(uint32_t);
  const uint32_t parts = ceil_div(vocab, slice);
  if (!combine_threads) combine_threads = sampler_threads(combine, ceil_div(parts, 32) * 32);
  Op(combine, "greedy token -> next slot")
      .groups({1, 1, 1}, {combine_threads, 1, 1})
      .in(0, io.partials, io.partials_at, size_t(parts) * 2 * u32)
      .out(1, io.token, io.token_at, u32)
      .args(2, args::ArgmaxArgs{parts, 0})
      .run(pass);
}

void encode_argmax(gpu::ComputePass& pass, const gpu::Pipeline& partial, const gpu::Pipeline& combine,
                   const ArgmaxBuffers& io, uint32_t vocab, uint32_t rows, uint32_t slice,
                   uint32_t combine_threads) {
  encode_argmax_partials(pass, partial, io, vocab, rows, slice);
  encode_argmax_combine(pass, combine, io, vocab, slice, combine_threads);
}

void encode_sample_token(gpu::ComputePass& pass, const gpu::Pipeline& kernel, const char* label,
                         const args::SampleArgs& a, const SampleTokenBuffers& io, uint32_t rows,
                         uint32_t threads) {
  const size_t u32 = sizeof(uint32_t), row_bytes = size_t(rows) * sizeof(float);
  Op op(kernel, label);
  op.groups({1, 1, 1}, {threads, 1, 1})
      .in(0, io.logits, io.logits_at, row_bytes)
      .inout(1, io.counts, 0, io.counts.size())
      .in(2, io.positions, io.position_at, u32)
      .out(3, io.tokens, io.token_at, u32)
      .out(4, io.logprobs, io.logprobs_at, io.logprobs_bytes)
      .out(5, io.top_ids, io.top_ids_at, io.top_ids_bytes)
      .args(6, a);
  if (a.bias) op.in(7, io.bias, 0, row_bytes);
  else op.bind(7, io.bias);  // bound (every argument must be), unread
  op.run(pass);
}

}  // namespace lily::runtime
