// Dispatch builders of metal/embed.metal (docs/prefill.md, "One chunk"): a chunk's embedding
// rows, and a batched decode step's, one row each. The prefill plan and the decode plan encode
// with it and lily._core binds it (encode_embed_rows). The batch-1 decode step's embedding is
// fused into its first norm_gemv (embed_norm_gemv_q4, gemv.metal); embed_q4, the one-row
// kernel, has no encoder in the runtime.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gpu/device.h"
#include "runtime/model.h"

namespace lily::runtime {

struct Traffic;  // runtime.h

// embed_rows_q4 (`kernel`): out [rows, cols] fp32 = the rows of the 4-bit `table` [vocab,
// cols] of token ids tokens[0 .. rows) (uint32 from byte `tokens_offset`; an id >= vocab is
// clamped to vocab - 1), written from byte `out_offset` of `out`. One thread per 8 values of
// a row. Adds the rows' bytes to `traffic`. Also a batched decode step's lookup of one row's
// token (DecodePlan::encode_rows; the batch-1 step fuses it into embed_norm_gemv_q4).
void encode_embed_rows(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                       const QuantLinear& table, gpu::Buffer& tokens, size_t tokens_offset, gpu::Buffer& out,
                       uint32_t rows, uint32_t cols, uint32_t vocab, Traffic* traffic = nullptr,
                       size_t out_offset = 0);

}  // namespace lily::runtime
