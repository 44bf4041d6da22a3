#include "runtime/model.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace lily::runtime {

void ModelDims::validate() const {
  auto need = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("model dims: ") + what);
  };
  need(hidden_size > 0 && hidden_size % 64 == 0, "hidden_size must be a positive multiple of 64");
  need(num_hidden_layers == full_attention.size(), "layer types must list every layer");
  need(num_key_value_heads > 0 && num_attention_heads % num_key_value_heads == 0,
       "num_attention_heads must be a multiple of num_key_value_heads");
  need(linear_num_key_heads > 0 && linear_num_value_heads % linear_num_key_heads == 0,
       "linear_num_value_heads must be a multiple of linear_num_key_heads");
  need(num_experts_per_tok > 0 && num_experts_per_tok <= num_experts,
       "num_experts_per_tok must be in 1..num_experts");
  need(moe_intermediate_size % 64 == 0 && shared_expert_intermediate_size % 64 == 0,
       "expert intermediate sizes must be multiples of 64");
  need(rotary_dim % 2 == 0 && rotary_dim <= head_dim, "rotary_dim must be even and <= head_dim");
  need(linear_conv_kernel_dim >= 2, "linear_conv_kernel_dim must be >= 2");
}

std::map<std::string, uint64_t> WeightTable::file_extents(const std::vector<TensorDesc>& tensors) {
  std::map<std::string, uint64_t> r;
  for (const auto& t : tensors) r[t.file] = std::max<uint64_t>(r[t.file], t.offset + t.nbytes);
  return r;
}

WeightTable::WeightTable(gpu::Device& device, const std::vector<TensorDesc>& tensors,
                         bool virtual_files) {
  std::map<std::string, std::vector<const TensorDesc*>> by_file;
  for (const auto& t : tensors) by_file[t.file].push_back(&t);
  const auto extents = file_extents(tensors);
  for (const auto& [file, list] : by_file) {
    const uint64_t end = extents.at(file);
    bool aligned = true;
    for (const TensorDesc* t : list) aligned = aligned && t->offset % kAlignment == 0;
    if (virtual_files) {
      files_[file] = device.new_buffer(end);
      files_[file]->set_label(file);
      for (const TensorDesc* t : list)
        tensors_[t->name] = TensorRef{files_[file].get(), size_t(t->offset), size_t(t->nbytes)};
      continue;
    }
    gpu::BufferPtr mapped = device.map_file(file);
    if (mapped->size() < end)
      throw std::invalid_argument("weights: " + file + " is shorter than its tensors need (" +
                                  std::to_string(end) + " bytes)");
    if (aligned) {
      files_[file] = mapped;
      for (const TensorDesc* t : list)
        tensors_[t->name] = TensorRef{mapped.get(), size_t(t->offset), size_t(t->nbytes)};
      continue;
    }
    // safetensors does not align tensor data (MLX's files put tensors at 2 mod 16), but
    // the kernels load 16-byte words: repack this file's tensors at aligned offsets.
    uint64_t size = 0;
    for (const TensorDesc* t : list) size = (size + kAlignment - 1) / kAlignment * kAlignment + t->nbytes;
    gpu::BufferPtr packed = device.new_buffer(std::max<uint64_t>(size, 1));
    packed->set_label(file + " (aligned copy)");
    auto* dst = static_cast<uint8_t*>(packed->contents());  // null on a record-only device
    uint64_t at = 0;
    for (const TensorDesc* t : list) {
      at = (at + kAlignment - 1) / kAlignment * kAlignment;
      if (dst) std::memcpy(dst + at, static_cast<const uint8_t*>(mapped->contents()) + t->offset, t->nbytes);
      tensors_[t->name] = TensorRef{packed.get(), size_t(at), size_t(t->nbytes)};
      at += t->nbytes;
    }
    files_[file] = packed;
    repacked_bytes_ += size;
  }
  for (const auto& t : tensors) total_bytes_ += t.nbytes;
}

const TensorRef& WeightTable::at(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw std::invalid_argument("weights: missing tensor " + name);
  return it->second;
}

QuantFormat native_quant_format(const std::string& module) {
  auto ends_with = [&](const char* s) {
    const size_t n = std::strlen(s);
    return module.size() >= n && module.compare(module.size() - n, n, s) == 0;
  };
  return QuantFormat{ends_with(".mlp.gate") || ends_with(".mlp.shared_expert_gate") ? 8u : 4u, kernels::kQuantGroup};
}

ModelWeights ModelWeights::bind(const WeightTable& table, const ModelDims& d) {
  auto tensor = [&](const std::string& name) { return &table.at(name); };
  // The sizes must be those of native_quant_format: a packed weight of out * in * bits / 8
  // bytes and bf16 scales and biases of out * in / group * 2 bytes each (lily.native_backend refuses
  // another format by the config before anything is mapped; this catches a config that
  // does not tell the truth).
  auto linear = [&](const std::string& module, uint32_t bits) {
    QuantLinear q{tensor(module + ".weight"), tensor(module + ".scales"), tensor(module + ".biases"), bits};
    const QuantFormat f = native_quant_format(module);
    const uint64_t elements = q.weight->nbytes * 8 / f.bits;
    if (f.bits != bits || q.scales->nbytes != q.biases->nbytes || q.scales->nbytes / 2 * f.group_size != elements)
      throw std::invalid_argument("weights: " + module + " is not quantized as the native kernels read it (" +
                                  std::to_string(f.bits) + "-bit in groups of " + std::to_string(f.group_size) +
                                  "): packed weight " + std::to_string(q.weight->nbytes) + " bytes, scales " +
                                  std::to_string(q.scales->nbytes) + " bytes, biases " +
                                  std::to_string(q.biases->nbytes) + " bytes");
    return q;
  };
  ModelWeights w;
  w.embed = linear("model.embed_tokens", 4);
  for (uint32_t l = 0; l < d.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l);
    Layer L;
    L.index = l;
    L.full_attention = d.full_attention[l];
    L.input_norm = tensor(p + ".input_layernorm.weight");
    L.post_attention_norm = tensor(p + ".post_attention_layernorm.weight");
    if (L.full_attention) {
      const std::string a = p + ".self_attn";
      L.attn = AttentionLayer{linear(a + ".q_proj", 4), linear(a + ".k_proj", 4), linear(a + ".v_proj", 4),
                              linear(a + ".o_proj", 4), tensor(a + ".q_norm.weight"), tensor(a + ".k_norm.weight")};
    } else {
      const std::string g = p + ".linear_attn";
      L.gdn = DeltaNetLayer{linear(g + ".in_proj_qkv", 4), linear(g + ".in_proj_z", 4),
                            linear(g + ".in_proj_b", 4),   linear(g + ".in_proj_a", 4),
                            linear(g + ".out_proj", 4),    tensor(g + ".conv1d.weight"),
                            tensor(g + ".A_log"),          tensor(g + ".dt_bias"),
                            tensor(g + ".norm.weight")};
    }
    const std::string m = p + ".mlp";
    L.moe = MoeBlock{linear(m + ".gate", 8),
                     linear(m + ".shared_expert_gate", 8),
                     linear(m + ".switch_mlp.gate_proj", 4),
                     linear(m + ".switch_mlp.up_proj", 4),
                     linear(m + ".switch_mlp.down_proj", 4),
                     linear(m + ".shared_expert.gate_proj", 4),
                     linear(m + ".shared_expert.up_proj", 4),
                     linear(m + ".shared_expert.down_proj", 4)};
    w.layers.push_back(L);
  }
  w.final_norm = tensor("model.norm.weight");
  w.lm_head = linear("lm_head", 4);
  return w;
}

}  // namespace lily::runtime
