// Dispatch builders of the prefill chunk's attention (metal/attention_prefill.metal,
// attention_prefill_tensor.metal; docs/prefill.md): the prep (q/k RMSNorm, partial RoPE, the KV
// append: attn_prefill_prep_d<D>[_qbf]), the causal attention of the chunk over the cache
// (attn_prefill_d<D>_g<G>[_tensor]) and its KV-split path (attn_prefill_split_d<D>_g<G>[_tensor]
// then attn_prefill_combine_d<D>). The prefill plan (prefill.cpp) encodes with them and
// lily._core binds them (encode_attn_prefill_prep, encode_attn_prefill,
// encode_attn_prefill_combine), so the kernel tests, lily doctor and kernel_bench dispatch
// exactly what the runtime does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gpu/device.h"
#include "runtime/kernel_args.h"
#include "runtime/model.h"

namespace lily::runtime {

// A chunk's attention buffers, each from offset 0: the projections qg (bf16 [M, Hq, 2 D]: q |
// gate), k and v (bf16 [M, Hkv, D]; the prep's), the prepared q (fp32 [M, Hq, D], or with
// bf16_q the tensor-op attention's bf16 [Hq / G, M, G, D]), the bf16 KV cache ([Hkv, capacity,
// D] each), the output out (bf16 [M, Hq * D]; direct attention and combine) and the split
// path's partials ml (fp32 [splits, M, Hq, 2]) and po (fp32 [splits, M, Hq, D]).
struct AttnPrefillBuffers {
  gpu::Buffer &qg, &q, &k_cache, &v_cache;
  gpu::Buffer *k = nullptr, *v = nullptr, *out = nullptr, *ml = nullptr, *po = nullptr;
};

// `kernel` (attn_prefill_prep_d<D>[_qbf]) over the chunk: 8 rows of one head a threadgroup of
// 256 threads, grid (ceil(M / 8), Hq + Hkv); reads qg, k, v and the norm weights (their bytes
// added to `weight_bytes` when given), writes q and cache rows [p0, p0 + M) of every KV head.
void encode_attn_prefill_prep(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                              const AttnPrefillBuffers& io, const TensorRef& q_norm, const TensorRef& k_norm,
                              const lily::kernels::AttnPrefillPrepArgs& args, uint32_t head_dim, bool bf16_q,
                              uint64_t* weight_bytes = nullptr);

// `kernel` with `args`: attn_prefill_d<D>_g<G>[_tensor] into out when args.num_splits is 0, else
// attn_prefill_split_d<D>_g<G>[_tensor] into the partials of args.num_splits splits. Grid
// (ceil(M / (kAttnPrefillPairs / G)), Hq / G[, splits]) of kAttnPrefillThreads; declares cache
// rows [0, p0 + M) of every KV head read.
void encode_attn_prefill(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                         const AttnPrefillBuffers& io, const lily::kernels::AttnPrefillArgs& args,
                         uint32_t head_dim, uint32_t heads_per_group, bool bf16_q);

// `kernel` (attn_prefill_combine_d<D>): merges the split partials ml and po (as
// AttnPrefillBuffers') of args.num_splits splits, gated by qg, into out; grid (Hq, M) of D threads.
void encode_attn_prefill_combine(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                                 gpu::Buffer& ml, gpu::Buffer& po, gpu::Buffer& qg, gpu::Buffer& out,
                                 const lily::kernels::AttnPrefillArgs& args, uint32_t head_dim);

}  // namespace lily::runtime
