// Encoding helpers shared by the decode step (decode.cpp) and the prefill chunk
// (prefill.cpp): a dispatch builder that binds buffers together with the byte ranges they
// declare, so the compute pass can derive the barriers; pipelines per weight width; the
// per-layer dispatch labels; the allocator the phases size their scratch with.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpu/device.h"
#include "runtime/kernel_names.h"
#include "runtime/model.h"

namespace lily::runtime {

inline uint32_t ceil_div(uint64_t a, uint64_t b) { return uint32_t((a + b - 1) / b); }

// Where a runtime buffer's bytes are counted (MemoryUse).
enum class Mem { scratch, kv_cache, state };
// Allocates a labelled device buffer for the runtime (Runtime::scratch), counted in its
// MemoryUse; while the runtime sizes itself it only counts, and returns null.
struct Alloc {
  std::function<gpu::BufferPtr(size_t, const char*, Mem)> fn;
  gpu::BufferPtr operator()(size_t bytes, const char* label, Mem kind = Mem::scratch) const {
    return fn(bytes, label, kind);
  }
};

// Query heads per attention threadgroup (decode and prefill): the largest of 8, 4, 2 dividing
// the GQA group, so each KV row is read by as few threadgroups as possible (one for the
// model's groups of 8); 0 if none divides it.
inline uint32_t attn_heads_per_group(uint32_t group) {
  for (uint32_t g : {8u, 4u, 2u})
    if (group % g == 0) return g;
  return 0;
}

// One kernel's _q4 and _q8 instantiations, looked up at load (only the widths the plan
// uses); indexed by QuantLinear::bits.
class ByBits {
 public:
  ByBits() = default;
  // Resolves `<base>_q<bits><suffix>` for each of `widths`; throws gpu::UsageError naming
  // an unknown kernel.
  ByBits(gpu::Device& dev, const std::string& base, const std::string& suffix, std::vector<uint32_t> widths)
      : base_(base) {
    for (uint32_t b : widths) slot(b) = &dev.pipeline(kernel_name(base, {{'q', b}}, suffix));
  }
  const gpu::Pipeline& operator[](uint32_t bits) const {
    const gpu::Pipeline* p = bits == 4 || bits == 8 ? by_bits_[bits == 8] : nullptr;
    if (!p) throw gpu::UsageError(base_ + ": no " + std::to_string(bits) + "-bit kernel resolved at load");
    return *p;
  }

 private:
  const gpu::Pipeline*& slot(uint32_t bits) {
    if (bits != 4 && bits != 8) throw gpu::UsageError(base_ + ": no " + std::to_string(bits) + "-bit kernel");
    return by_bits_[bits == 8];
  }
  std::string base_;
  const gpu::Pipeline* by_bits_[2] = {nullptr, nullptr};
};

// Dispatch labels "L<layer> <stage>" (named by the counters' records and hazard messages).
// Each is built the first time its stage is encoded (preflight, at load) and afterwards found
// by the address of the stage's string literal, so encoding a step does no string work.
class LayerLabels {
 public:
  explicit LayerLabels(uint32_t layers = 0) : by_layer_(layers) {}
  // `stage` must be a string literal (its address is the key). The reference stays valid.
  const std::string& operator()(uint32_t layer, const char* stage) {
    auto& labels = by_layer_.at(layer);
    for (const auto& [key, label] : labels)
      if (key == stage) return label;
    labels.emplace_back(stage, "L" + std::to_string(layer) + " " + stage);
    return labels.back().second;
  }

 private:
  std::vector<std::deque<std::pair<const char*, std::string>>> by_layer_;
};

// Builds one dispatch: bindings together with the ranges they declare.
class Op {
 public:
  Op(const gpu::Pipeline& pipeline, std::string_view label) {
    d_.pipeline = &pipeline;
    d_.label.assign(label);
  }
  Op& groups(gpu::Size3 grid, gpu::Size3 tg) {
    d_.grid = grid; d_.threadgroup = tg; d_.grid_is_threadgroups = true;
    return *this;
  }
  Op& threads(gpu::Size3 grid, gpu::Size3 tg) {
    d_.grid = grid; d_.threadgroup = tg; d_.grid_is_threadgroups = false;
    return *this;
  }
  // Binds [[buffer(i)]] at t and declares the whole tensor read.
  Op& in(uint32_t i, const TensorRef& t, uint64_t* traffic = nullptr) {
    d_.bindings.push_back(gpu::Binding::buf(i, *t.buffer, t.offset));
    d_.reads.push_back(t.range());
    if (traffic) *traffic += t.nbytes;
    return *this;
  }
  Op& in(uint32_t i, gpu::Buffer& b, size_t off, size_t n) { return in(i, TensorRef{&b, off, n}); }
  // A quantized linear's three tensors at i, i + 1, i + 2 (weight, scales, biases).
  Op& in(uint32_t i, const QuantLinear& w, uint64_t* traffic = nullptr) {
    return in(i, *w.weight, traffic).in(i + 1, *w.scales, traffic).in(i + 2, *w.biases, traffic);
  }
  Op& out(uint32_t i, gpu::Buffer& b, size_t off, size_t n) {
    d_.bindings.push_back(gpu::Binding::buf(i, b, off));
    d_.writes.push_back(gpu::Range{&b, off, n});
    return *this;
  }
  // As out(), for a dispatch of a group that writes disjoint elements of one range (tag:
  // Range::disjoint, nonzero); the group shares a barrier stage.
  Op& out_disjoint(uint32_t i, gpu::Buffer& b, size_t off, size_t n, uint32_t tag) {
    out(i, b, off, n);
    d_.writes.back().disjoint = tag;
    return *this;
  }
  Op& inout(uint32_t i, gpu::Buffer& b, size_t off, size_t n) {
    out(i, b, off, n);
    d_.reads.push_back(gpu::Range{&b, off, n});
    return *this;
  }
  // Binds without declaring (the caller declares narrower ranges with read()/write()).
  Op& bind(uint32_t i, gpu::Buffer& b, size_t off = 0) {
    d_.bindings.push_back(gpu::Binding::buf(i, b, off));
    return *this;
  }
  Op& read(gpu::Buffer& b, size_t off, size_t n) { d_.reads.push_back({&b, off, n}); return *this; }
  Op& write(gpu::Buffer& b, size_t off, size_t n) { d_.writes.push_back({&b, off, n}); return *this; }
  template <class T>
  Op& args(uint32_t i, const T& a) {
    d_.bindings.push_back(gpu::Binding::constant_bytes(i, &a, sizeof(T)));
    return *this;
  }
  void run(gpu::ComputePass& pass) { pass.dispatch(d_); }

 private:
  gpu::Dispatch d_;
};

}  // namespace lily::runtime
