// The decode phase (docs/decode.md): its pipelines, the scratch of a step, and DecodePlan,
// which encodes a step over (weights, kernels, state): the weights and pipelines it is bound
// to at load, the scratch and the sequence state its caller passes. decode.cpp implements
// it; the runtime (runtime.cpp) owns the state and decides what runs when.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gpu/device.h"
#include "runtime/encoder.h"
#include "runtime/model.h"

namespace lily::runtime {

// runtime.h
struct RuntimeOptions;
struct SequenceState;
struct Traffic;

// The pipelines of the decode step, looked up by kernel name once at load. The
// split-attention pair is null when the context never reaches the split path.
struct DecodeKernels {
  const gpu::Pipeline* embed_norm_gemv = nullptr;  // layer 0: embedding fused into the first norm_gemv
  ByBits norm_gemv, gemv_add, gemv_gated_add;      // the last: out_proj with the GDN gated norm on load
  // Their batched forms (metal/batch_args.h) by kernel rows: [0] 2, [1] 4, [2] 8 (batch_kernel);
  // embed_rows looks up each row's token for them (the batch-1 step fuses it into the norm).
  ByBits norm_gemv_batch[3], gemv_add_batch[3], gemv_gated_add_batch[3];
  const gpu::Pipeline* embed_rows = nullptr;
  const gpu::Pipeline *gdn_step = nullptr, *gdn_writeback = nullptr;
  const gpu::Pipeline *attn = nullptr, *attn_split = nullptr, *attn_combine = nullptr;
  const gpu::Pipeline *moe_gate_up = nullptr, *moe_down = nullptr;
  // batched (b 2, 4, 8): the rows' routing and gate/up over the union of their experts and the
  // shared expert, the rows' down projections
  const gpu::Pipeline *moe_gate_up_batch[3] = {}, *moe_down_batch[3] = {};
  const gpu::Pipeline *argmax_partial = nullptr, *argmax_partial_bias = nullptr,
                      *sample_greedy_combine = nullptr, *sample_token = nullptr;
};

// The buffers of one decode step, shared by whatever runs the phase: nothing in them is
// carried from one step to the next (the host reads `logits` after a step it waited for).
// A session's own buffers are its SequenceState's. A batched step's scratch holds `rows` rows
// of each buffer one after another (row r at at(buffer, r)); the batch-1 step's holds one.
struct DecodeScratch {
  uint32_t rows = 1;
  // bytes of one row of `b`, and the offset of row r
  size_t row_bytes(const gpu::BufferPtr& b) const { return b->size() / rows; }
  size_t at(const gpu::BufferPtr& b, uint32_t r) const { return r ? r * row_bytes(b) : 0; }
  // fp32 activations: the residual h and its norm xn; the DeltaNet projections qkv, z, b, a,
  // its output o and per-split sums of squares o_ssq; attention q|gate, k, v and output;
  // router logits | shared-expert gate logit, expert ids and routing weights, the experts'
  // hidden vectors; lm_head's logits [V]
  gpu::BufferPtr h, xn, qkv, z, b, a, o, o_ssq, qg, k, v, attn, router, ids, route_w, hidden, logits;
  // split attention partials (m, l and accumulators), max_blocks slots per query head
  gpu::BufferPtr part_ml, part_acc;
  uint32_t max_blocks = 0;
  // greedy argmax partials (argmax_partial -> sample_greedy_combine), one per kArgmaxSlice logits
  gpu::BufferPtr argmax_part;
};

class DecodePlan {
 public:
  // Dispatch geometry of the step (the lab's kernel checks read it: lily._core.CONSTANTS).
  // norm_gemv_q* rows per simdgroup and split-K (NormGemvArgs): 8 rows, one split for the wide
  // projections and lm_head; 1 row shared by 2 simdgroups for the 257-row router, so that it
  // spans 258 threadgroups (16K threads) instead of 17.
  static constexpr uint32_t kNormGemvRows = 8;
  static constexpr uint32_t kRouterRows = 1;
  static constexpr uint32_t kRouterSplits = 2;
  static constexpr uint32_t kLmHeadThreads = 256;  // fewer threadgroups re-reading x for the norm
  static constexpr uint32_t kArgmaxSlice = 4096;   // logits per argmax_partial threadgroup
  // 2 per core of a 40-core GPU: fewer, longer blocks halve the partials each KV row costs
  // against 3 per core, a trade the estimate favours at every split context (docs/decode.md)
  static constexpr uint32_t kDecodeTargetGroups = 80;
  static constexpr uint32_t kDecodeMinBlock = 32;  // 4 rows per simdgroup
  // gdn_decode_step: threadgroups per value head (Hv * 4 = 128 for the model, >= 3 per core
  // of a 40-core GPU), each owning Dv / 4 state rows at 4 per simdgroup.
  static constexpr uint32_t kGdnDecodeSplits = 4;
#define LILY_DECODE_PLAN_CONSTANTS(C) \
  C(kNormGemvRows) C(kRouterRows) C(kRouterSplits) C(kLmHeadThreads) C(kArgmaxSlice) C(kGdnDecodeSplits)

  // Throws std::invalid_argument when `dims` (validated) have no decode kernels. Both are
  // the runtime's and must outlive the plan.
  DecodePlan(const ModelDims& dims, const RuntimeOptions& options);

  // Query heads per attention threadgroup (G).
  uint32_t attn_heads() const { return attn_heads_; }
  bool uses_split_attention(uint32_t position) const;
  // KV rows per split block when `rows` cache rows are attended. Fixed when the split_block
  // option is set; otherwise the smallest multiple of 8 rows (one per simdgroup) >=
  // kDecodeMinBlock giving at most kDecodeTargetGroups threadgroups, so the grid fills a
  // 40-core GPU twice from ~1.3K rows on while the partials stay bounded.
  uint32_t split_rows(uint32_t rows) const;
  // That rule without the option, for `num_q_heads` query heads at `heads_per_threadgroup`
  // (attn_heads_per_group); the lab's kernel bench times the block it gives
  // (lily._core.decode_split_rows).
  static uint32_t split_rows_for(uint32_t rows, uint32_t num_q_heads, uint32_t heads_per_threadgroup);
  // The write-back window (docs/decode.md): the step at `position` writes the Gated DeltaNet
  // state back when (position + 1) % state_window == 0; the others append a ring entry.
  bool ends_window(uint32_t position) const;
  // The most steps a ring holds pending: W - 1, and no more than the context.
  uint32_t ring_capacity() const;
  // One GdnRing entry of a layer (metal/mixer_args.h).
  size_t ring_entry_bytes() const { return ring_entry_bytes_; }

  // The scratch of a step of up to `rows` rows, sized for the model and the context.
  DecodeScratch allocate(const Alloc& scratch, uint32_t rows = 1) const;
  // Looks up every pipeline the step dispatches (throws gpu::UsageError naming an unknown
  // kernel); from then on the plan encodes over `weights`, which must outlive it.
  void bind(gpu::Device& device, const ModelWeights& weights);

  // One step of `seq` at `position` from its token slot `slot`, with `pending` steps in the
  // Gated DeltaNet ring (the state holds the tokens before position - pending); the step
  // writes the state back when it ends a window. Ends with the sampler writing the next
  // token into slot slot ^ 1. The caller moves seq.written.
  void encode_step(gpu::CommandBuffer& cmd, DecodeScratch& s, SequenceState& seq, int slot, uint32_t position,
                   uint32_t pending, Traffic* traffic) const;
  // One row of a batched step: encode_step's sequence, slot, position and pending steps.
  struct Row {
    SequenceState* seq;
    int slot;
    uint32_t position;
    uint32_t pending;
  };
  // One step of 1 .. min(s.rows, kBatchMaxRows) rows, each as encode_step encodes it alone
  // (one row: exactly encode_step). With several, the dense projections (the layers' norm +
  // in_proj / q|k|v_proj, out_proj / o_proj, the router, the final norm + lm_head) run once
  // over the rows (their batched kernels: each weight read once, each row's result bit for
  // bit its batch-1 one), and so do the experts: each row's routing, then the gate/up of each
  // expert of the union of the rows' picks and of the shared expert for the rows that picked it
  // (moe_route_gate_up_batch_q4: each read once), the rows' down projections
  // (moe_down_batch_q4: the shared expert read once, each row's routed experts its own); each
  // row's embedding, attention, Gated DeltaNet step and sampler run per row. Row r's logits are
  // at s.at(s.logits, r).
  void encode_rows(gpu::CommandBuffer& cmd, DecodeScratch& s, const std::vector<Row>& rows,
                   Traffic* traffic) const;
  // Encodes, in a pass of its own, the write-back of `pending` (1 .. ring_capacity()) ring
  // entries of every Gated DeltaNet layer of `seq` (gdn_state_writeback); the caller moves
  // seq.written once everything is encoded.
  void encode_state_writeback(gpu::CommandBuffer& cmd, SequenceState& seq, uint32_t pending) const;
  // Final norm + lm_head over one fp32 row [H] at (x, offset) into s.logits, then (with
  // `sample`) the sampler writing the next token into seq's token slot slot ^ 1. Also the
  // head of a prefill chunk's last row.
  void encode_head(gpu::ComputePass& pass, DecodeScratch& s, SequenceState& seq, gpu::Buffer& x, size_t offset,
                   int slot, bool sample, Traffic& t) const;
  // Token selection by seq.sampling: reads s.logits, writes the next token id into seq's
  // token slot slot ^ 1 (and the log-probabilities of slot `slot`); the position of slot
  // `slot` keys the Philox draw.
  void encode_sample(gpu::ComputePass& pass, DecodeScratch& s, SequenceState& seq, int slot) const;
  // The same for row r of a batched step's scratch (its logits and argmax partials); `parts`
  // the stages to encode (a batched step encodes every row's first stage, then every greedy
  // row's combine: two barrier stages for the rows, each row's dispatches unchanged).
  enum SampleParts : uint32_t { kSampleFirst = 1, kSampleCombine = 2, kSampleAll = 3 };
  void encode_sample(gpu::ComputePass& pass, DecodeScratch& s, uint32_t r, SequenceState& seq, int slot,
                     uint32_t parts = kSampleAll) const;

 private:
  // final norm + lm_head over n rows of x (row r at offset + r * x_stride bytes) into s.logits
  void encode_lm_head(gpu::ComputePass& pass, DecodeScratch& s, gpu::Buffer& x, size_t offset, size_t x_stride,
                      uint32_t n, Traffic& t) const;
  const ModelDims& d_;
  const RuntimeOptions& opt_;
  const ModelWeights* w_ = nullptr;  // bind()
  DecodeKernels kernels_;
  mutable LayerLabels labels_;  // built as stages are first encoded (preflight, at load)
  uint32_t attn_heads_ = 0;
  size_t ring_entry_bytes_ = 0;
};

}  // namespace lily::runtime
