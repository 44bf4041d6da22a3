// Dispatch builders of metal/sample.metal (docs/kernels.md, "Sampling"): the greedy argmax in
// two stages and the sampler's draw, each with its bindings, geometry and declared ranges.
// The decode plan (decode.cpp encode_sample) encodes with them and lily._core binds them
// (encode_argmax, encode_sample_token), so the kernel tests and lily doctor dispatch exactly
// what the runtime does.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpu/device.h"
#include "runtime/kernel_args.h"

namespace lily::runtime {

// Threads of a one-threadgroup sampler dispatch: `want`, at most kSamplerThreads, as many as the
// pipeline allows (a Mac's compiler may lower a pipeline's limit under register pressure),
// in a power of two (sample_token takes any multiple of 32 dividing 1024, the combine any
// multiple of 32). Below 32 the load-time check refuses the pipeline by name.
uint32_t sampler_threads(const gpu::Pipeline& p, uint32_t want);

// The buffers of a greedy argmax: the logits (a row of `rows` floats from `logits_at`), the
// partials ([ceil(vocab / slice)] (value, index) pairs from `partials_at`), the token written
// (uint32 at `token_at`) and, when given, a bias ([rows] fp32 from offset 0) added to the
// logits (argmax_partial_bias).
struct ArgmaxBuffers {
  gpu::Buffer &logits, &partials, &token;
  gpu::Buffer* bias = nullptr;
  size_t logits_at = 0, partials_at = 0, token_at = 0;
};

// argmax_partial (argmax_partial_bias with io.bias: `partial`) over slices of `slice` of the
// first `vocab` logits, 256 threads each, then sample_greedy_combine (`combine`) in one
// threadgroup of `combine_threads` (0: sampler_threads of a thread per partial in whole
// simdgroups). The lowest index wins a tie.
void encode_argmax(gpu::ComputePass& pass, const gpu::Pipeline& partial, const gpu::Pipeline& combine,
                   const ArgmaxBuffers& io, uint32_t vocab, uint32_t rows, uint32_t slice,
                   uint32_t combine_threads = 0);
// Its two stages apart (a batched step encodes every row's partials, then every row's
// combine, so the rows share two barrier stages): the partials, then the combine.
void encode_argmax_partials(gpu::ComputePass& pass, const gpu::Pipeline& partial, const ArgmaxBuffers& io,
                            uint32_t vocab, uint32_t rows, uint32_t slice);
void encode_argmax_combine(gpu::ComputePass& pass, const gpu::Pipeline& combine, const ArgmaxBuffers& io,
                           uint32_t vocab, uint32_t slice, uint32_t combine_threads = 0);

// The buffers of a sampler draw: the logits (a row of `rows` floats from `logits_at`), the
// token counts (uint32 [rows], read and updated whole), the position (uint32 at
// `position_at`, the Philox counter), the token written (uint32 at `token_at`), the
// log-probabilities and the alternatives' ids (`logprobs_bytes` / `top_ids_bytes` from their
// `_at` offsets) and the dense bias ([rows] fp32; read when SampleArgs.bias, else bound only).
struct SampleTokenBuffers {
  gpu::Buffer &logits, &counts, &positions, &tokens, &logprobs, &top_ids, &bias;
  size_t logits_at = 0, position_at = 0, token_at = 0, logprobs_at = 0, top_ids_at = 0;
  size_t logprobs_bytes = 0, top_ids_bytes = 0;
};

// sample_token (`kernel`): one threadgroup of `threads` (a multiple of 32 dividing 1024) draws
// a token with `args` (sample_args.h SampleArgs: temperature, filters, penalties, seed).
void encode_sample_token(gpu::ComputePass& pass, const gpu::Pipeline& kernel, const char* label,
                         const lily::kernels::SampleArgs& args, const SampleTokenBuffers& io, uint32_t rows,
                         uint32_t threads);

}  // namespace lily::runtime
