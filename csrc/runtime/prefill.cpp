// The prefill phase (prefill.h): its pipelines (resolved at load) and chunk scratch, one chunk
// as a list of named dispatches over the layers (docs/prefill.md, "One chunk"), and the
// every-position lm_head. Kernel geometry and bindings follow docs/prefill.md; every dispatch
// declares what it reads and writes, and the compute pass derives the barriers from that.
#include "runtime/prefill.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <stdexcept>

#include "runtime/encoder.h"
#include "runtime/families/attention_prefill.h"
#include "runtime/families/embed.h"
#include "runtime/families/gdn_prefill.h"
#include "runtime/families/gemm.h"
#include "runtime/families/moe_prefill.h"
#include "runtime/families/norm.h"
#include "runtime/kernel_args.h"
#include "runtime/runtime.h"

namespace lily::runtime {

namespace args = lily::kernels;

namespace {

// Rows per active expert from which the tensor-op path takes 128-row expert tiles
// (moe_tile_rows; chosen from lily estimate, docs/performance.md).
constexpr double kTile128Rows = 64.0;
// Rows per active expert from which each height of kExpertTileRows, in its order, is taken
// (moe_tile_rows): the shortest always, then 24, 48 and kTile128Rows.
constexpr double kExpertTileMinRows[] = {0.0, 24.0, 48.0, kTile128Rows};
static_assert(std::size(kExpertTileMinRows) == std::size(args::kExpertTileRows), "one per tile height");
// Expert routing (metal/moe_prefill.metal): rows per histogram block, block_rows * top_k
// assignments <= kMoeRouteMaxBlockSlots (64 rows for top-8).
uint32_t route_block_rows(uint32_t top_k) { return std::max(1u, 512u / top_k); }
// attention: kAttnPrefillPairs (row, head) pairs per threadgroup on both paths
// (metal/prefill_args.h; the dispatches: families/attention_prefill.h).
constexpr uint32_t kAttnPairs = args::kAttnPrefillPairs;
// Split attention partials, at most this many bytes (the split count adapts).
constexpr uint64_t kAttnPartialBudget = 64ull << 20;
constexpr uint32_t kAttnMinGroups = 256;  // ~8 threadgroups per core of a 32-40-core GPU
// Rows of lm_head per command buffer when every position's logits are wanted.
constexpr uint32_t kAllLogitsRows = 64;

// The expert GEMM dispatches of the tile classes write disjoint slots of one output (hx, yx)
// in one barrier stage: their write ranges carry this tag (gpu::Range::disjoint).
constexpr uint32_t kTileClassWrites = 1;
// The router and the shared expert gate write disjoint columns of one logits buffer
// ([M, E + 1]): tagged, they share a barrier stage.
constexpr uint32_t kRouterWrites = 2;
// Dispatch labels by tile class (class 0: the full tiles of height T).
constexpr const char* kGateUpLabel[] = {"experts gate|up", "experts gate|up (class 1)", "experts gate|up (class 2)"};
constexpr const char* kDownLabel[] = {"experts down", "experts down (class 1)", "experts down (class 2)"};
static_assert(sizeof(kGateUpLabel) / sizeof(kGateUpLabel[0]) == args::kMoeTileClasses, "a label per class");

}  // namespace

PrefillPlan::PrefillPlan(const ModelDims& dims, const RuntimeOptions& options, const DecodePlan& head)
    : d_(dims), opt_(options), head_(head), labels_(dims.num_hidden_layers) {}

void PrefillPlan::select_paths(const gpu::Device& device) {
  // Every prefill tensor operation takes bfloat operands (the GEMMs' and the attention's:
  // nothing is clipped, docs/prefill.md): the tensor path needs a tensor library whose
  // operand table has bfloat (built with the MacOSX 26.2 SDK or later: 26.1 added bfloat to the
  // table, 26.2 the cooperative inputs), else prefill runs simdgroup_matrix. Each
  // family may still fall back alone at load (Runtime::check_tensor_families).
  const bool available = device.supports_tensor_ops() && device.supports_bfloat_tensor_ops();
  const bool tensor = opt_.gemm_path == GemmPath::tensor || (opt_.gemm_path == GemmPath::automatic && available);
  if (tensor && !available)
    throw std::invalid_argument("gemm_path 'tensor': " + (device.supports_tensor_ops()
                                                              ? device.bfloat_tensor_ops_status()
                                                              : device.tensor_ops_status()));
  families_ = tensor ? kGemmFamily | kMoeFamily | kAttentionFamily : 0;
}

const char* PrefillPlan::family_name(Family f) {
  return f == kGemmFamily ? "gemm" : f == kMoeFamily ? "moe_prefill" : "attention_prefill";
}

uint32_t PrefillPlan::family_of(const std::string& kernel) {
  auto ends = [&](const char* s) {
    const size_t n = std::strlen(s);
    return kernel.size() >= n && kernel.compare(kernel.size() - n, n, s) == 0;
  };
  if (!ends("_tensor") && !ends("_qbf")) return 0;
  if (kernel.rfind("attn_prefill", 0) == 0) return kAttentionFamily;
  if (kernel.rfind("moe_gemm", 0) == 0) return kMoeFamily;
  return kGemmFamily;
}

uint32_t PrefillPlan::split_rows() const { return opt_.split_block ? opt_.split_block : 1024; }

std::vector<std::pair<uint32_t, uint32_t>> PrefillPlan::layer_groups(uint32_t p0, uint32_t rows) const {
  const uint32_t L = d_.num_hidden_layers;
  if (!opt_.command_buffer_rows) return {{0, L}};
  const double context = double(p0) + rows / 2.0, budget = opt_.command_buffer_rows;
  std::vector<std::pair<uint32_t, uint32_t>> out;
  double work = 0;
  for (uint32_t l = 0; l < L; ++l) {
    const double w = rows * (d_.full_attention[l] ? 1.0 + context / kAttnLayerRows : 1.0);
    if (!out.empty() && work + w <= budget) {
      out.back().second = l + 1;
      work += w;
    } else {
      out.emplace_back(l, l + 1);
      work = w;
    }
  }
  return out;
}

bool PrefillPlan::splits_attention() const {
  return opt_.max_context > opt_.split_threshold && opt_.max_context >= 2 * split_rows();
}

PrefillScratch PrefillPlan::allocate(uint32_t rows, const Alloc& scratch) const {
  const ModelDims& d = d_;
  const size_t C = rows, f = sizeof(float), bf = 2, u32 = sizeof(uint32_t);
  const size_t H = d.hidden_size, k = d.num_experts_per_tok, E = d.num_experts;
  PrefillScratch c;
  c.rows = rows;
  c.tok[0] = scratch(C * u32, "chunk tokens A");
  c.tok[1] = scratch(C * u32, "chunk tokens B");
  c.h = scratch(C * H * f, "chunk h (residual)");
  c.xn = scratch(C * H * bf, "chunk xn (normed, bf16)");
  const size_t vdim = size_t(d.linear_num_value_heads) * d.linear_value_head_dim;
  c.qkv = scratch(C * d.conv_dim() * f, "chunk gdn qkv");
  c.z = scratch(C * vdim * bf, "chunk gdn z (bf16)");
  c.b = scratch(C * d.linear_num_value_heads * f, "chunk gdn b");
  c.a = scratch(C * d.linear_num_value_heads * f, "chunk gdn a");
  const size_t gdn_splits = size_t(d.linear_num_value_heads) * (d.linear_value_head_dim / gdn_scan_rows(d.linear_value_head_dim));
  c.gdn_ss = scratch(C * gdn_splits * f, "chunk gdn split sums of y^2");
  c.gdn_f = scratch(C * gdn_splits * bf, "chunk gdn norm scale (half)");
  const size_t Hq = d.num_attention_heads, Hkv = d.num_key_value_heads, D = d.head_dim;
  c.qg = scratch(C * Hq * 2 * D * bf, "chunk attn q|gate (bf16)");
  c.k = scratch(C * Hkv * D * bf, "chunk attn k (bf16)");
  c.v = scratch(C * Hkv * D * bf, "chunk attn v (bf16)");
  c.q = scratch(C * Hq * D * f, "chunk attn q (prepared)");
  c.attn = scratch(C * Hq * D * bf, "chunk attn out (bf16)");
  // The GDN out_proj input u (bf16) is dead in attention layers and attn in GDN layers: one
  // set of bytes when the model's dims allow (the real model: the same size).
  c.oh = Hq * D >= vdim ? c.attn : scratch(C * vdim * bf, "chunk gdn u (bf16)");
  c.router = scratch(C * (E + 1) * f, "chunk router logits | shared gate");
  c.ids = scratch(C * k * u32, "chunk expert ids");
  c.w = scratch(C * (k + 1) * f, "chunk routing weights");
  c.block_counts = scratch(ceil_div(C, route_block_rows(uint32_t(k))) * E * u32, "chunk routing histogram blocks");
  c.perm = scratch(C * k * u32, "chunk grouped order");
  // the class maps of the tile height with the most entries (a few KB; bounded by the chunk)
  c.max_tiles = 0;
  for (uint32_t T : kExpertTileRows)
    c.max_tiles = std::max(c.max_tiles, moe_map_entries(uint32_t(C * k), uint32_t(E), T));
  c.tiles = scratch(size_t(c.max_tiles) * sizeof(args::MoeTile), "chunk tile maps");
  c.tile_count = scratch(args::kMoeTileClasses * u32, "chunk tile counts");
  c.hx = scratch(C * k * d.moe_intermediate_size * bf, "chunk expert hidden (bf16)");
  c.yx = scratch(C * k * H * bf, "chunk expert outputs (bf16)");
  c.hs = scratch(C * d.shared_expert_intermediate_size * bf, "chunk shared hidden (bf16)");
  for (int p = 0; p < 2; ++p) {
    c.hist[p].resize(d.num_hidden_layers);
    for (auto& hb : c.hist[p]) hb = scratch(E * u32, "expert histogram");
  }
  if (splits_attention()) {
    const uint64_t per_split = uint64_t(C) * Hq * (D + 2) * f;
    c.attn_splits = uint32_t(std::max<uint64_t>(2, kAttnPartialBudget / per_split));
    c.part_ml = scratch(size_t(c.attn_splits) * C * Hq * 2 * f, "chunk attn partial m,l");
    c.part_o = scratch(size_t(c.attn_splits) * C * Hq * D * f, "chunk attn partial out");
  }
  c.logits_rows = uint32_t(std::min<size_t>(C, kAllLogitsRows));
  c.logits = scratch(size_t(c.logits_rows) * d.vocab_size * f, "chunk logits (all-logits mode)");
  return c;
}

// Tile height of the grouped expert GEMMs for the chunk's rows in layer `layer` (the one
// place the choice is made). From the rows per active expert, measured on the last
// completed chunk of the same layer when there is one, else expected from rows * k / E:
// 32-row tiles (2 x 2 simdgroups) read each expert's weights half as often as 16-row tiles
// and win once experts carry >= 24 rows on average (docs/goals.md: +13.2% at 2K tokens, 64 rows
// per expert); below that the padding of half-empty 32-row tiles costs more. 64-row tiles
// halve the weight reads again from 48 rows per expert on (a 2048-row chunk: 64 on average).
// On the tensor-op path 128-row tiles (which compute only the live moe_gemm_band rows of a partial
// tile) halve the dequantization again from kTile128Rows rows per expert on (docs/prefill.md).
uint32_t PrefillPlan::moe_tile_rows(const PrefillScratch& c, const Chunk& chunk, uint32_t layer) const {
  if (chunk.tile_rows) return chunk.tile_rows;
  const ModelDims& d = d_;
  const uint64_t assignments = uint64_t(chunk.rows) * d.num_experts_per_tok;
  double active = std::min<double>(d.num_experts, double(assignments));
  if (chunk.measured >= 0) {
    const auto* h = static_cast<const uint32_t*>(c.hist[chunk.measured][layer]->contents());
    uint32_t n = 0;
    for (uint32_t e = 0; e < d.num_experts; ++e) n += h[e] != 0;
    if (n) active = std::min<double>(n, double(assignments));
  }
  const double per_expert = assignments / std::max(1.0, active);
  for (size_t i = std::size(args::kExpertTileRows) - 1; i > 0; --i) {
    const uint32_t T = args::kExpertTileRows[i];
    if (expert_tile_available(T) && per_expert >= kExpertTileMinRows[i]) return T;
  }
  return args::kExpertTileRows[0];
}

// Index of tile height T in PrefillKernels' expert GEMMs (kExpertTileRows).
static uint32_t tile_index(uint32_t T) {
  uint32_t i = 0;
  while (kExpertTileRows[i] != T) ++i;
  return i;
}

void PrefillPlan::bind(gpu::Device& dev, const ModelWeights& weights) {
  const ModelDims& d = d_;
  w_ = &weights;
  PrefillKernels& k = kernels_;
  const std::string path = families_ & kGemmFamily ? "_tensor" : "";
  const std::string moe_path = families_ & kMoeFamily ? "_tensor" : "";
  const bool tensor_attention = families_ & kAttentionFamily;
  const uint32_t D = d.head_dim, G = attn_heads_per_group(d.num_attention_heads / d.num_key_value_heads);
  k.embed_rows = &dev.pipeline(kernel_name("embed_rows", {{'q', 4}}));
  k.rms_norm = &dev.pipeline("rms_norm_bf16");  // xn: the GEMMs' bfloat input
  const bool tensor_gemm = families_ & kGemmFamily;
  k.gemm = ByBits(dev, "gemm", gemm_suffix(GemmOut::store, tensor_gemm), {4, 8});
  k.gemm_add_h = ByBits(dev, "gemm", gemm_suffix(GemmOut::add, tensor_gemm), {4});
  k.gemm_add_hs = ByBits(dev, "gemm", gemm_suffix(GemmOut::add_scaled, tensor_gemm), {4});
  k.gemm_bf16 = ByBits(dev, "gemm", gemm_suffix(GemmOut::store_bf16, tensor_gemm), {4});
  // the scan with its head split into Dv / RV threadgroups of RV state rows (docs/prefill.md)
  const uint32_t Dv = d.linear_value_head_dim, RV = gdn_scan_rows(Dv);
  k.gdn_scan = &dev.pipeline(kernel_name("gdn_scan", {{'k', d.linear_key_head_dim}, {'v', Dv}, {'r', RV}}));
  k.gdn_norm_scale = &dev.pipeline(kernel_name("gdn_norm_scale", {{'v', Dv}, {'r', RV}}));
  k.gdn_conv_state = &dev.pipeline("gdn_conv_state");
  // the tensor-op attention (its own switch: bfloat operands) reads q as bfloat * scale in
  // its own layout (attn_prefill_prep_d<D>_qbf)
  const std::string attn_path = tensor_attention ? "_tensor" : "";
  k.attn_prep = &dev.pipeline(kernel_name("attn_prefill_prep", {{'d', D}}, tensor_attention ? "_qbf" : ""));
  // attention_prefill_tensor.metal on the tensor path
  k.attn = &dev.pipeline(kernel_name("attn_prefill", {{'d', D}, {'g', G}}, attn_path));
  if (splits_attention()) {
    k.attn_split = &dev.pipeline(kernel_name("attn_prefill_split", {{'d', D}, {'g', G}}, attn_path));
    k.attn_combine = &dev.pipeline(kernel_name("attn_prefill_combine", {{'d', D}}));
  }
  k.route_clear = &dev.pipeline("moe_route_clear");
  k.route_topk = &dev.pipeline("moe_route_topk");
  k.route_scatter = &dev.pipeline("moe_route_scatter");
  k.shared_gate_up = &dev.pipeline(kernel_name("gemm_swiglu", {{'q', 4}}, path));
  for (uint32_t T : kExpertTileRows) {
    if (!expert_tile_available(T)) continue;
    k.experts_gate_up[tile_index(T)] =
        &dev.pipeline(kernel_name("moe_gemm_gate_up", {{'q', 4}, {'t', T}}, moe_path));
    k.experts_down[tile_index(T)] = &dev.pipeline(kernel_name("moe_gemm_down", {{'q', 4}, {'t', T}}, moe_path));
  }
  k.moe_combine = &dev.pipeline("moe_combine");
  k.moe_combine_norm = &dev.pipeline("moe_combine_norm");
}

void PrefillPlan::encode_chunk(gpu::CommandBuffer& cmd, PrefillScratch& c, SequenceState& seq,
                               DecodeScratch& head, const Chunk& chunk, Traffic* tr) const {
  const ModelDims& d = d_;
  const ModelWeights& model = *w_;
  const PrefillKernels& K = kernels_;
  const int parity = chunk.parity;
  const uint32_t p0 = chunk.p0, M = chunk.rows;
  gpu::ComputePass& pass = cmd.compute_pass();
  Traffic local;
  Traffic& t = tr ? *tr : local;
  const size_t f = sizeof(float), bf = 2, u32 = sizeof(uint32_t);
  const uint32_t H = d.hidden_size, E = d.num_experts, k = d.num_experts_per_tok;
  auto tg = [](uint32_t x, uint32_t y = 1, uint32_t z = 1) { return gpu::Size3{x, y, z}; };
  const GemmBlock gb = gemm_block(families_ & kGemmFamily);
  // y[:, col0 : col0 + n] (=|+=) x[:, :cols] W^T with x, y row strides lda, ldy (elements);
  // x is bfloat (xn, hs, oh, attn); y fp32, or bfloat (bf16_y: the GDN z, the attention's
  // q|gate, k, v; not with add).
  // tag: nonzero for GEMMs that write disjoint columns of one y in one stage (gpu::Range::disjoint).
  // x_scale (add only): x's element i times x_scale[i >> x_shift] (gemm_q4_add_hs: out_proj).
  auto gemm = [&](const QuantLinear& w, bool add, gpu::Buffer& x, uint32_t cols, uint32_t lda, gpu::Buffer& y,
                  uint32_t n, uint32_t ldy, uint32_t col0, const std::string& label, bool bf16_y = false,
                  uint32_t tag = 0, gpu::Buffer* x_scale = nullptr, uint32_t x_shift = 0) {
    const GemmOut out = gemm_out(add, bf16_y, x_scale != nullptr);
    const ByBits& kernel = out == GemmOut::store_bf16   ? K.gemm_bf16
                           : out == GemmOut::store      ? K.gemm
                           : out == GemmOut::add_scaled ? K.gemm_add_hs
                                                        : K.gemm_add_h;
    GemmOperands io{x, y, 0, col0 * (bf16_y ? bf : f), x_scale, x_shift, tag};
    encode_gemm(pass, kernel[w.bits], label, gb, w, out, io, args::GemmArgs{M, n, cols, lda, ldy}, &t);
  };
  auto rms_rows = [&](const TensorRef& w, gpu::Buffer& x, gpu::Buffer& out, const std::string& label) {
    encode_rms_norm(pass, *K.rms_norm, label, x, w, out, M, H, d.rms_norm_eps, bf, kNormThreads, &t);
  };

  const uint32_t L = uint32_t(model.layers.size());
  const uint32_t first = chunk.layer_begin, end = chunk.layer_end ? chunk.layer_end : L;
  // embed: the chunk's token ids were written to tok[parity] by the host.
  if (first == 0) {
    encode_embed_rows(pass, *K.embed_rows, "embed", model.embed, *c.tok[parity], 0, *c.h, M, H, d.vocab_size, &t);
  }

  for (uint32_t li = first; li < end; ++li) {
    const Layer& layer = model.layers[li];
    const uint32_t l = layer.index;
    // the other layers' input norm is fused into the previous layer's combine
    if (l == 0) rms_rows(*layer.input_norm, *c.h, *c.xn, labels_(l, "input norm"));
    if (!layer.full_attention) {
      // ---- Gated DeltaNet
      const DeltaNetLayer& g = layer.gdn;
      const uint32_t Hv = d.linear_num_value_heads, Dv = d.linear_value_head_dim, C = d.conv_dim();
      gemm(g.in_proj_qkv, false, *c.xn, H, H, *c.qkv, C, C, 0, labels_(l, "in_proj_qkv"));
      // z only gates the norm: stored bf16, read by gdn_scan
      gemm(g.in_proj_z, false, *c.xn, H, H, *c.z, Hv * Dv, Hv * Dv, 0, labels_(l, "in_proj_z"), true);
      gemm(g.in_proj_b, false, *c.xn, H, H, *c.b, Hv, Hv, 0, labels_(l, "in_proj_b"));
      gemm(g.in_proj_a, false, *c.xn, H, H, *c.a, Hv, Hv, 0, labels_(l, "in_proj_a"));
      // The chunk reads the conv state of its start parity and leaves the one of its end
      // parity (decode alternates the two buffers by position); they may be the same buffer.
      gpu::Buffer& conv_in = *seq.conv[p0 % 2][l];
      gpu::Buffer& conv_out = *seq.conv[(p0 + M) % 2][l];
      const GdnShape shape = GdnShape::of(d);
      const uint32_t RV = gdn_scan_rows(Dv);
      encode_gdn_scan(pass, *K.gdn_scan, labels_(l, "conv + scan"), shape, g,
                      {*c.qkv, *c.b, *c.a, *c.z, conv_in, *seq.state[l], *c.oh, *c.gdn_ss}, M, RV,
                      d.rms_norm_eps, &t);
      // the per-(token, head, split) factors of the norm, applied by out_proj
      encode_gdn_norm_scale(pass, *K.gdn_norm_scale, labels_(l, "norm scale"), shape, *c.gdn_ss, *c.gdn_f, M,
                            RV, d.rms_norm_eps);
      encode_gdn_conv_state(pass, *K.gdn_conv_state, labels_(l, "conv state"), shape, *c.qkv, conv_in, conv_out,
                            M, kGdnConvStateThreads, &t);
      // u times the norm scale of its (token, head, split): one factor per RV elements of a row
      uint32_t shift = 0;
      while ((1u << shift) < RV) ++shift;
      if ((1u << shift) != RV) throw std::logic_error("gdn_scan rows per threadgroup must be a power of two");
      gemm(g.out_proj, true, *c.oh, Hv * Dv, Hv * Dv, *c.h, H, H, 0, labels_(l, "out_proj"), false, 0, c.gdn_f.get(),
           shift);
    } else {
      // ---- full attention
      const AttentionLayer& a = layer.attn;
      const uint32_t Hq = d.num_attention_heads, Hkv = d.num_key_value_heads, D = d.head_dim;
      // q|gate, k, v stored bf16: read by the prep (and the gate by the attention)
      gemm(a.q_proj, false, *c.xn, H, H, *c.qg, Hq * D * 2, Hq * D * 2, 0, labels_(l, "q_proj"), true);
      gemm(a.k_proj, false, *c.xn, H, H, *c.k, Hkv * D, Hkv * D, 0, labels_(l, "k_proj"), true);
      gemm(a.v_proj, false, *c.xn, H, H, *c.v, Hkv * D, Hkv * D, 0, labels_(l, "v_proj"), true);
      const size_t row = size_t(D) * 2;
      const uint32_t G = attn_heads_per_group(Hq / Hkv);
      const float scale = float(1.0 / std::sqrt(double(D)));
      const bool bf16_q = tensor_attention();  // the tensor attention's bfloat q
      AttnPrefillBuffers io{*c.qg, *c.q, *seq.k_cache[l], *seq.v_cache[l]};
      io.k = c.k.get(), io.v = c.v.get(), io.out = c.attn.get();
      io.ml = c.part_ml.get(), io.po = c.part_o.get();
      encode_attn_prefill_prep(pass, *K.attn_prep, labels_(l, "qk prep + kv append"), io, *a.q_norm, *a.k_norm,
                               args::AttnPrefillPrepArgs{Hq, Hkv, d.rotary_dim, opt_.max_context, p0, M,
                                                         d.rms_norm_eps, float(std::log2(double(d.rope_theta))),
                                                         scale, G},
                               D, bf16_q, &t.weight_bytes);
      const uint32_t BQ = kAttnPairs / G;
      const uint32_t end = p0 + M;  // cache rows [0, end) are read
      // Split the KV range only when the plain grid is too small to fill the GPU (few query
      // rows after a long prefix; docs/prefill.md): above the layout threshold and with
      // fewer than kAttnMinGroups threadgroups.
      const uint32_t plain_groups = ceil_div(M, BQ) * (Hq / G);
      const bool split = c.attn_splits > 0 && end > opt_.split_threshold && plain_groups < kAttnMinGroups &&
                         end >= 2 * split_rows();
      t.kv_bytes += 2 * size_t(Hkv) * (size_t(end) + M) * row;
      if (!split) {
        encode_attn_prefill(pass, *K.attn, labels_(l, "attention"), io,
                            args::AttnPrefillArgs{Hq, Hkv, opt_.max_context, p0, M, scale, 0, 0}, D, G, bf16_q);
      } else {
        // Few query rows after a long prefix: cut the KV range into splits so the grid fills
        // the GPU, then merge the partials (the split count is bounded by the partials buffer).
        const uint32_t cap = uint32_t(std::min<uint64_t>(c.attn_splits, uint64_t(kAttnPartialBudget) /
                                                                            (uint64_t(M) * Hq * (D + 2) * f)));
        const uint32_t S = std::max(split_rows(), ceil_div(end, std::max(2u, cap)));
        const args::AttnPrefillArgs aa{Hq, Hkv, opt_.max_context, p0, M, scale, S, ceil_div(end, S)};
        encode_attn_prefill(pass, *K.attn_split, labels_(l, "attention split"), io, aa, D, G, bf16_q);
        encode_attn_prefill_combine(pass, *K.attn_combine, labels_(l, "attention combine"), *c.part_ml,
                                    *c.part_o, *c.qg, *c.attn, aa, D);
      }
      gemm(a.o_proj, true, *c.attn, Hq * D, Hq * D, *c.h, H, H, 0, labels_(l, "o_proj"));
    }

    // ---- MoE
    const MoeBlock& m = layer.moe;
    const uint32_t I = d.moe_intermediate_size, Is = d.shared_expert_intermediate_size;
    rms_rows(*layer.post_attention_norm, *c.h, *c.xn, labels_(l, "post-attention norm"));
    gemm(m.gate, false, *c.xn, H, H, *c.router, E, E + 1, 0, labels_(l, "router"), false, kRouterWrites);
    gemm(m.shared_expert_gate, false, *c.xn, H, H, *c.router, 1, E + 1, E, labels_(l, "shared gate"), false,
         kRouterWrites);
    const uint32_t T = moe_tile_rows(c, chunk, l);
    const uint32_t block_rows = route_block_rows(k);
    const args::MoeRoutePrefillArgs ra{M, E, k, d.norm_topk_prob ? 1u : 0u, block_rows, T};
    encode_moe_route_clear(pass, *K.route_clear, labels_(l, "route clear"), *c.block_counts, ra);
    encode_moe_route_topk(pass, *K.route_topk, labels_(l, "route top-k + histogram"), *c.router, *c.ids, *c.w,
                          *c.block_counts, ra);
    const uint32_t classes = args::moe_tile_classes(T);
    const size_t tile_bytes = sizeof(args::MoeTile);
    encode_moe_route_scatter(pass, *K.route_scatter, labels_(l, "route scan + scatter + tile maps"), *c.ids,
                             *c.block_counts, *c.perm, *c.tiles, *c.tile_count, *c.hist[parity][l], ra);
    // shared expert (dense)
    // hs = sigmoid(shared gate) * swiglu: the gate (w[:, k], from top-k) scales the hidden, so
    // the down projection adds the shared expert's output into h itself.
    encode_gemm_swiglu(pass, *K.shared_gate_up, labels_(l, "shared expert gate|up"), gb, m.shared_gate_proj,
                       m.shared_up_proj, *c.xn, *c.hs, args::GemmArgs{M, Is, H, H, Is}, *c.w, k * f, k + 1, &t);
    gemm(m.shared_down_proj, true, *c.hs, Is, Is, *c.h, H, H, 0, labels_(l, "shared expert down"));
    // routed experts: one dispatch per tile class over its own map and count, the classes of
    // a projection in one barrier stage (disjoint slots); grids sized for each class's
    // capacity (surplus threadgroups exit; a class no tile can reach is not dispatched). The
    // weight traffic is counted once per projection.
    auto experts = [&](bool down) {
      for (uint32_t cl = 0; cl < classes; ++cl) {
        const uint32_t Tc = T >> cl, tiles_c = args::moe_class_capacity(M * k, E, T, cl);
        if (!tiles_c) continue;  // too few assignments for a tile of this class
        const MoeGemmBuffers io{down ? *c.hx : *c.xn, *c.perm, *c.tiles, *c.tile_count, down ? *c.yx : *c.hx,
                                args::moe_class_base(M * k, E, T, cl) * tile_bytes, cl * u32};
        const args::MoeGemmArgs ga = down ? args::MoeGemmArgs{H, I, M, k, E, I, H, T}
                                          : args::MoeGemmArgs{I, H, M, k, E, H, I, T};
        // a routed-expert stack is declared whole (the experts are only known on the GPU); the
        // traffic counts the experts the chunk can reach, once per projection (class 0)
        encode_moe_gemm(pass, *(down ? K.experts_down : K.experts_gate_up)[tile_index(Tc)],
                        labels_(l, (down ? kDownLabel : kGateUpLabel)[cl]),
                        moe_geometry(Tc, families_ & kMoeFamily),
                        down ? m.experts_down_proj : m.experts_gate_proj, down ? nullptr : &m.experts_up_proj, io,
                        ga, tiles_c, kTileClassWrites, cl == 0 ? &t.weight_bytes : nullptr);
      }
    };
    experts(false);
    experts(true);
    // combine; but for the last layer, fused with the next layer's input norm (h -> xn)
    const bool last = l + 1 == model.layers.size();
    encode_moe_combine(pass, last ? *K.moe_combine : *K.moe_combine_norm,
                       labels_(l, last ? "combine" : "combine + next input norm"), *c.h, *c.yx, *c.w,
                       args::MoeCombineArgs{M, H, k}, last ? nullptr : model.layers[l + 1].input_norm,
                       last ? nullptr : c.xn.get(), d.rms_norm_eps, 0, &t.weight_bytes);
  }

  if (end < L) {
    // a later command buffer runs the next layers (layer_groups)
  } else if (chunk.logits == Logits::all) {
    rms_rows(*model.final_norm, *c.h, *c.xn, "final norm");  // lm_head runs per block (encode_lm_head_rows)
  } else if (chunk.logits == Logits::last || chunk.sample) {
    const int slot = int((p0 + M - 1) % 2);
    head_.encode_head(pass, head, seq, *c.h, size_t(M - 1) * H * f, slot, chunk.sample, t);
  }
  pass.end();
}

void PrefillPlan::encode_lm_head_rows(gpu::CommandBuffer& cmd, PrefillScratch& c, uint32_t r0,
                                      uint32_t R) const {
  const ModelDims& d = d_;
  const size_t bf = 2, H = d.hidden_size, V = d.vocab_size;
  gpu::ComputePass& pass = cmd.compute_pass();
  const GemmBlock gb = gemm_block(families_ & kGemmFamily);
  encode_gemm(pass, kernels_.gemm[w_->lm_head.bits], "lm_head (all positions)", gb, w_->lm_head, GemmOut::store,
              GemmOperands{*c.xn, *c.logits, size_t(r0) * H * bf},
              args::GemmArgs{R, uint32_t(V), uint32_t(H), uint32_t(H), uint32_t(V)});
  pass.end();
}

}  // namespace lily::runtime
