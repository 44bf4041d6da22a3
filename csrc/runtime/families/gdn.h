// Dispatch builders of metal/gdn.metal (docs/kernels.md, "Gated DeltaNet"): the decode step
// and the state write-back, each one dispatch with its bindings, geometry and declared ranges.
// The decode plan (decode.cpp) encodes with them and lily._core binds them
// (encode_gdn_decode_step, encode_gdn_state_writeback), so the kernel tests and lily doctor
// dispatch exactly what the runtime does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gpu/device.h"
#include "runtime/model.h"

namespace lily::runtime {

struct Traffic;  // runtime.h

// A Gated DeltaNet layer's shape: key and value heads, their head dims, the conv taps.
struct GdnShape {
  uint32_t Hk, Hv, Dk, Dv, K;
  static GdnShape of(const ModelDims& d) {
    return {d.linear_num_key_heads, d.linear_num_value_heads, d.linear_key_head_dim, d.linear_value_head_dim,
            d.linear_conv_kernel_dim};
  }
  uint32_t conv_dim() const { return 2 * Hk * Dk + Hv * Dv; }
  size_t state_bytes() const { return size_t(Hv) * Dv * (Dk + 1) * sizeof(float); }  // S' and c
  size_t ring_entry_bytes() const;  // one GdnRing entry (metal/mixer_args.h)
};

// The buffers of one decode step of a layer: the projections qkv [C], b and a [Hv] (fp32);
// the conv state in and out ([K-1, C] each, ping-pong); the recurrent state; the layer's ring
// of pending updates; y [Hv*Dv] and the per-split sums of y^2 [Hv, splits] out. Bound from
// offset 0 but the projections and outputs, from their `_at` byte offset (a batched step's
// row in the decode scratch).
struct GdnStepBuffers {
  gpu::Buffer &qkv, &b, &a, &conv_in, &conv_out, &state, &ring, &y, &ssq;
  size_t qkv_at = 0, b_at = 0, a_at = 0, y_at = 0, ssq_at = 0;
};

// gdn_decode_step_k<Dk>_v<Dv> (`kernel`): grid (Hv, splits) of Dv / splits * 8 threads (4
// state rows per simdgroup). Replays the `pending` ring entries, then writes the state back
// (`write_back`) or appends this step's entry to ring slot `pending`. Adds the bytes it moves
// to `traffic` when given.
void encode_gdn_decode_step(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                            const GdnShape& shape, const DeltaNetLayer& w, const GdnStepBuffers& io,
                            uint32_t splits, uint32_t pending, bool write_back, Traffic* traffic = nullptr);

// gdn_state_writeback_k<Dk>_v<Dv>: the state after the `pending` (>= 1) entries of `ring`,
// on the decode step's grid.
void encode_gdn_state_writeback(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                                const GdnShape& shape, gpu::Buffer& state, gpu::Buffer& ring, uint32_t splits,
                                uint32_t pending);

}  // namespace lily::runtime
