// lily._core.encode_*: the runtime's per-family dispatch builders (csrc/runtime/families/),
// bound so that the kernel tests and lily doctor encode a kernel exactly as the plans do (as
// ggml's test-backend-ops runs the backend's own ops). Each resolves its pipeline by the
// kernel's name (kernel_names.h) on the pass's device; buffers are bound from offset 0 and a
// weight is a whole Buffer (a quantized one: a (weight, scales, biases) tuple).
#include "runtime/py_families.h"

#include <array>
#include <cstring>
#include <deque>
#include <initializer_list>

#include <optional>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "runtime/decode.h"
#include "runtime/families/attention.h"
#include "runtime/families/attention_prefill.h"
#include "runtime/families/embed.h"
#include "runtime/families/gdn.h"
#include "runtime/families/gdn_prefill.h"
#include "runtime/families/gemm.h"
#include "runtime/families/gemv.h"
#include "runtime/families/moe.h"
#include "runtime/families/moe_prefill.h"
#include "runtime/families/norm.h"
#include "runtime/families/sample.h"
#include "runtime/kernel_names.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::runtime {
namespace {

TensorRef whole(gpu::Buffer& b) { return TensorRef{&b, 0, b.size()}; }

// An argument struct from its bytes (lily.lab.device.pack_args), their size checked.
template <class T>
T args_from(const nb::bytes& b, const char* name) {
  if (b.size() != sizeof(T))
    throw std::invalid_argument(std::string(name) + ": " + std::to_string(b.size()) +
                                " bytes, the struct has " + std::to_string(sizeof(T)));
  T a;
  std::memcpy(&a, b.c_str(), sizeof(T));
  return a;
}
// A quantized weight (weight, scales, biases) of `bits` as whole buffers (refs: their storage).
QuantLinear quant(std::tuple<gpu::Buffer&, gpu::Buffer&, gpu::Buffer&> w, uint32_t bits, TensorRef* refs) {
  refs[0] = whole(std::get<0>(w)), refs[1] = whole(std::get<1>(w)), refs[2] = whole(std::get<2>(w));
  return QuantLinear{&refs[0], &refs[1], &refs[2], bits};
}
// Element i of a Python tuple `t` as T (a Buffer&, an int, ...); `what` names it in the error.
template <class T>
T item(const nb::tuple& t, size_t i, const char* what) {
  if (i >= t.size()) throw std::invalid_argument(std::string(what) + ": too few elements");
  return nb::cast<T>(t[i]);
}
// A quantized weight given as a (weight, scales, biases) tuple, each a Buffer or a
// (Buffer, offset, bytes) range of one.
QuantLinear quant(nb::handle w, uint32_t bits, TensorRef* refs, const char* what) {
  const auto t = nb::cast<nb::tuple>(w);
  if (t.size() != 3) throw std::invalid_argument(std::string(what) + ": weights are (weight, scales, biases)");
  for (size_t i = 0; i < 3; ++i) {
    if (nb::isinstance<nb::tuple>(t[i])) {
      const auto r = nb::cast<nb::tuple>(t[i]);
      if (r.size() != 3)
        throw std::invalid_argument(std::string(what) + ": a range is (buffer, offset, bytes)");
      refs[i] = TensorRef{&item<gpu::Buffer&>(r, 0, what), item<size_t>(r, 1, what), item<size_t>(r, 2, what)};
    } else {
      refs[i] = whole(item<gpu::Buffer&>(t, i, what));
    }
  }
  return QuantLinear{&refs[0], &refs[1], &refs[2], bits};
}
// The batched kernels' `_b<size>` for n rows (1 .. kBatchMaxRows).
uint32_t batch_size(uint32_t n) {
  if (n < 1 || n > lily::kernels::kBatchMaxRows)
    throw std::invalid_argument("batched kernels take 1 to " + std::to_string(lily::kernels::kBatchMaxRows) +
                                " rows, got " + std::to_string(n));
  return 2u << batch_kernel(n);
}
// Rows of fp32 a buffer holds, or `rows` when given.
uint32_t rows_of(const gpu::Buffer& b, uint32_t rows) {
  return rows ? rows : uint32_t(b.size() / sizeof(float));
}

}  // namespace

void bind_families(nb::module_& m) {
  // ---- metal/embed.metal
  m.def(
      "encode_embed_rows",
      [](gpu::ComputePass& pass, std::tuple<gpu::Buffer&, gpu::Buffer&, gpu::Buffer&> table,
         gpu::Buffer& tokens, gpu::Buffer& out, uint32_t rows, uint32_t cols, uint32_t vocab,
         const std::string& label) {
        const std::string name = kernel_name("embed_rows", {{'q', 4}});
        const TensorRef w = whole(std::get<0>(table)), s = whole(std::get<1>(table)),
                        b = whole(std::get<2>(table));
        encode_embed_rows(pass, pass.device().pipeline(name), label.empty() ? name : label,
                          QuantLinear{&w, &s, &b, 4}, tokens, 0, out, rows, cols, vocab);
      },
      "compute_pass"_a, "table"_a, "tokens"_a, "out"_a, "rows"_a, "cols"_a, "vocab"_a, "label"_a = "",
      "embed_rows_q4 as the prefill chunk encodes it (csrc/runtime/families/embed.h): out [rows, cols] fp32 =\n"
      "the rows of the 4-bit table (weight, scales, biases) [vocab, cols] of token ids tokens [rows] uint32.");

  // ---- metal/norm.metal
  m.def(
      "encode_rms_norm",
      [](gpu::ComputePass& pass, const std::string& kernel, gpu::Buffer& x, gpu::Buffer& w, gpu::Buffer& out,
         uint32_t rows, uint32_t n, float eps, uint32_t out_bytes, uint32_t threads, const std::string& label) {
        if (out_bytes != 2 && out_bytes != 4)
          throw std::invalid_argument("encode_rms_norm: out_bytes is 2 or 4");
        encode_rms_norm(pass, pass.device().pipeline(kernel), label.empty() ? kernel : label, x, whole(w), out,
                        rows, n, eps, out_bytes, threads);
      },
      "compute_pass"_a, "kernel"_a, "x"_a, "w"_a, "out"_a, "rows"_a, "n"_a, "eps"_a, "out_bytes"_a,
      "threads"_a = kNormThreads, "label"_a = "",
      "`kernel` (rms_norm: fp32 out, out_bytes 4; rms_norm_bf16: out_bytes 2) over `rows` rows of x [rows, n]\n"
      "fp32 with the bf16 weight w [n], as the prefill chunk encodes it (csrc/runtime/families/norm.h).");

  // ---- metal/gemv.metal
  m.def("batch_size", &batch_size, "rows"_a,
        "The batched kernels' b (their _b<b> suffix) for `rows` rows: the smallest built size holding them\n"
        "(csrc/runtime/families/gemv.h batch_kernel). Raises ValueError for rows outside 1..kBatchMaxRows.");
  m.def(
      "encode_gemv_add",
      [](gpu::ComputePass& pass, std::tuple<gpu::Buffer&, gpu::Buffer&, gpu::Buffer&> weights, gpu::Buffer& x,
         gpu::Buffer& y, uint32_t rows, uint32_t cols, uint32_t bits, const nb::object& gated,
         uint32_t batch_rows, uint32_t x_stride, uint32_t y_stride, uint32_t ssq_stride, uint32_t threads,
         const std::string& label) {
        const std::string base = gated.is_none() ? "gemv" : "gemv_gated";
        const std::string name =
            batch_rows ? kernel_name(base + "_batch", {{'q', bits}, {'b', batch_size(batch_rows)}}, "_add")
                       : kernel_name(base, {{'q', bits}}, "_add");
        TensorRef refs[3], norm;
        std::optional<GatedNorm> g;
        if (!gated.is_none()) {
          const auto t = nb::cast<nb::tuple>(gated);
          const char* what = "encode_gemv_add: gated = (ssq, z, norm, head_dim, splits, eps)";
          if (t.size() != 6) throw std::invalid_argument(what);
          norm = whole(item<gpu::Buffer&>(t, 2, what));
          g.emplace(GatedNorm{item<gpu::Buffer&>(t, 0, what), item<gpu::Buffer&>(t, 1, what), norm,
                              item<uint32_t>(t, 3, what), item<uint32_t>(t, 4, what), item<float>(t, 5, what)});
        }
        encode_gemv_add(pass, pass.device().pipeline(name), label.empty() ? name : label,
                        quant(weights, bits, refs), x, y, rows, cols,
                        GemvRows{batch_rows ? batch_rows : 1, batch_rows != 0, x_stride, y_stride, ssq_stride},
                        g ? &*g : nullptr, threads);
      },
      "compute_pass"_a, "weights"_a, "x"_a, "y"_a, "rows"_a, "cols"_a, "bits"_a = 4,
      "gated"_a.none() = nb::none(), "batch_rows"_a = 0, "x_stride"_a = 0, "y_stride"_a = 0, "ssq_stride"_a = 0,
      "threads"_a = kernels::kGemvThreads, "label"_a = "",
      "gemv_q<bits>_add as the decode step encodes it (csrc/runtime/families/gemv.h): y[rows] += W x[cols],\n"
      "W = weights (weight, scales, biases); with gated = (ssq, z, norm, head_dim, splits, eps)\n"
      "gemv_gated_q<bits>_add (x normalised on load); with batch_rows the batched kernel over that many\n"
      "rows, x and z rows x_stride floats apart, y rows y_stride, ssq rows ssq_stride.");
  m.def(
      "encode_norm_gemv",
      [](gpu::ComputePass& pass, gpu::Buffer& x, gpu::Buffer& norm, gpu::Buffer& xn, const nb::list& matrices,
         uint32_t cols, float eps, uint32_t bits, bool write_xn, uint32_t rows_per_simdgroup, uint32_t k_splits,
         uint32_t threads, uint32_t batch_rows, uint32_t x_stride, size_t x_at, const nb::object& embed,
         uint32_t extra_groups, const std::string& label) {
        std::deque<std::array<TensorRef, 3>> refs;
        std::deque<QuantLinear> weights;
        std::vector<NormGemvMatrix> mats;
        for (nb::handle m : matrices) {
          const auto t = nb::cast<nb::tuple>(m);
          const char* what = "encode_norm_gemv: a matrix is (weights, y, rows[, y_at[, y_stride]])";
          if (t.size() < 3 || t.size() > 5) throw std::invalid_argument(what);
          weights.push_back(quant(t[0], bits, refs.emplace_back().data(), what));
          mats.push_back({weights.back(), item<gpu::Buffer&>(t, 1, what),
                          t.size() > 3 ? item<size_t>(t, 3, what) : 0, item<uint32_t>(t, 2, what),
                          t.size() > 4 ? item<uint32_t>(t, 4, what) : 0});
        }
        std::string name = batch_rows
                               ? kernel_name("norm_gemv_batch", {{'q', bits}, {'b', batch_size(batch_rows)}})
                               : kernel_name("norm_gemv", {{'q', bits}});
        TensorRef table_refs[3];
        std::optional<QuantLinear> table;
        std::optional<EmbedLookup> lookup;
        if (!embed.is_none()) {
          const auto t = nb::cast<nb::tuple>(embed);
          const char* what = "encode_norm_gemv: embed = (table, tokens, vocab, token_at), batch-1 and 4-bit";
          if (batch_rows || bits != 4 || t.size() != 4) throw std::invalid_argument(what);
          table.emplace(quant(t[0], 4, table_refs, what));
          lookup.emplace(EmbedLookup{*table, item<gpu::Buffer&>(t, 1, what), item<size_t>(t, 3, what),
                                     item<uint32_t>(t, 2, what)});
          name = kernel_name("embed_norm_gemv", {{'q', 4}});
        }
        const TensorRef nw = whole(norm);
        encode_norm_gemv(pass, pass.device().pipeline(name), label.empty() ? name : label, x, x_at, nw, xn,
                         mats, cols, eps, write_xn, rows_per_simdgroup, k_splits,
                         GemvRows{batch_rows ? batch_rows : 1, batch_rows != 0, x_stride}, threads,
                         lookup ? &*lookup : nullptr, extra_groups);
      },
      "compute_pass"_a, "x"_a, "norm"_a, "xn"_a, "matrices"_a, "cols"_a, "eps"_a, "bits"_a = 4,
      "write_xn"_a = true, "rows_per_simdgroup"_a = DecodePlan::kNormGemvRows, "k_splits"_a = 1,
      "threads"_a = kernels::kGemvThreads, "batch_rows"_a = 0, "x_stride"_a = 0, "x_at"_a = 0,
      "embed"_a.none() = nb::none(), "extra_groups"_a = 0, "label"_a = "",
      "norm_gemv_q<bits> as the decode step encodes it (csrc/runtime/families/gemv.h): the RMSNorm of x\n"
      "(cols fp32 from byte x_at; norm bf16 [cols]) into xn (with write_xn) and the GEMVs of `matrices`\n"
      "(1 to 4 of (weights, y, rows[, y_at[, y_stride]])); with batch_rows norm_gemv_batch over that many\n"
      "rows (x and xn rows x_stride floats apart, each y's y_stride); with embed = (table, tokens, vocab,\n"
      "token_at) embed_norm_gemv_q4, x the token's embedding row (written). extra_groups: surplus\n"
      "threadgroups (they exit).");

  // ---- metal/moe.metal (decode)
  // The switch_mlp and shared-expert tensors of the MoE block: `names` of MoeBlock's members
  // set from the tuple `w` of (weight, scales, biases) weights (refs: their storage).
  auto moe_block = [](const nb::tuple& w, std::initializer_list<QuantLinear MoeBlock::*> names, TensorRef* refs,
                      const char* what) {
    if (w.size() != names.size())
      throw std::invalid_argument(std::string(what) + ": " + std::to_string(names.size()) +
                                  " weights expected");
    MoeBlock m;
    size_t i = 0;
    for (QuantLinear MoeBlock::*name : names) m.*name = quant(w[i], 4, refs + 3 * i, what), ++i;
    return m;
  };
  m.def(
      "encode_moe_route_gate_up",
      [moe_block](gpu::ComputePass& pass, const nb::tuple& weights, gpu::Buffer& xn, gpu::Buffer& logits,
                  gpu::Buffer& h, gpu::Buffer& ids, gpu::Buffer& route_w, uint32_t hidden, uint32_t inter,
                  uint32_t inter_shared, uint32_t experts, uint32_t top_k, bool norm_topk, uint32_t threads,
                  uint32_t batch_rows, uint32_t x_stride, uint32_t logits_stride, uint32_t h_stride,
                  uint32_t ids_stride, uint32_t w_stride, const std::string& label) {
        TensorRef refs[12];
        const MoeBlock w = moe_block(weights,
                                     {&MoeBlock::experts_gate_proj, &MoeBlock::experts_up_proj,
                                      &MoeBlock::shared_gate_proj, &MoeBlock::shared_up_proj},
                                     refs,
                                     "encode_moe_route_gate_up: weights = (gate, up, shared gate, shared up)");
        const std::string name =
            batch_rows ? kernel_name("moe_route_gate_up_batch", {{'q', 4}, {'b', batch_size(batch_rows)}})
                       : "moe_route_gate_up_swiglu_q4";
        encode_moe_route_gate_up(
            pass, pass.device().pipeline(name), label.empty() ? name : label, w,
            MoeBuffers{xn, logits, h, ids, route_w, xn},
            MoeShape{hidden, inter, inter_shared, experts, top_k, norm_topk},
            lily::kernels::MoeBatchArgs{batch_rows, x_stride, h_stride, ids_stride, w_stride, logits_stride},
            batch_rows != 0, threads);
      },
      "compute_pass"_a, "weights"_a, "xn"_a, "logits"_a, "h"_a, "ids"_a, "route_w"_a, "hidden"_a, "inter"_a,
      "inter_shared"_a, "experts"_a, "top_k"_a, "norm_topk"_a = true, "threads"_a = kernels::kGemvThreads,
      "batch_rows"_a = 0, "x_stride"_a = 0, "logits_stride"_a = 0, "h_stride"_a = 0, "ids_stride"_a = 0,
      "w_stride"_a = 0, "label"_a = "",
      "moe_route_gate_up_swiglu_q4 as the decode step encodes it (csrc/runtime/families/moe.h): weights =\n"
      "(gate, up, shared gate, shared up), each 4-bit (weight, scales, biases), the routed ones stacked\n"
      "[experts, inter, hidden]; the routing of xn [hidden] by logits [experts + 1] (the last the shared\n"
      "gate's), then h [top_k * inter + inter_shared], ids uint32 [top_k] and route_w [top_k + 1] out.\n"
      "With batch_rows moe_route_gate_up_batch_q4_b<batch_size(batch_rows)> over that many rows, row r of\n"
      "each buffer r times its stride (floats, uints) further (MoeBatchArgs).");
  m.def(
      "encode_moe_down",
      [moe_block](gpu::ComputePass& pass, const nb::tuple& weights, gpu::Buffer& h, gpu::Buffer& ids,
                  gpu::Buffer& route_w, gpu::Buffer& residual, uint32_t hidden, uint32_t inter,
                  uint32_t inter_shared, uint32_t experts, uint32_t top_k, uint32_t threads,
                  uint32_t batch_rows, uint32_t x_stride, uint32_t h_stride, uint32_t ids_stride,
                  uint32_t w_stride, const std::string& label) {
        TensorRef refs[6];
        const MoeBlock w = moe_block(weights, {&MoeBlock::experts_down_proj, &MoeBlock::shared_down_proj}, refs,
                                     "encode_moe_down: weights = (down, shared down)");
        const std::string name = batch_rows
                                     ? kernel_name("moe_down_batch", {{'q', 4}, {'b', batch_size(batch_rows)}})
                                     : "moe_down_q4";
        encode_moe_down(pass, pass.device().pipeline(name), label.empty() ? name : label, w,
                        MoeBuffers{residual, h, h, ids, route_w, residual},
                        MoeShape{hidden, inter, inter_shared, experts, top_k},
                        lily::kernels::MoeBatchArgs{batch_rows, x_stride, h_stride, ids_stride, w_stride, 0},
                        batch_rows != 0, threads);
      },
      "compute_pass"_a, "weights"_a, "h"_a, "ids"_a, "route_w"_a, "residual"_a, "hidden"_a, "inter"_a,
      "inter_shared"_a, "experts"_a, "top_k"_a, "threads"_a = kernels::kGemvThreads, "batch_rows"_a = 0,
      "x_stride"_a = 0, "h_stride"_a = 0, "ids_stride"_a = 0, "w_stride"_a = 0, "label"_a = "",
      "moe_down_q4 as the decode step encodes it (csrc/runtime/families/moe.h): weights = (down, shared\n"
      "down), 4-bit (weight, scales, biases), the routed ones stacked [experts, hidden, inter]; residual\n"
      "[hidden] += the route_w-weighted down projections of h [top_k * inter + inter_shared] by the experts\n"
      "ids uint32 [top_k] and the shared expert. With batch_rows moe_down_batch_q4_b<batch_size(batch_rows)>\n"
      "over that many rows (x_stride: the residual's; MoeBatchArgs).");

  // ---- metal/gemm.metal, gemm_tensor.metal
  m.def(
      "encode_gemm",
      [](gpu::ComputePass& pass, std::tuple<gpu::Buffer&, gpu::Buffer&, gpu::Buffer&> weights, gpu::Buffer& x,
         gpu::Buffer& y, uint32_t m, uint32_t n, uint32_t k, uint32_t bits, bool add, bool bf16_y,
         gpu::Buffer* x_scale, uint32_t x_shift, bool tensor, uint32_t lda, uint32_t ldy, size_t x_at,
         size_t y_at, uint32_t disjoint, const std::string& label) {
        if (bf16_y && add) throw std::invalid_argument("encode_gemm: a bfloat y is stored, not added to");
        if (x_scale && !add)
          throw std::invalid_argument("encode_gemm: an x scale comes with add (gemm_q4_add_hs)");
        const GemmOut out = gemm_out(add, bf16_y, x_scale != nullptr);
        const std::string name = kernel_name("gemm", {{'q', bits}}, gemm_suffix(out, tensor));
        TensorRef refs[3];
        const GemmOperands io{x, y, x_at, y_at, x_scale, x_shift, disjoint};
        encode_gemm(pass, pass.device().pipeline(name), label.empty() ? name : label, gemm_block(tensor),
                    quant(weights, bits, refs), out, io,
                    lily::kernels::GemmArgs{m, n, k, lda ? lda : k, ldy ? ldy : n});
      },
      "compute_pass"_a, "weights"_a, "x"_a, "y"_a, "m"_a, "n"_a, "k"_a, "bits"_a = 4, "add"_a = false,
      "bf16_y"_a = false, "x_scale"_a.none() = nb::none(), "x_shift"_a = 0, "tensor"_a = false, "lda"_a = 0,
      "ldy"_a = 0, "x_at"_a = 0, "y_at"_a = 0, "disjoint"_a = 0, "label"_a = "",
      "A dense prefill GEMM as the prefill chunk encodes it (csrc/runtime/families/gemm.h): y[m, n] (=|+=)\n"
      "x[m, k] W^T with W = weights (weight, scales, biases) of `bits`, x bfloat rows of lda (default k)\n"
      "elements from byte x_at, y rows of ldy (default n) from byte y_at: gemm_q<bits> (fp32 y), _bf16\n"
      "(bf16_y), _add_h (add), _add_hs (add with x_scale: half, one per 2^x_shift elements of x), each\n"
      "_tensor with `tensor`. disjoint: a nonzero tag for GEMMs writing disjoint columns of one y.");
  m.def(
      "encode_gemm_swiglu",
      [](gpu::ComputePass& pass, std::tuple<gpu::Buffer&, gpu::Buffer&, gpu::Buffer&> gate,
         std::tuple<gpu::Buffer&, gpu::Buffer&, gpu::Buffer&> up, gpu::Buffer& x, gpu::Buffer& h, uint32_t m,
         uint32_t n, uint32_t k, gpu::Buffer& scale, size_t scale_at, uint32_t ldg, bool tensor, uint32_t lda,
         uint32_t ldy, const std::string& label) {
        const std::string name = kernel_name("gemm_swiglu", {{'q', 4}}, tensor ? "_tensor" : "");
        TensorRef g[3], u[3];
        encode_gemm_swiglu(pass, pass.device().pipeline(name), label.empty() ? name : label, gemm_block(tensor),
                           quant(gate, 4, g), quant(up, 4, u), x, h,
                           lily::kernels::GemmArgs{m, n, k, lda ? lda : k, ldy ? ldy : n}, scale, scale_at,
                           ldg);
      },
      "compute_pass"_a, "gate"_a, "up"_a, "x"_a, "h"_a, "m"_a, "n"_a, "k"_a, "scale"_a, "scale_at"_a, "ldg"_a,
      "tensor"_a = false, "lda"_a = 0, "ldy"_a = 0, "label"_a = "",
      "gemm_swiglu_q4 (_tensor with `tensor`) as the prefill chunk encodes it (csrc/runtime/families/gemm.h):\n"
      "h[m, n] = bfloat(g * silu(x Wg^T) * (x Wu^T)), gate and up 4-bit (weight, scales, biases) [n, k], x "
      "and\n"
      "h bfloat rows of lda / ldy (defaults k, n), g fp32 at byte scale_at of `scale`, row stride ldg.");

  // ---- metal/moe_prefill.metal, moe_prefill_tensor.metal (the grouped expert GEMMs)
  m.def(
      "moe_geometry",
      [](uint32_t T, bool tensor) {
        const MoeGeometry g = moe_geometry(T, tensor);
        return nb::make_tuple(g.gate_up_threads, g.gate_up_bn, g.down_threads, g.down_bn);
      },
      "tile_rows"_a, "tensor"_a,
      "(gate/up threads, gate/up output columns, down threads, down output columns) per threadgroup of the\n"
      "grouped expert GEMMs of tile height tile_rows, on the tensor-op path with `tensor`, as the prefill\n"
      "plan picks them (the kernels' moe_gemm_threads / moe_gemm_bn of metal/prefill_args.h).");
  m.def(
      "encode_moe_gemm",
      [](gpu::ComputePass& pass, const std::string& kernel, const nb::tuple& weights, gpu::Buffer& x,
         gpu::Buffer& perm, gpu::Buffer& tiles, gpu::Buffer& tile_count, gpu::Buffer& y, const nb::bytes& args,
         uint32_t tile_entries, size_t tiles_at, size_t count_at, uint32_t disjoint, const std::string& label) {
        const auto a = args_from<lily::kernels::MoeGemmArgs>(args, "MoeGemmArgs");
        const bool gate_up = kernel.rfind("moe_gemm_gate_up", 0) == 0;
        if (!gate_up && kernel.rfind("moe_gemm_down", 0) != 0)
          throw std::invalid_argument("encode_moe_gemm: " + kernel + " is not a grouped expert GEMM");
        const char* what = gate_up ? "encode_moe_gemm: gate/up weights = (gate, up)"
                                   : "encode_moe_gemm: down weights = (down,)";
        if (weights.size() != (gate_up ? 2u : 1u)) throw std::invalid_argument(what);
        uint32_t T = 0;
        for (const KernelParam& p : kernel_params(kernel))
          if (p.key == 't') T = p.value;
        const bool tensor = kernel.size() > 7 && kernel.compare(kernel.size() - 7, 7, "_tensor") == 0;
        TensorRef refs[6];
        const QuantLinear gate = quant(weights[0], 4, refs, what);
        std::optional<QuantLinear> up;
        if (gate_up) up.emplace(quant(weights[1], 4, refs + 3, what));
        MoeGemmBuffers io{x, perm, tiles, tile_count, y};
        io.tiles_at = tiles_at, io.count_at = count_at;
        encode_moe_gemm(pass, pass.device().pipeline(kernel), label.empty() ? kernel : label,
                        moe_geometry(T, tensor), gate, up ? &*up : nullptr, io, a, tile_entries, disjoint);
      },
      "compute_pass"_a, "kernel"_a, "weights"_a, "x"_a, "perm"_a, "tiles"_a, "tile_count"_a, "y"_a, "args"_a,
      "tile_entries"_a, "tiles_at"_a = 0, "count_at"_a = 0, "disjoint"_a = 0, "label"_a = "",
      "A grouped expert GEMM as the prefill chunk encodes it (csrc/runtime/families/moe_prefill.h): `kernel`\n"
      "moe_gemm_gate_up_q4_t<T>[_tensor] (weights = (gate, up)) or moe_gemm_down_q4_t<T>[_tensor] (weights =\n"
      "(down,)), each stacked 4-bit (weight, scales, biases); `args` the bytes of MoeGemmArgs; x bfloat rows\n"
      "of lda, perm uint32 [m * top_k], tile_entries MoeTile entries of `tiles` from byte tiles_at and their\n"
      "count (uint32 at count_at of tile_count), y bfloat rows of ldy written (disjoint: the write tag).");

  // ---- metal/moe_prefill.metal (the chunk's routing and combine)
  m.def("moe_route_threads", &moe_route_threads, "experts"_a,
        "Threads per threadgroup of moe_route_topk / moe_route_scatter for `experts` experts, as the prefill\n"
        "plan dispatches them: one per expert, rounded up to whole simdgroups, at most 1024.");
  m.def("moe_map_entries", &moe_map_entries, "assignments"_a, "experts"_a, "tile_rows"_a,
        "MoeTile entries of the tile maps of all tile classes of a height-tile_rows tiling of `assignments`\n"
        "(rows * top_k) over `experts` (what moe_route_scatter writes; metal/prefill_args.h).");
  m.def(
      "encode_moe_route_clear",
      [](gpu::ComputePass& pass, gpu::Buffer& block_counts, const nb::bytes& args, const std::string& label) {
        const auto a = args_from<lily::kernels::MoeRoutePrefillArgs>(args, "MoeRoutePrefillArgs");
        encode_moe_route_clear(pass, pass.device().pipeline("moe_route_clear"),
                               label.empty() ? "moe_route_clear" : label, block_counts, a);
      },
      "compute_pass"_a, "block_counts"_a, "args"_a, "label"_a = "",
      "moe_route_clear as the prefill chunk encodes it (csrc/runtime/families/moe_prefill.h): zeroes\n"
      "block_counts (uint32 [ceil(rows / block_rows), experts]); `args` the bytes of MoeRoutePrefillArgs.");
  m.def(
      "encode_moe_route_topk",
      [](gpu::ComputePass& pass, gpu::Buffer& logits, gpu::Buffer& ids, gpu::Buffer& w,
         gpu::Buffer& block_counts, const nb::bytes& args, uint32_t threads, const std::string& label) {
        const auto a = args_from<lily::kernels::MoeRoutePrefillArgs>(args, "MoeRoutePrefillArgs");
        encode_moe_route_topk(pass, pass.device().pipeline("moe_route_topk"),
                              label.empty() ? "moe_route_topk" : label, logits, ids, w, block_counts, a,
                              threads);
      },
      "compute_pass"_a, "logits"_a, "ids"_a, "w"_a, "block_counts"_a, "args"_a, "threads"_a = 0, "label"_a = "",
      "moe_route_topk as the prefill chunk encodes it (csrc/runtime/families/moe_prefill.h): logits fp32\n"
      "[rows, experts + 1] -> ids uint32 [rows, top_k], w fp32 [rows, top_k + 1], block_counts added to;\n"
      "one threadgroup per row of `threads` (0: moe_route_threads(experts)).");
  m.def(
      "encode_moe_route_scatter",
      [](gpu::ComputePass& pass, gpu::Buffer& ids, gpu::Buffer& block_counts, gpu::Buffer& perm,
         gpu::Buffer& tiles, gpu::Buffer& tile_count, gpu::Buffer& hist, const nb::bytes& args,
         uint32_t threads, const std::string& label) {
        const auto a = args_from<lily::kernels::MoeRoutePrefillArgs>(args, "MoeRoutePrefillArgs");
        encode_moe_route_scatter(pass, pass.device().pipeline("moe_route_scatter"),
                                 label.empty() ? "moe_route_scatter" : label, ids, block_counts, perm, tiles,
                                 tile_count, hist, a, threads);
      },
      "compute_pass"_a, "ids"_a, "block_counts"_a, "perm"_a, "tiles"_a, "tile_count"_a, "hist"_a, "args"_a,
      "threads"_a = 0, "label"_a = "",
      "moe_route_scatter as the prefill chunk encodes it (csrc/runtime/families/moe_prefill.h): ids and\n"
      "block_counts -> perm uint32 [rows * top_k], the tile maps (moe_map_entries MoeTile entries), their\n"
      "counts (uint32 per tile class) and hist uint32 [experts]; one threadgroup per histogram block of\n"
      "`threads` (0: moe_route_threads(experts)).");
  m.def(
      "encode_moe_combine",
      [](gpu::ComputePass& pass, gpu::Buffer& h, gpu::Buffer& yx, gpu::Buffer& w, const nb::bytes& args,
         gpu::Buffer* norm, gpu::Buffer* xn, float eps, uint32_t threads, const std::string& label) {
        const auto a = args_from<lily::kernels::MoeCombineArgs>(args, "MoeCombineArgs");
        if (!norm != !xn)
          throw std::invalid_argument("encode_moe_combine: moe_combine_norm takes both norm and xn");
        const char* name = norm ? "moe_combine_norm" : "moe_combine";
        std::optional<TensorRef> nw;
        if (norm) nw = whole(*norm);
        encode_moe_combine(pass, pass.device().pipeline(name), label.empty() ? name : label, h, yx, w, a,
                           nw ? &*nw : nullptr, xn, eps, threads);
      },
      "compute_pass"_a, "h"_a, "yx"_a, "w"_a, "args"_a, "norm"_a.none() = nb::none(),
      "xn"_a.none() = nb::none(), "eps"_a = 1e-6f, "threads"_a = 0, "label"_a = "",
      "moe_combine as the prefill chunk encodes it (csrc/runtime/families/moe_prefill.h): h fp32 [rows,\n"
      "hidden] += yx (bfloat [rows * top_k, hidden]) weighted by w fp32 [rows, top_k + 1] (`args` the\n"
      "bytes of MoeCombineArgs), threads (0: 64) a threadgroup; with norm (bf16 [hidden]) and xn,\n"
      "moe_combine_norm, which also writes xn bfloat = RMSNorm(h, eps) * norm, one threadgroup of\n"
      "`threads` (0: 256) per row.");

  // ---- metal/sample.metal
  m.def(
      "encode_argmax",
      [](gpu::ComputePass& pass, gpu::Buffer& logits, gpu::Buffer& partials, gpu::Buffer& token, uint32_t vocab,
         uint32_t slice, gpu::Buffer* bias, uint32_t rows, uint32_t combine_threads, size_t token_at) {
        const bool biased = bias != nullptr;
        gpu::Device& dev = pass.device();
        ArgmaxBuffers io{logits, partials, token, bias};
        io.token_at = token_at;
        encode_argmax(pass, dev.pipeline(biased ? "argmax_partial_bias" : "argmax_partial"),
                      dev.pipeline("sample_greedy_combine"), io, vocab, rows_of(logits, rows), slice,
                      combine_threads);
      },
      "compute_pass"_a, "logits"_a, "partials"_a, "token"_a, "vocab"_a, "slice"_a = DecodePlan::kArgmaxSlice,
      "bias"_a.none() = nb::none(), "rows"_a = 0, "combine_threads"_a = 0, "token_at"_a = 0,
      "The decode step's greedy argmax (csrc/runtime/families/sample.h): argmax_partial (argmax_partial_bias\n"
      "with `bias` fp32 [rows]) over slices of `slice` of the first `vocab` of the fp32 logits [rows] (rows:\n"
      "the buffer's, unless given) into `partials` [ceil(vocab / slice), 2] uint32, then\n"
      "sample_greedy_combine (combine_threads: 0 = as the runtime picks) writing the token (uint32) at\n"
      "byte `token_at` of `token`.");
  m.def(
      "encode_sample_token",
      [](gpu::ComputePass& pass, const nb::bytes& args, gpu::Buffer& logits, gpu::Buffer& counts,
         gpu::Buffer& positions, gpu::Buffer& tokens, gpu::Buffer& logprobs, gpu::Buffer& top_ids,
         gpu::Buffer* bias, uint32_t threads, size_t position_at, size_t token_at, size_t logprobs_at,
         size_t logprobs_bytes, size_t top_ids_at, size_t top_ids_bytes, uint32_t rows) {
        const auto a = args_from<lily::kernels::SampleArgs>(args, "SampleArgs");
        if (a.bias && !bias)
          throw std::invalid_argument("encode_sample_token: SampleArgs.bias set but no bias buffer");
        SampleTokenBuffers io{logits, counts, positions, tokens, logprobs, top_ids, bias ? *bias : logits};
        io.position_at = position_at, io.token_at = token_at, io.logprobs_at = logprobs_at;
        io.logprobs_bytes = logprobs_bytes ? logprobs_bytes : logprobs.size() - logprobs_at;
        io.top_ids_at = top_ids_at,
        io.top_ids_bytes = top_ids_bytes ? top_ids_bytes : top_ids.size() - top_ids_at;
        encode_sample_token(pass, pass.device().pipeline("sample_token"), "sample token -> next slot", a, io,
                            rows_of(logits, rows), threads);
      },
      "compute_pass"_a, "args"_a, "logits"_a, "counts"_a, "positions"_a, "tokens"_a, "logprobs"_a, "top_ids"_a,
      "bias"_a.none() = nb::none(), "threads"_a = lily::kernels::kSamplerThreads, "position_at"_a = 0, "token_at"_a = 0,
      "logprobs_at"_a = 0, "logprobs_bytes"_a = 0, "top_ids_at"_a = 0, "top_ids_bytes"_a = 0, "rows"_a = 0,
      "sample_token as the decode step encodes it (csrc/runtime/families/sample.h): `args` the bytes of\n"
      "SampleArgs (lily.lab.device.pack_args); the fp32 logits [rows] (rows: the buffer's, unless given),\n"
      "the counts uint32 [rows] (read and updated whole), the position (uint32 at position_at), the token\n"
      "written at token_at, the log-probabilities and alternatives' ids (`_bytes` from their `_at`; 0: the\n"
      "rest of the buffer) and the bias fp32 [rows] (read when SampleArgs.bias, else the logits are bound).");

  // ---- metal/attention.metal (decode)
  m.def(
      "encode_attn_decode_fused",
      [](gpu::ComputePass& pass, const nb::bytes& args, uint32_t head_dim, gpu::Buffer& qg, gpu::Buffer& k,
         gpu::Buffer& v, gpu::Buffer& q_norm, gpu::Buffer& k_norm, gpu::Buffer& positions, gpu::Buffer& k_cache,
         gpu::Buffer& v_cache, uint32_t position, gpu::Buffer* out, gpu::Buffer* ml, gpu::Buffer* acc,
         uint32_t extra_blocks, const std::string& label) {
        const auto a = args_from<lily::kernels::AttnFusedArgs>(args, "AttnFusedArgs");
        const bool split = a.block_rows != 0;
        if (split ? !(ml && acc) : !out)
          throw std::invalid_argument(split ? "encode_attn_decode_fused: the split kernel writes ml and acc"
                                            : "encode_attn_decode_fused: the direct kernel writes out");
        const uint32_t g = a.num_kv_heads ? attn_heads_per_group(a.num_q_heads / a.num_kv_heads) : 0;
        if (!g) throw std::invalid_argument("encode_attn_decode_fused: no kernel for these heads");
        const std::string name =
            kernel_name(split ? "attn_decode_split_fused" : "attn_decode_fused", {{'d', head_dim}, {'g', g}});
        const TensorRef qn = whole(q_norm), kn = whole(k_norm);
        AttnStepBuffers io{qg, k, v, qn, kn, positions, k_cache, v_cache};
        io.out = out, io.ml = ml, io.acc = acc;
        encode_attn_decode_fused(pass, pass.device().pipeline(name), label.empty() ? name : label, io, a,
                                 head_dim, g, position, extra_blocks);
      },
      "compute_pass"_a, "args"_a, "head_dim"_a, "qg"_a, "k"_a, "v"_a, "q_norm"_a, "k_norm"_a, "positions"_a,
      "k_cache"_a, "v_cache"_a, "position"_a, "out"_a.none() = nb::none(), "ml"_a.none() = nb::none(),
      "acc"_a.none() = nb::none(), "extra_blocks"_a = 0, "label"_a = "",
      "The fused decode attention step as the decode step encodes it (csrc/runtime/families/attention.h):\n"
      "`args` the bytes of AttnFusedArgs (lily.lab.device.pack_args); q|gate qg [Hq, 2 head_dim], k and v\n"
      "[Hkv, head_dim] fp32, the bf16 q/k norms [head_dim], the position (uint32, the row appended) and the\n"
      "bf16 caches [Hkv, capacity, head_dim]. block_rows 0: attn_decode_fused_d<D>_g<G> into out\n"
      "[Hq, head_dim]; else attn_decode_split_fused over ceil((position + 1) / block_rows) blocks (plus\n"
      "extra_blocks surplus ones) into the partials ml [Hq, max_blocks, 2] and acc [Hq, max_blocks, D].");
  m.def(
      "encode_attn_combine",
      [](gpu::ComputePass& pass, const nb::bytes& args, uint32_t head_dim, gpu::Buffer& ml, gpu::Buffer& acc,
         gpu::Buffer& gate, gpu::Buffer& positions, gpu::Buffer& out, size_t gate_at,
         const std::string& label) {
        const auto a = args_from<lily::kernels::AttnCombineArgs>(args, "AttnCombineArgs");
        const std::string name = kernel_name("attn_combine", {{'d', head_dim}});
        AttnCombineBuffers io{ml, acc, gate, positions, out};
        io.gate_at = gate_at;
        encode_attn_combine(pass, pass.device().pipeline(name), label.empty() ? name : label, io, a, head_dim);
      },
      "compute_pass"_a, "args"_a, "head_dim"_a, "ml"_a, "acc"_a, "gate"_a, "positions"_a, "out"_a,
      "gate_at"_a = 0, "label"_a = "",
      "attn_combine_d<head_dim> as the decode step encodes it (csrc/runtime/families/attention.h): `args`\n"
      "the bytes of AttnCombineArgs; the split kernel's partials ml and acc, the gate (head h's values at\n"
      "float h * gate_stride from byte gate_at), the position (uint32) and out [Hq, head_dim] fp32.");

  // ---- metal/attention_prefill.metal, attention_prefill_tensor.metal (the prefill chunk's)
  m.def(
      "encode_attn_prefill_prep",
      [](gpu::ComputePass& pass, const nb::bytes& args, uint32_t head_dim, gpu::Buffer& qg, gpu::Buffer& k,
         gpu::Buffer& v, gpu::Buffer& q_norm, gpu::Buffer& k_norm, gpu::Buffer& k_cache, gpu::Buffer& v_cache,
         gpu::Buffer& q, bool bf16_q, const std::string& label) {
        const auto a = args_from<lily::kernels::AttnPrefillPrepArgs>(args, "AttnPrefillPrepArgs");
        const std::string name = kernel_name("attn_prefill_prep", {{'d', head_dim}}, bf16_q ? "_qbf" : "");
        AttnPrefillBuffers io{qg, q, k_cache, v_cache};
        io.k = &k, io.v = &v;
        encode_attn_prefill_prep(pass, pass.device().pipeline(name), label.empty() ? name : label, io,
                                 whole(q_norm), whole(k_norm), a, head_dim, bf16_q);
      },
      "compute_pass"_a, "args"_a, "head_dim"_a, "qg"_a, "k"_a, "v"_a, "q_norm"_a, "k_norm"_a, "k_cache"_a,
      "v_cache"_a, "q"_a, "bf16_q"_a = false, "label"_a = "",
      "attn_prefill_prep_d<head_dim>[_qbf] as the prefill chunk encodes it\n"
      "(csrc/runtime/families/attention_prefill.h): `args` the bytes of AttnPrefillPrepArgs; the bf16\n"
      "projections qg [M, Hq, 2 head_dim], k and v [M, Hkv, head_dim], the bf16 q/k norms [head_dim] and\n"
      "caches [Hkv, capacity, head_dim] (rows [p0, p0 + M) written); q fp32 [M, Hq, head_dim], or with\n"
      "bf16_q the tensor-op attention's bf16 [Hq / G, M, G, head_dim].");
  m.def(
      "encode_attn_prefill",
      [](gpu::ComputePass& pass, const nb::bytes& args, uint32_t head_dim, uint32_t q_group, gpu::Buffer& q,
         gpu::Buffer& qg, gpu::Buffer& k_cache, gpu::Buffer& v_cache, gpu::Buffer* out, gpu::Buffer* ml,
         gpu::Buffer* po, bool tensor, const std::string& label) {
        const auto a = args_from<lily::kernels::AttnPrefillArgs>(args, "AttnPrefillArgs");
        const bool split = a.num_splits != 0;
        if (split ? !(ml && po) : !out)
          throw std::invalid_argument(split ? "encode_attn_prefill: the split kernel writes ml and po"
                                            : "encode_attn_prefill: the direct kernel writes out");
        const std::string name = kernel_name(split ? "attn_prefill_split" : "attn_prefill",
                                             {{'d', head_dim}, {'g', q_group}}, tensor ? "_tensor" : "");
        AttnPrefillBuffers io{qg, q, k_cache, v_cache};
        io.out = out, io.ml = ml, io.po = po;
        encode_attn_prefill(pass, pass.device().pipeline(name), label.empty() ? name : label, io, a, head_dim,
                            q_group, tensor);
      },
      "compute_pass"_a, "args"_a, "head_dim"_a, "q_group"_a, "q"_a, "qg"_a, "k_cache"_a, "v_cache"_a,
      "out"_a.none() = nb::none(), "ml"_a.none() = nb::none(), "po"_a.none() = nb::none(), "tensor"_a = false,
      "label"_a = "",
      "The prefill chunk's causal attention as it encodes it (csrc/runtime/families/attention_prefill.h):\n"
      "`args` the bytes of AttnPrefillArgs; q as encode_attn_prefill_prep wrote it (bf16 with `tensor`, the\n"
      "*_tensor kernels'), qg the bf16 q|gate projection, the bf16 caches. num_splits 0:\n"
      "attn_prefill_d<D>_g<q_group>[_tensor] into out bf16 [M, Hq * head_dim]; else\n"
      "attn_prefill_split_d<D>_g<q_group>[_tensor] into the partials ml [splits, M, Hq, 2] and po\n"
      "[splits, M, Hq, head_dim] fp32.");
  m.def(
      "encode_attn_prefill_combine",
      [](gpu::ComputePass& pass, const nb::bytes& args, uint32_t head_dim, gpu::Buffer& ml, gpu::Buffer& po,
         gpu::Buffer& qg, gpu::Buffer& out, const std::string& label) {
        const auto a = args_from<lily::kernels::AttnPrefillArgs>(args, "AttnPrefillArgs");
        const std::string name = kernel_name("attn_prefill_combine", {{'d', head_dim}});
        encode_attn_prefill_combine(pass, pass.device().pipeline(name), label.empty() ? name : label, ml, po,
                                    qg, out, a, head_dim);
      },
      "compute_pass"_a, "args"_a, "head_dim"_a, "ml"_a, "po"_a, "qg"_a, "out"_a, "label"_a = "",
      "attn_prefill_combine_d<head_dim> as the prefill chunk encodes it\n"
      "(csrc/runtime/families/attention_prefill.h): merges the split partials ml and po of args.num_splits\n"
      "splits, gated by the bf16 q|gate qg, into out bf16 [M, Hq * head_dim].");

  // ---- metal/gdn.metal
  m.def(
      "encode_gdn_decode_step",
      [](gpu::ComputePass& pass, uint32_t hk, uint32_t hv, uint32_t dk, uint32_t dv, uint32_t k,
         std::tuple<gpu::Buffer&, gpu::Buffer&, gpu::Buffer&> weights, gpu::Buffer& qkv, gpu::Buffer& b,
         gpu::Buffer& a, gpu::Buffer& conv_in, gpu::Buffer& conv_out, gpu::Buffer& state, gpu::Buffer& ring,
         gpu::Buffer& y, gpu::Buffer& ssq, uint32_t splits, uint32_t pending, bool write_back,
         const std::string& label) {
        const std::string name = kernel_name("gdn_decode_step", {{'k', dk}, {'v', dv}});
        const TensorRef conv1d = whole(std::get<0>(weights)), A_log = whole(std::get<1>(weights)),
                        dt_bias = whole(std::get<2>(weights));
        DeltaNetLayer w;
        w.conv1d = &conv1d;
        w.A_log = &A_log;
        w.dt_bias = &dt_bias;
        encode_gdn_decode_step(
            pass, pass.device().pipeline(name), label.empty() ? name : label, GdnShape{hk, hv, dk, dv, k}, w,
            {qkv, b, a, conv_in, conv_out, state, ring, y, ssq}, splits, pending, write_back);
      },
      "compute_pass"_a, "hk"_a, "hv"_a, "dk"_a, "dv"_a, "k"_a, "weights"_a, "qkv"_a, "b"_a, "a"_a, "conv_in"_a,
      "conv_out"_a, "state"_a, "ring"_a, "y"_a, "ssq"_a, "splits"_a = DecodePlan::kGdnDecodeSplits,
      "pending"_a = 0, "write_back"_a = true, "label"_a = "",
      "gdn_decode_step_k<dk>_v<dv> as the decode step encodes it (csrc/runtime/families/gdn.h): weights =\n"
      "(conv1d, A_log, dt_bias); replays `pending` entries of `ring`, then writes `state` back or appends\n"
      "its entry; y [hv*dv] and the per-split sums of y^2 ssq [hv, splits] out.");
  m.def(
      "encode_gdn_state_writeback",
      [](gpu::ComputePass& pass, uint32_t hk, uint32_t hv, uint32_t dk, uint32_t dv, uint32_t k,
         gpu::Buffer& state, gpu::Buffer& ring, uint32_t pending, uint32_t splits, const std::string& label) {
        const std::string name = kernel_name("gdn_state_writeback", {{'k', dk}, {'v', dv}});
        encode_gdn_state_writeback(pass, pass.device().pipeline(name), label.empty() ? name : label,
                                   GdnShape{hk, hv, dk, dv, k}, state, ring, splits, pending);
      },
      "compute_pass"_a, "hk"_a, "hv"_a, "dk"_a, "dv"_a, "k"_a, "state"_a, "ring"_a, "pending"_a,
      "splits"_a = DecodePlan::kGdnDecodeSplits, "label"_a = "",
      "gdn_state_writeback_k<dk>_v<dv> as the decode plan encodes it: `state` after `pending` entries of "
      "`ring`.");

  // ---- metal/gdn_prefill.metal
  m.def("gdn_scan_rows", &gdn_scan_rows, "dv"_a,
        "State rows per gdn_scan threadgroup for value head dim dv (the r of gdn_scan_k<dk>_v<dv>_r<r>; a\n"
        "head's splits: dv / r), as the prefill plan picks them (csrc/runtime/families/gdn_prefill.h).");
  m.def(
      "encode_gdn_scan",
      [](gpu::ComputePass& pass, uint32_t hk, uint32_t hv, uint32_t dk, uint32_t dv, uint32_t k,
         std::tuple<gpu::Buffer&, gpu::Buffer&, gpu::Buffer&, gpu::Buffer&> weights, gpu::Buffer& qkv,
         gpu::Buffer& b, gpu::Buffer& a, gpu::Buffer& z, gpu::Buffer& conv_in, gpu::Buffer& state,
         gpu::Buffer& u, gpu::Buffer& ss, uint32_t rows, float norm_eps, const std::string& label) {
        const uint32_t rv = gdn_scan_rows(dv);
        const std::string name = kernel_name("gdn_scan", {{'k', dk}, {'v', dv}, {'r', rv}});
        const TensorRef conv1d = whole(std::get<0>(weights)), A_log = whole(std::get<1>(weights)),
                        dt_bias = whole(std::get<2>(weights)), norm = whole(std::get<3>(weights));
        DeltaNetLayer w;
        w.conv1d = &conv1d;
        w.A_log = &A_log;
        w.dt_bias = &dt_bias;
        w.norm = &norm;
        encode_gdn_scan(pass, pass.device().pipeline(name), label.empty() ? name : label,
                        GdnShape{hk, hv, dk, dv, k}, w, {qkv, b, a, z, conv_in, state, u, ss}, rows, rv,
                        norm_eps);
      },
      "compute_pass"_a, "hk"_a, "hv"_a, "dk"_a, "dv"_a, "k"_a, "weights"_a, "qkv"_a, "b"_a, "a"_a, "z"_a,
      "conv_in"_a, "state"_a, "u"_a, "ss"_a, "rows"_a, "norm_eps"_a, "label"_a = "",
      "gdn_scan_k<dk>_v<dv>_r<gdn_scan_rows(dv)> over `rows` tokens as the prefill chunk encodes it\n"
      "(csrc/runtime/families/gdn_prefill.h): weights = (conv1d, A_log, dt_bias, norm); u and the splits'\n"
      "sums of y^2 ss out, state updated in place.");
  m.def(
      "encode_gdn_norm_scale",
      [](gpu::ComputePass& pass, uint32_t hk, uint32_t hv, uint32_t dk, uint32_t dv, uint32_t k,
         gpu::Buffer& ss, gpu::Buffer& f, uint32_t rows, float norm_eps, uint32_t threads,
         const std::string& label) {
        const uint32_t rv = gdn_scan_rows(dv);
        const std::string name = kernel_name("gdn_norm_scale", {{'v', dv}, {'r', rv}});
        encode_gdn_norm_scale(pass, pass.device().pipeline(name), label.empty() ? name : label,
                              GdnShape{hk, hv, dk, dv, k}, ss, f, rows, rv, norm_eps, threads);
      },
      "compute_pass"_a, "hk"_a, "hv"_a, "dk"_a, "dv"_a, "k"_a, "ss"_a, "f"_a, "rows"_a, "norm_eps"_a,
      "threads"_a = kGdnNormScaleThreads, "label"_a = "",
      "gdn_norm_scale_v<dv>_r<gdn_scan_rows(dv)> as the prefill chunk encodes it: the splits' factors f from\n"
      "the scan's sums ss.");
  m.def(
      "encode_gdn_conv_state",
      [](gpu::ComputePass& pass, uint32_t hk, uint32_t hv, uint32_t dk, uint32_t dv, uint32_t k,
         gpu::Buffer& qkv, gpu::Buffer& conv_in, gpu::Buffer& conv_out, uint32_t rows, uint32_t threads,
         const std::string& label) {
        encode_gdn_conv_state(pass, pass.device().pipeline("gdn_conv_state"),
                              label.empty() ? "gdn_conv_state" : label, GdnShape{hk, hv, dk, dv, k}, qkv,
                              conv_in, conv_out, rows, threads);
      },
      "compute_pass"_a, "hk"_a, "hv"_a, "dk"_a, "dv"_a, "k"_a, "qkv"_a, "conv_in"_a, "conv_out"_a, "rows"_a,
      "threads"_a = kGdnConvStateThreads, "label"_a = "",
      "gdn_conv_state as the prefill chunk encodes it: the conv state after `rows` rows of qkv (conv_out may\n"
      "be conv_in).");
}

}  // namespace lily::runtime
