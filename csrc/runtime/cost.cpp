// The cost table (cost.h). Counts are per dispatch, from what the record holds; an FMA is
// 2 operations. Unpacking a 4/8-bit weight and applying its scale and bias counts 3 ALU
// operations per weight each time a threadgroup dequantizes it. Tile shapes are those of
// metal/gemm_tiles.h (gemm.metal, gemm_tensor.metal, moe_prefill*.metal) and
// attention_prefill.metal.
#include "runtime/cost.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "runtime/kernel_args.h"
#include "runtime/kernel_names.h"

namespace lily::runtime {

namespace {

namespace args = lily::kernels;

// Bytes per weight of an MLX affine-quantized matrix: the packed value plus a bf16 scale and
// bias per group of kQuantGroup.
double quant_bytes(int bits) { return bits / 8.0 + 4.0 / args::kQuantGroup; }
constexpr double kDequantOps = 3;
// The prefill GEMMs' weight tiles (gemm_tiles.h GemmWItems::put): codes turned into exact half
// integers by the magic-number OR, two per 32-bit operation (per 8 4-bit codes one shift, 4
// masks, 4 ORs, 4 half2 subtractions: 13; per 4 8-bit codes 5), in half ALU; then per weight
// in fp32 a conversion from half, the FMA with the scale and bias, and the rounding to bfloat
// (3).
double prefill_dequant_f16_ops(int bits) { return bits == 8 ? 5.0 / 4 : 13.0 / 8; }
constexpr double kPrefillDequantF32Ops = 3;
// Prefill's activations are bfloat in device memory (xn, hs, hx, the GDN scan's u, attn; the
// routed experts' outputs yx, the GDN z and the attention's q|gate, k and v): rounded from
// fp32 once per element by the kernel that writes them, one conversion (no clamp: nothing
// is clipped). The GDN out_proj (gemm_q4_add_hs) multiplies each A element by its half scale
// in fp32 and rounds the product to bfloat: 3 operations per element and column block.
constexpr double kBf16ConvOps = 1;
// gdn_scan's lazy decay folds (one multiply per state element) on this share of a head's
// tokens: a fold comes once the decays since the last one multiply to < 2^-40 (e^-27.7), so
// a head with mean -ln g = x folds on x / 27.7 of its tokens. The demo checkpoint (the one
// trained model here) measures 0.33 over its heads (mean -ln g ~ 9: heads that keep almost
// nothing); a long-context model's memory heads (g near 1) fold far less often, so 1/3 is
// on the pessimistic side. Every token folding would be 7, the eager scan's count.
constexpr double kGdnScanFolds = 1.0 / 3.0;
// Dense GEMM blocks and tiles: args::kGemmBM, kGemmBN, kGemmSwigluBN, kGemmBK and the
// threadgroup memory (metal/gemm_args.h; the tensor-op path's rows come with its grid).
using args::kGemmBK;
// Threadgroup memory of a GEMM block as the kernels declare it (gemm_args.h: GemmSmem's on the
// simdgroup_matrix path, GemmTensorSmem's on the tensor-op path).
uint64_t gemm_smem(uint32_t bm, uint32_t bn, int nb, bool tensor) {
  return tensor ? args::gemm_tensor_smem_bytes(bn, nb) : args::gemm_smem_bytes(bm, bn, nb);
}
// The prefill attention's shape (metal/prefill_args.h): KV rows per tile, (row, head) pairs
// per threadgroup.
constexpr uint32_t kAttnTile = args::kAttnPrefillTile;
constexpr uint32_t kAttnRows = args::kAttnPrefillPairs;

bool starts(const std::string& s, const char* p) { return s.rfind(p, 0) == 0; }
bool ends(const std::string& s, const char* p) {
  const size_t n = std::strlen(p);
  return s.size() >= n && s.compare(s.size() - n, n, p) == 0;
}
// A templated kernel's parameter ("attn_prefill_d256_g4", "_d" -> 256; kernel_names.h).
uint32_t param(const std::string& name, const char* key) { return kernel_param(name, key[1]); }

// The argument struct T of the record (the inline bytes of T's size; those bound at `at` where
// a kernel binds two structs of one size).
template <class T>
T arg(const gpu::DispatchRecord& r, int at = -1) {
  for (const auto& [index, bytes] : r.args) {
    if (bytes.size() == sizeof(T) && (at < 0 || int(index) == at)) {
      T a;
      std::memcpy(&a, bytes.data(), sizeof(T));
      return a;
    }
  }
  throw std::invalid_argument(r.label + ": no argument struct of " + std::to_string(sizeof(T)) + " bytes");
}

double reads_of(const gpu::DispatchRecord& r, const char* buffer_label) {
  double s = 0;
  for (const auto& [label, n] : r.reads) s += label == buffer_label ? double(n) : 0.0;
  return s;
}

double declared(const gpu::DispatchRecord& r) { return double(r.bytes_read + r.bytes_written); }


Cost make(const char* family) {
  Cost w;
  w.family = family;
  return w;
}
void add(Cost& w, Path p, double flops) { w.flops[int(p)] += flops; }

// ---- latency chains (cost.h Lat; docs/performance.md "Latency chains") -------------------
// Counted on the longest threadgroup's critical path after its first device load, per the
// kernel's code: loads the compiler cannot hoist (after a barrier, or behind an address that
// an earlier load or reduction gives), barriers, simdgroup reductions and dependent ALU steps;
// apart, the loads of run-time-count loops (Cost::loop; Apple GPUs issue in order, so without
// unrolling each iteration waits for its own loads).
void chain(Cost& w, Lat k, double n) { w.chain[int(k)] += n; }
void loop(Cost& w, Lat k, double n) { w.loop[int(k)] += n; }
// Iterations per lane of a decode GEMV's chunk loop (gemv.metal gemv_body, q_team): 16-byte
// chunks of a row strided over a team of up to 32 lanes and `splits` simdgroups (split-K).
double gemv_iterations(double chunks, double rows_per_simdgroup, double splits = 1) {
  double team = 32;
  while (team > 32 / rows_per_simdgroup && team > chunks) team /= 2;
  return std::ceil(chunks / (team * splits));
}
// A part of the chain before the threadgroup's bulk traffic (also in the chain).
void lead(Cost& w, Lat k, double n) {
  w.lead[int(k)] += n;
  w.chain[int(k)] += n;
}
// The same latencies `times` over (a loop), into the chain or the lead.
struct Steps {
  double dram = 0, mem = 0, local = 0, barrier = 0, reduce = 0, alu = 0;
};
void chain(Cost& w, const Steps& s, double times, bool is_lead = false) {
  auto put = is_lead ? lead : static_cast<void (*)(Cost&, Lat, double)>(chain);
  put(w, Lat::dram, s.dram * times);
  put(w, Lat::mem, s.mem * times);
  put(w, Lat::local, s.local * times);
  put(w, Lat::barrier, s.barrier * times);
  put(w, Lat::reduce, s.reduce * times);
  put(w, Lat::alu, s.alu * times);
}
// threadgroup_sum / threadgroup_max (common.h): a simdgroup reduction, two barriers around the
// scratch, then the nsg partials added in order.
Steps tg_reduce(double simdgroups) { return Steps{0, 0, 0, 2, 1, simdgroups}; }
// Simdgroups sharing a row group in gemv_q* and moe_down_q4 (decode_args.h).
constexpr double kGemvSplitK = args::kGemvSplitK;
// q_split_join (common.h): the other splits' sums through threadgroup memory behind a barrier.
void split_join(Cost& w, double splits) {
  if (splits > 1) chain(w, Steps{0, 0, 1, 1, 0, splits - 1}, 1);
}
// team_reduce_rows (common.h): log2(team) shuffle + add levels over float4s (the teams of the
// decode GEMVs span a simdgroup at these sizes).
constexpr double kTeamReduceAlu = 2 * 5;
constexpr double kGemvRows = args::kGemvRowsPerSimdgroup;       // gemv_q*, moe_down_*
constexpr double kGateUpRows = args::kGateUpRowsPerSimdgroup;  // moe_route_gate_up_*
constexpr double kGdnRowBatch = args::kGdnRowBatch;  // gdn.metal: state rows a simdgroup updates side by side
// route_topk_simd's registers per lane (route.h; decode_args.h): kRouteSimdRowsSmall up to 32
// times that many experts, else kRouteSimdRowsMax; the softmax walks them in order, a round's
// search is a tree over them.
double route_rows_per_lane(uint32_t experts) {
  return experts <= 32 * args::kRouteSimdRowsSmall ? args::kRouteSimdRowsSmall : args::kRouteSimdRowsMax;
}
double simdgroups_of(const gpu::DispatchRecord& r) { return double(r.threads.count()) / 32; }

// The k loop of a prefill GEMM threadgroup (gemm_tiles.h gemm_accumulate, gemm_tensor.h
// gemm_tensor_gemm): per kGemmBK step the tiles are filled from registers (the weight codes
// dequantized), a barrier, the next step's loads issued (register-staged double buffering),
// the products, a barrier. A step's chain is its loads' latency, issued after the first
// barrier of the step before, then one barrier: max(load, products + barrier) + barrier, the
// products being the threadgroup's own work (the estimate adds it). The simdgroup_matrix
// path fetches its A pieces with the weights; the tensor path loads its A elements into
// registers before the dequantization (their latency, a load of the stage before's output,
// overlaps it and the barrier). The first load is the dispatch's own; the simdgroup_matrix
// path's staged epilogue adds two barriers.
void gemm_chain(Cost& w, uint32_t k, bool tensor) {
  const double steps = std::ceil(double(k) / kGemmBK);
  chain(w, Steps{1, 0, 0, 1, 0, 0}, steps);
  chain(w, Lat::dram, -1);
  chain(w, Lat::barrier, tensor ? 0 : 2);
}

// Dense quantized GEMM blocks (NB weight matrices sharing x); bfloat operands, fp32 sums.
// The activations are bfloat (copied into the tiles, or loaded into registers); NB = 2 writes
// bfloat (hs, scaled by the shared gate), as does bf16_y (gemm_q4_bf16: z, q|gate, k, v).
// scaled_a: the A elements times a half scale (gemm_q4_add_hs).
Cost dense_gemm(const gpu::DispatchRecord& r, int nb, bool tensor, bool bf16_y = false, int bits = 4,
                bool scaled_a = false) {
  const auto a = arg<args::GemmArgs>(r);
  Cost w = make("dense projections");
  add(w, tensor ? Path::tensor_bf16 : Path::sgmm_bf16, 2.0 * nb * a.m * a.n * a.k);
  // Every row block of the grid (grid y) dequantizes the weight rows it multiplies, and every
  // column block (grid x) loads the A rows (scaled_a: a multiply and a rounding per element);
  // SwiGLU: silu(g) * u times the row scale; a bfloat output: its conversion.
  const double dequant = nb * r.groups.y * double(a.n) * a.k;
  add(w, Path::alu_f16, prefill_dequant_f16_ops(bits) * dequant);
  add(w, Path::alu_f32,
      kPrefillDequantF32Ops * dequant + (scaled_a ? 3.0 * double(r.groups.x) * a.m * a.k : 0.0) +
          (nb == 2 ? 5.0 * a.m * a.n : 0.0) + (nb == 2 || bf16_y ? kBf16ConvOps * a.m * a.n : 0.0));
  w.bytes = declared(r);
  w.threadgroup_memory = gemm_smem(args::kGemmBM, nb == 2 ? args::kGemmSwigluBN : args::kGemmBN, nb, tensor);
  gemm_chain(w, a.k, tensor);
  // the epilogue: y read (ADD: gemm_q4_add_h*, gemm_q4_add_hs*) or the row scale g (SwiGLU)
  const bool add_y = ends(r.kernel, "_add_h") || ends(r.kernel, "_add_h_tensor") || ends(r.kernel, "_add_hs") ||
                     ends(r.kernel, "_add_hs_tensor");
  chain(w, Lat::mem, add_y || nb == 2 ? 1 : 0);
  return w;
}

// Grouped expert GEMMs: one dispatch per tile class (prefill_args.h, "Tile classes"), class c
// of height h = T >> c; bfloat operands, fp32 sums. Expected tiles of the class under one
// assumption, stated in docs/performance.md: the reached experts' remainders r (the rows of
// their last tile, 1..T) are uniform, so a fraction (h - lo + 1) / T of them lands in class c
// (lo: its fewest rows) with (lo + h) / 2 real rows on average; class 0 also runs the full
// tiles, (m k - reached (T + 1) / 2) / T of them. Every tile computes h rows (its padding
// included; on the tensor-op path only the live blocks of its simdgroups, moe_gemm_band rows
// each: a tail of r rows computes r rounded up to the band), dequantizes its expert's n x k weights
// once, and reads them: the experts a class reaches are counted (class 0: at most every
// reached one; class c > 0: one per tail).
Cost expert_gemm(const gpu::DispatchRecord& r, int nb, bool tensor) {
  const auto a = arg<args::MoeGemmArgs>(r);
  const uint32_t h = param(r.kernel, "_t"), T = std::max(a.tile_rows, h);
  uint32_t c = 0;
  while ((T >> c) > h) ++c;
  const uint32_t lo = args::moe_class_min_rows(T, c);
  Cost w = make("routed experts");
  const double reached = expected_experts(a.m, a.top_k, a.experts);
  const double assignments = double(a.m) * a.top_k;
  const double tails = reached * (h - lo + 1) / T;
  const double full = c == 0 ? std::max(0.0, (assignments - reached * (T + 1) / 2.0) / T) : 0.0;
  const double tiles = std::min(full + tails, double(r.groups.x));
  // rows per simdgroup block (prefill_args.h moe_gemm_band): the tensor-op path skips padding in these
  const uint32_t band = tensor ? args::moe_gemm_band(h, tensor, nb) : h;
  double tail_rows = 0;  // computed rows of a tail, on average over r = lo..h
  for (uint32_t rr = lo; rr <= h; ++rr) tail_rows += double((rr + band - 1) / band * band) / (h - lo + 1);
  // computed, padding included
  const double rows = full + tails > 0 ? tiles * (full * h + tails * tail_rows) / (full + tails) : 0.0;
  const double real = std::min(assignments, full * T + tails * (lo + h) / 2.0);
  const double experts_read = std::min(reached, full + tails);
  const uint32_t bn = args::moe_gemm_bn(h, tensor, nb);  // output columns per threadgroup
  add(w, tensor ? Path::tensor_bf16 : Path::sgmm_bf16, 2.0 * nb * rows * a.n * a.k);
  // weights dequantized to bfloat; bfloat activations are copied or loaded; both outputs are
  // stored as bfloat (the conversion), gate/up after silu(g) * u
  const double dequant = nb * tiles * double(a.n) * a.k;
  add(w, Path::alu_f16, prefill_dequant_f16_ops(4) * dequant);
  add(w, Path::alu_f32, kPrefillDequantF32Ops * dequant + ((nb == 2 ? 4.0 : 0.0) + kBf16ConvOps) * rows * a.n);
  w.threadgroup_memory = gemm_smem(h, bn, nb, tensor);
  // The weights of the experts read; of the rest (activations, perm, map, outputs, declared
  // whole by every class), the class's share of the real rows.
  const double stacks = nb * double(a.experts) * double(a.n) * a.k * quant_bytes(4);
  const double share = assignments > 0 ? real / assignments : 0.0;
  w.bytes = stacks / a.experts * experts_read + share * std::max(0.0, declared(r) - stacks);
  // the tile's rows: its map entry, then perm (gather), then the A rows: two dependent loads
  // before the k loop; the down projection's sink reads perm again per output row
  lead(w, Lat::mem, 2);
  gemm_chain(w, a.k, tensor);
  chain(w, Lat::mem, nb == 1 ? 1 : 0);
  return w;
}

std::optional<Cost> cost_of(const gpu::DispatchRecord& r);

// A batched decode MoE dispatch of n rows whose routed stacks are declared whole: `matrices`
// expert matrices (inter x hidden, 4-bit) of the union of the rows' picks read once, the union
// expected with uniform routing (expected_experts).
Cost union_experts(const gpu::DispatchRecord& r, uint32_t experts, uint32_t top_k, uint32_t inter, uint32_t hidden,
                   double n, double matrices) {
  Cost w = make("routed experts");
  const double reached = expected_experts(uint32_t(n), top_k, experts);
  w.bytes = declared(r) - matrices * (experts - reached) * double(inter) * hidden * quant_bytes(4);
  return w;
}

// A batched decode GEMV (batch_args.h: norm_gemv_batch_q*_b*, gemv_batch_q*_b*_add,
// gemv_gated_batch_q*_b*_add) is its batch-1 kernel's dispatch whose weight chunks serve n
// rows: its bytes are the record's (the weights once, each row's x and y); per row its ALU
// work, the team reduction and split join after the chunk loop and, for norm_gemv, the norm's
// threadgroup sum and rsqrt (each row's in turn on the critical path).
std::optional<Cost> batched_gemv_cost(const gpu::DispatchRecord& r) {
  const std::string& k = r.kernel;
  const bool norm = starts(k, "norm_gemv_batch_q");
  if (!norm && !starts(k, "gemv_batch_q") && !starts(k, "gemv_gated_batch_q")) return std::nullopt;
  const double n = norm ? arg<args::NormGemvBatchArgs>(r).rows : arg<args::GemvBatchArgs>(r).rows;
  gpu::DispatchRecord one = r;
  one.kernel =
      kernel_name(k.substr(0, k.find("_batch")), {{'q', param(k, "_q")}}, ends(k, "_add") ? "_add" : "");
  Cost w = *cost_of(one);
  for (double& f : w.flops) f *= n;
  chain(w, Lat::alu, (n - 1) * kTeamReduceAlu);
  const double splits = norm ? arg<args::NormGemvArgs>(r).k_splits : kGemvSplitK;
  for (int i = 1; i < n; ++i) split_join(w, splits);
  if (norm) {
    chain(w, tg_reduce(simdgroups_of(r)), n - 1);
    chain(w, Lat::alu, 2 * (n - 1));
  }
  return w;
}

std::optional<Cost> cost_of(const gpu::DispatchRecord& r) {
  const std::string& k = r.kernel;
  if (auto w = batched_gemv_cost(r)) return w;
  const double groups = double(r.groups.count());
  const bool tensor = ends(k, "_tensor");

  // ---- decode GEMVs (fp32 ALU, bandwidth-bound)
  if (k == "gemv_q4" || k == "gemv_q8" || k == "gemv_q4_add" || k == "gemv_q8_add") {
    const auto a = arg<args::GemvArgs>(r);
    Cost w = make("dense projections");
    add(w, Path::alu_f32, (2 + kDequantOps) * double(a.rows) * a.cols);
    w.bytes = declared(r);
    // the chunk loop, the team reduction, the splits' join, then (_add) y[row] read after it
    const double bits = k.find("q8") != std::string::npos ? 8.0 : 4.0;
    loop(w, Lat::dram, gemv_iterations(a.cols * bits / 128, kGemvRows, kGemvSplitK) - 1);
    chain(w, Lat::alu, kTeamReduceAlu);
    split_join(w, kGemvSplitK);
    chain(w, Lat::mem, ends(k, "_add") ? 1 : 0);
    return w;
  }
  // out_proj of a GDN layer: gemv_q*_add plus the gated norm on load, per x value and
  // simdgroup that loads it (each loads its split's 1 / kGemvSplitK of x: cols >= 64 chunks):
  // scale, weight, SiLU (~4) and the gate product; per chunk the head's NS partial sums and
  // 1/sqrt (~8).
  if (k == "gemv_gated_q4_add" || k == "gemv_gated_q8_add") {
    const auto a = arg<args::GemvArgs>(r);
    const auto gn = arg<args::GatedNormArgs>(r);
    Cost w = make("dense projections");
    const double simdgroups = groups * (r.threads.count() / 32);
    const double per_chunk = 128.0 / (k == "gemv_gated_q4_add" ? 4 : 8);
    add(w, Path::alu_f32, (2 + kDequantOps) * double(a.rows) * a.cols +
                              simdgroups * a.cols / kGemvSplitK * (8.0 + (8.0 + gn.splits) / per_chunk));
    w.bytes = declared(r);
    loop(w, Lat::dram,
         gemv_iterations(a.cols * (k == "gemv_gated_q4_add" ? 4.0 : 8.0) / 128, kGemvRows, kGemvSplitK) - 1);
    chain(w, Lat::alu, kTeamReduceAlu);  // as gemv_q*_add
    split_join(w, kGemvSplitK);
    chain(w, Lat::mem, 1);
    return w;
  }
  if (k == "norm_gemv_q4" || k == "norm_gemv_q8" || k == "embed_norm_gemv_q4") {
    const auto a = arg<args::NormGemvArgs>(r);
    const bool head = r.label.find("lm_head") != std::string::npos;
    Cost w = make(head ? "lm head + sampling" : "dense projections");
    const double rows = double(a.rows[0]) + a.rows[1] + a.rows[2] + a.rows[3];
    // every threadgroup recomputes the norm of x
    add(w, Path::alu_f32, (2 + kDequantOps) * rows * a.cols + 4.0 * groups * a.cols);
    w.bytes = declared(r);
    if (k == "embed_norm_gemv_q4") {  // the table is declared whole; one row is read
      const auto e = arg<args::EmbedArgs>(r);
      w.bytes -= (double(e.vocab) - 1) * e.cols * quant_bytes(4);
      // the row's address waits for the token id; its dequantization into threadgroup
      // memory (8 codes a word, in order), then a barrier before the norm reads it
      lead(w, Lat::dram, 1);
      lead(w, Lat::alu, 32 / 4 * 2);
      lead(w, Lat::barrier, 1);
    }
    // every threadgroup: the norm's sum of squares (threadgroup_sum) and rsqrt before its
    // first x chunk is scaled. Its lanes' first weight chunk is requested before the norm
    // (gemv.metal norm_gemv_start), so that round trip runs beside it instead of after it:
    // the lead is the norm alone (its pass over x is the loop below, as before)
    chain(w, tg_reduce(simdgroups_of(r)), 1, true);
    lead(w, Lat::alu, 2);
    loop(w, Lat::mem, std::ceil(a.cols / 4.0 / r.threads.count()) - 1);  // the sum of squares' pass over x
    loop(w, Lat::dram,
         gemv_iterations(a.cols * (ends(k, "q8") ? 8.0 : 4.0) / 128, a.rows_per_simdgroup, a.k_splits) - 1);
    chain(w, Lat::alu, kTeamReduceAlu);
    split_join(w, a.k_splits);
    return w;
  }
  // ---- decode MoE (fp32 ALU): routed stacks declared whole, top-k experts read
  if (k == "moe_route_gate_up_swiglu_q4") {
    const auto a = arg<args::MoeRouteArgs>(r);
    Cost w = make("routed experts");
    const double rows = double(a.top_k) * a.inter + a.inter_shared;
    // route_topk_simd (route.h) in every simdgroup of a routed slot, per lane: the softmax over
    // its RPL registers (a load and a max, an exp, a simd_sum as five shuffle-add levels, an add
    // and a division: ~17 each), then slot j's j + 1 rounds (the leader's k), each a tree over
    // the registers (RPL - 1 nodes of ~6), simd_max and simd_min (~20) and the removal (RPL).
    const double rpl = route_rows_per_lane(a.experts);
    const double routing_lanes = double(r.groups.x) * (r.threads.count() / 32) * 32;
    const double rounds = a.top_k * (a.top_k + 1) / 2.0;  // over the k slots
    add(w, Path::alu_f32, 2 * (2 + kDequantOps) * rows * a.hidden + 4.0 * rows +
                              routing_lanes * (a.top_k * 17 * rpl + rounds * (7 * rpl + 14)));
    w.bytes = declared(r) - 2.0 * (a.experts - a.top_k) * double(a.inter) * a.hidden * quant_bytes(4);
    // route_topk_simd before the first weight load, whose address is the pick: the softmax
    // (the max over the RPL registers in order, simd_max, the row sums' simd_sums side by side
    // added in order, the division) and one round per pick (the tree's log2 RPL levels of a
    // compare and two selects, simd_max, simd_min, the removal). Slot j's simdgroups run j + 1
    // rounds, the leader's all k: the lead takes the mean over the slots, k / 2, the chain the
    // longest, k.
    const Steps softmax{0, 0, 0, 0, 2, 2.0 * rpl + 4};
    const Steps round{0, 0, 0, 0, 2, 3.0 * std::log2(rpl) + 3};
    chain(w, softmax, 1, true);
    chain(w, round, a.top_k / 2.0, true);
    lead(w, Lat::dram, 1);
    chain(w, round, a.top_k / 2.0);
    loop(w, Lat::dram, gemv_iterations(a.hidden / 32.0, kGateUpRows) - 1);  // gate_up_slot's chunks
    chain(w, Lat::alu, 2 * kTeamReduceAlu);  // gate and up
    return w;
  }
  if (k == "moe_down_q4") {
    const auto a = arg<args::MoeArgs>(r);
    Cost w = make("routed experts");
    add(w, Path::alu_f32, (2 + kDequantOps) * (double(a.top_k) * a.inter + a.inter_shared) * a.hidden);
    w.bytes = declared(r) - (a.experts - a.top_k) * double(a.inter) * a.hidden * quant_bytes(4);
    // each chunk's weight address waits for ids[slot] (cached after the first): the ids, h and
    // weights are the dispatch's first loads, the weight rows the first dependent one
    const double its =
        gemv_iterations((double(a.top_k) * a.inter + a.inter_shared) / 32, kGemvRows, kGemvSplitK);
    lead(w, Lat::dram, 1);
    loop(w, Lat::dram, its - 1);
    loop(w, Lat::local, its - 1);
    chain(w, Lat::alu, kTeamReduceAlu);
    split_join(w, kGemvSplitK);
    chain(w, Lat::mem, 1);  // residual[row] read after the reduction
    return w;
  }
  // ---- batched decode MoE (batch_args.h MoeBatchArgs): n rows per dispatch
  if (starts(k, "moe_route_gate_up_batch_q4")) {
    const auto a = arg<args::MoeRouteArgs>(r, 17);
    const double n = arg<args::MoeBatchArgs>(r, 18).rows;
    Cost w = union_experts(r, a.experts, a.top_k, a.inter, a.hidden, n, 2);
    const double rows = double(a.top_k) * a.inter + a.inter_shared;
    // moe_route_gate_up_swiglu_q4's work for each row (the routing as there: the softmax and
    // slot j's j + 1 rounds in every simdgroup of a routed column), plus in every simdgroup of
    // a routed column the other rows' softmax and the rank of its expert (a compare per
    // register and a simd_sum)
    const double rpl = route_rows_per_lane(a.experts);
    const double lanes_per_column = double(r.groups.x) * (r.threads.count() / 32) * 32;
    const double rounds = a.top_k * (a.top_k + 1) / 2.0;
    add(w, Path::alu_f32, n * (2 * (2 + kDequantOps) * rows * a.hidden + 4.0 * rows) +
                              n * lanes_per_column * (a.top_k * 17 * rpl + rounds * (7 * rpl + 14)) +
                              n * a.top_k * lanes_per_column * (n - 1) * (17 * rpl + 3 * rpl + 10));
    // before the first weight load: the row's routing (as the batch-1 kernel's), then each
    // other row's softmax and rank (a simd_sum)
    const Steps softmax{0, 0, 0, 0, 2, 2.0 * rpl + 4};
    const Steps round{0, 0, 0, 0, 2, 3.0 * std::log2(rpl) + 3};
    const Steps rank{0, 0, 0, 0, 2, 2.0 * rpl + 2};
    chain(w, softmax, 1, true);
    chain(w, round, a.top_k / 2.0, true);
    chain(w, softmax, n - 1, true);
    chain(w, rank, n - 1, true);
    lead(w, Lat::dram, 1);
    chain(w, round, a.top_k / 2.0);
    loop(w, Lat::dram, gemv_iterations(a.hidden / 32.0, kGateUpRows) - 1);
    chain(w, Lat::alu, 2 * n * kTeamReduceAlu);  // gate and up of each row picking the expert, at most n
    return w;
  }
  if (starts(k, "moe_down_batch_q4")) {
    const auto a = arg<args::MoeArgs>(r, 10);
    const double n = arg<args::MoeBatchArgs>(r, 11).rows;
    Cost w = union_experts(r, a.experts, a.top_k, a.inter, a.hidden, n, 1);
    const double slots = double(a.top_k) * a.inter + a.inter_shared;
    add(w, Path::alu_f32, n * (2 + kDequantOps) * slots * a.hidden + n * slots * a.hidden / 32);  // + phase 2's adds
    const double reached = expected_experts(uint32_t(n), a.top_k, a.experts);
    // the picks and the owners (two barriers, each entry compared with those before it), phase
    // 1's loads, a barrier, phase 2's threadgroup reads, then each row's reduction and join
    const double entries = n * a.top_k;
    const double items = (reached * a.inter + a.inter_shared) / 32;  // loaded (expert, chunk) pairs
    lead(w, Lat::dram, 1);
    chain(w, Lat::barrier, 3);
    chain(w, Lat::local, entries / 2);
    loop(w, Lat::dram, std::ceil(items / 64) - 1);
    loop(w, Lat::local, n * gemv_iterations(slots / 32, kGemvRows, kGemvSplitK));
    chain(w, Lat::alu, n * kTeamReduceAlu);
    for (int i = 0; i < n; ++i) split_join(w, kGemvSplitK);
    chain(w, Lat::mem, 1);
    return w;
  }
  // ---- Gated DeltaNet. Decode step: per token and value head ~9 Dk Dv (decay, k.S, rank-1
  // update, q.S: 7, plus two 32-lane simd_sums over every row) and 12 (Dk + Dv) for the
  // conv, norms and gates; each of the NS threadgroups of a head (grid y) redoes the q/k part;
  // 2 Dk Dv (decay, fma) per pending ring entry replayed. The write-back: the replay alone.
  if (starts(k, "gdn_decode_step_k")) {
    const uint32_t Dk = param(k, "_k"), Dv = param(k, "_v");
    const auto a = arg<args::GdnDecodeArgs>(r);
    Cost w = make("gated deltanet");
    add(w, Path::alu_f32, double(a.num_v_heads) * ((9.0 + 2.0 * a.pending) * Dk * Dv +
                                                   12.0 * (double(r.groups.y) * Dk + Dv)));
    w.bytes = declared(r);
    // gdn.metal: the conv and SiLU into threadgroup memory, a barrier, the q/k L2 norms
    // (simd_sum) and the gates from loads after the barrier; then each simdgroup's R rows in
    // batches of kGdnRowBatch (4: the runtime's R, one batch) side by side: the batch's state
    // loads together, the replay of the `pending` ring entries (an entry's g, k and the batch's
    // deltas loaded together, after the previous entry's update: one DRAM round trip per entry
    // and batch, gdn_replay), the update (S k and S q, each a dependent dot and a simd_sum per
    // row, the rows' in parallel); then a barrier and the split's sum of squares.
    const double batches = std::ceil(double(Dv) / r.groups.y / simdgroups_of(r) / kGdnRowBatch);
    chain(w, Steps{0, 1, 1, 1, 1, 25}, 1, true);
    chain(w, Steps{1, 0, 0, 0, 2, 13.0 + 2.0 * a.pending}, batches);
    loop(w, Lat::dram, batches * a.pending);
    chain(w, Steps{0, 0, 1, 1, 1, 4}, 1);
    return w;
  }
  if (starts(k, "gdn_state_writeback_k")) {
    const uint32_t Dk = param(k, "_k"), Dv = param(k, "_v");
    const auto a = arg<args::GdnDecodeArgs>(r);
    Cost w = make("gated deltanet");
    add(w, Path::alu_f32, 2.0 * a.num_v_heads * a.pending * Dk * Dv);
    w.bytes = declared(r);
    if (a.pending > 0) {  // the row batches, each its state loads and the replay (gdn_replay), then a barrier
      const double batches = std::ceil(double(Dv) / r.groups.y / simdgroups_of(r) / kGdnRowBatch);
      chain(w, Steps{1, 0, 0, 0, 0, 2.0 * a.pending}, batches);
      chain(w, Lat::dram, -1);  // the first load is the dispatch's own
      loop(w, Lat::dram, batches * a.pending);
      chain(w, Lat::barrier, 1);
    }
    return w;
  }
  // Prefill scan (gdn_prefill.metal): per token and value head (6 + kGdnScanFolds) Dk Dv for
  // the state (3 FMAs with the lazy decay, plus the fold's multiply on a share of the tokens),
  // per row two dot products over L lanes (per lane 3 adds folding its float4 partial and
  // log2(L) shuffle-add levels), delta, and on each lane the lazy decay's scalars (c *= g,
  // the fold test, c (S'k), / c as reciprocal and multiply, c (S'q): 6); per token and
  // threadgroup (grid y of them per head) the staging: the conv of its 2 Dk + RV channels
  // (K taps and SiLU: 2K + 4 each), q and k sums of squares and scaling (6 Dk) and the gates
  // (~40). Per output value the gated norm's part: y^2 and its log2(RV) shuffle-add levels,
  // z to fp32, SiLU (~4), three products and the conversion of u; per token and split a_s (~4
  // per lane, every lane of the split computes it).
  if (starts(k, "gdn_scan_k")) {
    const uint32_t Dk = param(k, "_k"), Dv = param(k, "_v");
    const auto a = arg<args::GdnScanArgs>(r);
    const double L = args::kGdnScanLanesPerRow;
    const double per_row = 2.0 * L * (3.0 + std::log2(L)) + 3.0 + 6.0 * L;
    Cost w = make("gated deltanet");
    const double RV = param(k, "_r"), conv = (2.0 * Dk + RV) * (2.0 * args::kGdnConvTaps + 4.0);
    const double norm = 1.0 + std::log2(RV) + 1.0 + 4.0 + 3.0 + kBf16ConvOps + 4.0;
    add(w, Path::alu_f32, double(a.rows) * a.num_v_heads * ((6.0 + kGdnScanFolds) * Dk * Dv + (per_row + norm) * Dv +
                                                            r.groups.y * (conv + 6.0 * Dk + 40.0)));
    w.bytes = declared(r);
    w.threadgroup_memory = args::gdn_scan_smem_bytes(Dk, param(k, "_r"));  // prefill_args.h
    // The recurrence: per token, its staged q, k, g from threadgroup memory, then the
    // dependent steps of the update (the decay, S'k: Dk / (4 L) float4 FMAs into one
    // accumulator, 2 adds and log2 L shuffle levels, delta, S'q likewise): ~36. Per block of
    // kGdnScanTokensPerBlock tokens: the gated norm's loads of the block before and the
    // staging's conv loads (two round trips after barriers), the q/k simd_sums, two barriers.
    const double per_token = 2 * (double(Dk) / (4 * L) + 2 + 2 * std::log2(L)) + 6;
    chain(w, Lat::alu, per_token * a.rows);
    loop(w, Lat::local, a.rows);
    chain(w, Steps{0, 2, 0, 2, 1, 40}, std::ceil(double(a.rows) / args::kGdnScanTokensPerBlock));
    return w;
  }
  if (starts(k, "gdn_norm_scale_v")) {
    const auto a = arg<args::GdnScanArgs>(r);
    const double S = double(param(k, "_v")) / param(k, "_r");
    Cost w = make("gated deltanet");
    // per (token, head): the sum of S partials and inv (~5), per split its factor (~5)
    add(w, Path::alu_f32, double(a.rows) * a.num_v_heads * (S + 5.0 + 5.0 * S));
    w.bytes = declared(r);
    return w;
  }
  if (k == "gdn_conv_state") {  // a copy of K-1 rows
    Cost w = make("gated deltanet");
    w.bytes = declared(r);
    return w;
  }

  // ---- attention
  if (starts(k, "attn_decode_fused_d") || starts(k, "attn_decode_split_fused_d")) {
    const uint32_t D = param(k, "_d"), G = param(k, "_g");
    const auto a = arg<args::AttnFusedArgs>(r);
    const double keys = reads_of(r, "k cache") / (double(a.num_kv_heads) * D * 2) + 1;  // cached rows + new
    Cost w = make("attention");
    // attend_rows (attention.metal), per lane and block of RB = 32 / G rows (each lane ends
    // up with one of the block's RB x G (row, head) pairs, so this is also the count per pair):
    // the K and V elements converted (2 RB NE), the dots (2 D), the reduce-scatter (31 shuffles,
    // 31 adds, 62 selects), the head's max over log2(RB) shuffles and the pair's softmax (the
    // masking, a max, two exps, l: ~11), the accumulation (per head and element a multiply and
    // RB FMAs: G NE (1 + 2 RB)); the prep ~16 per element of its G + 1 vectors.
    const double RB = 32.0 / G, NE = D / 32.0;
    const double per_pair = 2 * RB * NE + 2.0 * D + 124 + 2 * std::log2(RB) + 11 + G * NE * (1 + 2 * RB);
    add(w, Path::alu_f32,
        double(a.num_q_heads) * keys * per_pair + 16.0 * (a.num_q_heads + a.num_kv_heads) * D);
    w.bytes = declared(r);
    // fused_prep: one simdgroup per vector (the G query heads, the new k), every load issued
    // at once (the dispatch's first), the D/32 partial simd_sums side by side then added in
    // order, the norm, the RoPE partner read back through threadgroup memory, then one
    // barrier. attend_rows: each simdgroup's blocks one after another, a block's RB rows
    // loaded together (one DRAM round trip) and then its dependent steps: the dots (NE), the
    // reduce-scatter (5 levels of a select, a shuffle and an add), the max (log2 RB shuffles),
    // the exps, the exchange through threadgroup memory, the accumulation (a multiply and RB
    // FMAs). Then the merge: two barriers per head (one head's buffer), the output.
    chain(w, Steps{0, 0, 1, 1, 1, NE + 8}, 1, true);
    const bool split = starts(k, "attn_decode_split");
    const double rows_tg = split ? std::min<double>(a.block_rows, keys) : keys;
    chain(w, Lat::local, 1);  // the prepared queries
    const double blocks_sg = std::ceil(rows_tg / (args::kAttnSimdgroups * RB));
    chain(w, Steps{0, 0, 1, 0, 0, NE + 15 + 2 * std::log2(RB) + 7 + RB}, blocks_sg);
    loop(w, Lat::dram, blocks_sg);
    chain(w, Steps{0, 0, 1, 2, 0, 20}, G);
    chain(w, Steps{0, split ? 0.0 : 1.0, 0, 1, 0, 8}, 1);  // the gate (unsplit) and the output
    w.threadgroup_memory = args::attn_decode_fused_smem_bytes(D, G);  // mixer_args.h
    return w;
  }
  if (starts(k, "attn_combine_d")) {
    const auto a = arg<args::AttnCombineArgs>(r);
    Cost w = make("attention");
    add(w, Path::alu_f32, 4.0 * a.num_q_heads * a.max_blocks * param(k, "_d"));
    w.bytes = declared(r);
    // attn_combine (attention.metal): the max over the blocks' partials (each lane the blocks
    // lane, lane + 32, ...: a load and a max each, then simd_max), every 8th block's weighted
    // sum per simdgroup, a barrier, the gate. The blocks are at most max_blocks (the runtime's
    // split_rows gives about that many).
    const double nb = a.max_blocks, per_lane = std::ceil(nb / 32), per_sg = std::ceil(nb / 8);
    chain(w, Steps{0, 1, 0, 1, 1, 2 * per_lane + 6 * per_sg + 10}, 1);
    loop(w, Lat::mem, per_lane + per_sg);
    return w;
  }
  if (starts(k, "attn_prefill_prep_d")) {  // reads bfloat q|gate, k, v (their GEMMs' bf16_y)
    const auto a = arg<args::AttnPrefillPrepArgs>(r);
    Cost w = make("attention");
    // _qbf: q * scale rounded to bfloat (2 operations per q element)
    add(w, Path::alu_f32, 10.0 * a.rows * (a.num_q_heads + a.num_kv_heads) * param(k, "_d") +
                              (ends(k, "_qbf") ? 2.0 * a.rows * a.num_q_heads * param(k, "_d") : 0.0));
    w.bytes = declared(r);
    // per simdgroup: the row's simd_sums, rsqrt, a simdgroup barrier, RoPE (no threadgroup barrier)
    chain(w, Steps{0, 0, 1, 0, 1, 20}, 1);
    return w;
  }
  if (starts(k, "attn_prefill_d") || starts(k, "attn_prefill_split_d")) {
    const uint32_t D = param(k, "_d"), G = param(k, "_g");
    const auto a = arg<args::AttnPrefillArgs>(r);
    // KV tiles the threadgroups run, exactly as the kernel walks them: block b (BQ chunk rows)
    // covers keys [0, p0 + its last row], cut at split boundaries on the split path, in
    // kAttnTile-row tiles (the last one partial, masked, but computed in full).
    const uint32_t rows = kAttnRows;
    const uint32_t BQ = rows / G, M = a.rows;
    double tiles = 0;
    for (uint32_t row0 = 0; row0 < M; row0 += BQ) {
      const uint64_t kend = uint64_t(a.p0) + std::min(row0 + BQ, M);
      if (a.num_splits == 0) {
        tiles += double((kend + kAttnTile - 1) / kAttnTile);
        continue;
      }
      for (uint64_t kbeg = 0; kbeg < kend && kbeg < uint64_t(a.num_splits) * a.split_rows; kbeg += a.split_rows)
        tiles += double((std::min<uint64_t>(kend - kbeg, a.split_rows) + kAttnTile - 1) / kAttnTile);
    }
    // the longest threadgroup's tiles: the last row block (unsplit) or a whole split
    const double tg_tiles = a.num_splits == 0 ? std::ceil(double(uint64_t(a.p0) + M) / kAttnTile)
                                              : std::ceil(double(a.split_rows) / kAttnTile);
    tiles *= double(a.num_q_heads / G);  // threadgroup columns
    const double scores = tiles * rows * kAttnTile;
    Cost w = make("attention");
    // Q K^T and P V: 2 D flops each per score, fp32 accumulation, bfloat operands on both paths
    add(w, tensor ? Path::tensor_bf16 : Path::sgmm_bf16, 4.0 * D * scores);
    // online softmax per score (mask, max, subtract, exp, operand rounding, sum: 8); the
    // tensor path adds the two halves' partial scores (1 more) and, on its register path
    // (the GPU's fragment layout: attend_tensor), runs the softmax in both halves (8 more;
    // counted whichever path runs, the fallback's 9 being fewer). K and V are taken as cached
    // (the tensor path: V straight into registers, the simdgroup path a plain copy of each
    // tile) and the tensor path's q as its prep wrote it; the simdgroup path scales and
    // rounds Q per threadgroup. The rare diag(corr) O rescale (a row's max grew by > 8) is not
    // counted. Plain kernel: the gated output stored as bfloat (the conversion; the split
    // partials stay fp32).
    add(w, Path::alu_f32,
        (tensor ? 17.0 : 8.0) * scores + (tensor ? 0.0 : groups * rows * D) +
            (a.num_splits == 0 ? kBf16ConvOps * double(M) * a.num_q_heads * D : 0.0));
    w.bytes = declared(r);
    // as the kernels declare it (prefill_args.h)
    w.threadgroup_memory = tensor ? args::attn_prefill_tensor_smem_bytes() : args::attn_prefill_smem_bytes(D);
    // per KV tile: the tensor path issues the first V slice's loads with the product reading
    // K (the next slices' loads overlap the products before them), two barriers (the halves'
    // partial scores, then P or the sums), the sum read back by the softmax lanes (a
    // threadgroup-memory load), a softmax of 16 columns per lane (the fallback: the halves'
    // add, max, subtract, exp, rounding per column and 2 shuffle levels: ~84 steps; the
    // register path's two rows of 8 columns with 2 shuffle levels each take about as many)
    // (attention_prefill_tensor.metal); the simdgroup path loads K, and V only after a
    // barrier, four barriers, a softmax of 8 columns (~30 steps) (attention_prefill.metal).
    const Steps tile = tensor ? Steps{1, 0, 1, 2, 0, 84} : Steps{2, 0, 0, 4, 0, 30};
    chain(w, tile, tg_tiles);
    chain(w, Lat::dram, -1);  // the first tile's loads are the dispatch's own
    // tensor: the barrier before the output (Q goes into registers with the first tile's
    // loads); simdgroup: its Q and O staging through the simdgroups' scratch, counted as 2
    chain(w, Lat::barrier, tensor ? 1 : 2);
    return w;
  }
  if (starts(k, "attn_prefill_combine_d")) {
    const auto a = arg<args::AttnPrefillArgs>(r);
    Cost w = make("attention");
    add(w, Path::alu_f32, (4.0 * a.num_splits + kBf16ConvOps) * a.rows * a.num_q_heads * param(k, "_d"));
    w.bytes = declared(r);
    // two passes over the splits' partials, a load per split each (the max, then the sums)
    chain(w, Lat::alu, 2.0 * a.num_splits);
    loop(w, Lat::mem, 2.0 * a.num_splits);
    return w;
  }
  // ---- prefill GEMMs
  if (k == "gemm_q4" || k == "gemm_q4_tensor" || k == "gemm_q4_add_h" || k == "gemm_q4_add_h_tensor")
    return dense_gemm(r, 1, tensor);
  if (k == "gemm_q4_bf16" || k == "gemm_q4_bf16_tensor") return dense_gemm(r, 1, tensor, true);
  if (k == "gemm_q4_add_hs" || k == "gemm_q4_add_hs_tensor") return dense_gemm(r, 1, tensor, false, 4, true);
  if (k == "gemm_q8" || k == "gemm_q8_tensor") {
    Cost w = dense_gemm(r, 1, tensor, false, 8);  // the 8-bit matrices are the router and shared-expert gate
    w.family = "routing";
    return w;
  }
  if (k == "gemm_swiglu_q4" || k == "gemm_swiglu_q4_tensor") {
    Cost w = dense_gemm(r, 2, tensor);
    w.family = "shared expert";
    return w;
  }
  if (starts(k, "moe_gemm_gate_up_q4_t")) return expert_gemm(r, 2, tensor);
  if (starts(k, "moe_gemm_down_q4_t")) return expert_gemm(r, 1, tensor);
  // ---- prefill routing, norms, embedding, combine
  if (k == "moe_route_clear" || k == "moe_route_topk" || k == "moe_route_scatter") {
    const auto a = arg<args::MoeRoutePrefillArgs>(r);
    Cost w = make("routing");
    const double per_row = k == "moe_route_topk" ? double(a.experts) * (6.0 + a.top_k) : 8.0 * a.top_k;
    add(w, Path::alu_f32, k == "moe_route_clear" ? 0.0 : a.rows * per_row);
    w.bytes = declared(r);
    const double nsg = simdgroups_of(r), T = r.threads.count();
    if (k == "moe_route_topk") {
      // route_topk (route.h) with threadgroup barriers: the max (threadgroup_max), the
      // exps from loads after it, the row sums and the rescale behind two barriers; per
      // round a scan of the thread's probabilities, simd_max and simd_min, a barrier, the
      // simdgroups' winners in order, a barrier; then the histogram's atomic add
      chain(w, tg_reduce(nsg), 1);
      chain(w, Steps{0, 2, 0, 2, 1, 12}, 1);
      chain(w, Steps{0, 0, 1, 2, 2, std::ceil(a.experts / T) * 2 + 2 * nsg}, a.top_k);
    } else if (k == "moe_route_scatter") {
      // moe_route_scatter: each expert's histogram column summed over the blocks in order (a
      // load per block), the exclusive sums (one per tile class and the counts), the block's
      // ids behind a barrier, the tile maps' binary searches, and the stable scatter, whose
      // thread with the most assignments walks the block's earlier ones in threadgroup memory
      const double blocks = std::ceil(double(a.rows) / a.block_rows);
      const double na = std::min<double>(double(a.block_rows) * a.top_k, double(a.rows) * a.top_k);
      double walk = 0;  // the last thread's assignments tid, tid + T, ... each scans those before it
      for (double i = T - 1; i < na; i += T) walk += i;
      const double classes = args::moe_tile_classes(a.tile_rows);
      chain(w, Lat::alu, blocks * std::ceil(a.experts / T));
      loop(w, Lat::mem, blocks * std::ceil(a.experts / T));
      chain(w, Steps{0, 0, 0, 2, 1, nsg}, (1 + classes) * std::ceil(a.experts / T));
      chain(w, Steps{0, 1, 0, 1, 0, 0}, 1);
      chain(w, Steps{0, 0, 1, 0, 0, 2}, classes * std::ceil(std::log2(double(a.experts))));  // dependent
      chain(w, Lat::alu, 2 * walk);
      loop(w, Lat::local, walk);
    }
    return w;
  }
  if (k == "rms_norm" || k == "rms_norm_bf16") {
    const auto a = arg<args::NormArgs>(r);
    Cost w = make("norms, embedding, combine");
    add(w, Path::alu_f32, (k == "rms_norm_bf16" ? 4.0 + kBf16ConvOps : 4.0) * groups * a.n);
    w.bytes = declared(r);
    // rms_row (common.h): threadgroup_sum, rsqrt, then x and the weights read again after it
    chain(w, tg_reduce(simdgroups_of(r)), 1);
    chain(w, Steps{0, 1, 0, 0, 0, 4}, 1);
    return w;
  }
  if (k == "embed_rows_q4") {
    const auto a = arg<args::EmbedArgs>(r);
    Cost w = make("norms, embedding, combine");
    const double rows = double(r.groups.y);  // one grid row per token
    add(w, Path::alu_f32, kDequantOps * rows * a.cols);
    w.bytes = declared(r) - (double(a.vocab) - rows) * a.cols * quant_bytes(4);  // table declared whole
    chain(w, Lat::dram, 1);  // the row's address waits for the token id
    return w;
  }
  if (k == "moe_combine" || k == "moe_combine_norm") {
    const auto a = arg<args::MoeCombineArgs>(r);
    Cost w = make("norms, embedding, combine");
    // _norm: plus rms_norm_bf16's work on the updated rows
    add(w, Path::alu_f32,
        2.0 * a.rows * a.hidden * (a.top_k + 1) +
            (k == "moe_combine_norm" ? (4.0 + kBf16ConvOps) * a.rows * a.hidden : 0.0));
    w.bytes = declared(r);
    chain(w, Lat::alu, a.top_k);  // the k products summed in order
    if (k == "moe_combine_norm") {  // the row read back after a device barrier, then rms_row
      chain(w, Steps{0, 2, 0, 1, 0, 4}, 1);
      chain(w, tg_reduce(simdgroups_of(r)), 1);
    }
    return w;
  }
  // ---- token selection
  if (k == "argmax_partial" || k == "argmax_partial_bias" || k == "sample_greedy_combine") {  // multi-threadgroup greedy argmax
    Cost w = make("lm head + sampling");
    add(w, Path::alu_f32, 2.0 * r.bytes_read / sizeof(float));
    w.bytes = declared(r);
    // scan_argmax's strided loop over the slice, then tg_argmax (sample.metal): simd_max,
    // simd_min, two barriers, the simdgroups' bests in order
    const double per_thread = std::ceil(double(r.bytes_read) / sizeof(float) / groups / r.threads.count());
    chain(w, Lat::alu, 2 * per_thread);
    loop(w, Lat::mem, per_thread);
    chain(w, Steps{0, 0, 0, 2, 2, 2 * simdgroups_of(r)}, 1);
    return w;
  }
  if (k == "sample_greedy" || k == "sample_token") {
    const uint32_t V = k == "sample_greedy" ? arg<args::SampleGreedyArgs>(r).vocab : arg<args::SampleArgs>(r).vocab;
    Cost w = make("lm head + sampling");
    add(w, Path::alu_f32, (k == "sample_greedy" ? 2.0 : 24.0) * V);
    w.bytes = declared(r);
    chain(w, Steps{0, 0, 0, 2, 2, 2 * simdgroups_of(r)}, 1);  // tg_argmax
    if (k == "sample_token") {
      // sample_token's filtered path (sample.metal): four radix passes over the logits for the
      // top-k threshold (three barriers each), a bitonic sort of kCand = 1024 candidates
      // (55 barrier-separated stages), the top-p/min-p scans and the draw: counted for that
      // path, the longest; greedy requests do not run it
      chain(w, Steps{0, 4, 0, 3, 0, 8}, 4);
      chain(w, Steps{0, 0, 1, 1, 0, 4}, 55);
      chain(w, Steps{0, 2, 0, 8, 4, 40}, 1);
    }
    return w;
  }
  return std::nullopt;
}

}  // namespace

const char* path_name(Path p) {
  static const char* names[kPaths] = {"alu_f32",  "alu_f16",    "sgmm_f32",   "sgmm_f16",
                                      "sgmm_bf16", "tensor_f32", "tensor_f16", "tensor_bf16"};
  return names[int(p)];
}

const char* lat_name(Lat k) {
  static const char* names[kLats] = {"dram", "mem", "local", "barrier", "reduce", "alu"};
  return names[int(k)];
}

std::optional<Cost> dispatch_cost(const gpu::DispatchRecord& r) { return cost_of(r); }

double expected_experts(uint32_t rows, uint32_t k, uint32_t experts) {
  return experts * (1.0 - std::pow(1.0 - double(k) / experts, double(rows)));
}


}  // namespace lily::runtime
