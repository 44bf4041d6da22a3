#include "runtime/py_runtime.h"

#include <optional>
#include <type_traits>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/set.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "gpu/py_device.h"
#include "runtime/cost.h"
#include "runtime/kernel_args.h"
#include "runtime/kernel_names.h"
#include "runtime/runtime.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::runtime {
namespace {

// A bound struct with a read-write attribute per X-list field, and FIELDS naming them.
// `strict`: a setter that refuses a bool for a number (nanobind takes True as 1) and names
// the field in its ValueError, for options a user types.
template <class S>
struct FieldBinder {
  nb::class_<S>& cls;
  nb::list names;
  bool strict = false;
  template <class T>
  void add(const char* name, T S::*member) {
    names.append(name);
    if (!strict) {
      cls.def_rw(name, member);
      return;
    }
    const std::string type = std::is_same_v<T, bool> ? "bool" : std::is_integral_v<T> ? "int" : "float";
    cls.def_prop_rw(
        name, [member](const S& s) { return s.*member; },
        [member, name](S& s, nb::handle v) {
          const bool is_bool = PyBool_Check(v.ptr());
          T out{};
          std::string unsigned_rule = "a non-negative integer";
          if constexpr (std::is_same_v<S, RuntimeOptions>) unsigned_rule = RuntimeOptions::rule(name);
          if (std::is_same_v<T, bool> != is_bool || !nb::try_cast<T>(v, out))
            throw std::invalid_argument(std::string(name) + " must be " +
                                        (std::is_same_v<T, bool> ? "True or False"
                                         : std::is_unsigned_v<T> ? unsigned_rule
                                         : std::is_integral_v<T> ? "an integer"
                                                                 : "a number") +
                                        ", got " + nb::repr(v).c_str());
          s.*member = out;
        },
        nb::for_setter(nb::sig(("def " + std::string(name) + "(self, arg: " + type + ", /) -> None").c_str())));
  }
};

// One dispatch for the performance model (lily.lab.estimate): the device's record plus the cost
// table's entry (None for a kernel the table does not know).
nb::dict runtime_record_dict(const gpu::DispatchRecord& r) {
  nb::dict d = gpu::record_dict(r);
  const std::optional<Cost> w = dispatch_cost(r);
  d["threadgroup_memory"] = r.threadgroup_memory + (w ? w->threadgroup_memory : 0);
  if (!w) {
    d["work"] = nb::none();
    return d;
  }
  nb::dict work, flops;
  for (int p = 0; p < kPaths; ++p) flops[path_name(Path(p))] = w->flops[p];
  nb::dict chain, lead, loop;
  for (int k = 0; k < kLats; ++k) {
    chain[lat_name(Lat(k))] = w->chain[k];
    lead[lat_name(Lat(k))] = w->lead[k];
    loop[lat_name(Lat(k))] = w->loop[k];
  }
  work["family"] = w->family;
  work["flops"] = flops;
  work["bytes"] = w->bytes;
  work["chain"] = chain;
  work["lead"] = lead;
  work["loop"] = loop;
  d["work"] = work;
  return d;
}

nb::dict runtime_counters_dict(const gpu::Counters& c, const Traffic& t) {
  nb::dict d = gpu::counters_dict(c, true);
  d["weight_bytes"] = t.weight_bytes;
  d["kv_bytes"] = t.kv_bytes;
  d["state_bytes"] = t.state_bytes;
  d["activation_bytes"] = t.other_bytes;
  nb::list log;
  for (const auto& r : c.log) log.append(nb::make_tuple(r.label, r.stage));
  d["log"] = log;
  nb::list records;
  for (const auto& r : c.log) records.append(runtime_record_dict(r));
  d["records"] = records;
  return d;
}

}  // namespace

void bind_runtime(nb::module_& m) {
  using Tensor = std::tuple<std::string, std::string, uint64_t, uint64_t>;
  // The metal/*_args.h structs and constants (kernel_args.h): what Python packs and reads.
  nb::dict layouts;
  for (const kernels::ArgLayout& a : kernels::arg_layouts()) {
    nb::list fields;
    for (const kernels::ArgField& f : a.fields)
      fields.append(nb::make_tuple(f.name, f.type, f.offset, f.count));
    layouts[a.name] = nb::make_tuple(a.size, nb::tuple(fields));
  }
  m.attr("KERNEL_ARGS") = layouts;
  nb::dict constants;
  for (const kernels::KernelConstant& c : kernels::kernel_constants())
    constants[c.name] = c.is_float ? nb::cast(c.value) : nb::cast(uint32_t(c.value));
#define LILY_PLAN_CONSTANT(c) constants[#c] = DecodePlan::c;
  LILY_DECODE_PLAN_CONSTANTS(LILY_PLAN_CONSTANT)
#undef LILY_PLAN_CONSTANT
  m.attr("CONSTANTS") = constants;
  m.attr("EXPERT_TILE_ROWS") =
      nb::tuple(nb::cast(std::vector<uint32_t>(std::begin(kExpertTileRows), std::end(kExpertTileRows))));
  m.def(
      "decode_split_rows",
      [](uint32_t rows, uint32_t num_q_heads, uint32_t num_kv_heads) {
        const uint32_t g = num_kv_heads && num_q_heads % num_kv_heads == 0
                               ? attn_heads_per_group(num_q_heads / num_kv_heads)
                               : 0;
        if (!rows || !g)
          throw std::invalid_argument(
              "decode_split_rows needs rows >= 1 and query heads a multiple of the KV heads by 2, 4 or 8");
        return DecodePlan::split_rows_for(rows, num_q_heads, g);
      },
      "rows"_a, "num_q_heads"_a, "num_kv_heads"_a,
      "KV rows per block of the split decode attention over `rows` cache rows, as the runtime picks them\n"
      "without the split_block option (DecodePlan::split_rows, csrc/runtime/decode.cpp). Raises ValueError\n"
      "for rows 0 or heads with no attention kernel grouping.");
  // The grouped expert GEMMs' tile-class rules (metal/prefill_args.h), as kernels and host apply them.
  m.def("moe_tile_classes", &kernels::moe_tile_classes, "tile_rows"_a,
        "Tile classes of a height-T tiling (prefill_args.h moe_tile_classes).");
  m.def("moe_tail_class", &kernels::moe_tail_class, "tile_rows"_a, "rows"_a,
        "The class of an expert's last tile of `rows` rows, 1 <= rows <= T (prefill_args.h).");
  m.def("moe_class_capacity", &kernels::moe_class_capacity, "assignments"_a, "experts"_a, "tile_rows"_a,
        "cls"_a, "Tiles class `cls` can hold at most for `assignments` over `experts` (prefill_args.h).");
  m.def("moe_class_base", &kernels::moe_class_base, "assignments"_a, "experts"_a, "tile_rows"_a, "cls"_a,
        "First entry of class `cls`'s map in the tile-map buffer (prefill_args.h).");
  m.def(
      "kernel_name",
      [](const std::string& base, const std::string& suffix, const nb::kwargs& kwargs) {
        std::vector<KernelParam> params;
        for (auto [key, value] : kwargs) {
          const std::string k = nb::cast<std::string>(key);
          if (k.size() != 1 || !std::islower(static_cast<unsigned char>(k[0])))
            throw std::invalid_argument("kernel_name: a parameter key is one lowercase letter, got '" + k +
                                        "'");
          params.push_back({k[0], nb::cast<uint32_t>(value)});
        }
        return kernel_name(base, params, suffix);
      },
      "base"_a, "suffix"_a = "", "params"_a,
      "A templated kernel's host name (csrc/runtime/kernel_names.h): base, '_<key><value>' per keyword in\n"
      "order, then suffix: kernel_name('gdn_scan', k=128, v=128, r=32) == 'gdn_scan_k128_v128_r32'.");
  m.def(
      "kernel_params",
      [](const std::string& name) {
        nb::dict out;
        for (const KernelParam& p : kernel_params(name)) out[std::string(1, p.key).c_str()] = p.value;
        return out;
      },
      "name"_a,
      "The template parameters in a kernel's host name, by key: kernel_params('attn_prefill_d256_g4_tensor')\n"
      "== {'d': 256, 'g': 4} (csrc/runtime/kernel_names.h).");
  m.def("gdn_ring_entry_floats", [](uint32_t hk, uint32_t hv, uint32_t dk, uint32_t dv) {
    return lily::kernels::gdn_ring(hk, hv, dk, dv).entry;
  }, "hk"_a, "hv"_a, "dk"_a, "dv"_a,
        "Floats of one entry of a Gated DeltaNet layer's ring of pending decode-step updates "
        "(metal/mixer_args.h GdnRing: delta [hv*dv] | k [hk*dk] | g [hv]).");
  // The cost table's execution paths and latency kinds, in its order (cost.h Path, Lat).
  nb::list paths, latencies;
  for (int p = 0; p < kPaths; ++p) paths.append(path_name(Path(p)));
  for (int k = 0; k < kLats; ++k) latencies.append(lat_name(Lat(k)));
  m.attr("COST_PATHS") = nb::tuple(paths);
  m.attr("LATENCY_KINDS") = nb::tuple(latencies);
  m.def("dispatch_costs", [](const gpu::CommandBuffer& cb) {
    nb::list out;
    for (const auto& r : cb.counters().log) out.append(runtime_record_dict(r));
    return out;
  }, "command_buffer"_a,
        "The dispatches a command buffer recorded (CommandBuffer.dispatch_log) with the cost table's entry\n"
        "of each (as the counting runtime's records: work = flops per path, bytes, latency chains; None\n"
        "for a kernel the table does not know): how `lily bench --kernels` prices what it timed.");
  m.def("native_quant_format", [](const std::string& module) {
    const QuantFormat f = native_quant_format(module);
    return std::make_pair(f.bits, f.group_size);
  }, "module"_a,
        "(bits, group_size) the native kernels read the linear `module` in (e.g. "
        "'model.layers.0.mlp.gate' -> (8, 64)); csrc/runtime/model.h.");
  nb::class_<ModelDims> dims(m, "ModelDims",
                             "The model's dimensions (lily.checkpoint.ModelConfig's fields of the same names, "
                             "full_attention per layer); FIELDS lists the scalar ones.");
  dims.def(nb::init<>());
  FieldBinder<ModelDims> dims_fields{dims, {}};
#define LILY_BIND_FIELD(type, name, init) binder.add(#name, &Struct::name);
  {
    auto& binder = dims_fields;
    using Struct = ModelDims;
    LILY_MODEL_DIMS(LILY_BIND_FIELD)
  }
  dims.def_rw("full_attention", &ModelDims::full_attention);
  dims.attr("FIELDS") = nb::tuple(dims_fields.names);
  nb::class_<SamplingConfig> sampling(m, "SamplingConfig",
                                      "Device sampling settings (lily.sampling.SamplingParams' fields of "
                                      "the same names, listed in FIELDS).");
  sampling.def(nb::init<>());
  FieldBinder<SamplingConfig> sampling_fields{sampling, {}};
  {
    auto& binder = sampling_fields;
    using Struct = SamplingConfig;
    LILY_SAMPLING_CONFIG(LILY_BIND_FIELD)
  }
  sampling.attr("FIELDS") = nb::tuple(sampling_fields.names);
  sampling.def_rw("logit_bias", &SamplingConfig::logit_bias,
                  "lily.sampling.SamplingParams.logit_bias: (token id, bias) pairs, ids < vocab (not in FIELDS).");
  nb::class_<SessionSnapshot>(m, "SessionSnapshot",
                              "A Runtime's session state in a buffer of its device (Runtime.snapshot / restore).")
      .def("__init__",
           [](SessionSnapshot* self, uint32_t position, const std::vector<nb::bytes>& parts,
              std::shared_ptr<gpu::Device> device) {
             std::vector<std::pair<const void*, size_t>> views;
             for (const auto& p : parts) views.emplace_back(p.data(), p.size());
             new (self) SessionSnapshot(SessionSnapshot::upload(*device, position, views));
           },
           "position"_a, "parts"_a, "device"_a,
           "A snapshot from the bytes of `parts()` (a prompt cache file), uploaded into a buffer of "
           "`device`; Runtime.restore checks the sizes. ValueError on a record-only device.")
      .def_ro("position", &SessionSnapshot::position, "tokens in the session")
      .def_prop_ro("nbytes", &SessionSnapshot::nbytes, "bytes held (KV rows in use, conv and recurrent state)")
      .def_prop_ro("device_bytes",
                   [](const SessionSnapshot& s) -> uint64_t { return s.buffer ? s.buffer->size() : 0; },
                   "bytes of the device buffer holding the parts (nbytes; 0 when empty)")
      .def("parts",
           [](const SessionSnapshot& s) {
             std::vector<nb::bytes> out;
             for (const auto& p : s.host_parts()) out.emplace_back(p.data(), p.size());
             return out;
           },
           "The state as bytes (read from the device buffer), one item per attention layer's K or V "
           "rows or DeltaNet layer's conv or recurrent state.");
  nb::class_<RuntimeOptions> options(m, "RuntimeOptions",
                                     "A Runtime's options (csrc/runtime/runtime.h; FIELDS lists them but "
                                     "gemm_path). Setting a wrong type, an unknown gemm_path, or validate() "
                                     "on a zero max_context/split_threshold raises ValueError naming the option. "
                                     "prefill_chunk 0 (the default) is the automatic choice: the first of "
                                     "AUTO_PREFILL_CHUNKS, capped at max_context, that fits the device's memory.");
  options.def(nb::init<>());
  FieldBinder<RuntimeOptions> options_fields{options, {}, true};
  {
    auto& binder = options_fields;
    using Struct = RuntimeOptions;
    LILY_RUNTIME_OPTIONS(LILY_BIND_FIELD)
  }
#undef LILY_BIND_FIELD
  options.attr("FIELDS") = nb::tuple(options_fields.names);
  options.attr("MAX_STATE_WINDOW") = RuntimeOptions::kMaxStateWindow;
  options.attr("AUTO_PREFILL_CHUNKS") = nb::tuple(nb::cast(std::vector<uint32_t>(
      std::begin(kAutoPrefillChunks), std::end(kAutoPrefillChunks))));
  options.def_prop_rw(
      "gemm_path", [](const RuntimeOptions& o) { return std::string(RuntimeOptions::gemm_path_names[int(o.gemm_path)]); },
      [](RuntimeOptions& o, const std::string& name) { o.gemm_path = RuntimeOptions::parse_gemm_path(name); },
      "The prefill GEMM kernels: 'auto' (ask the device), 'simdgroup' or 'tensor'.");
  options.def("validate", &RuntimeOptions::validate, "ValueError naming the first invalid option.");
  nb::class_<Runtime>(m, "Runtime",
                            "One session of the model on a device: chunked prefill and pipelined decode (csrc/runtime/runtime.h).")
      .def("__init__",
           [](Runtime* self, std::shared_ptr<gpu::Device> device, const ModelDims& dims,
              const std::vector<Tensor>& tensors, const RuntimeOptions& options) {
             std::vector<TensorDesc> descs;
             descs.reserve(tensors.size());
             for (const auto& [name, file, offset, nbytes] : tensors) descs.push_back({name, file, offset, nbytes});
             new (self) Runtime(std::move(device), dims, descs, options);
           },
           "device"_a, "dims"_a, "tensors"_a, "options"_a,
           "tensors: [(name, safetensors path, byte offset, nbytes)]; dims: a ModelDims; options: a "
           "RuntimeOptions.")
      .def("reset", &Runtime::reset, "seq"_a = 0, nb::call_guard<nb::gil_scoped_release>(),
           "Empties sequence `seq` (0: the session).")
      .def("snapshot", &Runtime::snapshot, "seq"_a = 0, nb::call_guard<nb::gil_scoped_release>(),
           "A copy of sequence `seq`'s state (waits for its work in flight).")
      .def("restore", &Runtime::restore, "snapshot"_a, "seq"_a = 0, nb::call_guard<nb::gil_scoped_release>(),
           "Makes `snapshot` sequence `seq`'s state; ValueError if it is from another model or exceeds the context.")
      .def_prop_ro("position", [](const Runtime& r) { return r.position(); }, "The session's position.")
      .def("sequence_position", &Runtime::position, "seq"_a, "Tokens in sequence `seq`'s state.")
      .def("open_sequence", &Runtime::open_sequence, nb::call_guard<nb::gil_scoped_release>(),
           "A new sequence (its own KV cache at max_context and state), empty; its id. ValueError when it\n"
           "would take the runtime past the device's working set.")
      .def("close_sequence", &Runtime::close_sequence, "seq"_a, nb::call_guard<nb::gil_scoped_release>(),
           "Frees an opened sequence (waits for its work in flight).")
      .def_prop_ro("sequence_bytes", &Runtime::sequence_bytes, "Device bytes one more sequence allocates.")
      .def_prop_ro("sequences_bytes", &Runtime::sequences_bytes,
                   "Device bytes the opened sequences hold (the session's are in memory_use).")
      .def_prop_ro("sequence_room", &Runtime::sequence_room,
                   "How many more sequences fit the device's working set (2**32 - 1 without a limit).")
      .def("sequences", &Runtime::sequences, "The open sequences' ids, the session (0) first.")
      .def("begin",
           [](Runtime& rt, uint32_t seq, const SamplingConfig& sampling, const std::vector<uint32_t>& prompt) {
             nb::gil_scoped_release g;
             rt.begin(seq, sampling, prompt);
           },
           "seq"_a, "sampling"_a, "prompt"_a,
           "The device sampler's settings for sequence `seq`'s generation (token counts from `prompt`).")
      .def("submit_chunk",
           [](Runtime& rt, uint32_t seq, const std::vector<uint32_t>& tokens, bool sample, bool logits) {
             nb::gil_scoped_release g;
             return rt.submit_chunk(seq, tokens, sample, logits);
           },
           "seq"_a, "tokens"_a, "sample"_a = false, "logits"_a = false,
           "Commits one prefill chunk of sequence `seq`; `sample`: its last row's sampler writes the first\n"
           "generated token on the device; `logits`: its last row's logits are kept. The ticket (0: none).")
      .def("submit_step",
           [](Runtime& rt, const std::vector<std::tuple<uint32_t, int64_t, bool>>& rows) {
             std::vector<StepRow> r;
             for (const auto& [seq, token, logits] : rows) r.push_back(StepRow{seq, token, logits});
             nb::gil_scoped_release g;
             return rt.submit_step(r);
           },
           "rows"_a,
           "Commits one decode step of rows (seq, token: -1 for the device's, logits: keep them for the host);\n"
           "returns its ticket.")
      .def("take",
           [](Runtime& rt, uint64_t ticket, bool timed) {
             std::vector<RowOutput> rows;
             double gpu = 0;
             {
               nb::gil_scoped_release g;
               rows = rt.take(ticket, &gpu, timed);
             }
             nb::list out;
             for (RowOutput& o : rows) {
               nb::object logits = nb::none();
               if (!o.logits.empty()) {
                 auto* v = new std::vector<float>(std::move(o.logits));
                 nb::capsule owner(v, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
                 const size_t shape[1] = {v->size()};
                 logits = nb::cast(nb::ndarray<nb::numpy, float>(v->data(), 1, shape, owner));
               }
               out.append(nb::make_tuple(o.seq, o.position, o.step.token, o.step.logprob, o.step.top, logits));
             }
             return nb::make_tuple(out, gpu);
           },
           "ticket"_a, "timed"_a = true,
           "Waits for a ticket (taken in commit order): ([(seq, position, token, logprob, top, logits or None)],\n"
           "its device seconds, NaN when unknown).")
      .def("wait_all", &Runtime::wait_all, nb::call_guard<nb::gil_scoped_release>(),
           "Waits for every committed command buffer (their outputs stay for take).")
      .def_prop_ro("weight_bytes", &Runtime::weight_bytes)
      .def_prop_ro("repacked_bytes", &Runtime::repacked_bytes)
      .def_prop_ro("prefill_chunk", &Runtime::prefill_chunk)
      .def_prop_ro("prefill_scratch_bytes", &Runtime::prefill_scratch_bytes)
      .def_prop_ro("uses_tensor_ops", &Runtime::uses_tensor_ops)
      .def_prop_ro("gpu_seconds", &Runtime::gpu_seconds,
                   "Device seconds of the work whose results the host has taken since construction "
                   "(prefill chunks, forward passes, generation steps whose token next() returned): a "
                   "total, take differences.")
      .def_prop_ro("uses_tensor_attention", &Runtime::uses_tensor_attention)
      .def_prop_ro("tensor_families", &Runtime::tensor_families,
                   "The families of Metal 4 tensor-op kernels prefill runs (gemm, moe_prefill, attention_prefill), "
                   "after the load-time check against their simdgroup_matrix twins.")
      .def("prefill_command_buffers", &Runtime::prefill_command_buffers, "position"_a, "rows"_a,
           "The layers of a prefill chunk of `rows` rows at `position` as [begin, end) pairs, one command "
           "buffer each (the command_buffer_rows option bounds each one's work; docs/prefill.md).")
      .def_prop_ro("notices", &Runtime::notices,
                   "One line per tensor-op family the load-time check took off the tensor path, saying why.")
      .def_prop_ro("memory_use", [](const Runtime& r) {
        const MemoryUse& u = r.memory_use();
        nb::dict d;
        d["weights"] = u.weights;
        d["kv_cache"] = u.kv_cache;
        d["state"] = u.state;
        d["scratch"] = u.scratch;
        d["total"] = u.total();
        d["largest_buffer"] = u.largest_buffer;
        d["largest_label"] = u.largest_label;
        d["max_context"] = u.max_context;
        return d;
      }, "Device memory of the session in bytes (weights, kv_cache, state, scratch, total, largest buffer),\n"
         "checked against Device.memory_limits at load.")
      .def_prop_ro("kernel_table", [](const Runtime& r) {
        nb::list out;
        for (const KernelUse& k : r.kernel_table()) {
          nb::dict d;
          d["kernel"] = k.kernel;
          d["threads"] = k.threads;
          d["max_threads_per_threadgroup"] = k.max_threads;
          d["static_threadgroup_memory"] = k.threadgroup_memory;
          out.append(d);
        }
        return out;
      }, "Every kernel the runtime dispatches (built and validated at load): the largest threadgroup it\n"
         "asks for and its pipeline's thread limit and static threadgroup memory.")
      .def("expert_histogram", &Runtime::expert_histogram, "layer"_a,
           "Assignments per expert of `layer` in the last completed prefill chunk.")
      .def("forward",
           [](Runtime& rt, nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> tokens,
              const std::string& logits, bool decode_steps, uint32_t seq) {
             Logits which = logits == "all" ? Logits::all : logits == "last" ? Logits::last : Logits::none;
             if (logits != "all" && logits != "last" && logits != "none")
               throw std::invalid_argument("logits must be 'all', 'last' or 'none'");
             std::vector<uint32_t> ids(tokens.data(), tokens.data() + tokens.shape(0));
             auto* out = new std::vector<float>;
             nb::capsule owner(out, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
             {
               nb::gil_scoped_release g;
               *out = rt.forward(ids, which, decode_steps, seq);
             }
             // The logits are handed to numpy without a copy ([n, vocab], [vocab] or [0]).
             const size_t V = rt.dims().vocab_size;
             if (which == Logits::all) {
               const size_t shape[2] = {ids.size(), V};
               return nb::ndarray<nb::numpy, float>(out->data(), 2, shape, owner);
             }
             const size_t shape[1] = {out->size()};
             return nb::ndarray<nb::numpy, float>(out->data(), 1, shape, owner);
           },
           "tokens"_a, "logits"_a = "last", "decode_steps"_a = false, "seq"_a = 0,
           "Runs tokens (uint32 numpy array) at sequence `seq`'s position (prefill chunks; one token or "
           "decode_steps=True: decode steps). float32 logits [n, vocab] ('all'), [vocab] ('last') or "
           "[0] ('none').")
      .def("generate_greedy",
           [](Runtime& rt, uint32_t first, uint32_t max_tokens, const std::set<uint32_t>& stop) {
             nb::gil_scoped_release g;
             return rt.generate_greedy(first, max_tokens, stop);
           },
           "first"_a, "max_tokens"_a, "stop_ids"_a,
           "Pipelined greedy decode with the GPU token hand-off; returns the generated ids.")
      .def("start",
           [](Runtime& rt, const std::vector<uint32_t>& feed, uint32_t max_steps, const std::vector<uint32_t>& prompt,
              const SamplingConfig& sampling) {
             nb::gil_scoped_release g;
             rt.start(feed, sampling, max_steps, prompt);
           },
           "feed"_a, "max_steps"_a, "prompt"_a, "sampling"_a,
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
             return runtime_counters_dict(c, t);
           },
           "position"_a, "Encodes (and on a real device runs) one step; counters and traffic.")
      .def("count_batch_step",
           [](Runtime& rt, const std::vector<uint32_t>& positions) {
             Traffic t;
             gpu::Counters c = rt.count_batch_step(positions, &t);
             return runtime_counters_dict(c, t);
           },
           "positions"_a, "Encodes (and on a real device runs) one batched step of rows at `positions`; counters and\n"
           "traffic.")
      .def("count_chunk",
           [](Runtime& rt, uint32_t position, uint32_t rows) {
             Traffic t;
             gpu::Counters c = rt.count_chunk(position, rows, &t);
             return runtime_counters_dict(c, t);
           },
           "position"_a, "rows"_a, "Encodes (and on a real device runs) one prefill chunk; counters and traffic.");
}

}  // namespace lily::runtime
