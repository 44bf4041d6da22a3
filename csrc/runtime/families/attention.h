// Dispatch builders of metal/attention.metal's decode kernels (docs/kernels.md, "Decode
// attention"): the fused step of one row (q/k RMSNorm, partial RoPE, the KV append and the
// attention over the cache in one dispatch: attn_decode_fused_d<D>_g<G>, or over blocks of
// rows attn_decode_split_fused_d<D>_g<G>) and the split path's combine (attn_combine_d<D>).
// The decode plan (decode.cpp) encodes with them and lily._core binds them
// (encode_attn_decode_fused, encode_attn_combine), so the kernel tests and lily doctor
// dispatch exactly what the runtime does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gpu/device.h"
#include "runtime/kernel_args.h"
#include "runtime/model.h"

namespace lily::runtime {

struct Traffic;  // runtime.h

// One row's buffers of the fused step: the new token's q|gate (fp32 [Hq, 2 D] from qg_at), k
// and v ([Hkv, D] from k_at, v_at), the q/k norm weights (bf16 [D]), its position (uint32 at
// position_at), the bf16 KV cache ([Hkv, capacity, D] each, from offset 0), and the output:
// direct, out ([Hq, D] fp32 from out_at); split, the partials ml ([Hq, max_blocks, 2] fp32
// from ml_at) and acc ([Hq, max_blocks, D] from acc_at).
struct AttnStepBuffers {
  gpu::Buffer &qg, &k, &v;
  const TensorRef &q_norm, &k_norm;
  gpu::Buffer &positions, &k_cache, &v_cache;
  gpu::Buffer* out = nullptr;
  gpu::Buffer *ml = nullptr, *acc = nullptr;
  size_t qg_at = 0, k_at = 0, v_at = 0, position_at = 0, out_at = 0, ml_at = 0, acc_at = 0;
};

// `kernel` at `position` (the row it appends; rows [0, position) are read) with `args`: the
// direct kernel when args.block_rows is 0, else the split one over ceil((position + 1) /
// block_rows) blocks plus `extra_blocks` surplus ones (they must write nothing). Grid (Hq / G,
// blocks) of kAttnDecodeThreads; declares the cache rows it reads and writes and, split, the
// partials' whole [Hq, max_blocks] slots. Adds the bytes it moves to `traffic` when given.
void encode_attn_decode_fused(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                              const AttnStepBuffers& io, const lily::kernels::AttnFusedArgs& args,
                              uint32_t head_dim, uint32_t heads_per_group, uint32_t position,
                              uint32_t extra_blocks = 0, Traffic* traffic = nullptr);

// The split path's partials, the gate (fp32, head h's D values at float h * gate_stride from
// gate_at) and the position read by attn_combine, the output [Hq, D] fp32 from out_at.
struct AttnCombineBuffers {
  gpu::Buffer &ml, &acc, &gate, &positions, &out;
  size_t ml_at = 0, acc_at = 0, gate_at = 0, position_at = 0, out_at = 0;
};

// `kernel` (attn_combine_d<D>): grid (Hq, D / 32) of kAttnCombineThreads, simdgroups sharing a
// head's blocks of 32 columns; reads the partials' whole [Hq, max_blocks] slots.
void encode_attn_combine(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                         const AttnCombineBuffers& io, const lily::kernels::AttnCombineArgs& args,
                         uint32_t head_dim);

}  // namespace lily::runtime
