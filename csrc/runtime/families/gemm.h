// Dispatch builders of metal/gemm.metal and gemm_tensor.metal (docs/prefill.md, "GEMM"): the
// dense prefill GEMMs y (=|+=) x W^T on bfloat x and the shared expert's SwiGLU GEMM, on the
// simdgroup_matrix path or its tensor-op twins, each one dispatch with its bindings,
// geometry (metal/gemm_args.h) and declared ranges. The prefill plan (prefill.cpp) encodes
// with them and lily._core binds them (encode_gemm, encode_gemm_swiglu), so the kernel tests
// and lily doctor dispatch exactly what the runtime does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "gpu/device.h"
#include "runtime/kernel_args.h"
#include "runtime/model.h"

namespace lily::runtime {

struct Traffic;  // runtime.h

// A dense GEMM threadgroup on a path (metal/gemm_args.h): its output rows and columns
// (SwiGLU: columns of gate and of up) and its threads.
struct GemmBlock {
  uint32_t rows, cols, swiglu_cols, threads;
};
GemmBlock gemm_block(bool tensor_ops);

// What a dense GEMM does with y [m, n] (fp32 unless said): stores x W^T (gemm_q*), stores it
// as bfloat (gemm_q4_bf16), adds it (gemm_q4_add_h), or adds (x * s) W^T with a half scale s
// per 2^shift elements of x (gemm_q4_add_hs).
enum class GemmOut { store, store_bf16, add, add_scaled };
// The output of a GEMM that adds (`add`) or stores (as bfloat: `bf16_y`), with x scaled (`scaled`,
// add only).
inline GemmOut gemm_out(bool add, bool bf16_y, bool scaled) {
  return bf16_y ? GemmOut::store_bf16 : !add ? GemmOut::store : scaled ? GemmOut::add_scaled : GemmOut::add;
}
// The kernel's name after gemm_q<bits>: "", "_bf16", "_add_h" or "_add_hs", then "_tensor" on
// the tensor-op path (kernel_names.h).
std::string gemm_suffix(GemmOut out, bool tensor_ops);

// The operands of a dense GEMM: x bfloat rows of `a.lda` elements from byte `x_at`, y rows of
// `a.ldy` from byte `y_at` (a column block of a wider matrix: y_at at its first column), the
// x scale (GemmOut::add_scaled: half [elements of x >> x_shift] from offset 0). `disjoint`:
// nonzero for GEMMs writing disjoint columns of one y in one stage (gpu::Range::disjoint).
struct GemmOperands {
  gpu::Buffer &x, &y;
  size_t x_at = 0, y_at = 0;
  gpu::Buffer* x_scale = nullptr;
  uint32_t x_shift = 0, disjoint = 0;
};

// `kernel` (gemm_q<w.bits><gemm_suffix(out, ...)>) on `block`'s grid (ceil(n / cols),
// ceil(m / rows)): y[m, n] (=|+=) x[m, k] W^T. Adds the weight's bytes to `traffic` when given.
void encode_gemm(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                 const GemmBlock& block, const QuantLinear& w, GemmOut out, const GemmOperands& io,
                 const lily::kernels::GemmArgs& a, Traffic* traffic = nullptr);

// gemm_swiglu_q4(_tensor) (`kernel`): h[m, n] = bfloat(g[m] * silu(x Wg^T) * (x Wu^T)), x and h
// bfloat with row strides a.lda, a.ldy, g the fp32 row scale at byte `scale_at` of `scale`
// with row stride `ldg` (the routing weights' shared-gate column).
void encode_gemm_swiglu(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                        const GemmBlock& block, const QuantLinear& gate, const QuantLinear& up, gpu::Buffer& x,
                        gpu::Buffer& h, const lily::kernels::GemmArgs& a, gpu::Buffer& scale, size_t scale_at,
                        uint32_t ldg, Traffic* traffic = nullptr);

}  // namespace lily::runtime
