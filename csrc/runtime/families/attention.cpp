#include "runtime/families/attention.h"

#include "runtime/encoder.h"
#include "runtime/runtime.h"

namespace lily::runtime {

namespace args = lily::kernels;

void encode_attn_decode_fused(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                              const AttnStepBuffers& io, const args::AttnFusedArgs& a, uint32_t D, uint32_t G,
                              uint32_t position, uint32_t extra_blocks, Traffic* traffic) {
  Traffic local;
  Traffic& t = traffic ? *traffic : local;
  const size_t f = sizeof(float), Hq = a.num_q_heads, Hkv = a.num_kv_heads;
  const bool split = a.block_rows != 0;
  const uint32_t nblocks = split ? ceil_div(position + 1, a.block_rows) + extra_blocks : 1;
  const size_t row = size_t(D) * 2, head_rows = size_t(a.capacity) * row;  // bf16 cache rows
  Op op(kernel, label);
  op.groups({uint32_t(Hq / G), nblocks, 1}, {args::kAttnDecodeThreads, 1, 1})
      .in(0, io.qg, io.qg_at, Hq * D * 2 * f)
      .in(1, io.k, io.k_at, Hkv * D * f)
      .in(2, io.v, io.v_at, Hkv * D * f)
      .in(3, io.q_norm, &t.weight_bytes)
      .in(4, io.k_norm, &t.weight_bytes)
      .in(5, io.positions, io.position_at, sizeof(uint32_t))
      .bind(6, io.k_cache)
      .bind(7, io.v_cache);
  for (uint32_t kvh = 0; kvh < Hkv; ++kvh) {
    for (gpu::Buffer* cache : {&io.k_cache, &io.v_cache}) {
      if (position) op.read(*cache, kvh * head_rows, size_t(position) * row);
      op.write(*cache, kvh * head_rows + size_t(position) * row, row);
    }
  }
  t.kv_bytes += 2 * Hkv * (size_t(position) + 1) * row;
  if (!split) {
    op.out(8, *io.out, io.out_at, Hq * D * f).args(9, a).run(pass);
    return;
  }
  op.out(8, *io.ml, io.ml_at, Hq * a.max_blocks * 2 * f)
      .out(9, *io.acc, io.acc_at, Hq * a.max_blocks * D * f)
      .args(10, a)
      .run(pass);
  t.other_bytes += 2 * Hq * nblocks * (D + 2) * f;  // partials written, then read
}

void encode_attn_combine(gpu::ComputePass& pass, const gpu::Pipeline& kernel, std::string_view label,
                         const AttnCombineBuffers& io, const args::AttnCombineArgs& a, uint32_t D) {
  const size_t f = sizeof(float), Hq = a.num_q_heads;
  Op(kernel, label)
      .groups({uint32_t(Hq), D / 32, 1}, {args::kAttnCombineThreads, 1, 1})  // simdgroups split the blocks
      .in(0, io.ml, io.ml_at, Hq * a.max_blocks * 2 * f)
      .in(1, io.acc, io.acc_at, Hq * a.max_blocks * D * f)
      .in(2, io.gate, io.gate_at, ((Hq - 1) * a.gate_stride + D) * f)
      .in(3, io.positions, io.position_at, sizeof(uint32_t))
      .out(4, io.out, io.out_at, Hq * D * f)
      .args(5, a)
      .run(pass);
}

}  // namespace lily::runtime
