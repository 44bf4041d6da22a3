// Dispatch builders of metal/norm.metal (docs/kernels.md "rms_norm", docs/prefill.md): the
// RMSNorm of a chunk's rows (rms_norm_bf16, the GEMMs' bfloat input xn; rms_norm, fp32, the
// same code). The prefill plan encodes with it and lily._core binds it (encode_rms_norm).
#pragma once

#include <cstdint>
#include <string_view>

#include "gpu/device.h"
#include "runtime/model.h"

namespace lily::runtime {

struct Traffic;  // runtime.h

// Threads per row of the prefill RMSNorms (rms_norm_bf16, moe_combine_norm): one count for
// both, so the fused norm gives the standalone kernel's bits (metal/moe_prefill.metal).
constexpr uint32_t kNormThreads = 256;

// `kernel` (rms_norm: fp32 out, out_bytes 4; rms_norm_bf16: bfloat values, out_bytes 2): out [rows, n] =
// x [rows, n] fp32 * rsqrt(mean(x^2) + eps) * w (bf16 [n]), one threadgroup of `threads` per
// row. out may be x itself (fp32 only). Adds the weight's bytes to `traffic`.
void encode_rms_norm(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                     gpu::Buffer& x, const TensorRef& w, gpu::Buffer& out, uint32_t rows, uint32_t n, float eps,
                     uint32_t out_bytes, uint32_t threads = kNormThreads, Traffic* traffic = nullptr);

}  // namespace lily::runtime
