// The Metal simulator as a lily::gpu::Device.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "gpu/device.h"

namespace lily::sim {

enum class StageOrder { forward, reverse, random };

// Most OS threads a simulator device takes (SimOptions::threads, $LILY_SIM_THREADS).
constexpr unsigned kMaxSimThreads = 1024;

struct SimOptions {
  // Encode and count (dispatches, barrier stages, declared bytes) without executing
  // kernels or allocating buffer storage.
  bool record_only = false;
  // Order in which the dispatches of one barrier-free stage execute. A correct schedule
  // gives identical results in every order.
  StageOrder order = StageOrder::forward;
  // Order of threadgroups within a dispatch and of threads within a threadgroup (at start
  // and whenever a barrier or simd collective releases them). A kernel missing a barrier
  // gives different results in different orders.
  StageOrder thread_order = StageOrder::forward;
  uint64_t seed = 0;  // for the random orders
  // Fill new buffers and threadgroup memory with 0xFF bytes (NaN in every float type).
  bool poison = true;
  // After each dispatch, check that no byte outside its declared write ranges changed
  // in any buffer it binds, and that no byte of a disjoint-tagged write range changed by an
  // earlier dispatch of the same barrier stage changed again (HazardError otherwise).
  bool verify_writes = false;
  // After each dispatch, run it again with every byte of its buffers outside the declared
  // read ranges zeroed; a different result in its declared write ranges is a HazardError
  // (an undeclared read). Doubles execution time. Read-only file mappings are not zeroed.
  bool verify_reads = false;
  // The Apple GPU family the device reports (gpu::Device::gpu_family). 10 (apple10, M5)
  // enables the Metal 4 tensor-op kernels (metal/*_tensor.metal), as on a Mac; below it
  // looking them up is a UsageError.
  int gpu_family = 9;
  // With gpu_family 10: false emulates a system whose tensor-op library takes half but not
  // bfloat operands (the operand table of MacOSX 26.0's MPPTensorOpsMatMul2d.h): the GEMMs'
  // tensor kernels stay, the bfloat ones (the prefill attention's) are a UsageError.
  bool bfloat_tensor_ops = true;
  // Where the elements of Metal 4 cooperative tensors lie (tensor_ops.h): "sim", an
  // adversarial layout that catches kernels assuming one, or "nax", the M5's fragment layout
  // for execution_simdgroup tiles with extents multiples of 16 (the one MLX's NAX kernels
  // assume; other scopes and shapes keep "sim"). Anything else is a UsageError. Accepted with
  // every gpu_family; only apple10 runs tensor-op kernels.
  std::string tensor_layout = "sim";
  // The memory budget the device reports (gpu::Device::memory_limits; 0 = none), to test the
  // runtime's load-time memory check without a Mac. A new_buffer larger than max_buffer_bytes
  // fails, as on Metal.
  uint64_t working_set_bytes = 0;
  uint64_t max_buffer_bytes = 0;
  // Caps every pipeline's maxTotalThreadsPerThreadgroup below the kernel's declared
  // [[max_total_threads_per_threadgroup]] (0 = no cap), as a Mac's compiler may under
  // register pressure: tests the load-time refusal.
  uint32_t pipeline_thread_limit = 0;
  // OS threads running threadgroups (the queue thread and threads - 1 helpers; at most
  // kMaxSimThreads); 0: default_sim_threads(). With 1, threadgroups and dispatches run
  // one after another on the queue thread. Results do not depend on it for a kernel whose
  // threadgroups do not race (docs/device-layer.md, "Execution model and guarantees").
  unsigned threads = 0;
  // Faults injected into named kernels, to test the runtime's fallbacks without a Mac:
  // "build" (the pipeline does not build: gpu::Error, as a Metal compiler may refuse it),
  // "wrong" (every dispatch of it runs, then flips bit 6 of byte 3 of every 64-byte block of
  // its declared write ranges: wrong results), or a decimal number (the pipeline's thread
  // limit, as a Mac's compiler may set it under register pressure).
  std::map<std::string, std::string> faults;
};

// The default of SimOptions::threads: $LILY_SIM_THREADS if set and not empty (1..kMaxSimThreads,
// else a UsageError naming it), otherwise the CPUs this process may run on.
unsigned default_sim_threads();

std::unique_ptr<gpu::Device> make_sim_device(const SimOptions& options = {});

}  // namespace lily::sim
