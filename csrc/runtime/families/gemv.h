// Dispatch builders of metal/gemv.metal (docs/kernels.md, "GEMV"): the decode step's quantized
// GEMVs y += W x (gemv_q*_add, and gemv_gated_q*_add with the Gated DeltaNet's gated RMSNorm
// applied to x on load) and the RMSNorm fused into up to kNormGemvMaxMatrices GEMVs
// (norm_gemv_q*, embed_norm_gemv_q4 with the step's embedding lookup first), each in its
// batch-1 form or over the rows of a batched step (the *_batch_* kernels). The decode plan
// (decode.cpp) encodes with them and lily._core binds them (encode_gemv_add,
// encode_norm_gemv), so the kernel tests and lily doctor dispatch exactly what the runtime does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "gpu/device.h"
#include "runtime/model.h"

namespace lily::runtime {

struct Traffic;  // runtime.h

// The batched kernel for n (2 .. kBatchMaxRows) rows: index 0, 1, 2 of the kernels built for
// 2, 4, 8 rows (`_b<2 << index>`: the smallest holding n; it runs with `rows` = n).
inline uint32_t batch_kernel(uint32_t n) { return n <= 2 ? 0 : n <= 4 ? 1 : 2; }

// The rows of a batched step a GEMV-like dispatch covers (batch_args.h): `rows` rows (1 for a
// batch-1 kernel, which binds no batch arguments), row r of each operand `r * stride` floats
// after row 0.
struct GemvRows {
  uint32_t rows = 1;
  bool batched = false;  // a *_batch_* kernel (GemvBatchArgs / NormGemvBatchArgs bound)
  uint32_t x_stride = 0, y_stride = 0, ssq_stride = 0;
};

// gemv_gated_q*_add's normalisation: y / sqrt(ss / head_dim + eps) * norm * silu(z), ss the
// sum of a head's `splits` partial sums of squares `ssq` (GatedNormArgs).
struct GatedNorm {
  gpu::Buffer &ssq, &z;
  const TensorRef& norm;
  uint32_t head_dim, splits;
  float eps;
};

// `kernel` (gemv[_gated][_batch]_q<bits>[_b<n>]_add): y[rows] += W[rows, cols] x for each row
// of `batch`, x and y bound from offset 0, with `gated` the gated norm on load. Threadgroups of
// `threads`, kGemvSplitK simdgroups per kGemvRowsPerSimdgroup rows. Adds the bytes it moves to
// `traffic` when given.
void encode_gemv_add(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                     const QuantLinear& w, gpu::Buffer& x, gpu::Buffer& y, uint32_t rows, uint32_t cols,
                     const GemvRows& batch, const GatedNorm* gated, uint32_t threads,
                     Traffic* traffic = nullptr);

// One matrix of a norm_gemv: its weight, `rows` outputs written at byte `y_at` of y (row r of a
// batch `y_stride` floats further). A slot of 0 rows is bound, nothing declared.
struct NormGemvMatrix {
  const QuantLinear& w;
  gpu::Buffer& y;
  size_t y_at;
  uint32_t rows, y_stride = 0;
};

// embed_norm_gemv_q4's lookup: the row of the token id (uint32 at byte `token_at` of `tokens`)
// of the 4-bit table [vocab, cols] becomes x, written, and the norm's input.
struct EmbedLookup {
  const QuantLinear& table;
  gpu::Buffer& tokens;
  size_t token_at;
  uint32_t vocab;
};

// The RMSNorm of x (cols fp32 from byte `x_at`, rows of `batch.x_stride` floats; norm weight
// bf16 [cols]) fused into the GEMVs of `mats` (at most kNormGemvMaxMatrices, one weight width):
// `kernel` (norm_gemv_q*, norm_gemv_batch_q*_b<n> with batch.batched, embed_norm_gemv_q4
// with `embed`), rows_per_simdgroup rows shared by k_splits simdgroups, threadgroups of
// `threads` (and `extra_groups` surplus ones, which exit). With write_xn the normalised x is
// stored in xn (x's offset and strides), else xn is bound (from offset 0) only. The unused matrix slots
// are bound to x and xn, nothing declared.
void encode_norm_gemv(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                      gpu::Buffer& x, size_t x_at, const TensorRef& norm, gpu::Buffer& xn,
                      const std::vector<NormGemvMatrix>& mats, uint32_t cols, float eps, bool write_xn,
                      uint32_t rows_per_simdgroup, uint32_t k_splits, const GemvRows& batch, uint32_t threads,
                      const EmbedLookup* embed = nullptr, uint32_t extra_groups = 0,
                      Traffic* traffic = nullptr);

}  // namespace lily::runtime
