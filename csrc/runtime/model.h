// The model's dimensions, the weights table (checkpoint tensors as (buffer, offset) views of
// memory-mapped safetensors files; docs/conventions.md: weights are mapped, not copied) and
// the model's layers as structs of tensor references, resolved from the table once at load.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu/device.h"
#include "kernel_args.h"

namespace lily::runtime {

// Text-model hyperparameters (lily.checkpoint.ModelConfig, same names), listed once: the
// struct, its binding (lily._core.ModelDims, whose FIELDS lily.native_backend fills from the
// ModelConfig by name) expand this list. X(type, name, default).
#define LILY_MODEL_DIMS(X)                                                                  \
  X(uint32_t, vocab_size, 0) X(uint32_t, hidden_size, 0) X(uint32_t, num_hidden_layers, 0) \
  X(uint32_t, num_attention_heads, 0) X(uint32_t, num_key_value_heads, 0)                  \
  X(uint32_t, head_dim, 0) X(uint32_t, rotary_dim, 0)                                      \
  X(uint32_t, linear_num_key_heads, 0) X(uint32_t, linear_num_value_heads, 0)              \
  X(uint32_t, linear_key_head_dim, 0) X(uint32_t, linear_value_head_dim, 0)                \
  X(uint32_t, linear_conv_kernel_dim, 0) X(uint32_t, num_experts, 0)                       \
  X(uint32_t, num_experts_per_tok, 0) X(uint32_t, moe_intermediate_size, 0)                \
  X(uint32_t, shared_expert_intermediate_size, 0) X(float, rms_norm_eps, 1e-6f)            \
  X(float, rope_theta, 1e7f) X(bool, norm_topk_prob, true)

struct ModelDims {
#define LILY_DECLARE_FIELD(type, name, init) type name = init;
  LILY_MODEL_DIMS(LILY_DECLARE_FIELD)
  std::vector<bool> full_attention;  // per layer

  uint32_t conv_dim() const {
    return 2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads * linear_value_head_dim;
  }
  // Floats of one GDN layer's recurrent state: S' [Hv, Dv, Dk] then the pending decay c
  // [Hv, Dv] (S = c S' per row; metal/gdn_prefill.metal, "Lazy decay").
  size_t gdn_state_floats() const {
    return size_t(linear_num_value_heads) * linear_value_head_dim * (linear_key_head_dim + 1);
  }
  // Throws std::invalid_argument naming the first inconsistent field.
  void validate() const;
};

// One tensor as stored: `file` is a safetensors path, [offset, offset + nbytes) its bytes.
struct TensorDesc {
  std::string name;
  std::string file;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
};

// A tensor's bytes on the device.
struct TensorRef {
  gpu::Buffer* buffer = nullptr;
  size_t offset = 0;
  size_t nbytes = 0;
  gpu::Range range() const { return gpu::Range{buffer, offset, nbytes}; }
};

class WeightTable {
 public:
  // Maps each distinct file once (a whole-file no-copy buffer; repacked into an aligned
  // device buffer when its tensors are not 16-byte aligned). With `virtual_files`
  // (record-only counting of models that are not on disk) every file becomes a buffer
  // of its declared extent without storage.
  WeightTable(gpu::Device& device, const std::vector<TensorDesc>& tensors, bool virtual_files);
  WeightTable() = default;
  // Bytes each file's tensors extend to (the size of its mapped buffer), by file.
  static std::map<std::string, uint64_t> file_extents(const std::vector<TensorDesc>& tensors);
  // Throws std::invalid_argument naming the tensor when it is absent.
  const TensorRef& at(const std::string& name) const;
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  uint64_t total_bytes() const { return total_bytes_; }
  // Bytes copied because a file's tensors were not 16-byte aligned (0 when mapped as is).
  uint64_t repacked_bytes() const { return repacked_bytes_; }
  static constexpr uint64_t kAlignment = 16;

 private:
  std::map<std::string, gpu::BufferPtr> files_;
  std::map<std::string, TensorRef> tensors_;
  uint64_t total_bytes_ = 0;
  uint64_t repacked_bytes_ = 0;
};

// The quantization the kernels implement, as `mlx_lm convert -q --q-bits 4 --q-group-size 64`
// writes it: MLX affine, kQuantGroup-column groups (metal/decode_args.h), 4-bit weights and an
// 8-bit router (`mlp.gate`) and shared-expert gate (`mlp.shared_expert_gate`).
struct QuantFormat {
  uint32_t bits = 4;
  uint32_t group_size = kernels::kQuantGroup;
};
// The format the kernels read a linear module in (its name without `.weight`, e.g.
// `model.layers.0.mlp.gate`). lily.native_backend checks a checkpoint against it before loading.
QuantFormat native_quant_format(const std::string& module);

// A linear layer quantized as MLX writes it (affine, 64-column groups): packed weight
// [.., out, in * bits / 32] uint32, bf16 scales and biases [.., out, in / 64].
struct QuantLinear {
  const TensorRef* weight = nullptr;
  const TensorRef* scales = nullptr;
  const TensorRef* biases = nullptr;
  uint32_t bits = 4;
  uint64_t nbytes() const { return weight->nbytes + scales->nbytes + biases->nbytes; }
};

// Gated DeltaNet token mixer (`linear_attn`).
struct DeltaNetLayer {
  QuantLinear in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj;
  const TensorRef* conv1d = nullptr;   // [conv_dim, 1, K] bf16
  const TensorRef* A_log = nullptr;    // [Hv] f32
  const TensorRef* dt_bias = nullptr;  // [Hv] bf16
  const TensorRef* norm = nullptr;     // gated RMSNorm weight [Dv] bf16
};

// Full (gated) attention token mixer (`self_attn`).
struct AttentionLayer {
  QuantLinear q_proj, k_proj, v_proj, o_proj;  // q_proj: query | gate per head
  const TensorRef* q_norm = nullptr;           // [head_dim] bf16
  const TensorRef* k_norm = nullptr;
};

// Sparse MoE block (`mlp`): the router (8-bit in MLX's 4-bit checkpoints), the routed
// expert stacks [E, ...] and the shared expert with its sigmoid gate.
struct MoeBlock {
  QuantLinear gate, shared_expert_gate;
  QuantLinear experts_gate_proj, experts_up_proj, experts_down_proj;  // switch_mlp
  QuantLinear shared_gate_proj, shared_up_proj, shared_down_proj;     // shared_expert
};

struct Layer {
  uint32_t index = 0;
  bool full_attention = false;  // attn when true, else gdn
  const TensorRef* input_norm = nullptr;
  const TensorRef* post_attention_norm = nullptr;
  DeltaNetLayer gdn;
  AttentionLayer attn;
  MoeBlock moe;
};

// The whole model as the decode step and the prefill chunk read it.
struct ModelWeights {
  QuantLinear embed;  // embed_tokens [V, H]
  std::vector<Layer> layers;
  const TensorRef* final_norm = nullptr;
  QuantLinear lm_head;
  // Resolves every tensor the runtime reads (the one place checkpoint names appear in C++).
  // Throws std::invalid_argument naming the first missing tensor. The references point into
  // `table`, which must outlive the result.
  static ModelWeights bind(const WeightTable& table, const ModelDims& dims);
};

}  // namespace lily::runtime
