// Encoding helpers shared by the decode step (decode.cpp) and the prefill chunk
// (prefill.cpp): a dispatch builder that binds buffers together with the byte ranges they
// declare, so the compute pass can derive the barriers.
#pragma once

#include <cstdint>
#include <string>

#include "gpu/device.h"
#include "runtime/model.h"

namespace lily::runtime {

inline uint32_t ceil_div(uint64_t a, uint64_t b) { return uint32_t((a + b - 1) / b); }

// Query heads per attention threadgroup (decode and prefill): the largest of 8, 4, 2 dividing
// the GQA group, so each KV row is read by as few threadgroups as possible (one for the
// model's groups of 8); 0 if none divides it.
inline uint32_t attn_heads_per_group(uint32_t group) {
  for (uint32_t g : {8u, 4u, 2u})
    if (group % g == 0) return g;
  return 0;
}

// Builds one dispatch: bindings together with the ranges they declare.
class Op {
 public:
  Op(gpu::Device& dev, const std::string& kernel, std::string label) {
    d_.pipeline = &dev.pipeline(kernel);
    d_.label = std::move(label);
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
  Op& out(uint32_t i, gpu::Buffer& b, size_t off, size_t n) {
    d_.bindings.push_back(gpu::Binding::buf(i, b, off));
    d_.writes.push_back(gpu::Range{&b, off, n});
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
