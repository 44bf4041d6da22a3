// The prefill phase (docs/prefill.md): its pipelines, the scratch of a chunk, and
// PrefillPlan, which encodes a chunk over (weights, kernels, state) as DecodePlan does a
// step; a chunk's last row goes through the decode plan's head (final norm, lm_head,
// sampler). prefill.cpp implements it; the runtime (runtime.cpp) drives the chunks.
#pragma once

#include <cstdint>
#include <iterator>
#include <utility>
#include <vector>

#include "gpu/device.h"
#include "runtime/decode.h"
#include "runtime/encoder.h"
#include "runtime/model.h"

namespace lily::runtime {

enum class Logits;  // runtime.h

// The pipelines of the prefill chunk, as DecodeKernels; the GEMMs on the device's path
// (simdgroup matrices or tensor operations).
struct PrefillKernels {
  const gpu::Pipeline *embed_rows = nullptr, *rms_norm = nullptr;
  // gemm_add_h: y += x W^T (o_proj, shared down); gemm_add_hs: y += (x * s) W^T (out_proj:
  // u times the GDN norm scale); gemm_bf16: bfloat y (z, q|gate, k, v)
  ByBits gemm, gemm_add_h, gemm_add_hs, gemm_bf16;
  const gpu::Pipeline *gdn_scan = nullptr, *gdn_norm_scale = nullptr, *gdn_conv_state = nullptr;
  const gpu::Pipeline *attn_prep = nullptr, *attn = nullptr, *attn_split = nullptr, *attn_combine = nullptr;
  const gpu::Pipeline *route_clear = nullptr, *route_topk = nullptr, *route_scatter = nullptr;
  const gpu::Pipeline* shared_gate_up = nullptr;
  // grouped expert GEMMs by tile height, in the order of kExpertTileRows (moe_tile_rows)
  const gpu::Pipeline *experts_gate_up[std::size(kernels::kExpertTileRows)] = {},
                     *experts_down[std::size(kernels::kExpertTileRows)] = {};
  const gpu::Pipeline *moe_combine = nullptr, *moe_combine_norm = nullptr;  // the latter: + next input norm
};

// The buffers of one prefill chunk of at most `rows` tokens, shared by whatever runs the
// phase (docs/prefill.md "Data layout of one chunk"): token ids [2] (one per chunk in
// flight), activations, routing, and per layer the expert histograms [2][E] of the last
// chunks. The session state a chunk reads and writes is its SequenceState's.
struct PrefillScratch {
  uint32_t rows = 0;   // tokens per chunk: the prefill_chunk option, or the automatic choice
  uint64_t bytes = 0;  // of the buffers below (Runtime::prefill_scratch_bytes)
  gpu::BufferPtr tok[2], h, xn, qkv, z, b, a, qg, k, v, q, attn, router, ids, w, block_counts, perm, tiles,
      tile_count, hx, yx, hs, part_ml, part_o, logits;
  gpu::BufferPtr oh;      // the GDN scan's u (bfloat, out_proj's input): attn's bytes when they fit
  gpu::BufferPtr gdn_ss;  // the GDN scan's sums of y^2 per (token, head, split), fp32
  gpu::BufferPtr gdn_f;   // gdn_norm_scale's factors per (token, head, split), half
  std::vector<gpu::BufferPtr> hist[2];
  uint32_t logits_rows = 0;  // rows of `logits` (all-logits mode runs lm_head in blocks)
  uint32_t max_tiles = 0;    // entries of `tiles`: every tile class map of the largest tiling
  uint32_t attn_splits = 0;  // capacity of the split-attention partials (0: none allocated)
};

// One chunk to encode: token ids [0, rows) of the scratch's tok[parity] at positions p0 ..
struct Chunk {
  int parity = 0;  // the scratch's token and histogram buffers of this chunk
  uint32_t p0 = 0, rows = 0;
  Logits logits{};         // none (the default), the last row's, or all (the final norm only:
                           // PrefillPlan::encode_lm_head_rows runs lm_head)
  bool sample = false;     // the last row's sampler writes the first generated token
  int measured = -1;       // the parity of the newest completed chunk's expert histograms (-1: none)
  uint32_t tile_rows = 0;  // the expert tile height to encode (preflight); 0: moe_tile_rows chooses
  // The layers to encode, [layer_begin, layer_end) (layer_end 0: to the last): the embedding
  // runs with layer 0, the head (logits, sampler) after the last layer (PrefillPlan::layer_groups).
  uint32_t layer_begin = 0, layer_end = 0;
};

class PrefillPlan {
 public:
  // `head` encodes the last row's final norm, lm_head and sampler. All three must outlive
  // the plan.
  PrefillPlan(const ModelDims& dims, const RuntimeOptions& options, const DecodePlan& head);

  // Picks the GEMM path (gemm_path: Metal 4 tensor operations where the device has them) and
  // the attention's; throws std::invalid_argument when 'tensor' is asked and unavailable.
  void select_paths(const gpu::Device& device);
  // The three families of tensor-op kernels, one metal/<family>_tensor.metal each: the dense
  // GEMMs (gemm), the grouped expert GEMMs (moe_prefill) and the attention (attention_prefill,
  // bfloat operands). select_paths turns all on or off; one that fails its load-time check
  // (Runtime::check_tensor_families) is turned off alone, back to its simdgroup_matrix twins.
  enum Family : uint32_t { kGemmFamily = 1, kMoeFamily = 2, kAttentionFamily = 4 };
  static const char* family_name(Family f);
  // The families on the tensor path (a mask of Family), and the families a kernel name
  // belongs to (0: not a tensor-op kernel).
  uint32_t tensor_families() const { return families_; }
  void set_tensor_families(uint32_t mask) { families_ = mask; }
  static uint32_t family_of(const std::string& kernel);
  // Whether the GEMMs (dense or expert) run the Metal 4 tensor-op kernels.
  bool tensor_ops() const { return families_ & (kGemmFamily | kMoeFamily); }
  // Whether the attention runs them (bfloat operands).
  bool tensor_attention() const { return families_ & kAttentionFamily; }
  // Whether this path has expert tiles of height T (above kMoeSimdgroupTileRowsMax: tensor ops only).
  bool expert_tile_available(uint32_t T) const {
    return T <= kernels::kMoeSimdgroupTileRowsMax || (families_ & kMoeFamily);
  }
  // Minimum KV rows per split of a chunk's attention (split_block, or 1024).
  uint32_t split_rows() const;
  // The command buffers of a chunk of `rows` rows at `p0`: its layers as [begin, end) groups,
  // each holding at most the command_buffer_rows option's work (one group when it is 0) but
  // at least one layer. A layer's work is its rows, an attention layer's rows (1 +
  // c / kAttnLayerRows) for its mean context c (attention grows with the context, the rest
  // of a layer does not): a 4096-row chunk is one layer per command buffer, a 100-row chunk
  // one command buffer (docs/prefill.md "Command buffers").
  std::vector<std::pair<uint32_t, uint32_t>> layer_groups(uint32_t p0, uint32_t rows) const;
  // Context rows at which an attention layer costs twice the rest of a layer (lily estimate's
  // model of Qwen3.6-35B-A3B on an M1: ~9,200; rounded down).
  static constexpr uint32_t kAttnLayerRows = 8192;
  // Whether the context reaches the split attention (its partials and kernels exist).
  bool splits_attention() const;

  // The scratch of a chunk of `rows` tokens.
  PrefillScratch allocate(uint32_t rows, const Alloc& scratch) const;
  // As DecodePlan::bind (after select_paths).
  void bind(gpu::Device& device, const ModelWeights& weights);

  // One chunk of `seq` over `c`; with Logits::last or `sample` the last row goes through the
  // head into `head` (its logits; the sampler writes seq's decode token slot).
  void encode_chunk(gpu::CommandBuffer& cmd, PrefillScratch& c, SequenceState& seq, DecodeScratch& head,
                    const Chunk& chunk, Traffic* traffic) const;
  // Every-position logits: lm_head over rows [r0, r0 + rows) of the last chunk's normed
  // rows into c.logits (rows <= c.logits_rows), in its own compute pass.
  void encode_lm_head_rows(gpu::CommandBuffer& cmd, PrefillScratch& c, uint32_t r0, uint32_t rows) const;

 private:
  uint32_t moe_tile_rows(const PrefillScratch& c, const Chunk& chunk, uint32_t layer) const;

  const ModelDims& d_;
  const RuntimeOptions& opt_;
  const DecodePlan& head_;
  const ModelWeights* w_ = nullptr;  // bind()
  PrefillKernels kernels_;
  mutable LayerLabels labels_;
  uint32_t families_ = 0;  // Family mask on the tensor path (every family: bfloat operands)
};

}  // namespace lily::runtime
