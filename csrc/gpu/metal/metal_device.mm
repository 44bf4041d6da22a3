// The Metal backend: a thin Objective-C++ layer behind lily::gpu::Device. Everything that
// can be plain C++ (barrier derivation, counters, hazard checks, file mapping) lives in
// gpu/device.cpp and is shared with the simulator.
//
// Built only on Apple platforms with -fobjc-arc. Type-checked on Linux by
// tools/check_objc.sh against the macOS 12 SDK headers; APIs newer than macOS 12 are
// guarded with @available.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include "gpu/metal/metal_device.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace lily::metal {
namespace {

using gpu::Binding;
using gpu::BufferPtr;
using gpu::Counters;
using gpu::Dispatch;
using gpu::Error;
using gpu::Status;
using gpu::UsageError;

std::atomic<uint64_t> g_next_id{1};

std::string to_string(NSString* s) { return s ? std::string([s UTF8String]) : std::string(); }

#ifndef LILY_METAL_TENSOR_MIN_OS
#define LILY_METAL_TENSOR_MIN_OS "26.2"  // cmake/metal.cmake's default
#endif

// Whether this macOS is at least `version` ("major.minor").
bool at_least_macos(const char* version) {
  int major = 0, minor = 0;
  std::sscanf(version, "%d.%d", &major, &minor);
  return [[NSProcessInfo processInfo] isOperatingSystemAtLeastVersion:(NSOperatingSystemVersion){major, minor, 0}];
}

// gpu::Buffer has a member function id(), which hides Objective-C's `id` inside classes
// derived from it: name the type outside.
typedef id<MTLBuffer> MTLBufferRef;

class MetalBuffer : public gpu::Buffer, public std::enable_shared_from_this<MetalBuffer> {
 public:
  MetalBuffer(MTLBufferRef b, size_t size) : buf_(b), size_(size), id_(g_next_id++) {}
  // Release inside a pool: what the buffer's dealloc autoreleases is freed now, not when the
  // thread (Python's main thread, the server's generation thread) ends.
  ~MetalBuffer() override {
    @autoreleasepool {
      buf_ = nil;
    }
  }
  size_t size() const override { return size_; }
  void* contents() override { return [buf_ contents]; }
  uint64_t id() const override { return id_; }
  std::string label() const override {
    std::string s;
    @autoreleasepool {
      s = to_string([buf_ label]);
    }
    return s;
  }
  void set_label(const std::string& l) override {
    @autoreleasepool {
      [buf_ setLabel:@(l.c_str())];
    }
  }
  MTLBufferRef mtl() const { return buf_; }

 private:
  MTLBufferRef buf_;
  size_t size_;
  uint64_t id_;
};

class MetalPipeline : public gpu::Pipeline {
 public:
  MetalPipeline(std::string name, id<MTLComputePipelineState> pso, std::map<uint32_t, gpu::BufferParameter> params,
                id<MTLFunction> cooperative_fn = nil)
      : name_(std::move(name)), pso_(pso), params_(std::move(params)), cooperative_fn_(cooperative_fn) {}
  const std::string& name() const override { return name_; }
  gpu::BufferParameter buffer_parameter(uint32_t index) const override {
    auto it = params_.find(index);
    return it == params_.end() ? gpu::BufferParameter{} : it->second;
  }
  uint32_t max_threads_per_threadgroup() const override {
    return static_cast<uint32_t>([pso_ maxTotalThreadsPerThreadgroup]);
  }
  uint32_t thread_execution_width() const override { return static_cast<uint32_t>([pso_ threadExecutionWidth]); }
  uint64_t static_threadgroup_memory() const override { return uint64_t([pso_ staticThreadgroupMemoryLength]); }
  id<MTLComputePipelineState> pso() const { return pso_; }

  // The pipeline state to dispatch with `tg` threads per threadgroup, or nil with *error set.
  // Apple's MTLComputePipeline.h (macOS 26): a pipeline that uses cooperative tensors (every
  // kernel of the tensor library) must set requiredThreadsPerThreadgroup, and each dispatch
  // must match it; so those kernels get one pipeline state per threadgroup shape dispatched
  // (a few: the tile variants), built on first use, which the load-time preflight reaches.
  id<MTLComputePipelineState> pso_for(gpu::Size3 tg, std::string* error) const {
    if (cooperative_fn_ == nil) return pso_;
    std::lock_guard<std::mutex> lock(mu_);
    const auto key = std::make_tuple(tg.x, tg.y, tg.z);
    auto it = sized_.find(key);
    if (it != sized_.end()) return it->second;
    id<MTLComputePipelineState> pso = nil;
#if defined(__MAC_26_0)
    if (@available(macOS 26.0, *)) {
      MTLComputePipelineDescriptor* desc = [[MTLComputePipelineDescriptor alloc] init];
      desc.computeFunction = cooperative_fn_;
      desc.requiredThreadsPerThreadgroup = MTLSizeMake(tg.x, tg.y, tg.z);
      NSError* err = nil;
      pso = [[pso_ device] newComputePipelineStateWithDescriptor:desc
                                                          options:MTLPipelineOptionNone
                                                       reflection:nil
                                                            error:&err];
      if (pso == nil)
        *error = "cannot build kernel '" + name_ + "' for threadgroups of (" + std::to_string(tg.x) + ", " +
                 std::to_string(tg.y) + ", " + std::to_string(tg.z) + ") threads: " +
                 std::string([[err localizedDescription] UTF8String] ?: "unknown error");
    } else {
      *error = "kernel '" + name_ + "' uses cooperative tensors, which need macOS 26";
    }
#else
    *error = "kernel '" + name_ + "' uses cooperative tensors: rebuild Lily with the macOS 26 SDK";
#endif
    if (pso != nil) sized_.emplace(key, pso);
    return pso;
  }

 private:
  std::string name_;
  id<MTLComputePipelineState> pso_;
  std::map<uint32_t, gpu::BufferParameter> params_;  // [[buffer(n)]] alignment, from reflection
  id<MTLFunction> cooperative_fn_;                     // set for tensor-library kernels
  mutable std::mutex mu_;
  mutable std::map<std::tuple<uint32_t, uint32_t, uint32_t>, id<MTLComputePipelineState>> sized_;
};

// The [[buffer(n)]] parameters' alignments from pipeline reflection, for the shared
// dispatch validation. SDKs from macOS 13 have MTLBinding (MTLPipelineOptionBindingInfo);
// the macOS 12 SDK that tools/check_objc.sh type-checks against has only the deprecated
// MTLArgument, compiled as the fallback.
#if defined(MAC_OS_VERSION_13_0)
#define LILY_METAL_BINDINGS 1
constexpr MTLPipelineOption kReflectionOption = MTLPipelineOptionBindingInfo;
#else
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
constexpr MTLPipelineOption kReflectionOption = MTLPipelineOptionArgumentInfo;
#pragma clang diagnostic pop
#endif

std::map<uint32_t, gpu::BufferParameter> buffer_parameters(MTLComputePipelineReflection* refl) {
  std::map<uint32_t, gpu::BufferParameter> r;
#ifdef LILY_METAL_BINDINGS
  for (id<MTLBinding> b in [refl bindings]) {
    if ([b type] != MTLBindingTypeBuffer) continue;
    gpu::BufferParameter p;
    p.alignment = static_cast<size_t>([(id<MTLBufferBinding>)b bufferAlignment]);
    p.declaration = to_string([b name]);
    r[static_cast<uint32_t>([b index])] = p;
  }
#else
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
  for (MTLArgument* a in [refl arguments]) {
    if ([a type] != MTLArgumentTypeBuffer) continue;
    gpu::BufferParameter p;
    p.alignment = static_cast<size_t>([a bufferAlignment]);
    p.declaration = to_string([a name]);
    r[static_cast<uint32_t>([a index])] = p;
  }
#pragma clang diagnostic pop
#endif
  return r;
}

class MetalDevice;

// Keeps every buffer a command buffer uses alive until it completes (the command buffer
// is created with unretained references).
struct Keepalive {
  std::vector<std::shared_ptr<const MetalBuffer>> buffers;
};

class MetalPass : public gpu::ComputePass {
 public:
  MetalPass(gpu::Device* dev, gpu::BarrierMode mode, Counters* counters, bool log, id<MTLComputeCommandEncoder> enc,
            Keepalive* keep)
      : ComputePass(dev, mode, counters, log), enc_(enc), keep_(keep) {}

 protected:
  void validate(const Dispatch& d) override {
    const auto* p = dynamic_cast<const MetalPipeline*>(d.pipeline);
    if (!p) throw UsageError("dispatch '" + display_label(d) + "': the pipeline does not belong to the Metal device");
    const uint64_t tg = d.threadgroup.count();
    if (!d.threadgroup.x || !d.threadgroup.y || !d.threadgroup.z || !d.grid.x || !d.grid.y || !d.grid.z)
      throw UsageError("kernel '" + p->name() + "': grid and threadgroup sizes must be non-zero");
    if (tg > p->max_threads_per_threadgroup())
      throw UsageError("kernel '" + p->name() + "': threadgroup of " + std::to_string(tg) +
                       " threads exceeds the pipeline's maximum of " +
                       std::to_string(p->max_threads_per_threadgroup()));
    std::string pso_error;
    if (p->pso_for(d.threadgroup, &pso_error) == nil) throw UsageError(pso_error);
    size_t tg_total = 0;
    for (const Binding& b : d.bindings) {
      if (b.index >= 31) throw UsageError("kernel '" + p->name() + "': binding index " + std::to_string(b.index) + " > 30");
      switch (b.kind) {
        case Binding::Kind::buffer: {
          const auto* mb = dynamic_cast<const MetalBuffer*>(b.buffer);
          if (!mb) throw UsageError("kernel '" + p->name() + "': buffer(" + std::to_string(b.index) + ") is not a Metal buffer");
          if (b.offset > mb->size()) throw UsageError("kernel '" + p->name() + "': buffer offset past the end");
          break;
        }
        case Binding::Kind::bytes:
          if (b.bytes.size() > 4096) throw UsageError("kernel '" + p->name() + "': more than 4096 constant bytes");
          break;
        case Binding::Kind::threadgroup_memory:
          if (b.length % 16) throw UsageError("kernel '" + p->name() + "': threadgroup memory length not a multiple of 16");
          tg_total += b.length;
          break;
      }
    }
    if (tg_total + [p->pso() staticThreadgroupMemoryLength] > [[enc_ device] maxThreadgroupMemoryLength])
      throw UsageError("kernel '" + p->name() + "': threadgroup memory exceeds the device limit");
  }
  void encode_dispatch(const Dispatch& d) override {
    const auto* p = static_cast<const MetalPipeline*>(d.pipeline);
    std::string unused;
    [enc_ setComputePipelineState:p->pso_for(d.threadgroup, &unused)];  // built by validate()
    for (const Binding& b : d.bindings) {
      switch (b.kind) {
        case Binding::Kind::buffer: {
          const auto* mb = static_cast<const MetalBuffer*>(b.buffer);
          [enc_ setBuffer:mb->mtl() offset:b.offset atIndex:b.index];
          keep_->buffers.push_back(mb->shared_from_this());
          break;
        }
        case Binding::Kind::bytes:
          [enc_ setBytes:b.bytes.data() length:b.bytes.size() atIndex:b.index];
          break;
        case Binding::Kind::threadgroup_memory:
          [enc_ setThreadgroupMemoryLength:b.length atIndex:b.index];
          break;
      }
    }
    MTLSize grid = MTLSizeMake(d.grid.x, d.grid.y, d.grid.z);
    MTLSize group = MTLSizeMake(d.threadgroup.x, d.threadgroup.y, d.threadgroup.z);
    if (d.grid_is_threadgroups)
      [enc_ dispatchThreadgroups:grid threadsPerThreadgroup:group];
    else
      [enc_ dispatchThreads:grid threadsPerThreadgroup:group];
  }
  void encode_barrier() override { [enc_ memoryBarrierWithScope:MTLBarrierScopeBuffers]; }
  void encode_end() override { [enc_ endEncoding]; }

 private:
  id<MTLComputeCommandEncoder> enc_;
  Keepalive* keep_;
};

// Outstanding command buffers (created, not completed) are limited to kMaxInFlight.
struct InFlight {
  std::mutex mu;
  std::condition_variable cv;
  int outstanding = 0;
  int committed = 0;
};

class MetalCommandBuffer : public gpu::CommandBuffer {
 public:
  MetalCommandBuffer(MetalDevice* dev, id<MTLCommandBuffer> cb, std::shared_ptr<InFlight> inflight)
      : dev_(dev), cb_(cb), inflight_(std::move(inflight)), state_(std::make_shared<State>()) {}
  ~MetalCommandBuffer() override {
    if (!encoders_.empty() && !encoders_.back()->ended()) encoders_.back()->end();
    end_blit();
    if (committed_) {
      [cb_ waitUntilCompleted];
      std::unique_lock<std::mutex> g(state_->mu);
      state_->cv.wait(g, [&] { return state_->done; });  // the handler has run
    } else {
      std::lock_guard<std::mutex> g(inflight_->mu);
      inflight_->outstanding -= 1;
      inflight_->cv.notify_all();
    }
    @autoreleasepool {  // release the encoders and the command buffer now (see ~MetalBuffer)
      encoders_.clear();
      cb_ = nil;
    }
  }
  gpu::ComputePass& compute_pass(gpu::BarrierMode mode) override;
  void commit() override {
    if (committed_) throw UsageError("commit: the command buffer was already committed");
    if (!encoders_.empty()) encoders_.back()->end();
    end_blit();
    committed_ = true;
    std::shared_ptr<State> st = state_;
    std::shared_ptr<InFlight> inf = inflight_;
    std::shared_ptr<Keepalive> keep = keep_;
    auto handlers = handlers_;
    auto handler = ^(id<MTLCommandBuffer> done) {
      // Never throw from here: store the error; wait() rethrows it on the caller's thread.
      Status s;
      std::pair<double, double> gpu;
      std::string msg;
      @autoreleasepool {  // Metal's completion queue promises none; the buffers may be freed here
        s = [done status] == MTLCommandBufferStatusError ? Status::error : Status::completed;
        gpu = {[done GPUStartTime], [done GPUEndTime]};
        if (s == Status::error) msg = "Metal command buffer failed: " + to_string([[done error] localizedDescription]);
        for (auto& h : handlers) {
          try {
            h(s, msg);
          } catch (...) {
          }
        }
        keep->buffers.clear();
      }
      {
        std::lock_guard<std::mutex> g(st->mu);
        st->status = s;
        st->message = msg;
        st->gpu_interval = gpu;
        st->done = true;
      }
      st->cv.notify_all();
      {
        std::lock_guard<std::mutex> g(inf->mu);
        inf->outstanding -= 1;
        inf->committed -= 1;
      }
      inf->cv.notify_all();
    };
    {
      std::lock_guard<std::mutex> g(inflight_->mu);
      inflight_->committed += 1;
    }
    {
      std::lock_guard<std::mutex> g(state_->mu);
      state_->status = Status::committed;
    }
    @autoreleasepool {
      [cb_ addCompletedHandler:handler];
      [cb_ commit];
    }
  }
  void wait() override {
    if (!committed_) throw UsageError("wait: the command buffer was not committed");
    [cb_ waitUntilCompleted];
    std::unique_lock<std::mutex> g(state_->mu);
    state_->cv.wait(g, [&] { return state_->done; });
    if (state_->status == Status::error) throw Error(state_->message);
  }
  void on_completed(std::function<void(Status, const std::string&)> fn) override {
    if (committed_) throw UsageError("on_completed: register handlers before commit");
    handlers_.push_back(std::move(fn));
  }
  Status status() const override {
    std::lock_guard<std::mutex> g(state_->mu);
    return state_->status;
  }
  std::pair<double, double> gpu_interval() const override {
    std::lock_guard<std::mutex> g(state_->mu);
    return state_->gpu_interval;
  }
  const Counters& counters() const override { return counters_; }
  // Ends the open blit encoder of a run of copies, if any.
  void end_blit() {
    if (blit_) [blit_ endEncoding];
    blit_ = nil;
  }

 protected:
  void encode_copy(const gpu::Buffer& src, size_t src_offset, const gpu::Buffer& dst, size_t dst_offset,
                   size_t size) override {
    const auto* s = dynamic_cast<const MetalBuffer*>(&src);
    const auto* d = dynamic_cast<const MetalBuffer*>(&dst);
    if (!s || !d) throw UsageError("copy: both buffers must be Metal buffers");
    if ([s->mtl() device] != [cb_ device] || [d->mtl() device] != [cb_ device])
      throw UsageError("copy: a buffer belongs to another MTLDevice");
    if (!encoders_.empty()) encoders_.back()->end();
    @autoreleasepool {  // the encoder is autoreleased: blit_ keeps it, the pool entry goes now
      if (!blit_) blit_ = [cb_ blitCommandEncoder];  // consecutive copies share one encoder
      if (blit_)
        [blit_ copyFromBuffer:s->mtl() sourceOffset:src_offset toBuffer:d->mtl() destinationOffset:dst_offset size:size];
    }
    if (!blit_) throw Error("cannot create a blit encoder");
    keep_->buffers.push_back(s->shared_from_this());
    keep_->buffers.push_back(d->shared_from_this());
    counters_.copies += 1;
    counters_.bytes_copied += size;
  }

 private:
  struct State {
    mutable std::mutex mu;
    std::condition_variable cv;
    Status status = Status::encoding;
    std::pair<double, double> gpu_interval{std::numeric_limits<double>::quiet_NaN(),
                                           std::numeric_limits<double>::quiet_NaN()};
    std::string message;
    bool done = false;
  };
  MetalDevice* dev_;
  id<MTLCommandBuffer> cb_;
  std::shared_ptr<InFlight> inflight_;
  std::shared_ptr<State> state_;
  std::shared_ptr<Keepalive> keep_ = std::make_shared<Keepalive>();
  std::vector<std::unique_ptr<MetalPass>> encoders_;
  std::vector<std::function<void(Status, const std::string&)>> handlers_;
  Counters counters_;
  bool committed_ = false;
  id<MTLBlitCommandEncoder> blit_ = nil;
};

std::string module_directory() {
  Dl_info info;
  if (dladdr(reinterpret_cast<const void*>(&module_directory), &info) && info.dli_fname) {
    std::string p = info.dli_fname;
    size_t slash = p.find_last_of('/');
    if (slash != std::string::npos) return p.substr(0, slash);
  }
  return ".";
}

class MetalDevice : public gpu::Device {
 public:
  // Objective-C work runs inside @autoreleasepool blocks that never throw: they return an
  // error message and the C++ exception is thrown after the pool has drained.
  explicit MetalDevice(const std::string& metallib_path) {
    std::string err;
    @autoreleasepool {
      err = open(metallib_path);
    }
    if (!err.empty()) throw Error(err);
  }
  std::string name() const override { return "metal"; }
  int gpu_family() const override { return family_; }
  bool supports_tensor_ops() const override { return !tensor_libs_.empty(); }
  uint64_t allocated_bytes() const override { return uint64_t(dev_.currentAllocatedSize); }
  std::string tensor_ops_status() const override { return tensor_status_; }
  bool supports_bfloat_tensor_ops() const override { return !tensor_libs_.empty() && bfloat_status_.empty(); }
  std::string bfloat_tensor_ops_status() const override {
    return tensor_libs_.empty() ? tensor_status_ : bfloat_status_;
  }

  BufferPtr new_buffer(size_t bytes) override {
    id<MTLBuffer> b = [dev_ newBufferWithLength:(bytes ? bytes : 1) options:MTLResourceStorageModeShared];
    if (!b) throw Error("cannot allocate a Metal buffer of " + std::to_string(bytes) + " bytes");
    return std::make_shared<MetalBuffer>(b, bytes);
  }
  BufferPtr new_buffer_no_copy(void* ptr, size_t bytes, std::function<void()> release) override {
    if (!ptr || reinterpret_cast<uintptr_t>(ptr) % gpu::page_size() || bytes % gpu::page_size())
      throw UsageError("new_buffer_no_copy: pointer and length must be page-aligned");
    std::function<void()> rel = std::move(release);
    id<MTLBuffer> b = [dev_ newBufferWithBytesNoCopy:ptr
                                              length:bytes
                                             options:MTLResourceStorageModeShared
                                         deallocator:^(void*, NSUInteger) {
                                           if (rel) rel();
                                         }];
    if (!b) throw Error("cannot wrap " + std::to_string(bytes) + " bytes as a no-copy Metal buffer");
    return std::make_shared<MetalBuffer>(b, bytes);
  }
  const gpu::Pipeline& pipeline(const std::string& name) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = cache_.find(name);
    if (it != cache_.end()) return *it->second;
    if (!tensor_libs_.empty() && !bfloat_status_.empty() && gpu::is_bfloat_tensor_kernel(name))
      throw UsageError("kernel '" + name + "' uses Metal 4 tensor operations on bfloat operands, which this "
                       "device does not offer: " + bfloat_status_);
    std::string error;
    bool unknown = false;
    MetalPipeline* p = nullptr;
    @autoreleasepool {
      p = build_pipeline(name, &error, &unknown);
    }
    if (!p) {
      if (unknown) throw UsageError(error);
      throw Error(error);
    }
    return *p;
  }
  gpu::MemoryLimits memory_limits() const override {
    return gpu::MemoryLimits{uint64_t([dev_ recommendedMaxWorkingSetSize]), uint64_t([dev_ maxBufferLength])};
  }
  std::vector<std::string> kernel_names() const override {
    std::vector<std::string> v;
    @autoreleasepool {
      for (NSString* s in [lib_ functionNames]) v.push_back(to_string(s));
      for (const TensorLibrary& t : tensor_libs_)  // without bfloat tensor ops, the kernels that need them are not offered
        for (NSString* s in [t.lib functionNames])
          if (bfloat_status_.empty() || !gpu::is_bfloat_tensor_kernel(to_string(s))) v.push_back(to_string(s));
    }
    return v;
  }
  std::unique_ptr<gpu::CommandBuffer> new_command_buffer() override {
    {
      std::unique_lock<std::mutex> g(inflight_->mu);
      while (inflight_->outstanding >= kMaxInFlight) {
        if (inflight_->committed == 0)
          throw UsageError("new_command_buffer: " + std::to_string(kMaxInFlight) +
                           " command buffers are already outstanding and none is committed");
        inflight_->cv.wait(g);
      }
      inflight_->outstanding += 1;
    }
    id<MTLCommandBuffer> cb = nil;
    @autoreleasepool {  // autoreleased by Metal: the strong reference keeps it, the pool entry goes now
      cb = [queue_ commandBufferWithUnretainedReferences];
    }
    if (!cb) {
      std::lock_guard<std::mutex> g(inflight_->mu);
      inflight_->outstanding -= 1;
      throw Error("cannot create a Metal command buffer");
    }
    return std::make_unique<MetalCommandBuffer>(this, cb, inflight_);
  }
  id<MTLCommandQueue> queue() const { return queue_; }

 private:
  // The constructor's work; returns an error message ("" on success).
  std::string open(const std::string& metallib_path) {
    dev_ = MTLCreateSystemDefaultDevice();
    if (!dev_) {  // a command-line process may get none without CoreGraphics: take the first device
      NSArray<id<MTLDevice>>* all = MTLCopyAllDevices();
      if (all.count > 0) dev_ = all[0];
    }
    if (!dev_) return "no Metal device is available on this machine";
    family_ = detect_family();
    if (family_ < 7)
      return "Lily needs an Apple-silicon GPU (MTLGPUFamilyApple7 or newer); found '" + to_string([dev_ name]) + "'";
    queue_ = [dev_ newCommandQueue];
    if (!queue_) return "cannot create a Metal command queue";
    std::string path = metallib_path;
    if (path.empty()) {
      const char* env = std::getenv("LILY_METALLIB");
      path = env && *env ? env : module_directory() + "/lily.metallib";
    }
    NSError* err = nil;
    lib_ = [dev_ newLibraryWithURL:[NSURL fileURLWithPath:@(path.c_str())] error:&err];
    if (!lib_) return "cannot load the kernel library '" + path + "': " + to_string([err localizedDescription]);
    path_ = path;
    load_tensor_library();
    return {};
  }

  // The pipeline of kernel `name` (cached), or nullptr with *error set.
  MetalPipeline* build_pipeline(const std::string& name, std::string* error, bool* unknown) {
    // Pipelines are looked up by name across the libraries: lily.metallib, then (on
    // apple10 GPUs) the lily_tensor_<family>.metallib files with the Metal 4 tensor-op kernels.
    id<MTLFunction> fn = [lib_ newFunctionWithName:@(name.c_str())];
    const bool cooperative = fn == nil;
    for (size_t i = 0; !fn && i < tensor_libs_.size(); ++i) fn = [tensor_libs_[i].lib newFunctionWithName:@(name.c_str())];
    if (!fn) {
      std::string where = "not in " + path_;
      for (const TensorLibrary& t : tensor_libs_) where += " or " + t.path;
      if (tensor_libs_.empty())
        where += " (the Metal 4 tensor-op kernels of lily_tensor_*.metallib are not loaded: " + tensor_status_ + ")";
      else if (!tensor_notes_.empty())
        where += " (" + tensor_notes_ + ")";
      *error = "unknown kernel '" + name + "': " + where;
      *unknown = true;
      return nullptr;
    }
    NSError* err = nil;
    MTLComputePipelineReflection* refl = nil;
    id<MTLComputePipelineState> pso = [dev_ newComputePipelineStateWithFunction:fn
                                                                       options:kReflectionOption
                                                                    reflection:&refl
                                                                         error:&err];
    if (!pso) {
      *error = "cannot build the pipeline for kernel '" + name + "': " + to_string([err localizedDescription]);
      if (!bfloat_status_.empty() && cooperative)
        *error += " (bfloat tensor operations are unavailable: " + bfloat_status_ + ")";
      return nullptr;
    }
    auto params = buffer_parameters(refl);
    if (params.empty()) {
      // Every Lily kernel takes a buffer: reflection came back empty, so the buffer-offset
      // alignment checks are off for this kernel. Say so once instead of silently.
      static std::once_flag warned;
      std::call_once(warned, [&] {
        std::fprintf(stderr,
                     "lily: Metal pipeline reflection reported no buffer arguments for kernel '%s': buffer offset "
                     "alignment checks are off for such kernels (Device.pipeline_info shows which)\n",
                     name.c_str());
      });
    }
    auto p = std::make_unique<MetalPipeline>(name, pso, std::move(params), cooperative ? fn : nil);
    MetalPipeline* raw = p.get();
    cache_.emplace(name, std::move(p));
    return raw;
  }

  // The Apple family N of MTLGPUFamilyAppleN (7..10), 0 for a Mac2-only GPU, -1 unknown.
  int detect_family() {
    // MTLGPUFamilyApple8 (1008, macOS 13 SDK), Apple9 (1009, macOS 14 SDK) and Apple10
    // (1010, macOS 26 SDK) are not named in the macOS 12 SDK: use their values.
    if (@available(macOS 26.0, *)) {
      if ([dev_ supportsFamily:static_cast<MTLGPUFamily>(1010)]) return 10;
    }
    if (@available(macOS 14.0, *)) {
      if ([dev_ supportsFamily:static_cast<MTLGPUFamily>(1009)]) return 9;
    }
    if (@available(macOS 13.0, *)) {
      if ([dev_ supportsFamily:static_cast<MTLGPUFamily>(1008)]) return 8;
    }
    if ([dev_ supportsFamily:MTLGPUFamilyApple7]) return 7;
    if ([dev_ supportsFamily:MTLGPUFamilyMac2]) return 0;
    return -1;
  }

  // "" when probe kernel `name` of the tensor library builds, both plain and in the form
  // the tensor kernels are dispatched with (MetalPipeline::pso_for: the threadgroup shape
  // required, as macOS 26 asks of cooperative-tensor pipelines; a probe is one threadgroup
  // of 128 threads); otherwise why not.
  std::string probe_error(id<MTLLibrary> lib, const char* name, const std::string& path) {
    NSError* err = nil;
    id<MTLFunction> probe = [lib newFunctionWithName:@(name)];
    id<MTLComputePipelineState> pso = probe ? [dev_ newComputePipelineStateWithFunction:probe error:&err] : nil;
    std::string why = std::string("the probe kernel ") + name + " of " + path + " does not build on this system";
    if (!pso) return why + (probe ? ": " + to_string([err localizedDescription]) : std::string(" (it is missing)"));
    std::string sized_error;
    if (MetalPipeline(name, pso, {}, probe).pso_for(gpu::Size3{128, 1, 1}, &sized_error) == nil)
      return why + ": " + sized_error;
    return {};
  }

  // The tensor libraries (lily_tensor_<family>.metallib, one per metal/<family>_tensor.metal,
  // built with -std=metal4.0) are loaded only on apple10-family GPUs under macOS 26; each
  // that loads offers its family's kernels, one that does not is noted (tensor_notes_, one
  // line on stderr) and its family runs the simdgroup_matrix kernels. tensor_ops_probe (the
  // GEMMs' tensor operation: bfloat operands, a cooperative left input; in the gemm library)
  // must build where present, or no tensor kernel is used (tensor_status_ says why). The
  // attention's operations have their own probe (tensor_ops_probe_bfloat); prefill takes the
  // tensor path only where both build (every prefill tensor kernel takes bfloat operands:
  // MacOSX 26.1's operand table on), and bfloat_status_ says why not. Whether each family's
  // kernels compute what they should is checked by running them once when a model loads
  // (lily.native_backend), with the same fallback.
  void load_tensor_library() {
    const char* off = std::getenv("LILY_DISABLE_TENSOR_OPS");
    if (family_ < gpu::kTensorOpsFamily) {
      tensor_status_ = "the GPU is " + gpu::gpu_family_name(family_) +
                       "; Metal 4 tensor operations are used on apple10-family GPUs (M5 and newer)";
      return;
    }
    if (off && *off && std::string(off) != "0") {
      tensor_status_ = "disabled by LILY_DISABLE_TENSOR_OPS";
      return;
    }
    if (!at_least_macos(LILY_METAL_TENSOR_MIN_OS)) {
      NSOperatingSystemVersion v = [[NSProcessInfo processInfo] operatingSystemVersion];
      tensor_status_ = std::string("the tensor libraries need macOS ") + LILY_METAL_TENSOR_MIN_OS +
                       " (their minimum, -mmacosx-version-min); this is macOS " + std::to_string(v.majorVersion) + "." +
                       std::to_string(v.minorVersion);
      return;
    }
    if (@available(macOS 26.0, *)) {
      // $LILY_TENSOR_METALLIB: a colon-separated list of libraries instead of those beside lily.metallib
      std::vector<std::string> paths;
      const char* env = std::getenv("LILY_TENSOR_METALLIB");
      if (env && *env) {
        std::string list = env;
        for (size_t at = 0; at <= list.size();) {
          size_t end = list.find(':', at);
          if (end == std::string::npos) end = list.size();
          if (end > at) paths.push_back(list.substr(at, end - at));
          at = end + 1;
        }
      } else {
        const size_t slash = path_.find_last_of('/');
        const std::string dir = slash == std::string::npos ? "." : path_.substr(0, slash);
        for (NSString* f in [[NSFileManager defaultManager] contentsOfDirectoryAtPath:@(dir.c_str()) error:nil]) {
          const std::string name = to_string(f);
          if (name.rfind("lily_tensor_", 0) == 0 && name.size() > 9 && name.substr(name.size() - 9) == ".metallib")
            paths.push_back(dir + "/" + name);
        }
        std::sort(paths.begin(), paths.end());
      }
      if (paths.empty()) {
        tensor_status_ = "no lily_tensor_*.metallib beside " + path_ + ": this build's Metal compiler had no "
                         "-std=metal4.0 (Xcode 26.2 or newer with the Metal toolchain builds them)";
        return;
      }
      std::vector<TensorLibrary> libs;
      for (const std::string& path : paths) {
        NSError* err = nil;
        id<MTLLibrary> lib = [dev_ newLibraryWithURL:[NSURL fileURLWithPath:@(path.c_str())] error:&err];
        if (lib) {
          libs.push_back(TensorLibrary{lib, path});
          continue;
        }
        const std::string note = "cannot load " + path + ": " + to_string([err localizedDescription]);
        tensor_notes_ += (tensor_notes_.empty() ? "" : "; ") + note;
        std::fprintf(stderr, "lily: %s; its kernels' family uses the simdgroup_matrix kernels\n", note.c_str());
      }
      if (libs.empty()) {
        tensor_status_ = tensor_notes_;
        return;
      }
      auto with = [&](const char* probe) -> const TensorLibrary* {
        for (const TensorLibrary& t : libs)
          if ([t.lib newFunctionWithName:@(probe)] != nil) return &t;
        return nullptr;
      };
      if (const TensorLibrary* t = with("tensor_ops_probe")) {
        tensor_status_ = probe_error(t->lib, "tensor_ops_probe", t->path);
        if (!tensor_status_.empty()) return;
      }
      tensor_libs_ = std::move(libs);
      const TensorLibrary* t = with("tensor_ops_probe_bfloat");
      bfloat_status_ = t ? probe_error(t->lib, "tensor_ops_probe_bfloat", t->path)
                         : "the bfloat probe tensor_ops_probe_bfloat (lily_tensor_attention_prefill.metallib) is "
                           "not loaded";
    } else {
      tensor_status_ = "Metal 4 tensor operations need macOS 26";
    }
  }

  id<MTLDevice> dev_;
  id<MTLCommandQueue> queue_;
  id<MTLLibrary> lib_;
  struct TensorLibrary {
    id<MTLLibrary> lib;
    std::string path;
  };
  std::vector<TensorLibrary> tensor_libs_;  // empty: no tensor kernels (tensor_status_ says why)
  std::string path_;
  std::string tensor_status_;
  std::string tensor_notes_;   // the tensor libraries that did not load, while others did
  std::string bfloat_status_;  // why the bfloat tensor kernels are off while tensor libraries are loaded
  int family_ = -1;
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<MetalPipeline>> cache_;
  std::shared_ptr<InFlight> inflight_ = std::make_shared<InFlight>();
};

gpu::ComputePass& MetalCommandBuffer::compute_pass(gpu::BarrierMode mode) {
  if (committed_) throw UsageError("compute_pass: the command buffer was already committed");
  if (!encoders_.empty()) encoders_.back()->end();
  end_blit();
  id<MTLComputeCommandEncoder> enc = nil;
  @autoreleasepool {
    enc = [cb_ computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
  }
  if (!enc) throw Error("cannot create a concurrent compute encoder");
  encoders_.push_back(std::make_unique<MetalPass>(dev_, mode, &counters_, records_dispatches(), enc, keep_.get()));
  return *encoders_.back();
}

}  // namespace

std::unique_ptr<gpu::Device> make_metal_device(const std::string& metallib_path) {
  return std::make_unique<MetalDevice>(metallib_path);
}

std::string gpu_family(const gpu::Device& device) { return gpu::gpu_family_name(device.gpu_family()); }

}  // namespace lily::metal
