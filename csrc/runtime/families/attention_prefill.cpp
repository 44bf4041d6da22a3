#include "runtime/families/attention_prefill.h"

#include "runtime/encoder.h"

namespace lily::runtime {

namespace args = lily::kernels;

namespace {

constexpr size_t kBf = 2, kF = sizeof(float);

size_t q_bytes(size_t M, size_t Hq, size_t D, bool bf16_q) { return M * Hq * D * (bf16_q ? kBf : kF); }

// rows [r0, r0 + n) of every KV head of both caches, declared read or written
void cache_rows(Op& op, const AttnPrefillBuffers& io, uint32_t Hkv, uint32_t capacity, uint32_t D, uint32_t r0,
                uint32_t n, bool write) {
  const size_t row = size_t(D) * kBf, head_rows = size_t(capacity) * row;
  for (uint32_t kvh = 0; kvh < Hkv; ++kvh)
    for (gpu::Buffer* cache : {&io.k_cache, &io.v_cache}) {
      if (write) op.write(*cache, kvh * head_rows + size_t(r0) * row, size_t(n) * row);
      else op.read(*cache, kvh * head_rows + size_t(r0) * row, size_t(n) * row);
    }
}

}  // namespace

void encode_attn_prefill_prep(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                              const AttnPrefillBuffers& io, const TensorRef& q_norm, const TensorRef& k_norm,
                              const args::AttnPrefillPrepArgs& a, uint32_t D, bool bf16_q,
                              uint64_t* weight_bytes) {
  const size_t M = a.rows, Hq = a.num_q_heads, Hkv = a.num_kv_heads;
  const size_t kv_bytes = M * Hkv * D * kBf;
  Op op(kernel, label);
  op.groups({ceil_div(a.rows, args::kAttnPrefillPrepRows), uint32_t(Hq + Hkv), 1}, {args::kAttnPrefillPrepThreads, 1, 1})
      .in(0, io.qg, 0, M * Hq * 2 * D * kBf)
      .in(1, *io.k, 0, kv_bytes)
      .in(2, *io.v, 0, kv_bytes)
      .in(3, q_norm, weight_bytes)
      .in(4, k_norm, weight_bytes)
      .bind(5, io.k_cache)
      .bind(6, io.v_cache);
  cache_rows(op, io, a.num_kv_heads, a.capacity, D, a.p0, a.rows, true);
  op.out(7, io.q, 0, q_bytes(M, Hq, D, bf16_q)).args(8, a).run(pass);
}

void encode_attn_prefill(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                         const AttnPrefillBuffers& io, const args::AttnPrefillArgs& a, uint32_t D, uint32_t G,
                         bool bf16_q) {
  const size_t M = a.rows, Hq = a.num_q_heads;
  const uint32_t blocks = ceil_div(a.rows, args::kAttnPrefillPairs / G), splits = a.num_splits;
  Op op(kernel, label);
  op.groups({blocks, uint32_t(Hq / G), splits ? splits : 1u}, {args::kAttnPrefillThreads, 1, 1})
      .in(0, io.q, 0, q_bytes(M, Hq, D, bf16_q));
  if (!splits) {
    op.in(1, io.qg, 0, M * Hq * 2 * D * kBf).bind(2, io.k_cache).bind(3, io.v_cache);
    cache_rows(op, io, a.num_kv_heads, a.capacity, D, 0, a.p0 + a.rows, false);
    op.out(4, *io.out, 0, M * Hq * D * kBf).args(5, a).run(pass);
    return;
  }
  op.bind(1, io.k_cache).bind(2, io.v_cache);
  cache_rows(op, io, a.num_kv_heads, a.capacity, D, 0, a.p0 + a.rows, false);
  op.out(3, *io.ml, 0, splits * M * Hq * 2 * kF)
      .out(4, *io.po, 0, splits * M * Hq * D * kF)
      .args(5, a)
      .run(pass);
}

void encode_attn_prefill_combine(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                                 gpu::Buffer& ml, gpu::Buffer& po, gpu::Buffer& qg, gpu::Buffer& out,
                                 const args::AttnPrefillArgs& a, uint32_t D) {
  const size_t M = a.rows, Hq = a.num_q_heads, splits = a.num_splits;
  Op(kernel, label)
      .groups({a.num_q_heads, a.rows, 1}, {D, 1, 1})
      .in(0, ml, 0, splits * M * Hq * 2 * kF)
      .in(1, po, 0, splits * M * Hq * D * kF)
      .in(2, qg, 0, M * Hq * 2 * D * kBf)
      .out(3, out, 0, M * Hq * D * kBf)
      .args(4, a)
      .run(pass);
}

}  // namespace lily::runtime
