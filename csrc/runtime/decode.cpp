// The decode phase (docs/conventions.md "One plan, two phases"): its pipelines, resolved at
// load, and the step as a list of named dispatches over the layers (model.h), then the final
// norm + lm_head and the sampler. Kernel geometry and bindings follow docs/kernels.md; every
// dispatch declares what it reads and writes, and the compute pass derives the barriers.
#include "runtime/runtime.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "runtime/encoder.h"
#include "runtime/kernel_args.h"

namespace lily::runtime {

namespace args = lily::kernels;

namespace {

constexpr uint32_t kGemvThreads = 64;            // 2 simdgroups
constexpr uint32_t kGemvRowsPerSimdgroup = 4;    // gemv_q*, moe_down_q4 (metal/common.h)
constexpr uint32_t kGemvRowsPerGroup = kGemvRowsPerSimdgroup * kGemvThreads / 32;
// norm_gemv_q* rows per simdgroup (NormGemvArgs): 8 for the wide projections and lm_head,
// 1 for the 257-row router so that it spans ~130 threadgroups instead of 17.
constexpr uint32_t kNormGemvRows = 8;
constexpr uint32_t kRouterRows = 1;
constexpr uint32_t kLmHeadThreads = 256;     // fewer threadgroups re-reading x for the norm
constexpr uint32_t kGateUpRowsPerGroup = 8;  // 2 simdgroups x 4 rows

}  // namespace

uint32_t Runtime::split_rows(uint32_t rows) const {
  if (opt_.split_block) return opt_.split_block;
  const uint64_t per_block = uint64_t(dims_.num_attention_heads / attn_heads_);  // threadgroups per block
  const uint32_t want = ceil_div(uint64_t(rows) * per_block, kDecodeTargetGroups);
  return std::max(kDecodeMinBlock, (want + 7) / 8 * 8);
}

void Runtime::resolve_decode_kernels() {
  const ModelDims& d = dims_;
  gpu::Device& dev = *device_;
  DecodeKernels& k = decode_kernels_;
  const std::string attn_suffix = "_d" + std::to_string(d.head_dim) + "_g" + std::to_string(attn_heads_);
  k.embed_norm_gemv = &dev.pipeline("embed_norm_gemv_q4");
  k.norm_gemv = ByBits(dev, "norm_gemv", "", {4, 8});
  k.gemv_add = ByBits(dev, "gemv", "_add", {4});
  k.gemv_gated_add = ByBits(dev, "gemv_gated", "_add", {4});
  if (d.linear_value_head_dim % 32 || d.linear_value_head_dim % (4 * kGdnDecodeSplits))
    throw gpu::UsageError("gdn_decode_step: linear_value_head_dim must be a multiple of 32 and of 4 x the splits");
  const std::string gdn_suffix = "_k" + std::to_string(d.linear_key_head_dim) + "_v" +
                                 std::to_string(d.linear_value_head_dim);
  k.gdn_step = &dev.pipeline("gdn_decode_step" + gdn_suffix);
  k.gdn_writeback = &dev.pipeline("gdn_state_writeback" + gdn_suffix);
  k.attn = &dev.pipeline("attn_decode_fused" + attn_suffix);
  if (uses_split_attention(opt_.max_context - 1)) {
    k.attn_split = &dev.pipeline("attn_decode_split_fused" + attn_suffix);
    k.attn_combine = &dev.pipeline("attn_combine_d" + std::to_string(d.head_dim));
  }
  k.moe_gate_up = &dev.pipeline("moe_route_gate_up_swiglu_q4");
  k.moe_down = &dev.pipeline("moe_down_q4");
  k.argmax_partial = &dev.pipeline("argmax_partial");
  k.argmax_partial_bias = &dev.pipeline("argmax_partial_bias");
  k.sample_greedy_combine = &dev.pipeline("sample_greedy_combine");
  k.sample_token = &dev.pipeline("sample_token");
}

void Runtime::encode_state_writeback(gpu::CommandBuffer& cmd, uint32_t pending) {
  const ModelDims& d = dims_;
  if (pending == 0 || pending > ring_capacity())
    throw std::logic_error("encode_state_writeback: " + std::to_string(pending) + " pending steps");
  const uint32_t Hv = d.linear_num_value_heads, Dv = d.linear_value_head_dim;
  gpu::ComputePass& pass = cmd.compute_pass();
  for (const Layer& layer : model_.layers) {
    if (layer.full_attention) continue;
    const uint32_t l = layer.index;
    Op(*decode_kernels_.gdn_writeback, labels_(l, "gdn state write-back"))
        .groups(gpu::Size3{Hv, kGdnDecodeSplits, 1}, gpu::Size3{Dv / kGdnDecodeSplits * 8, 1, 1})
        .inout(0, *state_[l], 0, d.gdn_state_floats() * sizeof(float))
        .in(1, *ring_[l], 0, pending * ring_entry_bytes_)
        .args(2, args::GdnDecodeArgs{d.linear_num_key_heads, Hv, d.linear_conv_kernel_dim, 1e-6f, pending, 1})
        .run(pass);
  }
  pass.end();
}

void Runtime::encode_step(gpu::CommandBuffer& cmd, int slot, uint32_t position, uint32_t pending, Traffic* tr) {
  const ModelDims& d = dims_;
  if (pending > position % opt_.state_window)  // a window's last step always writes back
    throw std::logic_error("encode_step: " + std::to_string(pending) + " pending steps at position " +
                           std::to_string(position));
  const bool write_back = ends_window(position);
  const DecodeKernels& K = decode_kernels_;
  gpu::ComputePass& pass = cmd.compute_pass();
  Traffic local;
  Traffic& t = tr ? *tr : local;
  const size_t f = sizeof(float);
  const uint32_t H = d.hidden_size;
  const size_t u32 = sizeof(uint32_t);
  auto tg = [](uint32_t x, uint32_t y = 1) { return gpu::Size3{x, y, 1}; };
  // y += W x with one row of W per simdgroup lane group, by a kernel of `kernels`
  // (gemv_q*_add, or gemv_gated_q*_add, whose extra bindings the caller adds); not yet run.
  auto gemv_add_op = [&](const ByBits& kernels, const QuantLinear& w, gpu::Buffer& x, size_t cols,
                         gpu::Buffer& y, size_t rows, const std::string& label) {
    Op op(kernels[w.bits], label);
    op.groups(tg(ceil_div(rows, kGemvRowsPerGroup)), tg(kGemvThreads));
    op.in(0, w, &t.weight_bytes).in(3, x, 0, cols * f).inout(4, y, 0, rows * f);
    op.args(5, args::GemvArgs{uint32_t(rows), uint32_t(cols)});
    t.other_bytes += cols * f + rows * f * 2;
    return op;
  };
  auto gemv_add = [&](const QuantLinear& w, gpu::Buffer& x, size_t cols, gpu::Buffer& y, size_t rows,
                      const std::string& label) { gemv_add_op(K.gemv_add, w, x, cols, y, rows, label).run(pass); };
  // RMSNorm of the residual fused into up to four GEMVs of one weight width that read the
  // normalised vector (norm_gemv_q*); `xn_out` also stores that vector for later kernels.
  struct Proj { const QuantLinear& w; gpu::Buffer* out; size_t offset; uint32_t rows; };
  // With `embed`, the step's embedding lookup is fused in (embed_norm_gemv_q4): the row of
  // the token in this step's slot becomes h (written) and the norm's input.
  auto norm_gemv = [&](const TensorRef& norm_w, std::initializer_list<Proj> projs, bool xn_out, uint32_t rps,
                       const std::string& label, bool embed = false) {
    const uint32_t per_group = rps * kGemvThreads / 32;
    args::NormGemvArgs na{{0, 0, 0, 0}, H, d.rms_norm_eps, xn_out ? 1u : 0u, rps};
    uint32_t groups = 0;
    Op op(embed ? *K.embed_norm_gemv : K.norm_gemv[projs.begin()->w.bits], label);
    if (embed) {
      op.in(20, *model_.embed.weight).in(21, *model_.embed.scales).in(22, *model_.embed.biases)
          .in(23, *tokens_, slot * u32, u32).args(24, args::EmbedArgs{H, d.vocab_size}).out(0, *h_, 0, H * f);
      t.weight_bytes += H / 2 + 2 * (H / 64) * 2;  // the row it really reads
    } else {
      op.in(0, *h_, 0, H * f);
    }
    op.in(1, norm_w, &t.weight_bytes);
    if (xn_out) op.out(2, *xn_, 0, H * f); else op.bind(2, *xn_);
    uint32_t m = 0;
    for (const Proj& pr : projs) {
      const uint32_t base = 3 + 4 * m;
      na.rows[m++] = pr.rows;
      groups += ceil_div(pr.rows, per_group);
      op.in(base, pr.w, &t.weight_bytes).out(base + 3, *pr.out, pr.offset, size_t(pr.rows) * f);
      t.other_bytes += size_t(pr.rows) * f;
    }
    for (; m < 4; ++m) {  // unused slot: bound (every argument must be), nothing declared
      const uint32_t base = 3 + 4 * m;
      op.bind(base, *h_).bind(base + 1, *h_).bind(base + 2, *h_).bind(base + 3, *xn_);
    }
    op.groups(tg(groups), tg(kGemvThreads)).args(19, na).run(pass);
    t.other_bytes += H * f * (xn_out ? 2 : 1);
  };

  // The embedding of the token in this step's slot (written by the previous step's sampler)
  // is looked up inside layer 0's first norm_gemv.
  for (const Layer& layer : model_.layers) {
    const uint32_t l = layer.index;
    const bool first = l == 0;
    if (!layer.full_attention) {
      // ---- Gated DeltaNet
      const DeltaNetLayer& g = layer.gdn;
      const uint32_t Hv = d.linear_num_value_heads, Dv = d.linear_value_head_dim;
      norm_gemv(*layer.input_norm, {{g.in_proj_qkv, qkv_.get(), 0, d.conv_dim()},
                                    {g.in_proj_z, z_.get(), 0, Hv * Dv},
                                    {g.in_proj_b, b_.get(), 0, Hv},
                                    {g.in_proj_a, a_.get(), 0, Hv}},
                false, kNormGemvRows,
                labels_(l, first ? "embed + input norm + in_proj qkv|z|b|a" : "input norm + in_proj qkv|z|b|a"), first);
      gpu::Buffer& conv_in = *conv_[position % 2][l];
      gpu::Buffer& conv_out = *conv_[(position + 1) % 2][l];
      const size_t conv_bytes = conv_in.size();
      const size_t state_bytes = d.gdn_state_floats() * f;  // S' and c
      // gdn_decode_step: NS threadgroups per head, each Dv / NS * 8 threads (4 state rows per
      // simdgroup); y and per-split sums of squares, the gated norm is out_proj's
      const size_t ssq_bytes = size_t(Hv) * kGdnDecodeSplits * f;
      // the state read, the ring's pending entries replayed; then either the state written
      // back or this step's entry appended (metal/gdn.metal, "Write-back window")
      const size_t entry_bytes = ring_entry_bytes_;
      Op op(*K.gdn_step, labels_(l, "gdn step"));
      op.groups(tg(Hv, kGdnDecodeSplits), tg(Dv / kGdnDecodeSplits * 8))
          .in(0, *qkv_, 0, d.conv_dim() * f).in(1, *b_, 0, Hv * f).in(2, *a_, 0, Hv * f)
          .in(3, *g.conv1d, &t.weight_bytes).in(4, *g.A_log, &t.weight_bytes)
          .in(5, *g.dt_bias, &t.weight_bytes)
          .in(6, conv_in, 0, conv_bytes).out(7, conv_out, 0, conv_bytes)
          .out(9, *o_, 0, size_t(Hv) * Dv * f).out(10, *o_ssq_, 0, ssq_bytes)
          .args(11, args::GdnDecodeArgs{d.linear_num_key_heads, Hv, d.linear_conv_kernel_dim, 1e-6f, pending,
                                        write_back ? 1u : 0u})
          .bind(12, *ring_[l]);
      if (write_back) op.inout(8, *state_[l], 0, state_bytes);
      else op.in(8, *state_[l], 0, state_bytes).write(*ring_[l], pending * entry_bytes, entry_bytes);
      if (pending) op.read(*ring_[l], 0, pending * entry_bytes);
      op.run(pass);
      t.state_bytes += 2 * conv_bytes + state_bytes + (write_back ? state_bytes : entry_bytes) + pending * entry_bytes;
      t.other_bytes += 2 * ssq_bytes;  // written, then read by out_proj
      // out_proj: y += W gated_rmsnorm(o) (gemv_gated_q*_add), the norm applied on load
      const size_t cols = size_t(Hv) * Dv;
      gemv_add_op(K.gemv_gated_add, g.out_proj, *o_, cols, *h_, H, labels_(l, "gated norm + out_proj"))
          .in(6, *o_ssq_, 0, ssq_bytes).in(7, *z_, 0, cols * f).in(8, *g.norm, &t.weight_bytes)
          .args(9, args::GatedNormArgs{Dv, kGdnDecodeSplits, d.rms_norm_eps})
          .run(pass);
      t.other_bytes += cols * f;  // z
    } else {
      // ---- full attention
      const AttentionLayer& a = layer.attn;
      const uint32_t Hq = d.num_attention_heads, Hkv = d.num_key_value_heads, D = d.head_dim;
      norm_gemv(*layer.input_norm, {{a.q_proj, qg_.get(), 0, Hq * D * 2},
                                    {a.k_proj, k_.get(), 0, Hkv * D},
                                    {a.v_proj, v_.get(), 0, Hkv * D}},
                false, kNormGemvRows, labels_(l, first ? "embed + input norm + q|k|v_proj" : "input norm + q|k|v_proj"),
                first);
      // q/k RMSNorm + partial RoPE + KV append + attention in one dispatch: the new row is
      // used from threadgroup memory and written to the cache once per KV head.
      // One threadgroup per G = 8 query heads (each KV row read once); from split_threshold on
      // the rows are cut into blocks (split_rows) so ~kDecodeTargetGroups threadgroups share them.
      const size_t row = size_t(D) * 2, head_rows = size_t(opt_.max_context) * row;
      const uint32_t G = attn_heads_;
      const uint32_t max_blocks = decode_max_blocks_;
      const bool split = uses_split_attention(position);
      const uint32_t block = split ? split_rows(position + 1) : 0;
      const uint32_t nblocks = split ? ceil_div(position + 1, block) : 1;
      const args::AttnFusedArgs af{Hq, Hkv, d.rotary_dim, opt_.max_context, d.rms_norm_eps,
                               float(std::log2(double(d.rope_theta))), float(1.0 / std::sqrt(double(D))),
                               block, max_blocks};
      Op op(split ? *K.attn_split : *K.attn,
            split ? labels_(l, "qk prep + kv append + attention split") : labels_(l, "qk prep + kv append + attention"));
      op.groups(tg(Hq / G, nblocks), tg(256))
          .in(0, *qg_, 0, size_t(Hq) * D * 2 * f).in(1, *k_, 0, size_t(Hkv) * D * f)
          .in(2, *v_, 0, size_t(Hkv) * D * f)
          .in(3, *a.q_norm, &t.weight_bytes).in(4, *a.k_norm, &t.weight_bytes)
          .in(5, *positions_, slot * u32, u32).bind(6, *k_cache_[l]).bind(7, *v_cache_[l]);
      for (uint32_t kvh = 0; kvh < Hkv; ++kvh) {
        for (auto* cache : {k_cache_[l].get(), v_cache_[l].get()}) {
          if (position) op.read(*cache, kvh * head_rows, size_t(position) * row);
          op.write(*cache, kvh * head_rows + size_t(position) * row, row);
        }
      }
      t.kv_bytes += 2 * size_t(Hkv) * (size_t(position) + 1) * row;
      if (!split) {
        op.out(8, *attn_, 0, size_t(Hq) * D * f).args(9, af).run(pass);
      } else {
        op.out(8, *part_ml_, 0, part_ml_->size()).out(9, *part_acc_, 0, part_acc_->size()).args(10, af).run(pass);
        Op(*K.attn_combine, labels_(l, "attention combine"))
            .groups(tg(Hq, D / 32), tg(256))  // 8 simdgroups split the blocks of 32 columns
            .in(0, *part_ml_, 0, part_ml_->size()).in(1, *part_acc_, 0, part_acc_->size())
            .in(2, *qg_, D * f, (size_t(Hq) * D * 2 - D) * f).in(3, *positions_, slot * u32, u32)
            .out(4, *attn_, 0, size_t(Hq) * D * f)
            .args(5, args::AttnCombineArgs{Hq, 2 * D, block, max_blocks}).run(pass);
        t.other_bytes += 2 * size_t(Hq) * nblocks * (D + 2) * f;  // partials written, then read
      }
      gemv_add(a.o_proj, *attn_, size_t(Hq) * D, *h_, H, labels_(l, "o_proj"));
    }

    // ---- MoE
    const MoeBlock& m = layer.moe;
    const uint32_t E = d.num_experts, k = d.num_experts_per_tok;
    const uint32_t I = d.moe_intermediate_size, Is = d.shared_expert_intermediate_size;
    norm_gemv(*layer.post_attention_norm, {{m.gate, router_.get(), 0, E}, {m.shared_expert_gate, router_.get(), E * f, 1}},
              true, kRouterRows, labels_(l, "post-attention norm + router|shared gate"));
    const args::MoeArgs ma{H, I, Is, E, k};
    // Bytes the selected experts really move (the declared ranges cover whole stacks).
    const uint64_t expert_q4 = uint64_t(I) * H / 2 + 2 * uint64_t(I) * (H / 64) * 2;
    const uint64_t shared_q4 = uint64_t(Is) * H / 2 + 2 * uint64_t(Is) * (H / 64) * 2;
    Op(*K.moe_gate_up, labels_(l, "route top-k + experts gate|up"))
        .groups(tg(ceil_div(std::max(I, Is), kGateUpRowsPerGroup), k + 1), tg(kGemvThreads))
        .in(0, *xn_, 0, H * f).in(1, *router_, 0, (E + 1) * f)
        .in(2, m.experts_gate_proj).in(5, m.experts_up_proj).in(8, m.shared_gate_proj).in(11, m.shared_up_proj)
        .out(14, *hbuf_, 0, hbuf_->size()).out(15, *ids_, 0, k * u32).out(16, *route_w_, 0, (k + 1) * f)
        .args(17, args::MoeRouteArgs{H, I, Is, E, k, d.norm_topk_prob ? 1u : 0u}).run(pass);
    t.weight_bytes += 2 * (k * expert_q4 + shared_q4);
    Op(*K.moe_down, labels_(l, "experts down + shared"))
        .groups(tg(ceil_div(H, kGemvRowsPerGroup)), tg(kGemvThreads))
        .in(0, *hbuf_, 0, hbuf_->size()).in(1, *ids_, 0, k * u32).in(2, *route_w_, 0, (k + 1) * f)
        .in(3, m.experts_down_proj).in(6, m.shared_down_proj)
        .inout(9, *h_, 0, H * f).args(10, ma).run(pass);
    t.weight_bytes += k * expert_q4 + shared_q4;
  }

  encode_head(pass, *h_, 0, slot, true, t);
  pass.end();
}


void Runtime::encode_head(gpu::ComputePass& pass, gpu::Buffer& x, size_t offset, int slot, bool sample,
                          Traffic& t) {
  const ModelDims& d = dims_;
  const size_t f = sizeof(float);
  const uint32_t H = d.hidden_size;
  // final norm + lm_head: norm_gemv_q4 with one matrix (slots 1..3 unused: bound, not declared)
  {
    const uint32_t per_group = kNormGemvRows * kLmHeadThreads / 32;
    Op op(decode_kernels_.norm_gemv[model_.lm_head.bits], "final norm + lm_head");
    op.in(0, x, offset, H * f).in(1, *model_.final_norm, &t.weight_bytes).bind(2, *xn_)
        .in(3, model_.lm_head, &t.weight_bytes).out(6, *logits_, 0, size_t(d.vocab_size) * f);
    for (uint32_t m = 1; m < 4; ++m) {
      const uint32_t base = 3 + 4 * m;
      op.bind(base, *h_).bind(base + 1, *h_).bind(base + 2, *h_).bind(base + 3, *xn_);
    }
    op.groups({ceil_div(d.vocab_size, per_group), 1, 1}, {kLmHeadThreads, 1, 1})
        .args(19, args::NormGemvArgs{{d.vocab_size, 0, 0, 0}, H, d.rms_norm_eps, 0u, kNormGemvRows}).run(pass);
    t.other_bytes += H * f + size_t(d.vocab_size) * f;
  }
  if (sample) encode_sample(pass, slot);
}

// Token selection: reads logits_, writes the next token id into token slot slot ^ 1 (and the
// log-probabilities of slot `slot`); the position of slot `slot` keys the Philox draw.
void Runtime::encode_sample(gpu::ComputePass& pass, int slot) {
  const ModelDims& d = dims_;
  const DecodeKernels& K = decode_kernels_;
  const size_t f = sizeof(float), u32 = sizeof(uint32_t);
  auto tg = [](uint32_t x) { return gpu::Size3{x, 1, 1}; };
  const SamplingConfig& sc = sampling_;
  const bool bias = !sc.logit_bias.empty();
  const size_t vf = size_t(d.vocab_size) * f;
  if (sc.greedy_kernel()) {
    // Argmax in two stages so the ~1 MB of logits is read by many threadgroups: partials per
    // slice, then one threadgroup reduces them and writes the token (no host round trip).
    // A logit bias is one more [V] read in the first stage (a kernel of its own).
    const uint32_t parts = ceil_div(d.vocab_size, kArgmaxSlice);
    const size_t part_bytes = size_t(parts) * 2 * u32;
    Op partial(bias ? *K.argmax_partial_bias : *K.argmax_partial,
               bias ? "greedy argmax partials (+ logit bias)" : "greedy argmax partials");
    partial.groups(tg(parts), tg(256)).in(0, *logits_, 0, vf)
        .out(1, *argmax_part_, 0, part_bytes).args(2, args::ArgmaxArgs{d.vocab_size, kArgmaxSlice});
    if (bias) partial.in(3, *bias_, 0, vf);
    partial.run(pass);
    Op(*K.sample_greedy_combine, "greedy token -> next slot")
        .groups(tg(1), tg(std::min<uint32_t>(1024, ceil_div(parts, 32) * 32))).in(0, *argmax_part_, 0, part_bytes)
        .out(1, *tokens_, (slot ^ 1) * u32, u32).args(2, args::ArgmaxArgs{parts, 0}).run(pass);
  } else {
    const bool penalties = sc.presence_penalty != 0.0f || sc.frequency_penalty != 0.0f ||
                           sc.repetition_penalty != 1.0f;
    args::SampleArgs sa{d.vocab_size, sc.temperature, sc.top_k, sc.top_p, sc.min_p, sc.presence_penalty,
                    sc.frequency_penalty, sc.repetition_penalty, uint32_t(sc.seed), uint32_t(sc.seed >> 32),
                    sc.logprobs ? 1u : 0u, sc.top_logprobs, penalties ? 1u : 0u, bias ? 1u : 0u};
    const size_t lp = kMaxTopLogprobs * f, ti = kMaxTopLogprobs * u32;
    Op op(*K.sample_token, "sample token -> next slot");
    op.groups(tg(1), tg(1024)).in(0, *logits_, 0, size_t(d.vocab_size) * f)
        .inout(1, *counts_, 0, counts_->size()).in(2, *positions_, slot * u32, u32)
        .out(3, *tokens_, (slot ^ 1) * u32, u32)
        .out(4, *logprob_out_, slot * lp, lp).out(5, *top_ids_, slot * ti, ti).args(6, sa);
    if (bias) op.in(7, *bias_, 0, vf); else op.bind(7, *bias_);  // bound (every argument must be), unread
    op.run(pass);
  }
}

}  // namespace lily::runtime
