// The decode step as a list of named stages (ARCHITECTURE.md "One plan, two phases").
// Kernel geometry and bindings follow docs/kernels.md; every dispatch declares what it
// reads and writes, and the compute pass derives the barriers from that.
#include "runtime/decode.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace lily::runtime {

// Host mirrors of the kernels' argument structs (metal/common.h, metal/mixer_args.h):
// 32-bit fields, no padding; the sizes are checked against the documented ones.
namespace args {
struct Gemv { uint32_t rows, cols; };
struct Embed { uint32_t cols, vocab; };
struct Moe { uint32_t hidden, inter, inter_shared, experts, top_k; };
struct MoeRoute { uint32_t hidden, inter, inter_shared, experts, top_k, norm_topk; };
struct NormGemv { uint32_t rows[4]; uint32_t cols; float eps; uint32_t write_xn; };
struct Gdn { uint32_t num_k_heads, num_v_heads, conv_kernel; float norm_eps, l2_eps; };
struct AttnFused {
  uint32_t num_q_heads, num_kv_heads, rotary_dim, capacity; float norm_eps, log2_theta, scale;
  uint32_t block_rows, max_blocks;
};
struct AttnCombine { uint32_t num_q_heads, gate_stride, block_rows, max_blocks; };
struct Greedy { uint32_t vocab; };
struct Sample {
  uint32_t vocab; float temperature; uint32_t top_k; float top_p, min_p, presence_penalty,
      frequency_penalty, repetition_penalty; uint32_t seed_lo, seed_hi, logprobs, top_logprobs, update_counts;
};
static_assert(sizeof(Sample) == 52, "arg layout");
static_assert(sizeof(Gemv) == 8 && sizeof(Embed) == 8, "arg layout");
static_assert(sizeof(Moe) == 20 && sizeof(Gdn) == 20, "arg layout");
static_assert(sizeof(MoeRoute) == 24 && sizeof(NormGemv) == 28, "arg layout");
static_assert(sizeof(AttnFused) == 36 && sizeof(AttnCombine) == 16, "arg layout");
}  // namespace args

namespace {

constexpr uint32_t kGemvThreads = 64;        // 2 simdgroups x 8 rows = 16 rows per threadgroup
constexpr uint32_t kGemvRowsPerGroup = 16;
constexpr uint32_t kLmHeadThreads = 256;     // fewer threadgroups re-reading x for the norm
constexpr uint32_t kGateUpRowsPerGroup = 8;  // 2 simdgroups x 4 rows
constexpr uint32_t kMaxTopLogprobs1 = 21;    // chosen token + up to 20 alternatives

uint32_t ceil_div(uint64_t a, uint64_t b) { return uint32_t((a + b - 1) / b); }

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

}  // namespace

DecodeRuntime::DecodeRuntime(std::shared_ptr<gpu::Device> device, ModelDims dims,
                             const std::vector<TensorDesc>& tensors, RuntimeOptions options)
    : device_(std::move(device)),
      dims_(std::move(dims)),
      opt_(options),
      weights_(*device_, tensors, options.virtual_weights) {
  dims_.validate();
  if (opt_.max_context == 0) throw std::invalid_argument("max_context must be positive");
  if (opt_.split_block == 0) throw std::invalid_argument("split_block must be positive");
  const auto& d = dims_;
  const uint32_t group = d.num_attention_heads / d.num_key_value_heads;
  if (group % 2) throw std::invalid_argument("decode attention needs an even number of query heads per KV head");
  if (d.head_dim != 64 && d.head_dim != 256)
    throw std::invalid_argument("decode attention kernels exist for head_dim 64 and 256, got " +
                                std::to_string(d.head_dim));
  if (d.linear_key_head_dim != d.linear_value_head_dim ||
      (d.linear_key_head_dim != 128 && d.linear_key_head_dim != 32))
    throw std::invalid_argument("Gated DeltaNet kernels exist for Dk = Dv = 128 or 32");

  const size_t f = sizeof(float);
  tokens_ = scratch(2 * sizeof(uint32_t), "token slots");
  positions_ = scratch(2 * sizeof(uint32_t), "positions");
  h_ = scratch(d.hidden_size * f, "h (residual)");
  xn_ = scratch(d.hidden_size * f, "xn (normed)");
  qkv_ = scratch(d.conv_dim() * f, "gdn qkv");
  z_ = scratch(size_t(d.linear_num_value_heads) * d.linear_value_head_dim * f, "gdn z");
  b_ = scratch(d.linear_num_value_heads * f, "gdn b");
  a_ = scratch(d.linear_num_value_heads * f, "gdn a");
  o_ = scratch(size_t(d.linear_num_value_heads) * d.linear_value_head_dim * f, "gdn out");
  qg_ = scratch(size_t(d.num_attention_heads) * d.head_dim * 2 * f, "attn q|gate");
  k_ = scratch(size_t(d.num_key_value_heads) * d.head_dim * f, "attn k");
  v_ = scratch(size_t(d.num_key_value_heads) * d.head_dim * f, "attn v");
  attn_ = scratch(size_t(d.num_attention_heads) * d.head_dim * f, "attn out");
  router_ = scratch((d.num_experts + 1) * f, "router logits | shared-expert gate logit");
  ids_ = scratch(d.num_experts_per_tok * sizeof(uint32_t), "expert ids");
  route_w_ = scratch((d.num_experts_per_tok + 1) * f, "routing weights");
  hbuf_ = scratch((size_t(d.num_experts_per_tok) * d.moe_intermediate_size + d.shared_expert_intermediate_size) * f,
                  "expert hidden");
  logits_ = scratch(size_t(d.vocab_size) * f, "logits");
  const uint32_t max_blocks = ceil_div(opt_.max_context, opt_.split_block);
  part_ml_ = scratch(size_t(d.num_attention_heads) * max_blocks * 2 * f, "attn partial m,l");
  part_acc_ = scratch(size_t(d.num_attention_heads) * max_blocks * d.head_dim * f, "attn partial acc");

  const size_t kv_bytes = size_t(d.num_key_value_heads) * opt_.max_context * d.head_dim * 2;
  k_cache_.resize(d.num_hidden_layers);
  v_cache_.resize(d.num_hidden_layers);
  conv_[0].resize(d.num_hidden_layers);
  conv_[1].resize(d.num_hidden_layers);
  state_.resize(d.num_hidden_layers);
  for (uint32_t l = 0; l < d.num_hidden_layers; ++l) {
    if (d.full_attention[l]) {
      k_cache_[l] = scratch(kv_bytes, "k cache");
      v_cache_[l] = scratch(kv_bytes, "v cache");
    } else {
      const size_t conv = size_t(d.linear_conv_kernel_dim - 1) * d.conv_dim() * f;
      conv_[0][l] = scratch(conv, "conv state A");
      conv_[1][l] = scratch(conv, "conv state B");
      state_[l] = scratch(size_t(d.linear_num_value_heads) * d.linear_value_head_dim *
                              d.linear_key_head_dim * f, "recurrent state");
    }
  }
  counts_ = scratch(size_t(d.vocab_size) * sizeof(uint32_t), "token counts");
  logprob_out_ = scratch(2 * kMaxTopLogprobs1 * f, "logprobs (per slot)");
  top_ids_ = scratch(2 * kMaxTopLogprobs1 * sizeof(uint32_t), "top logprob ids (per slot)");
  record_only_ = tokens_->contents() == nullptr;
  reset();
}

gpu::BufferPtr DecodeRuntime::scratch(size_t bytes, const char* label) {
  gpu::BufferPtr b = device_->new_buffer(std::max<size_t>(bytes, 4));
  b->set_label(label);
  owned_.push_back(b);
  return b;
}

void DecodeRuntime::reset() {
  finish();
  position_ = 0;
  if (record_only_) return;
  // The recurrent and conv state start at zero; the KV cache needs no clearing (rows past
  // the position are never read).
  for (uint32_t l = 0; l < dims_.num_hidden_layers; ++l) {
    if (dims_.full_attention[l]) continue;
    for (auto* buf : {conv_[0][l].get(), conv_[1][l].get(), state_[l].get()})
      std::memset(buf->contents(), 0, buf->size());
  }
}

void DecodeRuntime::write_token(int slot, uint32_t token, uint32_t position) {
  static_cast<uint32_t*>(tokens_->contents())[slot] = token;
  static_cast<uint32_t*>(positions_->contents())[slot] = position;
}

void DecodeRuntime::encode_step(gpu::CommandBuffer& cb, int slot, uint32_t position, Traffic* tr) {
  const ModelDims& d = dims_;
  gpu::Device& dev = *device_;
  gpu::ComputePass& pass = cb.compute_pass();
  Traffic local;
  Traffic& t = tr ? *tr : local;
  const size_t f = sizeof(float);
  const uint32_t H = d.hidden_size;
  const size_t u32 = sizeof(uint32_t);
  auto W = [&](const std::string& name) -> const TensorRef& { return weights_.at(name); };
  auto tg = [](uint32_t x, uint32_t y = 1) { return gpu::Size3{x, y, 1}; };
  // A quantized linear's three tensors, bound at i, i+1, i+2 (weight, scales, biases).
  auto qlin = [&](Op& op, uint32_t i, const std::string& m, uint64_t* traffic) -> Op& {
    return op.in(i, W(m + ".weight"), traffic).in(i + 1, W(m + ".scales"), traffic).in(i + 2, W(m + ".biases"), traffic);
  };
  auto gemv = [&](const std::string& module, uint32_t bits, bool add, gpu::Buffer& x, size_t cols,
                  gpu::Buffer& y, size_t rows, const std::string& label) {
    Op op(dev, std::string("gemv_q") + std::to_string(bits) + (add ? "_add" : ""), label);
    op.groups(tg(ceil_div(rows, kGemvRowsPerGroup)), tg(kGemvThreads));
    qlin(op, 0, module, &t.weight_bytes).in(3, x, 0, cols * f);
    if (add) op.inout(4, y, 0, rows * f); else op.out(4, y, 0, rows * f);
    op.args(5, args::Gemv{uint32_t(rows), uint32_t(cols)}).run(pass);
    t.other_bytes += cols * f + rows * f * (add ? 2 : 1);
  };
  // RMSNorm of the residual fused into up to four GEMVs that read the normalised vector
  // (norm_gemv_q*); `xn_out` also stores that vector for later kernels.
  struct Proj { std::string module; gpu::Buffer* out; size_t offset; uint32_t rows; };
  // With `embed`, the step's embedding lookup is fused in (embed_norm_gemv_q4): the row of
  // the token in this step's slot becomes h (written) and the norm's input.
  auto norm_gemv = [&](uint32_t bits, const TensorRef& norm_w, std::vector<Proj> projs, bool xn_out,
                       uint32_t threads, const std::string& label, bool embed = false) {
    const uint32_t per_group = 8 * threads / 32;
    args::NormGemv na{{0, 0, 0, 0}, H, d.rms_norm_eps, xn_out ? 1u : 0u};
    uint32_t groups = 0;
    Op op(dev, (embed ? "embed_norm_gemv_q" : "norm_gemv_q") + std::to_string(bits), label);
    if (embed) {
      op.in(20, W("model.embed_tokens.weight")).in(21, W("model.embed_tokens.scales"))
          .in(22, W("model.embed_tokens.biases")).in(23, *tokens_, slot * u32, u32)
          .args(24, args::Embed{H, d.vocab_size}).out(0, *h_, 0, H * f);
      t.weight_bytes += H / 2 + 2 * (H / 64) * 2;  // the row it really reads
    } else {
      op.in(0, *h_, 0, H * f);
    }
    op.in(1, norm_w, &t.weight_bytes);
    if (xn_out) op.out(2, *xn_, 0, H * f); else op.bind(2, *xn_);
    for (uint32_t m = 0; m < 4; ++m) {
      const uint32_t base = 3 + 4 * m;
      if (m < projs.size()) {
        const Proj& pr = projs[m];
        na.rows[m] = pr.rows;
        groups += ceil_div(pr.rows, per_group);
        qlin(op, base, pr.module, &t.weight_bytes).out(base + 3, *pr.out, pr.offset, size_t(pr.rows) * f);
        t.other_bytes += size_t(pr.rows) * f;
      } else {  // unused slot: bound (every argument must be), nothing declared
        op.bind(base, *h_).bind(base + 1, *h_).bind(base + 2, *h_).bind(base + 3, *xn_);
      }
    }
    op.groups(tg(groups), tg(threads)).args(19, na).run(pass);
    t.other_bytes += H * f * (xn_out ? 2 : 1);
  };

  // The embedding of the token in this step's slot (written by the previous step's sampler)
  // is looked up inside layer 0's first norm_gemv.
  for (uint32_t l = 0; l < d.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l);
    const std::string L = "L" + std::to_string(l) + " ";
    const TensorRef& in_norm = W(p + ".input_layernorm.weight");
    if (!d.full_attention[l]) {
      // ---- Gated DeltaNet
      const std::string g = p + ".linear_attn";
      const uint32_t Hv = d.linear_num_value_heads, Dv = d.linear_value_head_dim, Dk = d.linear_key_head_dim;
      norm_gemv(4, in_norm, {{g + ".in_proj_qkv", qkv_.get(), 0, d.conv_dim()},
                             {g + ".in_proj_z", z_.get(), 0, Hv * Dv},
                             {g + ".in_proj_b", b_.get(), 0, Hv},
                             {g + ".in_proj_a", a_.get(), 0, Hv}},
                false, kGemvThreads, (l == 0 ? L + "embed + " : L) + "input norm + in_proj qkv|z|b|a", l == 0);
      gpu::Buffer& conv_in = *conv_[position % 2][l];
      gpu::Buffer& conv_out = *conv_[(position + 1) % 2][l];
      const size_t conv_bytes = conv_in.size();
      const size_t state_bytes = size_t(Hv) * Dv * Dk * f;
      Op op(dev, "gdn_decode_step_k" + std::to_string(Dk) + "_v" + std::to_string(Dv), L + "gdn step");
      op.groups(tg(Hv), tg(1024))
          .in(0, *qkv_, 0, d.conv_dim() * f).in(1, *z_, 0, size_t(Hv) * Dv * f)
          .in(2, *b_, 0, Hv * f).in(3, *a_, 0, Hv * f)
          .in(4, W(g + ".conv1d.weight"), &t.weight_bytes).in(5, W(g + ".A_log"), &t.weight_bytes)
          .in(6, W(g + ".dt_bias"), &t.weight_bytes).in(7, W(g + ".norm.weight"), &t.weight_bytes)
          .in(8, conv_in, 0, conv_bytes).out(9, conv_out, 0, conv_bytes)
          .inout(10, *state_[l], 0, state_bytes).out(11, *o_, 0, size_t(Hv) * Dv * f)
          .args(12, args::Gdn{d.linear_num_key_heads, Hv, d.linear_conv_kernel_dim, d.rms_norm_eps, 1e-6f})
          .run(pass);
      t.state_bytes += 2 * conv_bytes + 2 * state_bytes;
      gemv(g + ".out_proj", 4, true, *o_, size_t(Hv) * Dv, *h_, H, L + "out_proj");
    } else {
      // ---- full attention
      const std::string a = p + ".self_attn";
      const uint32_t Hq = d.num_attention_heads, Hkv = d.num_key_value_heads, D = d.head_dim;
      norm_gemv(4, in_norm, {{a + ".q_proj", qg_.get(), 0, Hq * D * 2},
                             {a + ".k_proj", k_.get(), 0, Hkv * D},
                             {a + ".v_proj", v_.get(), 0, Hkv * D}},
                false, kGemvThreads, (l == 0 ? L + "embed + " : L) + "input norm + q|k|v_proj", l == 0);
      // q/k RMSNorm + partial RoPE + KV append + attention in one dispatch: the new row is
      // used from threadgroup memory and written to the cache once per KV head.
      const size_t row = size_t(D) * 2, head_rows = size_t(opt_.max_context) * row;
      const uint32_t group = Hq / Hkv;
      const uint32_t G = group % 4 == 0 ? 4 : 2;
      const std::string suffix = "_d" + std::to_string(D) + "_g" + std::to_string(G);
      const uint32_t max_blocks = ceil_div(opt_.max_context, opt_.split_block);
      const args::AttnFused af{Hq, Hkv, d.rotary_dim, opt_.max_context, d.rms_norm_eps,
                               float(std::log2(double(d.rope_theta))), float(1.0 / std::sqrt(double(D))),
                               opt_.split_block, max_blocks};
      const bool split = uses_split_attention(position);
      Op op(dev, (split ? "attn_decode_split_fused" : "attn_decode_fused") + suffix,
            L + (split ? "qk prep + kv append + attention split" : "qk prep + kv append + attention"));
      op.groups(tg(Hq / G, split ? ceil_div(position + 1, opt_.split_block) : 1), tg(256))
          .in(0, *qg_, 0, size_t(Hq) * D * 2 * f).in(1, *k_, 0, size_t(Hkv) * D * f)
          .in(2, *v_, 0, size_t(Hkv) * D * f)
          .in(3, W(a + ".q_norm.weight"), &t.weight_bytes).in(4, W(a + ".k_norm.weight"), &t.weight_bytes)
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
        Op comb(dev, "attn_combine_d" + std::to_string(D), L + "attention combine");
        comb.groups(tg(Hq), tg(D))
            .in(0, *part_ml_, 0, part_ml_->size()).in(1, *part_acc_, 0, part_acc_->size())
            .in(2, *qg_, D * f, (size_t(Hq) * D * 2 - D) * f).in(3, *positions_, slot * u32, u32)
            .out(4, *attn_, 0, size_t(Hq) * D * f)
            .args(5, args::AttnCombine{Hq, 2 * D, opt_.split_block, max_blocks}).run(pass);
      }
      gemv(a + ".o_proj", 4, true, *attn_, size_t(Hq) * D, *h_, H, L + "o_proj");
    }

    // ---- MoE
    const std::string m = p + ".mlp";
    const uint32_t E = d.num_experts, k = d.num_experts_per_tok;
    const uint32_t I = d.moe_intermediate_size, Is = d.shared_expert_intermediate_size;
    norm_gemv(8, W(p + ".post_attention_layernorm.weight"),
              {{m + ".gate", router_.get(), 0, E}, {m + ".shared_expert_gate", router_.get(), E * f, 1}},
              true, kGemvThreads, L + "post-attention norm + router|shared gate");
    const args::Moe ma{H, I, Is, E, k};
    // Bytes the selected experts really move (the declared ranges cover whole stacks).
    const uint64_t expert_q4 = uint64_t(I) * H / 2 + 2 * uint64_t(I) * (H / 64) * 2;
    const uint64_t shared_q4 = uint64_t(Is) * H / 2 + 2 * uint64_t(Is) * (H / 64) * 2;
    {
      Op op(dev, "moe_route_gate_up_swiglu_q4", L + "route top-k + experts gate|up");
      op.groups(tg(ceil_div(std::max(I, Is), kGateUpRowsPerGroup), k + 1), tg(kGemvThreads))
          .in(0, *xn_, 0, H * f).in(1, *router_, 0, (E + 1) * f);
      qlin(op, 2, m + ".switch_mlp.gate_proj", nullptr);
      qlin(op, 5, m + ".switch_mlp.up_proj", nullptr);
      qlin(op, 8, m + ".shared_expert.gate_proj", nullptr);
      qlin(op, 11, m + ".shared_expert.up_proj", nullptr);
      op.out(14, *hbuf_, 0, hbuf_->size()).out(15, *ids_, 0, k * u32).out(16, *route_w_, 0, (k + 1) * f)
          .args(17, args::MoeRoute{H, I, Is, E, k, d.norm_topk_prob ? 1u : 0u}).run(pass);
      t.weight_bytes += 2 * (k * expert_q4 + shared_q4);
    }
    {
      Op op(dev, "moe_down_q4", L + "experts down + shared");
      op.groups(tg(ceil_div(H, kGemvRowsPerGroup)), tg(kGemvThreads))
          .in(0, *hbuf_, 0, hbuf_->size()).in(1, *ids_, 0, k * u32).in(2, *route_w_, 0, (k + 1) * f);
      qlin(op, 3, m + ".switch_mlp.down_proj", nullptr);
      qlin(op, 6, m + ".shared_expert.down_proj", nullptr);
      op.inout(9, *h_, 0, H * f).args(10, ma).run(pass);
      t.weight_bytes += k * expert_q4 + shared_q4;
    }
  }

  norm_gemv(4, W("model.norm.weight"), {{"lm_head", logits_.get(), 0, d.vocab_size}}, false,
            kLmHeadThreads, "final norm + lm_head");
  const SamplingConfig& sc = sampling_;
  if (sc.greedy_kernel()) {
    Op op(dev, "sample_greedy", "greedy token -> next slot");
    op.groups(tg(1), tg(1024)).in(0, *logits_, 0, size_t(d.vocab_size) * f)
        .out(1, *tokens_, (slot ^ 1) * u32, u32).args(2, args::Greedy{d.vocab_size}).run(pass);
  } else {
    const bool penalties = sc.presence_penalty != 0.0f || sc.frequency_penalty != 0.0f ||
                           sc.repetition_penalty != 1.0f;
    args::Sample sa{d.vocab_size, sc.temperature, sc.top_k, sc.top_p, sc.min_p, sc.presence_penalty,
                    sc.frequency_penalty, sc.repetition_penalty, uint32_t(sc.seed), uint32_t(sc.seed >> 32),
                    sc.logprobs ? 1u : 0u, sc.top_logprobs, penalties ? 1u : 0u};
    const size_t lp = kMaxTopLogprobs1 * f, ti = kMaxTopLogprobs1 * u32;
    Op op(dev, "sample_token", "sample token -> next slot");
    op.groups(tg(1), tg(1024)).in(0, *logits_, 0, size_t(d.vocab_size) * f)
        .inout(1, *counts_, 0, counts_->size()).in(2, *positions_, slot * u32, u32)
        .out(3, *tokens_, (slot ^ 1) * u32, u32)
        .out(4, *logprob_out_, slot * lp, lp).out(5, *top_ids_, slot * ti, ti).args(6, sa).run(pass);
  }
  pass.end();
}

std::vector<float> DecodeRuntime::forward(const std::vector<uint32_t>& tokens, bool all_logits) {
  if (record_only_) throw std::invalid_argument("forward: the device is record-only");
  finish();  // a generation left open ends here (its steps are part of the session)
  if (tokens.empty()) throw std::invalid_argument("forward: no tokens");
  if (uint64_t(position_) + tokens.size() > opt_.max_context)
    throw std::invalid_argument("forward: " + std::to_string(position_) + " tokens in context + " +
                                std::to_string(tokens.size()) + " new exceed the context window of " +
                                std::to_string(opt_.max_context));
  for (uint32_t tok : tokens)
    if (tok >= dims_.vocab_size)
      throw std::invalid_argument("forward: token id " + std::to_string(tok) + " is outside the vocabulary");
  const size_t V = dims_.vocab_size;
  std::vector<float> out(all_logits ? tokens.size() * V : V);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int slot = position_ % 2;
    write_token(slot, tokens[i], position_);
    auto cb = device_->new_command_buffer();
    encode_step(*cb, slot, position_, nullptr);
    cb->commit();
    cb->wait();
    ++position_;
    if (all_logits || i + 1 == tokens.size())
      std::memcpy(out.data() + (all_logits ? i * V : 0), logits_->contents(), V * sizeof(float));
  }
  return out;
}

void DecodeRuntime::start(uint32_t first, const SamplingConfig& cfg, uint32_t max_steps,
                          const std::vector<uint32_t>& prompt) {
  if (record_only_) throw std::invalid_argument("generate: the device is record-only");
  if (generating_) throw std::logic_error("generate: a generation is already running");
  if (first >= dims_.vocab_size) throw std::invalid_argument("generate: token id " + std::to_string(first) +
                                                             " is outside the vocabulary");
  if (position_ >= opt_.max_context)
    throw std::invalid_argument("generate: the context window of " + std::to_string(opt_.max_context) +
                                " tokens is full");
  if (cfg.top_logprobs + 1 > kMaxTopLogprobs1) throw std::invalid_argument("generate: top_logprobs > 20");
  sampling_ = cfg;
  auto* counts = static_cast<uint32_t*>(counts_->contents());
  std::memset(counts, 0, counts_->size());
  for (uint32_t t : prompt)
    if (t < dims_.vocab_size) counts[t] = 0x80000000u;
  gen_steps_ = uint32_t(std::min<uint64_t>(max_steps, uint64_t(opt_.max_context) - position_));
  gen_encoded_ = gen_done_ = 0;
  generating_ = true;
  write_token(position_ % 2, first, position_);
  if (gen_steps_) submit_next();
}

void DecodeRuntime::submit_next() {
  const uint32_t pos = position_ + gen_encoded_;
  const int slot = pos % 2;
  static_cast<uint32_t*>(positions_->contents())[slot] = pos;  // the token itself comes from the GPU
  inflight_[slot] = device_->new_command_buffer();
  encode_step(*inflight_[slot], slot, pos, nullptr);
  inflight_[slot]->commit();
  ++gen_encoded_;
}

bool DecodeRuntime::next(StepOutput* out) {
  if (!generating_) throw std::logic_error("generate: next() without start()");
  if (gen_done_ == gen_encoded_) return false;
  // Encode step n+1 before waiting on step n, so the device never idles on the host.
  if (gen_encoded_ < gen_steps_ && gen_encoded_ - gen_done_ < 2) submit_next();
  const int slot = (position_ + gen_done_) % 2;
  inflight_[slot]->wait();
  inflight_[slot].reset();
  ++gen_done_;
  out->token = static_cast<const uint32_t*>(tokens_->contents())[slot ^ 1];
  out->top.clear();
  if (sampling_.logprobs) {
    const float* lp = static_cast<const float*>(logprob_out_->contents()) + slot * kMaxTopLogprobs1;
    const uint32_t* ids = static_cast<const uint32_t*>(top_ids_->contents()) + slot * kMaxTopLogprobs1;
    out->logprob = lp[0];
    for (uint32_t i = 0; i < sampling_.top_logprobs; ++i) out->top.emplace_back(ids[i], lp[1 + i]);
  }
  return true;
}

void DecodeRuntime::finish() {
  if (!generating_) return;
  for (auto& cb : inflight_) {
    if (cb) {
      cb->wait();
      cb.reset();
      ++gen_done_;
    }
  }
  position_ += gen_done_;
  generating_ = false;
}

std::vector<uint32_t> DecodeRuntime::generate_greedy(uint32_t first, uint32_t max_tokens,
                                                     const std::set<uint32_t>& stop_ids) {
  std::vector<uint32_t> out;
  if (max_tokens == 0) return out;
  start(first, SamplingConfig{}, max_tokens, {});
  StepOutput o;
  while (next(&o)) {
    out.push_back(o.token);
    if (stop_ids.count(o.token)) break;
  }
  finish();
  return out;
}

gpu::Counters DecodeRuntime::count_step(uint32_t position, Traffic* traffic) {
  if (position >= opt_.max_context)
    throw std::invalid_argument("count_step: position " + std::to_string(position) +
                                " is outside the context window of " + std::to_string(opt_.max_context));
  auto cb = device_->new_command_buffer();
  encode_step(*cb, position % 2, position, traffic);
  gpu::Counters c = cb->counters();
  cb->commit();
  cb->wait();
  return c;
}

}  // namespace lily::runtime
