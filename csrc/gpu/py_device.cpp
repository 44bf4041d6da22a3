// Python access to the device layer (lily._core.Device, Buffer, CommandBuffer,
// ComputePass). Bindings only: validation and logic live in gpu/device.* and gpu/sim/*.
#include "gpu/py_device.h"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "gpu/device.h"
#ifdef LILY_HAVE_SIM
#include "gpu/sim/sim_device.h"
#endif
#ifdef LILY_HAVE_METAL
#include "gpu/metal/metal_device.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::gpu {
namespace {

Size3 to_size3(nb::handle h, const char* what) {
  std::vector<long long> v;
  if (nb::isinstance<nb::int_>(h)) {
    v.push_back(nb::cast<long long>(h));
  } else {
    for (nb::handle x : h) v.push_back(nb::cast<long long>(x));
  }
  if (v.empty() || v.size() > 3)
    throw std::invalid_argument(std::string(what) + " must be an int or a sequence of 1 to 3 ints");
  for (long long x : v)
    if (x < 0 || x > 0xffffffffll)
      throw std::invalid_argument(std::string(what) + " has a dimension out of range: " + std::to_string(x));
  Size3 s;
  s.x = uint32_t(v[0]);
  if (v.size() > 1) s.y = uint32_t(v[1]);
  if (v.size() > 2) s.z = uint32_t(v[2]);
  return s;
}

// (buffer, offset, size) or buffer (whole buffer) -> Range
Range to_range(nb::handle h) {
  Range r;
  if (nb::isinstance<Buffer>(h)) {
    Buffer& b = nb::cast<Buffer&>(h);
    r.buffer = &b;
    r.size = b.size();
    return r;
  }
  nb::tuple t = nb::cast<nb::tuple>(h);
  if (t.size() != 3 && t.size() != 4)
    throw std::invalid_argument("a declared range is a Buffer or a (Buffer, offset, size[, disjoint tag]) tuple");
  Buffer& b = nb::cast<Buffer&>(t[0]);
  long long off = nb::cast<long long>(t[1]), size = nb::cast<long long>(t[2]);
  if (off < 0 || size < 0) throw std::invalid_argument("declared range offset/size must be >= 0");
  r.buffer = &b;
  r.offset = size_t(off);
  r.size = size_t(size);
  if (t.size() == 4) {
    const long long tag = nb::cast<long long>(t[3]);
    if (tag < 0 || tag > 0xFFFFFFFFll) throw std::invalid_argument("a range's disjoint tag must be in [0, 2^32)");
    r.disjoint = uint32_t(tag);
  }
  return r;
}

const char* status_name(Status s) {
  switch (s) {
    case Status::encoding: return "encoding";
    case Status::committed: return "committed";
    case Status::completed: return "completed";
    case Status::error: return "error";
  }
  return "?";
}

struct PendingCall {
  PyObject* fn;
  Status status;
  std::string message;
};

int run_pending(void* arg) {
  PendingCall* p = static_cast<PendingCall*>(arg);
  PyObject* res = PyObject_CallFunction(p->fn, "ss", status_name(p->status), p->message.c_str());
  if (!res) PyErr_WriteUnraisable(p->fn);
  Py_XDECREF(res);
  Py_DECREF(p->fn);
  delete p;
  return 0;
}

void do_dispatch(ComputePass& pass, const std::string& kernel, nb::handle grid,
                 nb::handle threadgroup, nb::handle buffers, nb::handle constants,
                 nb::handle threadgroup_memory, nb::handle reads, nb::handle writes,
                 bool threadgroups, const std::string& label) {
  Dispatch d;
  d.pipeline = &pass.device().pipeline(kernel);
  d.grid = to_size3(grid, "grid");
  d.threadgroup = to_size3(threadgroup, "threadgroup");
  d.grid_is_threadgroups = threadgroups;
  d.label = label;
  if (!buffers.is_none())
    for (nb::handle item : buffers) {
      nb::tuple t = nb::cast<nb::tuple>(item);
      if (t.size() != 2 && t.size() != 3)
        throw std::invalid_argument("buffers entries are (index, Buffer) or (index, Buffer, offset)");
      long long idx = nb::cast<long long>(t[0]);
      long long off = t.size() == 3 ? nb::cast<long long>(t[2]) : 0;
      if (idx < 0 || off < 0) throw std::invalid_argument("buffer index and offset must be >= 0");
      d.bindings.push_back(Binding::buf(uint32_t(idx), nb::cast<Buffer&>(t[1]), size_t(off)));
    }
  if (!constants.is_none())
    for (nb::handle item : constants) {
      nb::tuple t = nb::cast<nb::tuple>(item);
      if (t.size() != 2) throw std::invalid_argument("constants entries are (index, bytes)");
      long long idx = nb::cast<long long>(t[0]);
      if (idx < 0) throw std::invalid_argument("constant index must be >= 0");
      nb::bytes b = nb::cast<nb::bytes>(t[1]);
      d.bindings.push_back(Binding::constant_bytes(uint32_t(idx), b.c_str(), b.size()));
    }
  if (!threadgroup_memory.is_none())
    for (nb::handle item : threadgroup_memory) {
      nb::tuple t = nb::cast<nb::tuple>(item);
      if (t.size() != 2) throw std::invalid_argument("threadgroup_memory entries are (index, length)");
      long long idx = nb::cast<long long>(t[0]), len = nb::cast<long long>(t[1]);
      if (idx < 0 || len < 0) throw std::invalid_argument("threadgroup memory index/length must be >= 0");
      d.bindings.push_back(Binding::threadgroup(uint32_t(idx), size_t(len)));
    }
  if (!reads.is_none())
    for (nb::handle item : reads) d.reads.push_back(to_range(item));
  if (!writes.is_none())
    for (nb::handle item : writes) d.writes.push_back(to_range(item));
  pass.dispatch(d);
}

}  // namespace

nb::dict counters_dict(const Counters& c, bool declared) {
  nb::dict d;
  d["dispatches"] = c.dispatches;
  d["barrier_stages"] = c.barrier_stages;
  d[declared ? "declared_bytes_read" : "bytes_read"] = c.bytes_read;
  d[declared ? "declared_bytes_written" : "bytes_written"] = c.bytes_written;
  d["passes"] = c.passes;
  d["copies"] = c.copies;
  d["bytes_copied"] = c.bytes_copied;
  return d;
}

nb::dict record_dict(const DispatchRecord& r) {
  nb::dict d;
  d["label"] = r.label;
  d["kernel"] = r.kernel;
  d["groups"] = nb::make_tuple(r.groups.x, r.groups.y, r.groups.z);
  d["threads"] = nb::make_tuple(r.threads.x, r.threads.y, r.threads.z);
  d["threadgroup_memory"] = r.threadgroup_memory;
  d["pass"] = r.pass;
  d["stage"] = r.stage;
  d["bytes_read"] = r.bytes_read;
  d["bytes_written"] = r.bytes_written;
  return d;
}

void bind_device(nb::module_& m) {
  // A device's failure at run time (a Metal command buffer in error, a simulator kernel fault):
  // RuntimeError as before, with its own type so the CLI can report it without a traceback.
  // HazardError derives from it, in C++ and in Python (later translators are tried first).
  nb::exception<Error> gpu_error(m, "GpuError", PyExc_RuntimeError);
  nb::exception<HazardError>(m, "HazardError", gpu_error);

  nb::class_<Buffer>(m, "Buffer", "Device memory (shared storage).")
      .def_prop_ro("size", &Buffer::size)
      .def_prop_ro("id", &Buffer::id)
      .def_prop_rw("label", &Buffer::label, &Buffer::set_label)
      .def("write",
           [](Buffer& b, nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu> a, size_t offset) {
             size_t n = a.nbytes();
             if (!b.contents()) throw std::invalid_argument("write: the buffer has no storage (record-only device)");
             if (offset > b.size() || n > b.size() - offset)
               throw std::invalid_argument("write: " + std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                                           " exceed the buffer's " + std::to_string(b.size()) + " bytes");
             std::memcpy(static_cast<unsigned char*>(b.contents()) + offset, a.data(), n);
           },
           "array"_a, "offset"_a = 0, "Copies a C-contiguous array into the buffer at a byte offset.")
      .def("read",
           [](Buffer& b, size_t offset, long long size) {
             if (!b.contents()) throw std::invalid_argument("read: the buffer has no storage (record-only device)");
             size_t n = size < 0 ? (offset <= b.size() ? b.size() - offset : 0) : size_t(size);
             if (offset > b.size() || n > b.size() - offset)
               throw std::invalid_argument("read: range exceeds the buffer's " + std::to_string(b.size()) + " bytes");
             return nb::bytes(static_cast<const char*>(b.contents()) + offset, n);
           },
           "offset"_a = 0, "size"_a = -1, "Copies bytes out of the buffer.");

  nb::class_<ComputePass>(m, "ComputePass", "A concurrent compute pass; barriers come from declared ranges.")
      .def("dispatch", &do_dispatch, "kernel"_a, "grid"_a, "threadgroup"_a, "buffers"_a = nb::none(),
           "constants"_a = nb::none(), "threadgroup_memory"_a = nb::none(), "reads"_a = nb::none(),
           "writes"_a = nb::none(), "threadgroups"_a = false, "label"_a = "",
           "Encodes one dispatch of a kernel (by host name). grid counts threads, or threadgroups\n"
           "when threadgroups=True. buffers: [(index, Buffer[, offset])]; constants: [(index, bytes)];\n"
           "threadgroup_memory: [(index, length)]; reads/writes: [Buffer | (Buffer, offset, size)]; a write may\n"
           "carry a 4th item, a nonzero tag: writes with equal tags are disjoint by construction (no barrier).")
      .def("barrier", &ComputePass::barrier)
      .def("end", &ComputePass::end)
      .def_prop_ro("manual_barriers", [](ComputePass& p) { return p.mode() == BarrierMode::manual; });

  nb::class_<CommandBuffer>(m, "CommandBuffer")
      .def("compute_pass",
           [](CommandBuffer& cb, bool manual) {
             return &cb.compute_pass(manual ? BarrierMode::manual : BarrierMode::automatic);
           },
           "manual_barriers"_a = false, nb::rv_policy::reference_internal)
      .def("copy", &CommandBuffer::copy, "src"_a, "src_offset"_a, "dst"_a, "dst_offset"_a, "size"_a,
           "Copies size bytes of src at src_offset to dst at dst_offset on the device, in encoding\n"
           "order (ends the current compute pass). Offsets and size: multiples of 4; ValueError\n"
           "for ranges outside their buffers or overlapping in one buffer.")
      .def("commit", &CommandBuffer::commit)
      .def("wait", [](CommandBuffer& cb) {
        {
          nb::gil_scoped_release g;
          try {
            cb.wait();
          } catch (...) {
            nb::gil_scoped_acquire a;
            Py_MakePendingCalls();
            throw;
          }
        }
        if (Py_MakePendingCalls() != 0) throw nb::python_error();
      })
      .def("on_completed",
           [](CommandBuffer& cb, nb::callable fn) {
             PyObject* f = fn.ptr();
             Py_INCREF(f);
             cb.on_completed([f](Status s, const std::string& msg) {
               auto* p = new PendingCall{f, s, msg};
               if (Py_AddPendingCall(&run_pending, p) != 0) delete p;  // queue full: drop
             });
           },
           "fn"_a, "fn(status: str, error: str) runs on the main thread after completion (by the next wait()).")
      .def_prop_ro("status", [](CommandBuffer& cb) { return status_name(cb.status()); })
      .def_prop_ro("gpu_seconds", &CommandBuffer::gpu_seconds,
                   "Seconds the device spent executing it, once completed (NaN before): Metal's "
                   "GPUEndTime - GPUStartTime; the simulator's execution wall time.")
      .def_prop_ro("gpu_interval", &CommandBuffer::gpu_interval,
                   "(start, end) of its execution in seconds of a host clock shared by the device's "
                   "command buffers, once completed ((nan, nan) before).")
      .def_prop_ro("counters", [](CommandBuffer& cb) { return counters_dict(cb.counters()); })
      .def_prop_ro("dispatch_log", [](CommandBuffer& cb) {
        nb::list out;
        for (const DispatchRecord& r : cb.counters().log) out.append(record_dict(r));
        return out;
      }, "Per-dispatch counters: label, kernel, threadgroups, threads per threadgroup, dynamic threadgroup "
         "memory, pass, barrier stage, declared bytes read/written.");

  nb::class_<Device>(m, "Device", "A Lily device: 'sim' (the Metal simulator) or 'metal'.")
      .def_prop_ro("name", &Device::name)
      .def("kernel_names", &Device::kernel_names)
      .def("has_kernel",
           [](Device& d, const std::string& n) {
             try {
               d.pipeline(n);
               return true;
             } catch (const UsageError&) {
               return false;
             }
           })
      .def("buffer",
           [](Device& d, long long nbytes) {
             if (nbytes < 0) throw std::invalid_argument("buffer size must be >= 0");
             return d.new_buffer(size_t(nbytes));
           },
           "nbytes"_a)
      .def("map_file", &Device::map_file, "path"_a, "offset"_a = 0, "length"_a = 0)
      .def_prop_ro("gpu_family", [](const Device& d) { return gpu_family_name(d.gpu_family()); },
                   "The GPU's Apple family: 'apple7' (M1) .. 'apple10' (M5); the simulator's is an option.")
      .def_prop_ro("allocated_bytes", &Device::allocated_bytes,
                   "Bytes of the buffers this device allocated that are still alive.")
      .def_prop_ro("supports_tensor_ops", &Device::supports_tensor_ops,
                   "Whether the Metal 4 tensor-op kernels (metal/*_tensor.metal) can be used on this device.")
      .def_prop_ro("tensor_ops_status", &Device::tensor_ops_status,
                   "Why supports_tensor_ops is False ('' when it is True).")
      .def_prop_ro("supports_bfloat_tensor_ops", &Device::supports_bfloat_tensor_ops,
                   "Whether the tensor-op kernels with bfloat operands (the prefill attention's) can be used too.")
      .def_prop_ro("bfloat_tensor_ops_status", &Device::bfloat_tensor_ops_status,
                   "Why supports_bfloat_tensor_ops is False ('' when it is True).")
      .def("pipeline_info",
           [](Device& d, const std::string& name) {
             const Pipeline& p = d.pipeline(name);
             nb::dict r;
             r["kernel"] = p.name();
             r["max_threads_per_threadgroup"] = p.max_threads_per_threadgroup();
             r["thread_execution_width"] = p.thread_execution_width();
             r["static_threadgroup_memory"] = p.static_threadgroup_memory();
             uint32_t reflected = 0;
             for (uint32_t i = 0; i < 31; ++i) reflected += p.buffer_parameter(i).alignment != 0;
             r["reflected_buffer_parameters"] = reflected;
             return r;
           },
           "name"_a,
           "Builds kernel `name`'s pipeline: its maxTotalThreadsPerThreadgroup (on the simulator the\n"
           "kernel's [[max_total_threads_per_threadgroup]], default 1024), thread execution width,\n"
           "static threadgroup memory in bytes (0 on the simulator) and how many [[buffer(n)]]\n"
           "parameters reflection described (0: buffer alignment checks are off for it).")
      .def_prop_ro("memory_limits",
                   [](const Device& d) {
                     MemoryLimits l = d.memory_limits();
                     nb::dict r;
                     r["working_set"] = l.working_set;
                     r["max_buffer"] = l.max_buffer;
                     return r;
                   },
                   "Bytes: working_set (Metal recommendedMaxWorkingSetSize) and max_buffer (maxBufferLength);\n"
                   "0 = no limit (the simulator's unless created with a budget).")
      .def("command_buffer",
           [](Device& d, bool dispatch_log) {
             nb::gil_scoped_release g;
             auto cb = d.new_command_buffer();
             cb->record_dispatches(dispatch_log);
             return cb;
           },
           "dispatch_log"_a = true, nb::keep_alive<0, 1>(),
           "A new command buffer; with dispatch_log (the default) it keeps the per-dispatch records\n"
           "CommandBuffer.dispatch_log reads (the scalar counters are always kept).")
      ;

#ifdef LILY_HAVE_SIM
  m.def("sim_device",
        [](bool record_only, const std::string& order, const std::string& thread_order, uint64_t seed, bool poison,
           bool verify_writes, bool verify_reads, const std::string& gpu_family, uint64_t working_set_bytes,
           uint64_t max_buffer_bytes, uint32_t pipeline_thread_limit, bool bfloat_tensor_ops,
           nb::handle threads, const std::map<std::string, std::string>& faults, const std::string& tensor_layout) {
          sim::SimOptions o;
          if (!threads.is_none()) {  // an int (not a bool) in 1..kMaxSimThreads
            const long most = sim::kMaxSimThreads;
            long v = 0;
            const bool is_int = nb::isinstance<nb::int_>(threads) && !nb::isinstance<nb::bool_>(threads);
            if (is_int && !nb::try_cast(threads, v)) v = 0;  // beyond a long
            if (v < 1 || v > most)
              throw std::invalid_argument("threads must be a whole number of OS threads, 1.." +
                                          std::to_string(most) + " (1: the serial simulator), not " +
                                          nb::repr(threads).c_str());
            o.threads = unsigned(v);
          }
          for (const auto& [kernel, fault] : faults) {
            const bool limit = !fault.empty() && fault.size() <= 4 &&
                               fault.find_first_not_of("0123456789") == std::string::npos && std::stoul(fault) > 0;
            if (fault != "build" && fault != "wrong" && !limit)
              throw std::invalid_argument("faults['" + kernel + "'] must be 'build', 'wrong' or a thread limit 1..9999, "
                                          "not '" + fault + "'");
          }
          o.faults = faults;
          o.bfloat_tensor_ops = bfloat_tensor_ops;
          o.tensor_layout = tensor_layout;
          o.pipeline_thread_limit = pipeline_thread_limit;
          o.working_set_bytes = working_set_bytes;
          o.max_buffer_bytes = max_buffer_bytes;
          o.gpu_family = parse_gpu_family(gpu_family);
          o.record_only = record_only;
          auto parse = [](const std::string& v, const char* what) {
            if (v == "forward") return sim::StageOrder::forward;
            if (v == "reverse") return sim::StageOrder::reverse;
            if (v == "random") return sim::StageOrder::random;
            throw std::invalid_argument(std::string(what) + " must be 'forward', 'reverse' or 'random', not '" + v + "'");
          };
          o.order = parse(order, "order");
          o.thread_order = parse(thread_order, "thread_order");
          o.seed = seed;
          o.poison = poison;
          o.verify_writes = verify_writes;
          o.verify_reads = verify_reads;
          return std::shared_ptr<Device>(sim::make_sim_device(o));
        },
        "record_only"_a = false, "order"_a = "forward", "thread_order"_a = "forward", "seed"_a = 0, "poison"_a = true,
        "verify_writes"_a = false, "verify_reads"_a = false, "gpu_family"_a = "apple9", "working_set_bytes"_a = 0,
        "max_buffer_bytes"_a = 0, "pipeline_thread_limit"_a = 0, "bfloat_tensor_ops"_a = true,
        "threads"_a.none() = nb::none(),
        "faults"_a = std::map<std::string, std::string>{}, "tensor_layout"_a = "sim",
        "The Metal simulator: runs metal/*.metal on the CPU with Metal's execution model.\n"
        "gpu_family ('apple7'..'apple10') is the family it reports; 'apple10' offers the Metal 4\n"
        "tensor-op kernels (metal/*_tensor.metal), as an M5 does; bfloat_tensor_ops=False leaves out\n"
        "those with bfloat operands (the prefill attention's), as a tensor library without them.\n"
        "tensor_layout: where cooperative-tensor elements lie: 'sim' (default), an adversarial layout\n"
        "that catches kernels assuming one; 'nax', the M5's 16 x 16 fragment layout of\n"
        "execution_simdgroup tiles with extents multiples of 16, which MLX's NAX kernels assume\n"
        "(other scopes and shapes keep 'sim'); accepted with every gpu_family, used by apple10's\n"
        "tensor-op kernels only. Another value is a ValueError.\n"
        "working_set_bytes / max_buffer_bytes: the memory budget it reports (Device.memory_limits;\n"
        "0 = none), as a Mac's GPU does.\n"
        "pipeline_thread_limit caps every pipeline's thread limit below the kernel's declared one, as\n"
        "register pressure may on a Mac (0 = none).\n"
        "threads: the OS threads running threadgroups (None: sim_default_threads(), i.e.\n"
        "$LILY_SIM_THREADS or every CPU; 1: one after another, the serial simulator).\n"
        "faults: {kernel: 'build' | 'wrong' | thread limit as a string} injects a pipeline that does not\n"
        "build, wrong results, or a lower thread limit into named kernels (tests of the fallbacks).");
  m.def("sim_default_threads", &sim::default_sim_threads,
        "The threads a sim_device() takes by default: $LILY_SIM_THREADS if set, else the CPUs this\n"
        "process may run on. A bad $LILY_SIM_THREADS is a ValueError naming it.");
#endif
#ifdef LILY_HAVE_METAL
  m.def("metal_device",
        [](const std::string& metallib) { return std::shared_ptr<Device>(metal::make_metal_device(metallib)); },
        "metallib"_a = "", "The system's Metal GPU with lily.metallib (from beside this module by default).");
#endif
  m.def("is_bfloat_tensor_kernel", &is_bfloat_tensor_kernel, "name"_a,
        "Whether tensor-library kernel `name` runs tensor operations on bfloat operands (the naming rule "
        "the Metal device uses to leave them out when the system lacks them).");
  m.def("gpu_family", [](const Device& d) { return gpu_family_name(d.gpu_family()); }, "device"_a,
        "The device's GPU family, 'apple7' .. 'apple10' (same as Device.gpu_family).");
}

}  // namespace lily::gpu
