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
#include "runtime/families/attention.h"
#include "runtime/families/embed.h"
#include "runtime/families/gdn.h"
#include "runtime/families/gemv.h"
#include "runtime/families/moe.h"
#include "runtime/families/sample.h"
#include "runtime/kernel_args.h"
#include "runtime/runtime.h"

namespace lily::runtime {

namespace args = lily::kernels;

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
  if ((uint64_t(d.num_experts_per_tok) * d.moe_intermediate_size + d.shared_expert_intermediate_size) / 32 >
      args::kMoeBatchMaxChunks)
    throw std::invalid_argument("the batched decode MoE kernels take (top_k * moe_intermediate_size + "
                                "shared_expert_intermediate_size) / 32 <= " +
                                std::to_string(args::kMoeBatchMaxChunks));
}

bool DecodePlan::uses_split_attention(uint32_t position) const { return position + 1 > opt_.split_threshold; }

bool DecodePlan::ends_window(uint32_t position) const { return (position + 1) % opt_.state_window == 0; }

uint32_t DecodePlan::ring_capacity() const { return std::min(opt_.state_window - 1, opt_.max_context); }

uint32_t DecodePlan::split_rows(uint32_t rows) const {
  return opt_.split_block ? opt_.split_block : split_rows_for(rows, d_.num_attention_heads, attn_heads_);
}

uint32_t DecodePlan::split_rows_for(uint32_t rows, uint32_t num_q_heads, uint32_t heads_per_threadgroup) {
  const uint64_t per_block = uint64_t(num_q_heads / heads_per_threadgroup);  // threadgroups per block
  const uint32_t want = ceil_div(uint64_t(rows) * per_block, kDecodeTargetGroups);
  return std::max(kDecodeMinBlock, (want + 7) / 8 * 8);
}

DecodeScratch DecodePlan::allocate(const Alloc& alloc, uint32_t rows) const {
  const ModelDims& d = d_;
  const size_t f = sizeof(float);
  DecodeScratch s;
  s.rows = rows;
  // each buffer holds `rows` rows (DecodeScratch::at)
  auto scratch = [&](size_t bytes, const char* label) { return alloc(bytes * rows, label); };
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
  for (uint32_t i = 0; i < 3; ++i) {
    const std::string b = "_b" + std::to_string(2u << i);
    k.norm_gemv_batch[i] = ByBits(dev, "norm_gemv_batch", b, {4, 8});
    k.gemv_add_batch[i] = ByBits(dev, "gemv_batch", b + "_add", {4});
    k.gemv_gated_add_batch[i] = ByBits(dev, "gemv_gated_batch", b + "_add", {4});
    k.moe_gate_up_batch[i] = &dev.pipeline("moe_route_gate_up_batch_q4" + b);
    k.moe_down_batch[i] = &dev.pipeline("moe_down_batch_q4" + b);
  }
  k.embed_rows = &dev.pipeline(kernel_name("embed_rows", {{'q', 4}}));
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
  encode_rows(cmd, s, {Row{&seq, slot, position, pending}}, tr);
}

void DecodePlan::encode_rows(gpu::CommandBuffer& cmd, DecodeScratch& s, const std::vector<Row>& rows,
                             Traffic* tr) const {
  const ModelDims& d = d_;
  const ModelWeights& model = *w_;
  const uint32_t n = uint32_t(rows.size());
  if (n == 0 || n > s.rows || n > args::kBatchMaxRows)
    throw std::logic_error("encode_rows: " + std::to_string(n) + " rows for a scratch of " +
                           std::to_string(s.rows));
  for (const Row& row : rows)
    if (row.pending > row.position % opt_.state_window)  // a window's last step always writes back
      throw std::logic_error("encode_step: " + std::to_string(row.pending) + " pending steps at position " +
                             std::to_string(row.position));
  const bool batched = n > 1;
  const uint32_t nk = batched ? batch_kernel(n) : 0;
  const DecodeKernels& K = kernels_;
  gpu::ComputePass& pass = cmd.compute_pass();
  Traffic local;
  Traffic& t = tr ? *tr : local;
  const size_t f = sizeof(float);
  const uint32_t H = d.hidden_size;
  const size_t u32 = sizeof(uint32_t);
  // floats between two rows of a scratch buffer
  auto stride = [&](const gpu::BufferPtr& b) { return uint32_t(s.row_bytes(b) / f); };
  // h += W x for each row (gemv_q*_add, with `gated` gemv_gated_q*_add; with several rows
  // their batched form, `ss` floats between two rows' sums of squares)
  auto gemv_add = [&](const ByBits& kernels, const ByBits* batch, const gpu::BufferPtr& x, uint32_t cols,
                      const QuantLinear& w, const std::string& label, const GatedNorm* gated = nullptr,
                      uint32_t ss = 0) {
    const GemvRows rows{n, batched, stride(x), stride(s.h), ss};
    encode_gemv_add(pass, batched ? batch[nk][w.bits] : kernels[w.bits], label, w, *x, *s.h, H, cols, rows,
                    gated, args::kGemvThreads, &t);
  };
  // RMSNorm of the residual fused into up to four GEMVs of one weight width that read the
  // normalised vector (norm_gemv_q*), for each row; `xn_out` also stores that vector for
  // later kernels.
  struct Proj {
    const QuantLinear& w;
    const gpu::BufferPtr& out;
    size_t offset;
    uint32_t rows;
  };
  // With `embed`, the step's embedding lookup comes first: one row's is fused in
  // (embed_norm_gemv_q4: the row of the token in its slot becomes h, written, and the norm's
  // input); several rows' are looked up one by one into their h (embed_rows_q4).
  auto norm_gemv = [&](const TensorRef& norm_w, std::initializer_list<Proj> projs, bool xn_out, uint32_t rps,
                       uint32_t splits, const std::string& label, bool embed = false) {
    const uint32_t bits = projs.begin()->w.bits;
    if (embed && batched) {
      for (uint32_t r = 0; r < n; ++r)
        encode_embed_rows(pass, *K.embed_rows, labels_(0, "embed"), model.embed, *rows[r].seq->tokens,
                          rows[r].slot * u32, *s.h, 1, H, d.vocab_size, &t, s.at(s.h, r));
    }
    std::vector<NormGemvMatrix> mats;
    for (const Proj& pr : projs) mats.push_back({pr.w, *pr.out, pr.offset, pr.rows, stride(pr.out)});
    const EmbedLookup lookup{model.embed, *rows[0].seq->tokens, rows[0].slot * u32, d.vocab_size};
    encode_norm_gemv(pass,
                     batched ? K.norm_gemv_batch[nk][bits]
                     : embed ? *K.embed_norm_gemv
                             : K.norm_gemv[bits],
                     label, *s.h, 0, norm_w, *s.xn, mats, H, d.rms_norm_eps, xn_out, rps, splits,
                     GemvRows{n, batched, stride(s.h)}, args::kGemvThreads, embed && !batched ? &lookup : nullptr, 0,
                     &t);
  };

  for (const Layer& layer : model.layers) {
    const uint32_t l = layer.index;
    const bool first = l == 0;
    if (!layer.full_attention) {
      // ---- Gated DeltaNet
      const DeltaNetLayer& g = layer.gdn;
      const uint32_t Hv = d.linear_num_value_heads, Dv = d.linear_value_head_dim;
      norm_gemv(*layer.input_norm,
                {{g.in_proj_qkv, s.qkv, 0, d.conv_dim()},
                 {g.in_proj_z, s.z, 0, Hv * Dv},
                 {g.in_proj_b, s.b, 0, Hv},
                 {g.in_proj_a, s.a, 0, Hv}},
                false, kNormGemvRows, 1,
                labels_(l, first && !batched ? "embed + input norm + in_proj qkv|z|b|a"
                                             : "input norm + in_proj qkv|z|b|a"),
                first);
      // gdn_decode_step: kGdnDecodeSplits threadgroups per head; y and per-split sums of
      // squares, the gated norm is out_proj's
      for (uint32_t r = 0; r < n; ++r) {
        SequenceState& seq = *rows[r].seq;
        const uint32_t position = rows[r].position;
        GdnStepBuffers io{*s.qkv,
                          *s.b,
                          *s.a,
                          *seq.conv[position % 2][l],
                          *seq.conv[(position + 1) % 2][l],
                          *seq.state[l],
                          *seq.ring[l],
                          *s.o,
                          *s.o_ssq};
        io.qkv_at = s.at(s.qkv, r), io.b_at = s.at(s.b, r), io.a_at = s.at(s.a, r);
        io.y_at = s.at(s.o, r), io.ssq_at = s.at(s.o_ssq, r);
        encode_gdn_decode_step(pass, *K.gdn_step, labels_(l, "gdn step"), GdnShape::of(d), g, io,
                               kGdnDecodeSplits, rows[r].pending, ends_window(position), &t);
      }
      // out_proj: y += W gated_rmsnorm(o) (gemv_gated_q*_add), the norm applied on load
      const GatedNorm gated{*s.o_ssq, *s.z, *g.norm, Dv, kGdnDecodeSplits, d.rms_norm_eps};
      gemv_add(K.gemv_gated_add, K.gemv_gated_add_batch, s.o, Hv * Dv, g.out_proj,
               labels_(l, "gated norm + out_proj"), &gated, stride(s.o_ssq));
    } else {
      // ---- full attention
      const AttentionLayer& a = layer.attn;
      const uint32_t Hq = d.num_attention_heads, Hkv = d.num_key_value_heads, D = d.head_dim;
      norm_gemv(*layer.input_norm,
                {{a.q_proj, s.qg, 0, Hq * D * 2}, {a.k_proj, s.k, 0, Hkv * D}, {a.v_proj, s.v, 0, Hkv * D}},
                false, kNormGemvRows, 1,
                labels_(l, first && !batched ? "embed + input norm + q|k|v_proj" : "input norm + q|k|v_proj"),
                first);
      // q/k RMSNorm + partial RoPE + KV append + attention in one dispatch: the new row is
      // used from threadgroup memory and written to the cache once per KV head.
      // One threadgroup per G = 8 query heads (each KV row read once); from split_threshold on
      // the rows are cut into blocks (split_rows) so ~kDecodeTargetGroups threadgroups share them.
      // each row's attention, then (split rows) each row's combine: the rows share a stage
      const uint32_t G = attn_heads_, max_blocks = s.max_blocks;
      auto block_of = [&](uint32_t position) {
        return uses_split_attention(position) ? split_rows(position + 1) : 0;
      };
      for (uint32_t r = 0; r < n; ++r) {
        SequenceState& seq = *rows[r].seq;
        const uint32_t position = rows[r].position;
        const bool split = uses_split_attention(position);
        const uint32_t block = block_of(position);
        const args::AttnFusedArgs af{Hq,
                                     Hkv,
                                     d.rotary_dim,
                                     opt_.max_context,
                                     d.rms_norm_eps,
                                     float(std::log2(double(d.rope_theta))),
                                     float(1.0 / std::sqrt(double(D))),
                                     block,
                                     max_blocks};
        AttnStepBuffers io{*s.qg,          *s.k,           *s.v,           *a.q_norm,
                           *a.k_norm,      *seq.positions, *seq.k_cache[l], *seq.v_cache[l]};
        io.qg_at = s.at(s.qg, r), io.k_at = s.at(s.k, r), io.v_at = s.at(s.v, r);
        io.position_at = rows[r].slot * u32;
        io.out = s.attn.get(), io.out_at = s.at(s.attn, r);
        io.ml = s.part_ml.get(), io.ml_at = s.at(s.part_ml, r);
        io.acc = s.part_acc.get(), io.acc_at = s.at(s.part_acc, r);
        encode_attn_decode_fused(pass, split ? *K.attn_split : *K.attn,
                                 split ? labels_(l, "qk prep + kv append + attention split")
                                       : labels_(l, "qk prep + kv append + attention"),
                                 io, af, D, G, position, 0, &t);
      }
      for (uint32_t r = 0; r < n; ++r) {
        const uint32_t block = block_of(rows[r].position);
        if (!block) continue;
        // the gate straight from the q_proj output: D floats after each head's q
        AttnCombineBuffers io{*s.part_ml, *s.part_acc, *s.qg, *rows[r].seq->positions, *s.attn};
        io.ml_at = s.at(s.part_ml, r), io.acc_at = s.at(s.part_acc, r);
        io.gate_at = s.at(s.qg, r) + D * f;
        io.position_at = rows[r].slot * u32, io.out_at = s.at(s.attn, r);
        encode_attn_combine(pass, *K.attn_combine, labels_(l, "attention combine"), io,
                            args::AttnCombineArgs{Hq, 2 * D, block, max_blocks}, D);
      }
      gemv_add(K.gemv_add, K.gemv_add_batch, s.attn, Hq * D, a.o_proj, labels_(l, "o_proj"));
    }

    // ---- MoE
    const MoeBlock& m = layer.moe;
    const uint32_t E = d.num_experts, k = d.num_experts_per_tok;
    const uint32_t I = d.moe_intermediate_size, Is = d.shared_expert_intermediate_size;
    norm_gemv(*layer.post_attention_norm,
              {{m.gate, s.router, 0, E}, {m.shared_expert_gate, s.router, E * f, 1}}, true, kRouterRows,
              kRouterSplits, labels_(l, "post-attention norm + router|shared gate"));
    // routing + gate|up, the routing in every simdgroup: one row's, or (batched) the rows' with
    // each expert of the union of their picks read once; then the down projections over it
    const MoeShape shape{H, I, Is, E, k, d.norm_topk_prob};
    const MoeBuffers io{*s.xn, *s.router, *s.hidden, *s.ids, *s.route_w, *s.h};
    const args::MoeBatchArgs mb{n,           stride(s.xn),      stride(s.hidden),
                                stride(s.ids), stride(s.route_w), stride(s.router)};
    encode_moe_route_gate_up(pass, batched ? *K.moe_gate_up_batch[nk] : *K.moe_gate_up,
                             labels_(l, batched ? "route top-k + experts gate|up (union of the rows)"
                                                : "route top-k + experts gate|up"),
                             m, io, shape, mb, batched, args::kGemvThreads, &t);
    encode_moe_down(pass, batched ? *K.moe_down_batch[nk] : *K.moe_down, labels_(l, "experts down + shared"), m,
                    io, shape, mb, batched, args::kGemvThreads, &t);
  }

  if (!batched) {
    encode_head(pass, s, *rows[0].seq, *s.h, 0, rows[0].slot, true, t);
  } else {
    encode_lm_head(pass, s, *s.h, 0, s.row_bytes(s.h), n, t);
    for (uint32_t parts : {kSampleFirst, kSampleCombine})
      for (uint32_t r = 0; r < n; ++r) encode_sample(pass, s, r, *rows[r].seq, rows[r].slot, parts);
  }
  pass.end();
}

void DecodePlan::encode_head(gpu::ComputePass& pass, DecodeScratch& s, SequenceState& seq, gpu::Buffer& x,
                             size_t offset, int slot, bool sample, Traffic& t) const {
  encode_lm_head(pass, s, x, offset, 0, 1, t);
  if (sample) encode_sample(pass, s, seq, slot);
}

void DecodePlan::encode_lm_head(gpu::ComputePass& pass, DecodeScratch& s, gpu::Buffer& x, size_t offset,
                                size_t x_stride, uint32_t n, Traffic& t) const {
  const ModelDims& d = d_;
  const ModelWeights& model = *w_;
  const size_t f = sizeof(float);
  const uint32_t H = d.hidden_size;
  // final norm + lm_head: norm_gemv_q4 with one matrix (slots 1..3 unused: bound, not declared)
  const uint32_t bits = model.lm_head.bits;
  encode_norm_gemv(pass, n > 1 ? kernels_.norm_gemv_batch[batch_kernel(n)][bits] : kernels_.norm_gemv[bits],
                   "final norm + lm_head", x, offset, *model.final_norm, *s.xn,
                   {{model.lm_head, *s.logits, 0, d.vocab_size, uint32_t(s.row_bytes(s.logits) / f)}}, H,
                   d.rms_norm_eps, false, kNormGemvRows, 1, GemvRows{n, n > 1, uint32_t(x_stride / f)},
                   kLmHeadThreads, nullptr, 0, &t);
}

void DecodePlan::encode_sample(gpu::ComputePass& pass, DecodeScratch& s, SequenceState& seq, int slot) const {
  encode_sample(pass, s, 0, seq, slot);
}

void DecodePlan::encode_sample(gpu::ComputePass& pass, DecodeScratch& s, uint32_t r, SequenceState& seq,
                               int slot, uint32_t parts) const {
  const ModelDims& d = d_;
  const DecodeKernels& K = kernels_;
  const size_t f = sizeof(float), u32 = sizeof(uint32_t);
  const SamplingConfig& sc = seq.sampling;
  const bool bias = !sc.logit_bias.empty();
  // the samplers see only the first V logits: the rows past the tokenizer's ids (padding) never win
  const uint32_t V = sc.vocab_limit != 0 ? std::min(sc.vocab_limit, d.vocab_size) : d.vocab_size;
  if (sc.greedy_kernel()) {
    // Argmax in two stages so the ~1 MB of logits is read by many threadgroups: partials per
    // slice, then one threadgroup reduces them and writes the token (no host round trip).
    // A logit bias is one more [V] read in the first stage (a kernel of its own).
    ArgmaxBuffers io{*s.logits, *s.argmax_part, *seq.tokens, bias ? seq.bias.get() : nullptr};
    io.logits_at = s.at(s.logits, r), io.partials_at = s.at(s.argmax_part, r), io.token_at = (slot ^ 1) * u32;
    if (parts & kSampleFirst)
      encode_argmax_partials(pass, bias ? *K.argmax_partial_bias : *K.argmax_partial, io, V, d.vocab_size,
                             kArgmaxSlice);
    if (parts & kSampleCombine) encode_argmax_combine(pass, *K.sample_greedy_combine, io, V, kArgmaxSlice);
  } else if (parts & kSampleFirst) {  // one dispatch
    const bool penalties = sc.presence_penalty != 0.0f || sc.frequency_penalty != 0.0f ||
                           sc.repetition_penalty != 1.0f;
    args::SampleArgs sa{V, sc.temperature, sc.top_k, sc.top_p, sc.min_p, sc.presence_penalty,
                    sc.frequency_penalty, sc.repetition_penalty, uint32_t(sc.seed), uint32_t(sc.seed >> 32),
                    sc.logprobs ? 1u : 0u, sc.top_logprobs, penalties ? 1u : 0u, bias ? 1u : 0u};
    const size_t lp = SequenceState::kMaxTopLogprobs * f, ti = SequenceState::kMaxTopLogprobs * u32;
    SampleTokenBuffers io{*s.logits,        *seq.counts,  *seq.positions, *seq.tokens,
                          *seq.logprob_out, *seq.top_ids, *seq.bias};
    io.logits_at = s.at(s.logits, r), io.position_at = slot * u32, io.token_at = (slot ^ 1) * u32;
    io.logprobs_at = slot * lp, io.logprobs_bytes = lp, io.top_ids_at = slot * ti, io.top_ids_bytes = ti;
    encode_sample_token(pass, *K.sample_token, "sample token -> next slot", sa, io, d.vocab_size,
                        sampler_threads(*K.sample_token, args::kSamplerThreads));
  }
}

}  // namespace lily::runtime
