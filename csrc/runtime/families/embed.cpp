#include "runtime/families/embed.h"

#include "runtime/encoder.h"
#include "runtime/kernel_args.h"
#include "runtime/runtime.h"

namespace lily::runtime {

namespace args = lily::kernels;

void encode_embed_rows(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                       const QuantLinear& table, gpu::Buffer& tokens, size_t tokens_offset, gpu::Buffer& out,
                       uint32_t rows, uint32_t cols, uint32_t vocab, Traffic* traffic, size_t out_offset) {
  const size_t f = sizeof(float), u32 = sizeof(uint32_t);
  Op(kernel, label)
      .threads({cols / args::kEmbedValuesPerThread, rows, 1}, {args::kEmbedThreads, 1, 1})
      .in(0, table)
      .in(3, tokens, tokens_offset, rows * u32)
      .out(4, out, out_offset, size_t(rows) * cols * f)
      .args(5, args::EmbedArgs{cols, vocab})
      .run(pass);
  // the rows it really reads: codes, and a bf16 scale and bias per kQuantGroup values
  if (traffic) traffic->weight_bytes += uint64_t(rows) * args::q4_row_bytes(cols);
}

}  // namespace lily::runtime
