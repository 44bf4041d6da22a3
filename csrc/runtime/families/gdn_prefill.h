// Dispatch builders of metal/gdn_prefill.metal (docs/prefill.md, "Gated DeltaNet"): a chunk's
// scan (conv inline), the norm scale and the conv state after the chunk. The prefill plan
// encodes with them and lily._core binds them (encode_gdn_scan, encode_gdn_norm_scale,
// encode_gdn_conv_state), so the kernel tests and lily doctor dispatch what the runtime does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gpu/device.h"
#include "runtime/families/gdn.h"
#include "runtime/kernel_args.h"
#include "runtime/model.h"

namespace lily::runtime {

struct Traffic;  // runtime.h

// State rows per gdn_scan threadgroup (RV, the instantiations of metal/gdn_prefill.metal:
// gdn_scan_k<Dk>_v<Dv>_r<RV>): 32 for Dv = 128, so the model's 32 heads run as 128
// threadgroups (>= 2x a 40-core GPU); 16 below. A head's splits: Dv / RV.
inline uint32_t gdn_scan_rows(uint32_t Dv) { return Dv >= 128 ? 32 : 16; }
// Threads per threadgroup of gdn_norm_scale and gdn_conv_state: metal/prefill_args.h.
using kernels::kGdnConvStateThreads;
using kernels::kGdnNormScaleThreads;

// The buffers of one chunk's scan (all bound from offset 0; M rows each): the projections qkv
// [M, C], b and a [M, Hv] (fp32) and z [M, Hv*Dv] (2 bytes a value); the conv state before the
// chunk; the recurrent state (updated in place); u [M, Hv*Dv] (2 bytes a value) and the
// splits' sums of y^2 ss [M, Hv, Dv/RV] (fp32) out.
struct GdnScanBuffers {
  gpu::Buffer &qkv, &b, &a, &z, &conv_in, &state, &u, &ss;
};

// gdn_scan_k<Dk>_v<Dv>_r<rv> (`kernel`) over `rows` tokens: grid (Hv, Dv / rv) of rv *
// kGdnScanLanesPerRow threads. `w`: conv1d, A_log, dt_bias and the gated norm's weight.
void encode_gdn_scan(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                     const GdnShape& shape, const DeltaNetLayer& w, const GdnScanBuffers& io, uint32_t rows,
                     uint32_t rv, float norm_eps, Traffic* traffic = nullptr);
// gdn_norm_scale_v<Dv>_r<rv>: the splits' factors f [M, Hv, Dv/RV] (2 bytes each) from their
// sums of y^2 `ss`, one thread per (token, head).
void encode_gdn_norm_scale(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                           const GdnShape& shape, gpu::Buffer& ss, gpu::Buffer& f, uint32_t rows, uint32_t rv,
                           float norm_eps, uint32_t threads = kGdnNormScaleThreads);
// gdn_conv_state: the conv state after the chunk, the last K-1 rows of [conv_in | qkv rows];
// conv_out may be conv_in itself. One thread per channel.
void encode_gdn_conv_state(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                           const GdnShape& shape, gpu::Buffer& qkv, gpu::Buffer& conv_in, gpu::Buffer& conv_out,
                           uint32_t rows, uint32_t threads = kGdnConvStateThreads, Traffic* traffic = nullptr);

}  // namespace lily::runtime
