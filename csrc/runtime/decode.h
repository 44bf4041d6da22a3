// Batch-1 decode on the device: the whole step (embedding -> 40 layers -> lm_head -> token
// selection) encoded into one concurrent compute pass with barriers derived from declared
// ranges, session state in device buffers, and the GPU-resident token hand-off (the step's
// sampler writes the next token id into the other token slot, which the next step's
// embedding reads).
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gpu/device.h"
#include "runtime/model.h"

namespace lily::runtime {

struct RuntimeOptions {
  uint32_t max_context = 4096;         // KV-cache rows per attention layer
  uint32_t split_threshold = 32768;    // context at which attention switches to the split path
  uint32_t split_block = 1024;         // KV rows per block on the split path
  bool virtual_weights = false;        // record-only counting: weights need not exist on disk
};

// Bytes a step actually moves (the routed experts it selects, not the whole stacks that
// are declared for hazard tracking because the ids are only known on the GPU).
struct Traffic {
  uint64_t weight_bytes = 0;  // quantized weights, scales, biases, norms, conv weights
  uint64_t kv_bytes = 0;      // KV-cache rows read and written
  uint64_t state_bytes = 0;   // recurrent + conv state read and written
  uint64_t other_bytes = 0;   // activations between kernels
};

// Token selection on the device (metal/sample.metal). Greedy without logprobs runs
// sample_greedy; anything else runs sample_token (penalties from the per-session count
// buffer, temperature, top-k, top-p, min-p, a Philox draw keyed by `seed` with the
// token's position as counter, optional log-probabilities of the raw logits).
struct SamplingConfig {
  float temperature = 0.0f;
  uint32_t top_k = 0;
  float top_p = 1.0f, min_p = 0.0f;
  float presence_penalty = 0.0f, frequency_penalty = 0.0f, repetition_penalty = 1.0f;
  uint64_t seed = 0;
  bool logprobs = false;
  uint32_t top_logprobs = 0;  // 0..20
  bool greedy_kernel() const {
    return temperature == 0.0f && !logprobs && presence_penalty == 0.0f && frequency_penalty == 0.0f &&
           repetition_penalty == 1.0f;
  }
};

// One generated token as the host reads it (one step behind the device).
struct StepOutput {
  uint32_t token = 0;
  float logprob = 0.0f;                                // when SamplingConfig::logprobs
  std::vector<std::pair<uint32_t, float>> top;         // top_logprobs alternatives
};

class DecodeRuntime {
 public:
  DecodeRuntime(std::shared_ptr<gpu::Device> device, ModelDims dims,
                const std::vector<TensorDesc>& tensors, RuntimeOptions options);

  // Empties the session: position 0, zero recurrent/conv state.
  void reset();
  uint32_t position() const { return position_; }
  const ModelDims& dims() const { return dims_; }

  // Runs `tokens` through the model one decode step each. Returns the logits of every
  // position (all_logits) or of the last one, float32 [n or 1, vocab].
  // Throws std::invalid_argument (context full, bad token id) before touching the state.
  std::vector<float> forward(const std::vector<uint32_t>& tokens, bool all_logits);

  // Greedy generation with the GPU token hand-off: `first` is fed at the current position,
  // each step's argmax becomes the next step's input on the device, two command buffers
  // alternate so step n+1 is encoded while step n runs, and the host reads ids one step
  // behind. Stops after `max_tokens`, at an id in `stop_ids` (included in the result), or
  // when the context is full. The one step encoded ahead of a stop has run by then: its
  // output id is discarded, and the token it consumed (the stop id) is part of the
  // session, so position() advances by the number of steps executed (len or len + 1).
  std::vector<uint32_t> generate_greedy(uint32_t first, uint32_t max_tokens,
                                        const std::set<uint32_t>& stop_ids);

  // The same pipeline, one token at a time, for hosts that decide when to stop (stop
  // strings): start() feeds `first` at the current position with `prompt` marking the
  // tokens the repetition penalty sees; next() returns the next generated token (false
  // when max_steps or the context is exhausted) while the following step already runs;
  // finish() waits for the step in flight and commits the session position (every executed
  // step consumed a token: `first`, then the outputs; a speculative step consumes the last
  // returned token and its own output is dropped).
  void start(uint32_t first, const SamplingConfig& cfg, uint32_t max_steps,
             const std::vector<uint32_t>& prompt);
  bool next(StepOutput* out);
  void finish();

  // Encodes one step at `position` into a fresh command buffer and commits it; on a
  // record-only device nothing executes. Returns the device counters and the traffic.
  gpu::Counters count_step(uint32_t position, Traffic* traffic);

  uint64_t weight_bytes() const { return weights_.total_bytes(); }
  uint64_t repacked_bytes() const { return weights_.repacked_bytes(); }
  bool uses_split_attention(uint32_t position) const { return position + 1 > opt_.split_threshold; }

 private:
  struct Layer;
  void encode_step(gpu::CommandBuffer& cb, int slot, uint32_t position, Traffic* traffic);
  void submit_next();
  void write_token(int slot, uint32_t token, uint32_t position);
  gpu::BufferPtr scratch(size_t bytes, const char* label);

  std::shared_ptr<gpu::Device> device_;
  ModelDims dims_;
  RuntimeOptions opt_;
  WeightTable weights_;
  uint32_t position_ = 0;
  bool record_only_ = false;

  // token slots [2] and positions [2] (one per command buffer in flight)
  gpu::BufferPtr tokens_, positions_;
  // activations (fp32)
  gpu::BufferPtr h_, xn_, qkv_, z_, b_, a_, o_, qg_, k_, v_, attn_, router_, ids_,
      route_w_, hbuf_, logits_, part_ml_, part_acc_;
  // session state per layer
  std::vector<gpu::BufferPtr> k_cache_, v_cache_, conv_[2], state_;
  std::vector<gpu::BufferPtr> owned_;

  // sampling: per-session token counts [V] (bit 31: seen in the prompt) and per-slot
  // log-probability outputs
  gpu::BufferPtr counts_, logprob_out_, top_ids_;
  SamplingConfig sampling_;
  // the generation in progress (start/next/finish)
  std::unique_ptr<gpu::CommandBuffer> inflight_[2];
  uint32_t gen_steps_ = 0, gen_encoded_ = 0, gen_done_ = 0;
  bool generating_ = false;
};

}  // namespace lily::runtime
