// Dispatch builders of metal/moe.metal's decode kernels (docs/kernels.md, "MoE"): the routing
// fused into the experts' gate/up SwiGLU (moe_route_gate_up_swiglu_q4) and the weighted down
// projections added to the residual (moe_down_q4), each in its batch-1 form or over the rows of
// a batched step (moe_route_gate_up_batch_q4_b*, moe_down_batch_q4_b*: the union of the rows'
// experts, each read once). The decode plan (decode.cpp) encodes with them and lily._core binds
// them (encode_moe_route_gate_up, encode_moe_down), so the kernel tests and lily doctor dispatch
// exactly what the runtime does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gpu/device.h"
#include "runtime/kernel_args.h"
#include "runtime/model.h"

namespace lily::runtime {

struct Traffic;  // runtime.h

// The decode MoE block's sizes (MoeArgs / MoeRouteArgs).
struct MoeShape {
  uint32_t hidden, inter, inter_shared, experts, top_k;
  bool norm_topk = true;
  // floats of one row's expert hidden vector h: top_k * inter + inter_shared
  size_t hidden_floats() const { return size_t(top_k) * inter + inter_shared; }
};

// The MoE block's activations, each bound from offset 0: the normalised x [hidden], the router
// logits | shared-expert gate logit [experts + 1], the experts' SwiGLU outputs h
// [MoeShape::hidden_floats], the picked ids (uint32 [top_k]) and routing weights [top_k + 1],
// and the residual [hidden] the down projections add to. Row r of a batched step lies
// `batch` strides further (MoeBatchArgs; batch.rows = 1 for the batch-1 kernels, which bind no
// batch arguments).
struct MoeBuffers {
  gpu::Buffer &xn, &logits, &h, &ids, &weights, &residual;
};

// `kernel` (moe_route_gate_up_swiglu_q4, or with batched moe_route_gate_up_batch_q4_b<n>): the
// routing of each row (softmax top-k of its logits, the shared gate's sigmoid) in every
// simdgroup, then the SwiGLU of its experts' (and the shared expert's) gate/up rows into h;
// grid (ceil(max(inter, inter_shared) / rows per group), rows * top_k + 1) of `threads`. Adds the
// bytes the picked experts move (several rows: the union expected with uniform routing,
// cost.h expected_experts) to `traffic` when given.
void encode_moe_route_gate_up(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                              const MoeBlock& w, const MoeBuffers& io, const MoeShape& shape,
                              const lily::kernels::MoeBatchArgs& batch, bool batched, uint32_t threads,
                              Traffic* traffic = nullptr);

// `kernel` (moe_down_q4, or with batched moe_down_batch_q4_b<n>): residual += sum_j w_j Wd_j h_j
// over each row's experts and the shared expert, kGemvSplitK simdgroups per
// kGemvRowsPerSimdgroup output rows, threadgroups of `threads`.
void encode_moe_down(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                     const MoeBlock& w, const MoeBuffers& io, const MoeShape& shape,
                     const lily::kernels::MoeBatchArgs& batch, bool batched, uint32_t threads,
                     Traffic* traffic = nullptr);

}  // namespace lily::runtime
