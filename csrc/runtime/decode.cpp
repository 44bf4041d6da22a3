// The decode phase (docs/conventions.md "One plan, two phases"; decode.h): its pipelines,
// resolved at load, its scratch, and the step as a list of named dispatches over the layers
// (model.h), then the final norm + lm_head and the sampler. Kernel geometry and bindings
// follow docs/kernels.md; every dispatch declares what it reads and writes, and the compute
// pass derives the barriers.
#include "runtime/decode.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "runtime/encoder.h"
#include "runtime/families/gdn.h"
#include "runtime/kernel_args.h"
#include "runtime/runtime.h"

namespace lily::runtime {

namespace args = lily::kernels;

namespace {

constexpr uint32_t kGemvRowsPerGroup =
    args::kGemvRowsPerSimdgroup * DecodePlan::kGemvThreads / 32 / args::kGemvSplitK;
constexpr uint32_t kGateUpRowsPerGroup = args::kGateUpRowsPerSimdgroup * DecodePlan::kGemvThreads / 32;

}  // namespace

DecodePlan::DecodePlan(const ModelDims& dims, const RuntimeOptions& options)
    : d_(dims), opt_(options), labels_(dims.num_hidden_layers) {
  const ModelDims& d = d_;
  const uint32_t group = d.num_attention_heads / d.num_key_value_heads;
  if (group % 2)
    throw std::invalid_argument("decode attention needs an even number of query heads per KV head");
  attn_heads_ = attn_heads_per_group(group);
  if (d.head_dim != 64 && d.head_dim != 256)
    throw std::invalid_argument("decode attention kernels exist for head_dim 64 and 256, got " +
                                std::to_string(d.head_dim));
  if (d.linear_key_head_dim != d.linear_value_head_dim ||
      (d.linear_key_head_dim != 128 && d.linear_key_head_dim != 32))
    throw std::invalid_argument("Gated DeltaNet kernels exist for Dk = Dv = 128 or 32");
  ring_entry_bytes_ = GdnShape::of(d).ring_entry_bytes();
}

bool DecodePlan::uses_split_attention(uint32_t position) const { return position + 1 > opt_.split_threshold; }

bool DecodePlan::ends_window(uint32_t position) const { return (position + 1) % opt_.state_window == 0; }

uint32_t DecodePlan::ring_capacity() const { return std::min(opt_.state_window - 1, opt_.max_context); }

uint32_t DecodePlan::split_rows(uint32_t rows) const {
  if (opt_.split_block) return opt_.split_block;
  const uint64_t per_block = uint64_t(d_.num_attention_heads / attn_heads_);  // threadgroups per block
  const uint32_t want = ceil_div(uint64_t(rows) * per_block, kDecodeTargetGroups);
  return std::max(kDecodeMinBlock, (want + 7) / 8 * 8);
}

DecodeScratch DecodePlan::allocate(const Alloc& scratch) const {
  const ModelDims& d = d_;
  const size_t f = sizeof(float);
  DecodeScratch s;
  s.h = scratch(d.hidden_size * f, "h (residual)");
  s.xn = scratch(d.hidden_size * f, "xn (normed)");
  s.qkv = scratch(d.conv_dim() * f, "gdn qkv");
  s.z = scratch(size_t(d.linear_num_value_heads) * d.linear_value_head_dim * f, "gdn z");
  s.b = scratch(d.linear_num_value_heads * f, "gdn b");
  s.a = scratch(d.linear_num_value_heads * f, "gdn a");
  s.o = scratch(size_t(d.linear_num_value_heads) * d.linear_value_head_dim * f, "gdn out");
  s.o_ssq = scratch(size_t(d.linear_num_value_heads) * kGdnDecodeSplits * f, "gdn out sums of squares");
  s.qg = scratch(size_t(d.num_attention_heads) * d.head_dim * 2 * f, "attn q|gate");
  s.k = scratch(size_t(d.num_key_value_heads) * d.head_dim * f, "attn k");
  s.v = scratch(size_t(d.num_key_value_heads) * d.head_dim * f, "attn v");
  s.attn = scratch(size_t(d.num_attention_heads) * d.head_dim * f, "attn out");
  s.router = scratch((d.num_experts + 1) * f, "router logits | shared-expert gate logit");
  s.ids = scratch(d.num_experts_per_tok * sizeof(uint32_t), "expert ids");
  s.route_w = scratch((d.num_experts_per_tok + 1) * f, "routing weights");
  s.hidden =
      scratch((size_t(d.num_experts_per_tok) * d.moe_intermediate_size + d.shared_expert_intermediate_size) * f,
            "expert hidden");
  s.logits = scratch(size_t(d.vocab_size) * f, "logits");
  s.argmax_part =
      scratch(size_t(ceil_div(d.vocab_size, kArgmaxSlice)) * 2 * sizeof(uint32_t), "argmax partials");
  // Blocks of the split path: ceil(rows / split_rows(rows)) <= ceil(target / (Hq / G)) when
  // chosen by context (each block has >= rows * (Hq/G) / target rows).
  s.max_blocks = opt_.split_block
                     ? ceil_div(opt_.max_context, opt_.split_block)
                     : std::min(ceil_div(opt_.max_context, kDecodeMinBlock),
                                ceil_div(kDecodeTargetGroups, d.num_attention_heads / attn_heads_));
  s.part_ml = scratch(size_t(d.num_attention_heads) * s.max_blocks * 2 * f, "attn partial m,l");
  s.part_acc = scratch(size_t(d.num_attention_heads) * s.max_blocks * d.head_dim * f, "attn partial acc");
  return s;
}

void DecodePlan::bind(gpu::Device& dev, const ModelWeights& weights) {
  const ModelDims& d = d_;
  w_ = &weights;
  DecodeKernels& k = kernels_;
  k.embed_norm_gemv = &dev.pipeline(kernel_name("embed_norm_gemv", {{'q', 4}}));
  k.norm_gemv = ByBits(dev, "norm_gemv", "", {4, 8});
  k.gemv_add = ByBits(dev, "gemv", "_add", {4});
  k.gemv_gated_add = ByBits(dev, "gemv_gated", "_add", {4});
  if (d.linear_value_head_dim % 32 || d.linear_value_head_dim % (4 * kGdnDecodeSplits))
    throw gpu::UsageError("gdn_decode_step: linear_value_head_dim must be a multiple of 32 and of 4 x the splits");
  const std::vector<KernelParam> gdn = {{'k', d.linear_key_head_dim}, {'v', d.linear_value_head_dim}};
  k.gdn_step = &dev.pipeline(kernel_name("gdn_decode_step", gdn));
  k.gdn_writeback = &dev.pipeline(kernel_name("gdn_state_writeback", gdn));
  const std::vector<KernelParam> attn = {{'d', d.head_dim}, {'g', attn_heads_}};
  k.attn = &dev.pipeline(kernel_name("attn_decode_fused", attn));
  if (uses_split_attention(opt_.max_context - 1)) {
    k.attn_split = &dev.pipeline(kernel_name("attn_decode_split_fused", attn));
    k.attn_combine = &dev.pipeline(kernel_name("attn_combine", {{'d', d.head_dim}}));
  }
  k.moe_gate_up = &dev.pipeline("moe_route_gate_up_swiglu_q4");
  k.moe_down = &dev.pipeline("moe_down_q4");
  k.argmax_partial = &dev.pipeline("argmax_partial");
  k.argmax_partial_bias = &dev.pipeline("argmax_partial_bias");
  k.sample_greedy_combine = &dev.pipeline("sample_greedy_combine");
  k.sample_token = &dev.pipeline("sample_token");
}

void DecodePlan::encode_state_writeback(gpu::CommandBuffer& cmd, SequenceState& seq, uint32_t pending) const {
  const ModelDims& d = d_;
  if (pending == 0 || pending > ring_capacity())
    throw std::logic_error("encode_state_writeback: " + std::to_string(pending) + " pending steps");
  gpu::ComputePass& pass = cmd.compute_pass();
  for (const Layer& layer : w_->layers) {
    if (layer.full_attention) continue;
    const uint32_t l = layer.index;
    encode_gdn_state_writeback(pass, *kernels_.gdn_writeback, labels_(l, "gdn state write-back"),
                               GdnShape::of(d), *seq.state[l], *seq.ring[l], kGdnDecodeSplits, pending);
  }
  pass.end();
}

void DecodePlan::encode_step(gpu::CommandBuffer& cmd, DecodeScratch& s, SequenceState& seq, int slot,
                             uint32_t position, uint32_t pending, Traffic* tr) const {
  const ModelDims& d = d_;
  const ModelWeights& model = *w_;
  if (pending > position % opt_.state_window)  // a window's last step always writes back
    throw std::logic_error("encode_step: " + std::to_string(pending) + " pending steps at position " +
                           std::to_string(position));
  const bool write_back = ends_window(position);
  const DecodeKernels& K = kernels_;
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
                       uint32_t splits, const std::string& label, bool embed = false) {
    const uint32_t per_group = rps * kGemvThreads / 32 / splits;
    args::NormGemvArgs na{{0, 0, 0, 0}, H, d.rms_norm_eps, xn_out ? 1u : 0u, rps, splits};
    uint32_t groups = 0;
    Op op(embed ? *K.embed_norm_gemv : K.norm_gemv[projs.begin()->w.bits], label);
    if (embed) {
      op.in(20, *model.embed.weight).in(21, *model.embed.scales).in(22, *model.embed.biases)
          .in(23, *seq.tokens, slot * u32, u32).args(24, args::EmbedArgs{H, d.vocab_size})
          .out(0, *s.h, 0, H * f);
      t.weight_bytes += H / 2 + 2 * (H / 64) * 2;  // the row it really reads
    } else {
      op.in(0, *s.h, 0, H * f);
    }
    op.in(1, norm_w, &t.weight_bytes);
    if (xn_out) op.out(2, *s.xn, 0, H * f); else op.bind(2, *s.xn);
    uint32_t m = 0;
    for (const Proj& pr : projs) {
      const uint32_t base = 3 + 4 * m;
      na.rows[m++] = pr.rows;
      groups += ceil_div(pr.rows, per_group);
      op.in(base, pr.w, &t.weight_bytes).out(base + 3, *pr.out, pr.offset, size_t(pr.rows) * f);
      t.other_bytes += size_t(pr.rows) * f;
    }
    // unused slot: bound (every argument must be), nothing declared
    for (; m < args::kNormGemvMaxMatrices; ++m) {
      const uint32_t base = 3 + 4 * m;
      op.bind(base, *s.h).bind(base + 1, *s.h).bind(base + 2, *s.h).bind(base + 3, *s.xn);
    }
    op.groups(tg(groups), tg(kGemvThreads)).args(19, na).run(pass);
    t.other_bytes += H * f * (xn_out ? 2 : 1);
  };

  // The embedding of the token in this step's slot (written by the previous step's sampler)
  // is looked up inside layer 0's first norm_gemv.
  for (const Layer& layer : model.layers) {
    const uint32_t l = layer.index;
    const bool first = l == 0;
    if (!layer.full_attention) {
      // ---- Gated DeltaNet
      const DeltaNetLayer& g = layer.gdn;
      const uint32_t Hv = d.linear_num_value_heads, Dv = d.linear_value_head_dim;
      norm_gemv(*layer.input_norm, {{g.in_proj_qkv, s.qkv.get(), 0, d.conv_dim()},
                                    {g.in_proj_z, s.z.get(), 0, Hv * Dv},
                                    {g.in_proj_b, s.b.get(), 0, Hv},
                                    {g.in_proj_a, s.a.get(), 0, Hv}},
                false, kNormGemvRows, 1,
                labels_(l, first ? "embed + input norm + in_proj qkv|z|b|a" : "input norm + in_proj qkv|z|b|a"), first);
      // gdn_decode_step: kGdnDecodeSplits threadgroups per head; y and per-split sums of
      // squares, the gated norm is out_proj's
      encode_gdn_decode_step(pass, *K.gdn_step, labels_(l, "gdn step"), GdnShape::of(d), g,
                             {*s.qkv, *s.b, *s.a, *seq.conv[position % 2][l], *seq.conv[(position + 1) % 2][l],
                              *seq.state[l], *seq.ring[l], *s.o, *s.o_ssq},
                             kGdnDecodeSplits, pending, write_back, &t);
      const size_t ssq_bytes = size_t(Hv) * kGdnDecodeSplits * f;
      // out_proj: y += W gated_rmsnorm(o) (gemv_gated_q*_add), the norm applied on load
      const size_t cols = size_t(Hv) * Dv;
      gemv_add_op(K.gemv_gated_add, g.out_proj, *s.o, cols, *s.h, H, labels_(l, "gated norm + out_proj"))
          .in(6, *s.o_ssq, 0, ssq_bytes).in(7, *s.z, 0, cols * f).in(8, *g.norm, &t.weight_bytes)
          .args(9, args::GatedNormArgs{Dv, kGdnDecodeSplits, d.rms_norm_eps})
          .run(pass);
      t.other_bytes += cols * f;  // z
    } else {
      // ---- full attention
      const AttentionLayer& a = layer.attn;
      const uint32_t Hq = d.num_attention_heads, Hkv = d.num_key_value_heads, D = d.head_dim;
      norm_gemv(*layer.input_norm, {{a.q_proj, s.qg.get(), 0, Hq * D * 2},
                                    {a.k_proj, s.k.get(), 0, Hkv * D},
                                    {a.v_proj, s.v.get(), 0, Hkv * D}},
                false, kNormGemvRows, 1,
                labels_(l, first ? "embed + input norm + q|k|v_proj" : "input norm + q|k|v_proj"), first);
      // q/k RMSNorm + partial RoPE + KV append + attention in one dispatch: the new row is
      // used from threadgroup memory and written to the cache once per KV head.
      // One threadgroup per G = 8 query heads (each KV row read once); from split_threshold on
      // the rows are cut into blocks (split_rows) so ~kDecodeTargetGroups threadgroups share them.
      const size_t row = size_t(D) * 2, head_rows = size_t(opt_.max_context) * row;
      const uint32_t G = attn_heads_;
      const uint32_t max_blocks = s.max_blocks;
      const bool split = uses_split_attention(position);
      const uint32_t block = split ? split_rows(position + 1) : 0;
      const uint32_t nblocks = split ? ceil_div(position + 1, block) : 1;
      const args::AttnFusedArgs af{Hq, Hkv, d.rotary_dim, opt_.max_context, d.rms_norm_eps,
                               float(std::log2(double(d.rope_theta))), float(1.0 / std::sqrt(double(D))),
                               block, max_blocks};
      Op op(split ? *K.attn_split : *K.attn,
            split ? labels_(l, "qk prep + kv append + attention split") : labels_(l, "qk prep + kv append + attention"));
      op.groups(tg(Hq / G, nblocks), tg(256))
          .in(0, *s.qg, 0, size_t(Hq) * D * 2 * f).in(1, *s.k, 0, size_t(Hkv) * D * f)
          .in(2, *s.v, 0, size_t(Hkv) * D * f)
          .in(3, *a.q_norm, &t.weight_bytes).in(4, *a.k_norm, &t.weight_bytes)
          .in(5, *seq.positions, slot * u32, u32).bind(6, *seq.k_cache[l]).bind(7, *seq.v_cache[l]);
      for (uint32_t kvh = 0; kvh < Hkv; ++kvh) {
        for (auto* cache : {seq.k_cache[l].get(), seq.v_cache[l].get()}) {
          if (position) op.read(*cache, kvh * head_rows, size_t(position) * row);
          op.write(*cache, kvh * head_rows + size_t(position) * row, row);
        }
      }
      t.kv_bytes += 2 * size_t(Hkv) * (size_t(position) + 1) * row;
      if (!split) {
        op.out(8, *s.attn, 0, size_t(Hq) * D * f).args(9, af).run(pass);
      } else {
        op.out(8, *s.part_ml, 0, s.part_ml->size()).out(9, *s.part_acc, 0, s.part_acc->size())
            .args(10, af).run(pass);
        Op(*K.attn_combine, labels_(l, "attention combine"))
            .groups(tg(Hq, D / 32), tg(256))  // 8 simdgroups split the blocks of 32 columns
            .in(0, *s.part_ml, 0, s.part_ml->size()).in(1, *s.part_acc, 0, s.part_acc->size())
            .in(2, *s.qg, D * f, (size_t(Hq) * D * 2 - D) * f).in(3, *seq.positions, slot * u32, u32)
            .out(4, *s.attn, 0, size_t(Hq) * D * f)
            .args(5, args::AttnCombineArgs{Hq, 2 * D, block, max_blocks}).run(pass);
        t.other_bytes += 2 * size_t(Hq) * nblocks * (D + 2) * f;  // partials written, then read
      }
      gemv_add(a.o_proj, *s.attn, size_t(Hq) * D, *s.h, H, labels_(l, "o_proj"));
    }

    // ---- MoE
    const MoeBlock& m = layer.moe;
    const uint32_t E = d.num_experts, k = d.num_experts_per_tok;
    const uint32_t I = d.moe_intermediate_size, Is = d.shared_expert_intermediate_size;
    norm_gemv(*layer.post_attention_norm,
              {{m.gate, s.router.get(), 0, E}, {m.shared_expert_gate, s.router.get(), E * f, 1}}, true,
              kRouterRows, kRouterSplits, labels_(l, "post-attention norm + router|shared gate"));
    const args::MoeArgs ma{H, I, Is, E, k};
    // Bytes the selected experts really move (the declared ranges cover whole stacks).
    const uint64_t expert_q4 = uint64_t(I) * H / 2 + 2 * uint64_t(I) * (H / 64) * 2;
    const uint64_t shared_q4 = uint64_t(Is) * H / 2 + 2 * uint64_t(Is) * (H / 64) * 2;
    Op(*K.moe_gate_up, labels_(l, "route top-k + experts gate|up"))
        .groups(tg(ceil_div(std::max(I, Is), kGateUpRowsPerGroup), k + 1), tg(kGemvThreads))
        .in(0, *s.xn, 0, H * f).in(1, *s.router, 0, (E + 1) * f)
        .in(2, m.experts_gate_proj).in(5, m.experts_up_proj).in(8, m.shared_gate_proj).in(11, m.shared_up_proj)
        .out(14, *s.hidden, 0, s.hidden->size()).out(15, *s.ids, 0, k * u32).out(16, *s.route_w, 0, (k + 1) * f)
        .args(17, args::MoeRouteArgs{H, I, Is, E, k, d.norm_topk_prob ? 1u : 0u}).run(pass);
    t.weight_bytes += 2 * (k * expert_q4 + shared_q4);
    Op(*K.moe_down, labels_(l, "experts down + shared"))
        .groups(tg(ceil_div(H, kGemvRowsPerGroup)), tg(kGemvThreads))
        .in(0, *s.hidden, 0, s.hidden->size()).in(1, *s.ids, 0, k * u32).in(2, *s.route_w, 0, (k + 1) * f)
        .in(3, m.experts_down_proj).in(6, m.shared_down_proj)
        .inout(9, *s.h, 0, H * f).args(10, ma).run(pass);
    t.weight_bytes += k * expert_q4 + shared_q4;
  }

  encode_head(pass, s, seq, *s.h, 0, slot, true, t);
  pass.end();
}

void DecodePlan::encode_head(gpu::ComputePass& pass, DecodeScratch& s, SequenceState& seq, gpu::Buffer& x,
                             size_t offset, int slot, bool sample, Traffic& t) const {
  const ModelDims& d = d_;
  const ModelWeights& model = *w_;
  const size_t f = sizeof(float);
  const uint32_t H = d.hidden_size;
  // final norm + lm_head: norm_gemv_q4 with one matrix (slots 1..3 unused: bound, not declared)
  {
    const uint32_t per_group = kNormGemvRows * kLmHeadThreads / 32;
    Op op(kernels_.norm_gemv[model.lm_head.bits], "final norm + lm_head");
    op.in(0, x, offset, H * f).in(1, *model.final_norm, &t.weight_bytes).bind(2, *s.xn)
        .in(3, model.lm_head, &t.weight_bytes).out(6, *s.logits, 0, size_t(d.vocab_size) * f);
    for (uint32_t m = 1; m < args::kNormGemvMaxMatrices; ++m) {
      const uint32_t base = 3 + 4 * m;
      op.bind(base, *s.h).bind(base + 1, *s.h).bind(base + 2, *s.h).bind(base + 3, *s.xn);
    }
    op.groups({ceil_div(d.vocab_size, per_group), 1, 1}, {kLmHeadThreads, 1, 1})
        .args(19, args::NormGemvArgs{{d.vocab_size, 0, 0, 0}, H, d.rms_norm_eps, 0u, kNormGemvRows, 1u})
        .run(pass);
    t.other_bytes += H * f + size_t(d.vocab_size) * f;
  }
  if (sample) encode_sample(pass, s, seq, slot);
}

// Threads of a one-threadgroup sampler dispatch: `want`, at most 1024, as many as the
// pipeline allows (a Mac's compiler may lower a pipeline's limit under register pressure),
// in a power of two (sample_token takes any multiple of 32 dividing 1024, the combine any
// multiple of 32). Below 32 the load-time check refuses the pipeline by name.
static uint32_t sampler_threads(const gpu::Pipeline& p, uint32_t want) {
  const uint32_t cap = std::min<uint32_t>({want, 1024, p.max_threads_per_threadgroup()});
  uint32_t n = 32;
  while (2 * n <= cap) n *= 2;
  return n;
}

void DecodePlan::encode_sample(gpu::ComputePass& pass, DecodeScratch& s, SequenceState& seq, int slot) const {
  const ModelDims& d = d_;
  const DecodeKernels& K = kernels_;
  const size_t f = sizeof(float), u32 = sizeof(uint32_t);
  auto tg = [](uint32_t x) { return gpu::Size3{x, 1, 1}; };
  const SamplingConfig& sc = seq.sampling;
  const bool bias = !sc.logit_bias.empty();
  const size_t vf = size_t(d.vocab_size) * f;
  // the samplers see only the first V logits: the rows past the tokenizer's ids (padding) never win
  const uint32_t V = sc.vocab_limit != 0 ? std::min(sc.vocab_limit, d.vocab_size) : d.vocab_size;
  if (sc.greedy_kernel()) {
    // Argmax in two stages so the ~1 MB of logits is read by many threadgroups: partials per
    // slice, then one threadgroup reduces them and writes the token (no host round trip).
    // A logit bias is one more [V] read in the first stage (a kernel of its own).
    const uint32_t parts = ceil_div(V, kArgmaxSlice);
    const size_t part_bytes = size_t(parts) * 2 * u32;
    Op partial(bias ? *K.argmax_partial_bias : *K.argmax_partial,
               bias ? "greedy argmax partials (+ logit bias)" : "greedy argmax partials");
    partial.groups(tg(parts), tg(256)).in(0, *s.logits, 0, vf)
        .out(1, *s.argmax_part, 0, part_bytes).args(2, args::ArgmaxArgs{V, kArgmaxSlice});
    if (bias) partial.in(3, *seq.bias, 0, vf);
    partial.run(pass);
    Op(*K.sample_greedy_combine, "greedy token -> next slot")
        .groups(tg(1), tg(sampler_threads(*K.sample_greedy_combine, ceil_div(parts, 32) * 32)))
        .in(0, *s.argmax_part, 0, part_bytes)
        .out(1, *seq.tokens, (slot ^ 1) * u32, u32).args(2, args::ArgmaxArgs{parts, 0}).run(pass);
  } else {
    const bool penalties = sc.presence_penalty != 0.0f || sc.frequency_penalty != 0.0f ||
                           sc.repetition_penalty != 1.0f;
    args::SampleArgs sa{V, sc.temperature, sc.top_k, sc.top_p, sc.min_p, sc.presence_penalty,
                    sc.frequency_penalty, sc.repetition_penalty, uint32_t(sc.seed), uint32_t(sc.seed >> 32),
                    sc.logprobs ? 1u : 0u, sc.top_logprobs, penalties ? 1u : 0u, bias ? 1u : 0u};
    const size_t lp = SequenceState::kMaxTopLogprobs * f, ti = SequenceState::kMaxTopLogprobs * u32;
    Op op(*K.sample_token, "sample token -> next slot");
    op.groups(tg(1), tg(sampler_threads(*K.sample_token, 1024))).in(0, *s.logits, 0, size_t(d.vocab_size) * f)
        .inout(1, *seq.counts, 0, seq.counts->size()).in(2, *seq.positions, slot * u32, u32)
        .out(3, *seq.tokens, (slot ^ 1) * u32, u32)
        .out(4, *seq.logprob_out, slot * lp, lp).out(5, *seq.top_ids, slot * ti, ti).args(6, sa);
    if (bias) op.in(7, *seq.bias, 0, vf); else op.bind(7, *seq.bias);  // bound (every argument must be), unread
    op.run(pass);
  }
}

}  // namespace lily::runtime
