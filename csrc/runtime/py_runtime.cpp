#include "runtime/py_runtime.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/set.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "runtime/runtime.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::runtime {
namespace {

template <class T>
T get(nb::dict d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("model dims: missing '") + key + "'");
  return nb::cast<T>(d[key]);
}

ModelDims dims_from(nb::dict d) {
  ModelDims m;
  m.vocab_size = get<uint32_t>(d, "vocab_size");
  m.hidden_size = get<uint32_t>(d, "hidden_size");
  m.num_hidden_layers = get<uint32_t>(d, "num_hidden_layers");
  m.num_attention_heads = get<uint32_t>(d, "num_attention_heads");
  m.num_key_value_heads = get<uint32_t>(d, "num_key_value_heads");
  m.head_dim = get<uint32_t>(d, "head_dim");
  m.rotary_dim = get<uint32_t>(d, "rotary_dim");
  m.linear_num_key_heads = get<uint32_t>(d, "linear_num_key_heads");
  m.linear_num_value_heads = get<uint32_t>(d, "linear_num_value_heads");
  m.linear_key_head_dim = get<uint32_t>(d, "linear_key_head_dim");
  m.linear_value_head_dim = get<uint32_t>(d, "linear_value_head_dim");
  m.linear_conv_kernel_dim = get<uint32_t>(d, "linear_conv_kernel_dim");
  m.num_experts = get<uint32_t>(d, "num_experts");
  m.num_experts_per_tok = get<uint32_t>(d, "num_experts_per_tok");
  m.moe_intermediate_size = get<uint32_t>(d, "moe_intermediate_size");
  m.shared_expert_intermediate_size = get<uint32_t>(d, "shared_expert_intermediate_size");
  m.rms_norm_eps = get<float>(d, "rms_norm_eps");
  m.rope_theta = get<float>(d, "rope_theta");
  m.norm_topk_prob = get<bool>(d, "norm_topk_prob");
  m.full_attention = get<std::vector<bool>>(d, "full_attention");
  return m;
}

nb::dict counters_dict(const gpu::Counters& c, const Traffic& t) {
  nb::dict d;
  d["dispatches"] = c.dispatches;
  d["barrier_stages"] = c.barrier_stages;
  d["declared_bytes_read"] = c.bytes_read;
  d["declared_bytes_written"] = c.bytes_written;
  d["weight_bytes"] = t.weight_bytes;
  d["kv_bytes"] = t.kv_bytes;
  d["state_bytes"] = t.state_bytes;
  d["activation_bytes"] = t.other_bytes;
  nb::list log;
  for (const auto& r : c.log) log.append(nb::make_tuple(r.label, r.stage, r.threadgroups));
  d["log"] = log;
  return d;
}

}  // namespace

void bind_runtime(nb::module_& m) {
  using Tensor = std::tuple<std::string, std::string, uint64_t, uint64_t>;
  nb::class_<SessionSnapshot>(m, "SessionSnapshot",
                              "A host copy of a Runtime's session state (Runtime.snapshot / restore).")
      .def_ro("position", &SessionSnapshot::position, "tokens in the session")
      .def_prop_ro("nbytes", &SessionSnapshot::nbytes, "bytes held (KV rows in use, conv and recurrent state)");
  nb::class_<Runtime>(m, "Runtime",
                            "One session of the model on a device: chunked prefill and pipelined decode (csrc/runtime/runtime.h).")
      .def("__init__",
           [](Runtime* self, std::shared_ptr<gpu::Device> device, nb::dict dims,
              const std::vector<Tensor>& tensors, uint32_t max_context, uint32_t split_threshold,
              uint32_t split_block, bool virtual_weights, uint32_t prefill_chunk, const std::string& gemm_path) {
             std::vector<TensorDesc> descs;
             descs.reserve(tensors.size());
             for (const auto& [name, file, offset, nbytes] : tensors) descs.push_back({name, file, offset, nbytes});
             RuntimeOptions o;
             o.max_context = max_context;
             o.split_threshold = split_threshold;
             o.split_block = split_block;
             o.virtual_weights = virtual_weights;
             o.prefill_chunk = prefill_chunk;
             if (gemm_path == "auto") o.gemm_path = GemmPath::automatic;
             else if (gemm_path == "simdgroup") o.gemm_path = GemmPath::simdgroup;
             else if (gemm_path == "tensor") o.gemm_path = GemmPath::tensor;
             else throw std::invalid_argument("gemm_path must be 'auto', 'simdgroup' or 'tensor', got '" +
                                              gemm_path + "'");
             if (prefill_chunk == 0) throw std::invalid_argument("prefill_chunk must be positive");
             new (self) Runtime(std::move(device), dims_from(dims), descs, o);
           },
           "device"_a, "dims"_a, "tensors"_a, "max_context"_a, "split_threshold"_a = 256,
           "split_block"_a = 0, "virtual_weights"_a = false, "prefill_chunk"_a = 2048,
           "gemm_path"_a = "auto",
           "tensors: [(name, safetensors path, byte offset, nbytes)]; dims: lily.checkpoint.ModelConfig fields.")
      .def("reset", &Runtime::reset)
      .def("snapshot", &Runtime::snapshot, nb::call_guard<nb::gil_scoped_release>(),
           "A copy of the session state (waits for work in flight).")
      .def("restore", &Runtime::restore, "snapshot"_a, nb::call_guard<nb::gil_scoped_release>(),
           "Makes `snapshot` the session state; ValueError if it is from another model or exceeds the context.")
      .def_prop_ro("position", &Runtime::position)
      .def_prop_ro("weight_bytes", &Runtime::weight_bytes)
      .def_prop_ro("repacked_bytes", &Runtime::repacked_bytes)
      .def_prop_ro("prefill_chunk", &Runtime::prefill_chunk)
      .def_prop_ro("prefill_scratch_bytes", &Runtime::prefill_scratch_bytes)
      .def_prop_ro("uses_tensor_ops", &Runtime::uses_tensor_ops)
      .def("expert_histogram", &Runtime::expert_histogram, "layer"_a,
           "Assignments per expert of `layer` in the last completed prefill chunk.")
      .def("forward",
           [](Runtime& rt, const std::vector<uint32_t>& tokens, const std::string& logits, bool decode_steps) {
             Logits which = logits == "all" ? Logits::all : logits == "last" ? Logits::last : Logits::none;
             if (logits != "all" && logits != "last" && logits != "none")
               throw std::invalid_argument("logits must be 'all', 'last' or 'none'");
             std::vector<float> out;
             {
               nb::gil_scoped_release g;
               out = rt.forward(tokens, which, decode_steps);
             }
             return nb::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(float));
           },
           "tokens"_a, "logits"_a = "last", "decode_steps"_a = false,
           "Runs tokens at the current position (prefill chunks; one token or decode_steps=True: "
           "decode steps). float32 logits bytes [n, vocab] ('all'), [vocab] ('last') or empty ('none').")
      .def("generate_greedy",
           [](Runtime& rt, uint32_t first, uint32_t max_tokens, const std::set<uint32_t>& stop) {
             nb::gil_scoped_release g;
             return rt.generate_greedy(first, max_tokens, stop);
           },
           "first"_a, "max_tokens"_a, "stop_ids"_a,
           "Pipelined greedy decode with the GPU token hand-off; returns the generated ids.")
      .def("start",
           [](Runtime& rt, const std::vector<uint32_t>& feed, uint32_t max_steps, const std::vector<uint32_t>& prompt,
              float temperature, uint32_t top_k, float top_p, float min_p, float presence_penalty,
              float frequency_penalty, float repetition_penalty, uint64_t seed, bool logprobs,
              uint32_t top_logprobs) {
             SamplingConfig c;
             c.temperature = temperature; c.top_k = top_k; c.top_p = top_p; c.min_p = min_p;
             c.presence_penalty = presence_penalty; c.frequency_penalty = frequency_penalty;
             c.repetition_penalty = repetition_penalty; c.seed = seed; c.logprobs = logprobs;
             c.top_logprobs = top_logprobs;
             nb::gil_scoped_release g;
             rt.start(feed, c, max_steps, prompt);
           },
           "feed"_a, "max_steps"_a, "prompt"_a, "temperature"_a = 0.0f, "top_k"_a = 0, "top_p"_a = 1.0f,
           "min_p"_a = 0.0f, "presence_penalty"_a = 0.0f, "frequency_penalty"_a = 0.0f,
           "repetition_penalty"_a = 1.0f, "seed"_a = 0, "logprobs"_a = false, "top_logprobs"_a = 0,
           "Starts pipelined generation: `feed` (>= 1 tokens) is fed at the current position; several "
           "tokens run as prefill chunks whose last one samples the first output on the device.")
      .def("next",
           [](Runtime& rt) -> nb::object {
             StepOutput o;
             bool more;
             {
               nb::gil_scoped_release g;
               more = rt.next(&o);
             }
             if (!more) return nb::none();
             return nb::make_tuple(o.token, o.logprob, o.top);
           },
           "The next generated (token, logprob, [(id, logprob)]), or None when the steps are used up.")
      .def("finish",
           [](Runtime& rt) {
             nb::gil_scoped_release g;
             rt.finish();
           },
           "Waits for the step in flight and commits the session position.")
      .def("count_step",
           [](Runtime& rt, uint32_t position) {
             Traffic t;
             gpu::Counters c = rt.count_step(position, &t);
             return counters_dict(c, t);
           },
           "position"_a, "Encodes (and on a real device runs) one step; counters and traffic.")
      .def("count_chunk",
           [](Runtime& rt, uint32_t position, uint32_t rows) {
             Traffic t;
             gpu::Counters c = rt.count_chunk(position, rows, &t);
             return counters_dict(c, t);
           },
           "position"_a, "rows"_a, "Encodes (and on a real device runs) one prefill chunk; counters and traffic.");
}

}  // namespace lily::runtime
