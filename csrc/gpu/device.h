// The device interface: one API over the Metal backend (csrc/gpu/metal) and the Metal
// simulator (csrc/gpu/sim). Plain C++17; no Objective-C types cross this header.
//
// Model (mirrors Metal):
//   Device         owns buffers, pipelines (looked up by kernel host name) and one queue.
//   Buffer         shared-storage memory visible to host and kernels; may wrap a
//                  page-aligned mmapped file region without copying.
//   CommandBuffer  a list of compute passes; commit() hands it to the queue (in order),
//                  wait() blocks until it completed and rethrows its error, completion
//                  callbacks run when it completes. At most kMaxInFlight are outstanding.
//   ComputePass    a concurrent compute encoder. Every dispatch declares the buffer ranges
//                  it reads and writes; the pass derives barriers from them (a dispatch
//                  that conflicts RAW/WAR/WAW with one in the current stage starts a new
//                  stage). With BarrierMode::manual the caller places barriers and a
//                  conflict inside one stage is a HazardError naming both dispatches.
//   copy           CommandBuffer::copy, a buffer-to-buffer copy on the device (Metal: a
//                  blit encoder); it ends the current compute pass and is ordered after
//                  everything encoded before it and before everything encoded after it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace lily::gpu {

// Errors. Messages name the kernel, buffer, binding or geometry at fault.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Two dispatches in one barrier stage conflict (RAW/WAR/WAW), or a dispatch wrote
// outside its declared ranges (simulator's verify_writes mode).
struct HazardError : Error {
  using Error::Error;
};
// Bad arguments from the caller (unknown kernel, bad geometry, missing binding...).
struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct Size3 {
  uint32_t x = 1, y = 1, z = 1;
  uint64_t count() const { return uint64_t(x) * y * z; }
};

class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual size_t size() const = 0;
  // Host pointer to the storage (shared storage mode). nullptr on a record-only device.
  virtual void* contents() = 0;
  // Process-unique id, stable for the buffer's lifetime (used in messages and counters).
  virtual uint64_t id() const = 0;
  virtual std::string label() const = 0;
  virtual void set_label(const std::string& label) = 0;
};
using BufferPtr = std::shared_ptr<Buffer>;

// What a backend knows about a kernel's [[buffer(n)]] parameter.
struct BufferParameter {
  // Required alignment of the bound offset in bytes: the alignment of the parameter's
  // pointee type (Metal requires it; a misaligned vector access may fault). 0 = unknown.
  size_t alignment = 0;
  std::string declaration;  // e.g. "device const uint4* w" (for messages; may be empty)
};

class Pipeline {
 public:
  virtual ~Pipeline() = default;
  virtual const std::string& name() const = 0;
  virtual uint32_t max_threads_per_threadgroup() const = 0;
  virtual uint32_t thread_execution_width() const = 0;  // 32 on Apple GPUs
  // The kernel's [[buffer(index)]] parameter; alignment 0 when the kernel has none there
  // or the backend cannot tell.
  virtual BufferParameter buffer_parameter(uint32_t index) const { return {}; }
  // Bytes of threadgroup memory the kernel declares statically (Metal:
  // staticThreadgroupMemoryLength). 0 on the simulator, which allocates threadgroup
  // variables when a dispatch first reaches them.
  virtual uint64_t static_threadgroup_memory() const { return 0; }
};

// The memory a device offers, in bytes; 0 = no limit known.
struct MemoryLimits {
  uint64_t working_set = 0;  // Metal: recommendedMaxWorkingSetSize (GPU-resident memory budget)
  uint64_t max_buffer = 0;   // Metal: maxBufferLength (largest single buffer)
};

// A declared byte range of a buffer that a dispatch reads or writes.
struct Range {
  const Buffer* buffer = nullptr;
  size_t offset = 0;
  size_t size = 0;
  // Write ranges only. Nonzero: dispatches declaring writes with the same tag write disjoint
  // elements of the range (e.g. the tile classes of one grouped expert GEMM, each over its own
  // tiles), so two such writes are no write-after-write conflict; reads still conflict.
  uint32_t disjoint = 0;
  bool overlaps(const Range& o) const {
    return buffer == o.buffer && size && o.size && offset < o.offset + o.size &&
           o.offset < offset + size;
  }
};

// One argument-table entry: [[buffer(index)]] bound to a buffer+offset or to inline
// constant bytes (setBytes), or [[threadgroup(index)]] given a dynamic memory length.
struct Binding {
  enum class Kind { buffer, bytes, threadgroup_memory };
  Kind kind = Kind::buffer;
  uint32_t index = 0;
  const Buffer* buffer = nullptr;  // Kind::buffer
  size_t offset = 0;               // Kind::buffer
  std::vector<uint8_t> bytes;      // Kind::bytes (at most 4 KiB, as Metal)
  size_t length = 0;               // Kind::threadgroup_memory

  static Binding buf(uint32_t index, const Buffer& b, size_t offset = 0) {
    Binding r; r.kind = Kind::buffer; r.index = index; r.buffer = &b; r.offset = offset;
    return r;
  }
  static Binding constant_bytes(uint32_t index, const void* p, size_t n) {
    Binding r; r.kind = Kind::bytes; r.index = index;
    r.bytes.assign(static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
    return r;
  }
  static Binding threadgroup(uint32_t index, size_t length) {
    Binding r; r.kind = Kind::threadgroup_memory; r.index = index; r.length = length;
    return r;
  }
};

struct Dispatch {
  const Pipeline* pipeline = nullptr;
  // grid counts threads (dispatchThreads: edge threadgroups may be partial) unless
  // grid_is_threadgroups, then it counts threadgroups (dispatchThreadgroups).
  Size3 grid;
  Size3 threadgroup;
  bool grid_is_threadgroups = false;
  std::vector<Binding> bindings;
  std::vector<Range> reads, writes;
  std::string label;  // for messages; defaults to the kernel name
};

// One dispatch as counted: for per-dispatch performance counters.
struct DispatchRecord {
  std::string label;     // "<label or kernel> (#<index in pass>)"
  std::string kernel;    // the pipeline's host name
  uint32_t pass = 0;     // index of the pass in the command buffer
  uint32_t stage = 0;    // barrier stage within the command buffer (0-based)
  uint64_t bytes_read = 0, bytes_written = 0;
  Size3 groups;          // threadgroups launched (a dispatchThreads grid rounded up)
  Size3 threads;         // threads per threadgroup as dispatched
  // Dynamic [[threadgroup(n)]] lengths; arrays a kernel declares itself are not visible here.
  uint64_t threadgroup_memory = 0;
  // Inline constant bytes (the kernel's argument structs) by [[buffer(n)]] index.
  std::vector<std::pair<uint32_t, std::vector<uint8_t>>> args;
  // Declared ranges as (buffer label, bytes), in declaration order.
  std::vector<std::pair<std::string, uint64_t>> reads, writes;
};

struct Counters {
  uint64_t dispatches = 0;
  uint64_t barrier_stages = 0;  // barrier-free stages (a pass with k barriers has k+1)
  uint64_t bytes_read = 0;      // sum of declared read ranges
  uint64_t bytes_written = 0;   // sum of declared write ranges
  uint64_t passes = 0;
  uint64_t copies = 0;          // CommandBuffer::copy calls (not counted in bytes_read/written)
  uint64_t bytes_copied = 0;
  // One entry per dispatch, in encoding order, when the command buffer records dispatches
  // (CommandBuffer::record_dispatches); empty otherwise.
  std::vector<DispatchRecord> log;
  Counters& operator+=(const Counters& o) {
    log.insert(log.end(), o.log.begin(), o.log.end());
    dispatches += o.dispatches; barrier_stages += o.barrier_stages;
    bytes_read += o.bytes_read; bytes_written += o.bytes_written; passes += o.passes;
    copies += o.copies; bytes_copied += o.bytes_copied;
    return *this;
  }
};

// Derives barriers from declared ranges. Shared by every backend. Entries hold buffer ids,
// not pointers, so a buffer released mid-pass cannot alias a new one. Storage is reused
// from stage to stage: tracking a dispatch formats nothing and, once the stage's vectors
// have grown, allocates nothing (a label longer than the string's small buffer excepted).
class StageTracker {
 public:
  struct Span {
    uint64_t buffer_id = 0;
    size_t offset = 0, size = 0;
    uint32_t disjoint = 0;  // Range::disjoint
    bool overlaps(const Span& o) const {
      return buffer_id == o.buffer_id && size && o.size && offset < o.offset + o.size &&
             o.offset < offset + size;
    }
  };
  // A dispatch of the current stage, for hazard messages: its label as given (the kernel
  // name when none was) and its index in the pass; its spans are
  // spans_[first, first + n_reads) (reads) then n_writes more (writes).
  struct Entry {
    std::string label;
    uint64_t index = 0;
    size_t first = 0, n_reads = 0, n_writes = 0;
  };
  // The first conflict of d with an entry of the current stage: RAW, WAR or WAW. mine is
  // d's declared range (its buffer is alive); theirs lies in the same buffer.
  struct Conflict {
    const Entry* entry = nullptr;
    const char* kind = nullptr;  // "read-after-write", "write-after-read", "write-after-write"
    const Range* mine = nullptr;
    Span theirs;
  };
  Conflict conflict(const Dispatch& d) const;
  void add(const Dispatch& d, uint64_t index);
  void new_stage() {
    used_ = 0;
    spans_.clear();
  }
  bool empty() const { return used_ == 0; }
  static Span span(const Range& r);

 private:
  std::vector<Entry> entries_;  // entries_[0, used_) are the current stage's; the rest keep their storage
  size_t used_ = 0;
  std::vector<Span> spans_;
};

enum class BarrierMode {
  automatic,  // barriers derived from the declared ranges
  manual,     // caller calls barrier(); a conflict within one stage is a HazardError
};

class ComputePass {
 public:
  virtual ~ComputePass() = default;
  // Validates (declared ranges inside their buffers; buffer offsets aligned to the
  // kernel parameters' types; then the backend's validate()), derives a barrier if needed,
  // records counters, then encodes.
  // Works on d in place: it formats the "<label> (#<index>)" display label only for an
  // error message or a DispatchRecord.
  void dispatch(const Dispatch& d);
  // Hand-placed barrier (only meaningful with BarrierMode::manual; harmless otherwise).
  void barrier();
  void end();
  bool ended() const { return ended_; }
  BarrierMode mode() const { return mode_; }
  class Device& device() const { return *device_; }

 protected:
  // counters (may be null) receives the scalar counts; with log, a DispatchRecord per
  // dispatch too (CommandBuffer::record_dispatches).
  ComputePass(class Device* device, BarrierMode mode, Counters* counters, bool log)
      : device_(device), mode_(mode), counters_(counters), log_(log) {}
  // "<label or kernel> (#<index in pass>)" of the dispatch being validated, for messages (DispatchRecord::label has the same form).
  std::string display_label(const Dispatch& d) const;
  // Checks geometry and bindings; throws UsageError. Runs before anything is recorded,
  // so a rejected dispatch leaves the pass and its counters unchanged.
  virtual void validate(const Dispatch& d) = 0;
  virtual void encode_dispatch(const Dispatch& d) = 0;  // after validate(d)
  virtual void encode_barrier() = 0;
  virtual void encode_end() = 0;

 private:
  void start_stage();
  class Device* device_;
  BarrierMode mode_;
  Counters* counters_;
  bool log_;
  StageTracker tracker_;
  bool ended_ = false;
  bool any_dispatch_ = false;
  uint64_t dispatch_index_ = 0;
};

enum class Status { encoding, committed, completed, error };

class CommandBuffer {
 public:
  virtual ~CommandBuffer() = default;
  // Begins a concurrent compute pass; the previous pass, if any, is ended first.
  virtual ComputePass& compute_pass(BarrierMode mode = BarrierMode::automatic) = 0;
  virtual void commit() = 0;
  // Blocks until completed; rethrows the execution error (as Error) if it failed.
  virtual void wait() = 0;
  // Runs fn(status, error_message) on completion (on the queue's thread). Register
  // before commit. fn must not throw.
  virtual void on_completed(std::function<void(Status, const std::string&)> fn) = 0;
  virtual Status status() const = 0;
  // When the device started and finished executing this command buffer, in seconds of a
  // host clock shared by the device's command buffers, once it completed ({NaN, NaN}
  // before): on Metal GPUStartTime / GPUEndTime (host time, Apple's MTLCommandBuffer docs);
  // on the simulator its worker's steady clock. Intervals of consecutive command buffers may
  // overlap on a GPU; gpu_seconds() is one buffer's length.
  virtual std::pair<double, double> gpu_interval() const = 0;
  double gpu_seconds() const {
    const auto [start, end] = gpu_interval();
    return end - start;
  }
  virtual const Counters& counters() const = 0;
  // Keep a DispatchRecord per dispatch in counters().log, for the passes begun after this
  // call. Off by default: building records costs strings and vectors on every dispatch, and
  // only estimates, load-time checks and inspection read them; the scalar counters are
  // always kept.
  void record_dispatches(bool on = true) { log_dispatches_ = on; }
  bool records_dispatches() const { return log_dispatches_; }
  // Copies [src_offset, src_offset+size) of src to dst at dst_offset on the device (Metal:
  // MTLBlitCommandEncoder copyFromBuffer), after all work encoded before it in this command
  // buffer and before all work encoded after it (it ends the current compute pass: passes
  // and copies run in encoding order, so no barrier is needed). The buffers may come from
  // another Device of the same backend (Metal: the same MTLDevice). Throws UsageError for a
  // range outside its buffer, offsets or size not multiples of 4 (Metal on macOS), ranges
  // of one buffer that overlap, buffers of another backend, or a committed command buffer.
  // size 0 does nothing.
  void copy(const Buffer& src, size_t src_offset, const Buffer& dst, size_t dst_offset, size_t size);

 protected:
  // After copy() checked the ranges; counts the copy in counters() and encodes it.
  virtual void encode_copy(const Buffer& src, size_t src_offset, const Buffer& dst, size_t dst_offset,
                           size_t size) = 0;

 private:
  bool log_dispatches_ = false;
};

class Device {
 public:
  static constexpr int kMaxInFlight = 2;  // command buffers outstanding at once

  virtual ~Device() = default;
  virtual std::string name() const = 0;
  // New shared-storage buffer (contents undefined; the simulator poisons them with NaN).
  virtual BufferPtr new_buffer(size_t bytes) = 0;
  // Wraps page-aligned host memory without copying; release() runs when the buffer dies.
  virtual BufferPtr new_buffer_no_copy(void* ptr, size_t bytes,
                                       std::function<void()> release) = 0;
  // Maps [offset, offset+length) of a file read-only and wraps it without copying.
  // offset must be a multiple of the page size; length 0 means "to the end".
  BufferPtr map_file(const std::string& path, size_t offset = 0, size_t length = 0);
  // Looks a kernel up by host name; throws UsageError naming it when unknown.
  virtual const Pipeline& pipeline(const std::string& name) = 0;
  virtual std::vector<std::string> kernel_names() const = 0;
  virtual std::unique_ptr<CommandBuffer> new_command_buffer() = 0;

  // The GPU's Apple family N (MTLGPUFamilyAppleN): 7 = M1, 8 = M2, 9 = M3/M4, 10 = M5
  // (per-core neural accelerators). The simulator reports the family it was created with.
  virtual int gpu_family() const = 0;
  // Whether the Metal 4 tensor-operation kernels (metal/*_tensor.metal; on a Mac the
  // lily_tensor_<family>.metallib files) can be used: an apple10-family GPU, macOS 26, at
  // least one tensor library built and loaded, not disabled by LILY_DISABLE_TENSOR_OPS. A
  // family whose library is missing offers no kernels. Prefill picks its GEMM kernels
  // (*_tensor twins or simdgroup_matrix) with this.
  virtual bool supports_tensor_ops() const = 0;
  // Why supports_tensor_ops() is false, for messages and benchmarks ("" when it is true).
  virtual std::string tensor_ops_status() const = 0;
  // Whether the tensor-op kernels with bfloat operands (the prefill attention's,
  // metal/attention_prefill_tensor.metal) can be used too: supports_tensor_ops() and the
  // system's tensor-op library takes bfloat operands (MacOSX 26.1's operand table lists
  // them, 26.0's does not). When only this is false, prefill keeps the tensor-op GEMMs and
  // runs the simdgroup_matrix attention.
  virtual bool supports_bfloat_tensor_ops() const = 0;
  // Why supports_bfloat_tensor_ops() is false ("" when it is true; tensor_ops_status() when
  // supports_tensor_ops() is false).
  virtual std::string bfloat_tensor_ops_status() const = 0;
  // Bytes of the buffers this device allocated with new_buffer that are still alive (no-copy
  // wrappers and file mappings are not counted); on Metal, MTLDevice.currentAllocatedSize.
  virtual uint64_t allocated_bytes() const = 0;
  // The memory budget: on Metal the device's recommended working set and largest buffer;
  // the simulator reports the budget it was created with (SimOptions, none by default).
  virtual MemoryLimits memory_limits() const = 0;
};

// "apple10" for 10, etc.
std::string gpu_family_name(int family);
// Parses "apple7".."apple10"; throws UsageError otherwise.
int parse_gpu_family(const std::string& name);
// The Apple family from which Metal 4 tensor operations are used (M5: neural accelerators).
constexpr int kTensorOpsFamily = 10;
// Whether tensor-library kernel `name` runs tensor operations on bfloat operands: every
// prefill tensor kernel (*_tensor: the GEMMs and the attention) and both probes. A naming
// rule, for the Metal device, whose library does not say; the simulator marks them from the
// source, and tests/test_sim_tensor.py checks the two agree on every shipped kernel.
bool is_bfloat_tensor_kernel(const std::string& name);

size_t page_size();

}  // namespace lily::gpu
