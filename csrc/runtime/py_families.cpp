// lily._core.encode_*: the runtime's per-family dispatch builders (csrc/runtime/families/),
// bound so that the kernel tests and lily doctor encode a kernel exactly as the plans do (as
// ggml's test-backend-ops runs the backend's own ops). Each resolves its pipeline by the
// kernel's name (kernel_names.h) on the pass's device; buffers are bound from offset 0 and a
// weight is a whole Buffer (a quantized one: a (weight, scales, biases) tuple).
#include "runtime/py_families.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "runtime/decode.h"
#include "runtime/families/embed.h"
#include "runtime/families/gdn.h"
#include "runtime/families/gdn_prefill.h"
#include "runtime/families/norm.h"
#include "runtime/kernel_names.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::runtime {
namespace {

TensorRef whole(gpu::Buffer& b) { return TensorRef{&b, 0, b.size()}; }

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
