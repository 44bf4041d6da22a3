// The simulator device: buffers in host memory, pipelines from the kernel registry, a
// serial queue executed by one queue thread (its threadgroups on the executor's pool of OS
// threads), and the checks of docs/verification.md.
#include "gpu/sim/sim_device.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <random>
#include <sstream>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

#include "gpu/sim/executor.h"

namespace lily::sim {
namespace {

using gpu::Binding;
using gpu::BufferPtr;
using gpu::Counters;
using gpu::Dispatch;
using gpu::Error;
using gpu::Status;
using gpu::UsageError;

std::atomic<uint64_t> g_next_buffer_id{1};

class SimBuffer : public gpu::Buffer, public std::enable_shared_from_this<SimBuffer> {
 public:
  // `live` counts the bytes of the device's new_buffer allocations still alive.
  SimBuffer(size_t size, bool allocate, bool poison, std::shared_ptr<std::atomic<uint64_t>> live)
      : size_(size), id_(g_next_buffer_id++), live_(std::move(live)) {
    if (allocate) {
      // Aligned for every MSL type, as a Metal buffer is; followed by the guard zone (exact
      // size under ASan, so it sees overruns).
      void* mem = nullptr;
      if (posix_memalign(&mem, kBindingAlignment, (size ? size : 1) + kGuardBytes) != 0) throw std::bad_alloc();
      owned_.reset(static_cast<unsigned char*>(mem));
      std::memset(owned_.get(), poison ? kPoison : 0, size);
      set_guard(owned_.get() + size);
      data_ = owned_.get();
    }
    *live_ += size_;
  }
  SimBuffer(void* p, size_t size, std::function<void()> release)
      : size_(size), id_(g_next_buffer_id++), data_(static_cast<unsigned char*>(p)),
        release_(std::move(release)) {}
  ~SimBuffer() override {
    if (release_) release_();
    if (live_) *live_ -= size_;
  }
  size_t size() const override { return size_; }
  void* contents() override { return data_; }
  unsigned char* data() const { return data_; }
  bool owned() const { return owned_ != nullptr; }  // no-copy buffers may be read-only maps
  // False (and the zone restored) when a kernel wrote into the guard zone past the end.
  bool guard_intact() { return !owned_ || check_guard(owned_.get() + size_); }
  uint64_t id() const override { return id_; }
  std::string label() const override {
    std::lock_guard<std::mutex> g(mu_);
    return label_;
  }
  void set_label(const std::string& l) override {
    std::lock_guard<std::mutex> g(mu_);
    label_ = l;
  }

 private:
  size_t size_;
  uint64_t id_;
  struct Free {
    void operator()(unsigned char* p) const { std::free(p); }
  };
  std::unique_ptr<unsigned char, Free> owned_;
  unsigned char* data_ = nullptr;
  std::function<void()> release_;
  std::shared_ptr<std::atomic<uint64_t>> live_;
  mutable std::mutex mu_;
  std::string label_;
};

class SimPipeline : public gpu::Pipeline {
 public:
  SimPipeline(const KernelInfo& k, uint32_t cap) : k_(k), max_threads_(cap ? std::min(cap, k.max_threads) : k.max_threads) {}
  const std::string& name() const override { return k_.name; }
  uint32_t max_threads_per_threadgroup() const override { return max_threads_; }
  uint32_t thread_execution_width() const override { return kSimdWidth; }
  const KernelInfo& kernel() const { return k_; }
  gpu::BufferParameter buffer_parameter(uint32_t index) const override {
    gpu::BufferParameter r;
    for (const ParamInfo& p : k_.params)
      if (p.attr == Attr::buffer && p.index == index) {
        r.alignment = p.align;
        r.declaration = p.decl ? p.decl : "";
      }
    return r;
  }

 private:
  const KernelInfo& k_;
  uint32_t max_threads_;
};

// Inline constant bytes, stored aligned for every MSL type (std::vector's storage is only
// aligned to alignof(max_align_t)).
struct AlignedBytes {
  struct alignas(kBindingAlignment) Block {
    unsigned char b[kBindingAlignment];
  };
  std::vector<Block> blocks;
  size_t size = 0;
  void assign(const std::vector<uint8_t>& v) {
    size = v.size();
    blocks.assign((size + kBindingAlignment - 1) / kBindingAlignment, Block{});
    if (size) std::memcpy(blocks.data(), v.data(), size);
  }
  unsigned char* data() { return blocks.empty() ? nullptr : blocks.data()->b; }
};

// A dispatch as recorded: everything it needs to run later, buffers kept alive.
struct Recorded {
  const KernelInfo* kernel;
  std::string label;
  U3 groups, tg_size, threads;
  struct Buf {
    bool bound = false;
    std::shared_ptr<SimBuffer> buffer;  // or
    AlignedBytes bytes;                 // inline constant bytes
    size_t offset = 0;
  } bufs[kMaxBindings];
  size_t tg_mem[kMaxBindings] = {};
  std::vector<gpu::Range> reads, writes;
};

// A CommandBuffer::copy as recorded (source and destination kept alive).
struct CopyRecord {
  std::shared_ptr<SimBuffer> src, dst;
  size_t src_offset = 0, dst_offset = 0, size = 0;
};

// A compute pass (stages) or a run of consecutive copies; passes_ executes them in order.
struct PassRecord {
  std::vector<std::vector<Recorded>> stages;
  std::vector<CopyRecord> copies;
};

class SimDevice;

class SimCommandBuffer;

class SimPass : public gpu::ComputePass {
 public:
  SimPass(gpu::Device* dev, gpu::BarrierMode mode, Counters* counters, bool log, PassRecord* rec, bool record_only)
      : ComputePass(dev, mode, counters, log), rec_(rec), record_only_(record_only) {}

 protected:
  void validate(const Dispatch& d) override;
  void encode_dispatch(const Dispatch& d) override;
  void encode_barrier() override { rec_->stages.emplace_back(); }
  void encode_end() override {}

 private:
  PassRecord* rec_;
  bool record_only_;
  std::unique_ptr<Recorded> pending_;  // built by validate(), stored by encode_dispatch()
};

std::string kernel_where(const KernelInfo& k) { return "kernel '" + k.name + "' (" + k.where + ")"; }

void SimPass::validate(const Dispatch& d) {
  pending_.reset();
  const auto* pipe = dynamic_cast<const SimPipeline*>(d.pipeline);
  if (!pipe) throw UsageError("dispatch '" + display_label(d) + "': the pipeline does not belong to the simulator");
  const KernelInfo& k = pipe->kernel();
  auto fail = [&](const std::string& m) { throw UsageError(kernel_where(k) + ": " + m); };
  auto size3 = [](gpu::Size3 s) {
    return "(" + std::to_string(s.x) + ", " + std::to_string(s.y) + ", " + std::to_string(s.z) + ")";
  };
  // geometry
  if (!d.threadgroup.x || !d.threadgroup.y || !d.threadgroup.z)
    fail("threadgroup size " + size3(d.threadgroup) + " has a zero dimension");
  if (d.threadgroup.count() > pipe->max_threads_per_threadgroup())
    fail("threadgroup size " + size3(d.threadgroup) + " = " + std::to_string(d.threadgroup.count()) +
         " threads exceeds the pipeline's maximum of " + std::to_string(pipe->max_threads_per_threadgroup()) +
         (pipe->max_threads_per_threadgroup() < k.max_threads
              ? std::string(" (the kernel declares up to ") + std::to_string(k.max_threads) + ")"
              : std::string(" ([[max_total_threads_per_threadgroup]])")));
  if (!d.grid.x || !d.grid.y || !d.grid.z) fail("grid " + size3(d.grid) + " has a zero dimension");
  auto rp = std::make_unique<Recorded>();
  Recorded& r = *rp;
  r.kernel = &k;
  if (!record_only_) r.label = display_label(d);  // for the executor's messages; a record-only pass runs nothing
  r.tg_size = U3{d.threadgroup.x, d.threadgroup.y, d.threadgroup.z};
  uint64_t threads[3], groups[3];
  uint32_t g[3] = {d.grid.x, d.grid.y, d.grid.z}, t[3] = {d.threadgroup.x, d.threadgroup.y, d.threadgroup.z};
  for (int i = 0; i < 3; ++i) {
    if (d.grid_is_threadgroups) {
      groups[i] = g[i];
      threads[i] = uint64_t(g[i]) * t[i];
    } else {
      threads[i] = g[i];
      groups[i] = (uint64_t(g[i]) + t[i] - 1) / t[i];
    }
    if (threads[i] > 0xffffffffull) fail("grid " + size3(d.grid) + " overflows 32-bit thread positions");
  }
  r.groups = U3{uint32_t(groups[0]), uint32_t(groups[1]), uint32_t(groups[2])};
  r.threads = U3{uint32_t(threads[0]), uint32_t(threads[1]), uint32_t(threads[2])};
  // bindings
  size_t tg_total = 0;
  for (const Binding& b : d.bindings) {
    if (b.index >= kMaxBindings) fail("binding index " + std::to_string(b.index) + " is out of range (max 30)");
    switch (b.kind) {
      case Binding::Kind::buffer: {
        auto* sb = dynamic_cast<const SimBuffer*>(b.buffer);
        if (!sb) fail("buffer(" + std::to_string(b.index) + ") is null or not a simulator buffer");
        if (b.offset > sb->size())
          fail("buffer(" + std::to_string(b.index) + ") offset " + std::to_string(b.offset) +
               " is past the end of buffer #" + std::to_string(sb->id()) + " (" + std::to_string(sb->size()) + " bytes)");
        auto& rb = r.bufs[b.index];
        rb = Recorded::Buf{};
        rb.bound = true;
        rb.buffer = std::const_pointer_cast<SimBuffer>(sb->shared_from_this());
        rb.offset = b.offset;
        break;
      }
      case Binding::Kind::bytes: {
        if (b.bytes.size() > 4096)
          fail("constant bytes at buffer(" + std::to_string(b.index) + ") are " + std::to_string(b.bytes.size()) +
               " bytes; Metal allows at most 4096 (use a buffer)");
        auto& rb = r.bufs[b.index];
        rb = Recorded::Buf{};
        rb.bound = true;
        rb.bytes.assign(b.bytes);
        break;
      }
      case Binding::Kind::threadgroup_memory:
        if (b.length % 16) fail("threadgroup(" + std::to_string(b.index) + ") length " + std::to_string(b.length) + " is not a multiple of 16");
        r.tg_mem[b.index] = b.length;
        break;
    }
  }
  for (size_t i = 0; i < kMaxBindings; ++i) tg_total += r.tg_mem[i];
  if (tg_total > kMaxThreadgroupMemory)
    fail("dynamic threadgroup memory totals " + std::to_string(tg_total) + " bytes; the limit is " +
         std::to_string(kMaxThreadgroupMemory));
  if (!k.error.empty()) fail(k.error);
  for (size_t i = 0; i < k.params.size(); ++i) {
    const ParamInfo& p = k.params[i];
    if (p.attr == Attr::buffer) {
      const auto& rb = r.bufs[p.index];
      if (!rb.bound) fail("[[buffer(" + std::to_string(p.index) + ")]] is not bound");
      if (p.reference) {
        size_t avail = rb.buffer ? rb.buffer->size() - rb.offset : rb.bytes.size;
        if (avail < p.ref_size)
          fail("[[buffer(" + std::to_string(p.index) + ")]] needs " + std::to_string(p.ref_size) +
               " bytes but only " + std::to_string(avail) + " are bound");
      }
    } else if (p.attr == Attr::threadgroup) {
      if (!r.tg_mem[p.index]) fail("[[threadgroup(" + std::to_string(p.index) + ")]] memory length is not set");
    }
  }
  r.reads = d.reads;
  r.writes = d.writes;
  pending_ = std::move(rp);
}

void SimPass::encode_dispatch(const Dispatch&) {
  if (rec_->stages.empty()) rec_->stages.emplace_back();
  if (!record_only_ && pending_) rec_->stages.back().push_back(std::move(*pending_));
  pending_.reset();
}

class SimDevice : public gpu::Device {
 public:
  explicit SimDevice(const SimOptions& o) : opt_(o), rng_(o.seed) {
    if (o.gpu_family < 7 || o.gpu_family > 10)
      throw UsageError("sim_device: gpu_family must be apple7..apple10, not " + std::to_string(o.gpu_family));
    if (o.tensor_layout != "sim" && o.tensor_layout != "nax")
      throw UsageError("sim_device: tensor_layout must be 'sim' or 'nax', not '" + o.tensor_layout + "'");
    if (o.threads > kMaxSimThreads)
      throw UsageError("sim_device: threads must be 1.." + std::to_string(kMaxSimThreads) + ", not " +
                       std::to_string(o.threads));
    if (!opt_.threads) opt_.threads = default_sim_threads();
    if (!opt_.record_only) {
      exec_ = std::make_unique<Executor>(opt_.threads);
      worker_ = std::thread([this] { run(); });
    }
  }
  ~SimDevice() override {
    {
      std::unique_lock<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }
  std::string name() const override { return "sim"; }
  BufferPtr new_buffer(size_t bytes) override {
    if (opt_.max_buffer_bytes && bytes > opt_.max_buffer_bytes)
      throw Error("cannot allocate a buffer of " + std::to_string(bytes) + " bytes: the device's largest buffer is " +
                  std::to_string(opt_.max_buffer_bytes) + " bytes");
    return std::make_shared<SimBuffer>(bytes, !opt_.record_only, opt_.poison, live_);
  }
  gpu::MemoryLimits memory_limits() const override {
    return gpu::MemoryLimits{opt_.working_set_bytes, opt_.max_buffer_bytes};
  }
  BufferPtr new_buffer_no_copy(void* ptr, size_t bytes, std::function<void()> release) override {
    if (!ptr) throw UsageError("new_buffer_no_copy: null pointer");
    if (reinterpret_cast<uintptr_t>(ptr) % gpu::page_size() || bytes % gpu::page_size())
      throw UsageError("new_buffer_no_copy: pointer and length must be page-aligned (" +
                       std::to_string(gpu::page_size()) + " bytes), as Metal requires");
    return std::make_shared<SimBuffer>(ptr, bytes, std::move(release));
  }
  const gpu::Pipeline& pipeline(const std::string& name) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = pipelines_.find(name);
    if (it != pipelines_.end()) return *it->second;
    for (const KernelInfo& k : registered_kernels())
      if (k.name == name) {
        if (!k.error.empty()) throw UsageError(kernel_where(k) + ": " + k.error);
        if (k.tensor_ops && !supports_tensor_ops())
          throw UsageError(kernel_where(k) + " uses Metal 4 tensor operations, which this device does not offer: " +
                           tensor_ops_status());
        if (k.tensor_bfloat && !supports_bfloat_tensor_ops())
          throw UsageError(kernel_where(k) + " uses Metal 4 tensor operations on bfloat operands, which this device "
                           "does not offer: " + bfloat_tensor_ops_status());
        uint32_t cap = opt_.pipeline_thread_limit;
        auto fault = opt_.faults.find(name);
        if (fault != opt_.faults.end()) {
          if (fault->second == "build")
            throw Error("cannot build the pipeline for kernel '" + name + "': a fault injected by the simulator's "
                        "faults option");
          if (fault->second != "wrong") cap = uint32_t(std::stoul(fault->second));
        }
        auto p = std::make_unique<SimPipeline>(k, cap);
        const gpu::Pipeline& ref = *p;
        pipelines_.emplace(name, std::move(p));
        return ref;
      }
    throw UsageError("unknown kernel '" + name + "': no metal/*.metal source instantiates it with [[host_name(\"" +
                     name + "\")]]");
  }
  std::vector<std::string> kernel_names() const override {
    std::vector<std::string> v;
    for (const KernelInfo& k : registered_kernels())
      if ((!k.tensor_ops || supports_tensor_ops()) && (!k.tensor_bfloat || supports_bfloat_tensor_ops()))
        v.push_back(k.name);
    std::sort(v.begin(), v.end());
    return v;
  }
  int gpu_family() const override { return opt_.gpu_family; }
  bool supports_tensor_ops() const override { return tensor_ops_status().empty(); }
  uint64_t allocated_bytes() const override { return *live_; }
  std::string tensor_ops_status() const override {
    if (opt_.gpu_family < gpu::kTensorOpsFamily)
      return "the simulator was created with gpu_family='" + gpu::gpu_family_name(opt_.gpu_family) +
             "'; Metal 4 tensor operations need 'apple10' (sim_device(gpu_family='apple10'))";
    const char* off = std::getenv("LILY_DISABLE_TENSOR_OPS");
    if (off && *off && std::string(off) != "0") return "disabled by LILY_DISABLE_TENSOR_OPS";
    return {};
  }
  bool supports_bfloat_tensor_ops() const override { return bfloat_tensor_ops_status().empty(); }
  std::string bfloat_tensor_ops_status() const override {
    if (!supports_tensor_ops()) return tensor_ops_status();
    if (!opt_.bfloat_tensor_ops)
      return "the simulator was created with bfloat_tensor_ops=False (tensor operations on half operands only, "
             "as MacOSX 26.0's operand table lists)";
    return {};
  }
  std::unique_ptr<gpu::CommandBuffer> new_command_buffer() override;

  // queue
  void enqueue(SimCommandBuffer* cb);
  void wait_for(SimCommandBuffer* cb);
  void released(SimCommandBuffer* cb);
  const SimOptions& options() const { return opt_; }

 private:
  friend class SimCommandBuffer;
  void run();
  void execute(SimCommandBuffer* cb);
  // Bytes of disjoint-tagged write ranges (gpu::Range::disjoint) changed so far in the current
  // barrier stage: per buffer, the label of the dispatch that changed each (verify_writes).
  using TaggedWrites = std::map<const SimBuffer*, std::vector<const std::string*>>;
  void run_verified(const Recorded& r, const ExecDispatch& d, TaggedWrites& tagged);
  ExecDispatch exec_dispatch(Recorded& r);

  SimOptions opt_;
  std::unique_ptr<Executor> exec_;  // the threadgroups' OS threads (none when record-only)
  std::shared_ptr<std::atomic<uint64_t>> live_ = std::make_shared<std::atomic<uint64_t>>(0);
  std::mt19937_64 rng_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<SimCommandBuffer*> queue_;
  int outstanding_ = 0;  // created and not yet completed (or released)
  bool stop_ = false;
  std::thread worker_;
  std::map<std::string, std::unique_ptr<SimPipeline>> pipelines_;
};

class SimCommandBuffer : public gpu::CommandBuffer {
 public:
  explicit SimCommandBuffer(SimDevice* dev) : dev_(dev) {}
  ~SimCommandBuffer() override {
    if (status_ == Status::committed) dev_->wait_for(this);
    dev_->released(this);
  }
  gpu::ComputePass& compute_pass(gpu::BarrierMode mode) override {
    if (status_ != Status::encoding) throw UsageError("compute_pass: the command buffer was already committed");
    if (!encoders_.empty()) encoders_.back()->end();
    passes_.emplace_back(std::make_unique<PassRecord>());
    encoders_.push_back(std::make_unique<SimPass>(static_cast<gpu::Device*>(dev_), mode, &counters_, records_dispatches(), passes_.back().get(), dev_->options().record_only));
    return *encoders_.back();
  }
  void commit() override {
    if (status_ != Status::encoding) throw UsageError("commit: the command buffer was already committed");
    if (!encoders_.empty()) encoders_.back()->end();
    dev_->enqueue(this);
  }
  void wait() override {
    if (status_ == Status::encoding) throw UsageError("wait: the command buffer was not committed");
    dev_->wait_for(this);
    if (error_) std::rethrow_exception(error_);
  }
  void on_completed(std::function<void(Status, const std::string&)> fn) override {
    if (status_ != Status::encoding) throw UsageError("on_completed: register handlers before commit");
    handlers_.push_back(std::move(fn));
  }
  Status status() const override { return status_.load(); }
  std::pair<double, double> gpu_interval() const override {
    std::lock_guard<std::mutex> g(dev_->mu_);
    return gpu_interval_;
  }
  const Counters& counters() const override { return counters_; }

 protected:
  void encode_copy(const gpu::Buffer& src, size_t src_offset, const gpu::Buffer& dst, size_t dst_offset,
                   size_t size) override {
    auto* s = dynamic_cast<const SimBuffer*>(&src);
    auto* d = dynamic_cast<const SimBuffer*>(&dst);
    if (!s || !d) throw UsageError("copy: both buffers must be simulator buffers");
    if (!encoders_.empty()) encoders_.back()->end();
    counters_.copies += 1;
    counters_.bytes_copied += size;
    if (dev_->options().record_only) return;
    if (passes_.empty() || passes_.back()->copies.empty()) passes_.emplace_back(std::make_unique<PassRecord>());
    passes_.back()->copies.push_back(CopyRecord{std::const_pointer_cast<SimBuffer>(s->shared_from_this()),
                                                std::const_pointer_cast<SimBuffer>(d->shared_from_this()),
                                                src_offset, dst_offset, size});
  }

 private:
  friend class SimDevice;
  SimDevice* dev_;
  std::vector<std::unique_ptr<PassRecord>> passes_;
  std::vector<std::unique_ptr<SimPass>> encoders_;  // kept: callers may hold references
  Counters counters_;
  std::vector<std::function<void(Status, const std::string&)>> handlers_;
  std::atomic<Status> status_{Status::encoding};
  std::pair<double, double> gpu_interval_{std::numeric_limits<double>::quiet_NaN(),
                                          std::numeric_limits<double>::quiet_NaN()};  // under dev_->mu_
  std::exception_ptr error_;
  std::string error_message_;
  bool counted_ = true;
};

std::unique_ptr<gpu::CommandBuffer> SimDevice::new_command_buffer() {
  std::unique_lock<std::mutex> g(mu_);
  while (outstanding_ >= kMaxInFlight) {
    if (queue_.empty())
      throw UsageError("new_command_buffer: " + std::to_string(kMaxInFlight) +
                       " command buffers are already outstanding and none is committed; commit or release one first");
    cv_.wait(g);
  }
  outstanding_ += 1;
  return std::make_unique<SimCommandBuffer>(this);
}

void SimDevice::released(SimCommandBuffer* cb) {
  std::lock_guard<std::mutex> g(mu_);
  if (cb->counted_) {
    cb->counted_ = false;
    outstanding_ -= 1;
  }
  cv_.notify_all();
}

void SimDevice::enqueue(SimCommandBuffer* cb) {
  if (opt_.record_only) {
    cb->status_ = Status::committed;
    {
      std::lock_guard<std::mutex> g(mu_);
      cb->status_ = Status::completed;
      if (cb->counted_) {
        cb->counted_ = false;
        outstanding_ -= 1;
      }
    }
    for (auto& h : cb->handlers_) h(Status::completed, "");
    cv_.notify_all();
    return;
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    cb->status_ = Status::committed;
    queue_.push_back(cb);
  }
  cv_.notify_all();
}

void SimDevice::wait_for(SimCommandBuffer* cb) {
  std::unique_lock<std::mutex> g(mu_);
  cv_.wait(g, [&] { return cb->status_ == Status::completed || cb->status_ == Status::error; });
}

void SimDevice::run() {
  for (;;) {
    SimCommandBuffer* cb = nullptr;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      cb = queue_.front();
    }
    auto now = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
    const double start = now();
    execute(cb);
    const double end = now();
    Status st = cb->error_ ? Status::error : Status::completed;
    for (auto& h : cb->handlers_) h(st, cb->error_message_);
    {
      std::lock_guard<std::mutex> g(mu_);
      queue_.pop_front();
      cb->gpu_interval_ = {start, end};
      cb->status_ = st;
      if (cb->counted_) {
        cb->counted_ = false;
        outstanding_ -= 1;
      }
    }
    cv_.notify_all();
  }
}

namespace {
bool covered(const std::vector<gpu::Range>& rs, const SimBuffer* buf, size_t i, bool tagged_only = false) {
  for (const gpu::Range& w : rs)
    if (w.buffer == buf && i >= w.offset && i < w.offset + w.size && (!tagged_only || w.disjoint)) return true;
  return false;
}
std::string buffer_name(const SimBuffer* buf) {
  std::string s = "buffer #" + std::to_string(buf->id());
  if (!buf->label().empty()) s += " '" + buf->label() + "'";
  return s;
}
}  // namespace

// Runs a dispatch and checks its declarations against what it did:
//  * writes: no byte outside the declared write ranges of any bound buffer changed;
//  * reads: re-running it with every undeclared byte of its (owned) buffers zeroed gives
//    the same bytes in its declared write ranges. A byte inside a declared read *or write*
//    range is declared: it keeps its value from before the dispatch. (A write declaration
//    orders the dispatch against every other access to those bytes, so reading them is
//    covered too; and an output byte the dispatch legitimately leaves unwritten must not
//    look like an undeclared read.)
//  * disjoint writes: no byte of a disjoint-tagged write range that an earlier dispatch of the
//    same stage changed is changed again (the group's promise of disjoint elements).
void SimDevice::run_verified(const Recorded& r, const ExecDispatch& d, TaggedWrites& tagged) {
  std::vector<SimBuffer*> bufs;
  for (uint32_t i = 0; i < kMaxBindings; ++i) {
    SimBuffer* b = r.bufs[i].buffer.get();
    if (b && std::find(bufs.begin(), bufs.end(), b) == bufs.end()) bufs.push_back(b);
  }
  std::vector<std::vector<unsigned char>> before;
  for (SimBuffer* b : bufs) before.emplace_back(b->data(), b->data() + b->size());
  exec_->run(&d, 1);
  if (opt_.verify_writes)
    for (size_t k = 0; k < bufs.size(); ++k) {
      const unsigned char* now = bufs[k]->data();
      for (size_t i = 0; i < before[k].size(); ++i) {
        if (now[i] == before[k][i]) continue;
        if (!covered(r.writes, bufs[k], i))
          throw gpu::HazardError("dispatch '" + r.label + "' wrote byte " + std::to_string(i) + " of " +
                                 buffer_name(bufs[k]) + " outside its declared write ranges");
        if (!covered(r.writes, bufs[k], i, true)) continue;
        auto& by = tagged[bufs[k]];
        by.resize(before[k].size(), nullptr);
        if (by[i] && by[i] != &r.label)
          throw gpu::HazardError("dispatch '" + r.label + "' wrote byte " + std::to_string(i) + " of " +
                                 buffer_name(bufs[k]) + ", which '" + *by[i] +
                                 "' of the same stage wrote too (declared disjoint)");
        by[i] = &r.label;
      }
    }
  if (!opt_.verify_reads) return;
  std::vector<std::vector<unsigned char>> after;
  for (SimBuffer* b : bufs) after.emplace_back(b->data(), b->data() + b->size());
  for (size_t k = 0; k < bufs.size(); ++k) {
    if (!bufs[k]->owned()) continue;  // a read-only file mapping cannot be rewritten
    unsigned char* p = bufs[k]->data();
    for (size_t i = 0; i < before[k].size(); ++i)
      p[i] = covered(r.reads, bufs[k], i) || covered(r.writes, bufs[k], i) ? before[k][i] : 0;
  }
  std::string fault;
  try {
    exec_->run(&d, 1);
  } catch (const std::exception& e) {
    fault = e.what();
  }
  std::string msg;
  for (size_t k = 0; k < bufs.size() && msg.empty() && fault.empty(); ++k) {
    const unsigned char* now = bufs[k]->data();
    for (size_t i = 0; i < after[k].size(); ++i)
      if (now[i] != after[k][i] && covered(r.writes, bufs[k], i)) {
        msg = "dispatch '" + r.label + "' reads outside its declared read ranges: with the undeclared bytes of its "
              "buffers zeroed, byte " + std::to_string(i) + " of " + buffer_name(bufs[k]) + " came out different";
        break;
      }
  }
  if (!fault.empty())
    msg = "dispatch '" + r.label + "' reads outside its declared read ranges: with the undeclared bytes of its "
          "buffers zeroed it failed: " + fault;
  for (size_t k = 0; k < bufs.size(); ++k)
    if (bufs[k]->owned()) std::memcpy(bufs[k]->data(), after[k].data(), after[k].size());
  if (!msg.empty()) throw gpu::HazardError(msg);
}

ExecDispatch SimDevice::exec_dispatch(Recorded& r) {
  ExecDispatch d;
  d.kernel = r.kernel;
  d.label = r.label;
  d.threadgroups = r.groups;
  d.threadgroup_size = r.tg_size;
  d.threads_per_grid = r.threads;
  d.poison = opt_.poison;
  d.thread_order = static_cast<int>(opt_.thread_order);
  d.seed = rng_();
  d.tensor_layout = opt_.tensor_layout == "nax" ? tensor_ops::Layout::nax : tensor_ops::Layout::sim;
  for (uint32_t i = 0; i < kMaxBindings; ++i) {
    auto& b = r.bufs[i];
    d.threadgroup_memory[i] = r.tg_mem[i];
    if (!b.bound) continue;
    d.buffers[i].bound = true;
    if (b.buffer) {
      d.buffers[i].ptr = b.buffer->data() + b.offset;
      d.buffers[i].available = b.buffer->size() - b.offset;
    } else {
      d.buffers[i].ptr = b.bytes.data();
      d.buffers[i].available = b.bytes.size;
    }
  }
  return d;
}

namespace {
// The guard zones of the buffers the dispatches rs[0..n) bind, after they ran: a damaged one
// is an error naming the dispatch that binds it, or every one that does when they ran at the
// same time (one barrier stage).
void check_guards(Recorded* const* rs, size_t n) {
  std::vector<SimBuffer*> seen;
  for (size_t k = 0; k < n; ++k)
    for (uint32_t i = 0; i < kMaxBindings; ++i) {
      SimBuffer* b = rs[k]->bufs[i].buffer.get();
      if (!b || std::find(seen.begin(), seen.end(), b) != seen.end()) continue;
      seen.push_back(b);
      if (b->guard_intact()) continue;
      std::string by;  // the dispatches binding b
      int binders = 0;
      for (size_t o = 0; o < n; ++o)
        for (uint32_t j = 0; j < kMaxBindings; ++j)
          if (rs[o]->bufs[j].buffer.get() == b)
            by += std::string(binders++ ? ", '" : "'") + rs[o]->label + "' (buffer(" + std::to_string(j) + "))";
      const std::string what =
          buffer_name(b) + " (" + std::to_string(b->size()) + " bytes): an out-of-bounds index";
      if (binders == 1)
        throw gpu::Error("kernel '" + rs[k]->label + "' wrote past the end of buffer(" + std::to_string(i) +
                         ") " + what);
      throw gpu::Error("a kernel of one barrier stage wrote past the end of " + what +
                       "; the dispatches that bind it ran at the same time: " + by);
    }
}
}  // namespace

// The faults option's "wrong": a dispatch of the kernel flips bit 6 of byte 3 of every
// 64-byte block of its declared write ranges once it has run.
void inject_wrong_results(const std::map<std::string, std::string>& faults, Recorded* const* rs, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    auto fault = faults.find(rs[i]->kernel->name);
    if (fault == faults.end() || fault->second != "wrong") continue;
    for (const gpu::Range& w : rs[i]->writes)
      for (size_t at = w.offset; at + 4 <= w.offset + w.size; at += 64)
        static_cast<uint8_t*>(const_cast<gpu::Buffer*>(w.buffer)->contents())[at + 3] ^= 0x40;
  }
}

void SimDevice::execute(SimCommandBuffer* cb) {
  try {
    std::vector<Recorded*> order;
    std::vector<ExecDispatch> ds;
    for (auto& pass : cb->passes_) {
      for (auto& stage : pass->stages) {
        order.clear();
        for (Recorded& r : stage) order.push_back(&r);
        if (opt_.order == StageOrder::reverse) std::reverse(order.begin(), order.end());
        if (opt_.order == StageOrder::random) std::shuffle(order.begin(), order.end(), rng_);
        ds.clear();
        for (Recorded* r : order) ds.push_back(exec_dispatch(*r));
        // The dispatches of a barrier stage run at the same time, as on a GPU, unless a check
        // needs them one by one: the write and read verification attribute every changed byte
        // to one dispatch, and the reverse and random stage orders are orders only if each
        // dispatch completes before the next starts.
        if (opt_.verify_writes || opt_.verify_reads || opt_.order != StageOrder::forward) {
          TaggedWrites tagged;
          for (size_t i = 0; i < ds.size(); ++i) {
            if (opt_.verify_writes || opt_.verify_reads) run_verified(*order[i], ds[i], tagged);
            else exec_->run(&ds[i], 1);
            check_guards(&order[i], 1);
            inject_wrong_results(opt_.faults, &order[i], 1);
          }
        } else if (!ds.empty()) {
          exec_->run(ds.data(), ds.size());
          check_guards(order.data(), order.size());
          inject_wrong_results(opt_.faults, order.data(), order.size());
        }
      }
      // Copies run in queue order, after the passes encoded before them (CommandBuffer::copy
      // checked their ranges against the buffers when they were encoded).
      for (const CopyRecord& c : pass->copies)
        std::memmove(c.dst->data() + c.dst_offset, c.src->data() + c.src_offset, c.size);
    }
  } catch (const std::exception& e) {
    cb->error_ = std::current_exception();
    cb->error_message_ = e.what();
  }
  // Release recorded buffers now: the command buffer no longer needs them.
  cb->passes_.clear();
}

}  // namespace

unsigned default_sim_threads() {
  const char* env = std::getenv("LILY_SIM_THREADS");
  if (env && *env) {  // set and not empty
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(env, &end, 10);
    if (*end || errno || v < 1 || v > long(kMaxSimThreads))
      throw UsageError(std::string("LILY_SIM_THREADS must be a whole number of threads, 1..") +
                       std::to_string(kMaxSimThreads) + ", not '" + env + "'");
    return unsigned(v);
  }
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0)
    return std::min(unsigned(CPU_COUNT(&set)), kMaxSimThreads);
#endif
  return std::clamp(std::thread::hardware_concurrency(), 1u, kMaxSimThreads);
}

std::unique_ptr<gpu::Device> make_sim_device(const SimOptions& options) {
  return std::make_unique<SimDevice>(options);
}

}  // namespace lily::sim
