// The simulator's executor: runs dispatches of registered kernels threadgroup by
// threadgroup, each threadgroup's threads as cooperatively scheduled fibers on one OS
// thread, the threadgroups spread over a pool of OS threads.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gpu/sim/kernel_registry.h"
#include "gpu/sim/tensor_ops.h"

namespace lily::sim {

constexpr uint32_t kMaxBindings = 31;
// Alignment of buffer storage, inline constant bytes and dynamic threadgroup memory in
// the simulator: at least the largest alignment of an MSL type (long4: 32).
constexpr size_t kBindingAlignment = 64;

// Guard zone after every simulator allocation (buffer storage, threadgroup memory): a kernel
// writing up to kGuardBytes past the end changes it, and the dispatch fails naming the
// allocation instead of corrupting the host heap. Off under AddressSanitizer, whose own
// redzones report the faulting source line (and need exact sizes).
#if defined(__SANITIZE_ADDRESS__)
#define LILY_SIM_GUARDS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LILY_SIM_GUARDS 0
#endif
#endif
#ifndef LILY_SIM_GUARDS
#define LILY_SIM_GUARDS 1
#endif
constexpr size_t kGuardBytes = LILY_SIM_GUARDS ? 4096 : 0;
constexpr unsigned char kGuardByte = 0xA5;
inline void set_guard(unsigned char* end) { std::memset(end, kGuardByte, kGuardBytes); }
// True when the kGuardBytes at `end` are intact; otherwise restores them and returns false.
inline bool check_guard(unsigned char* end) {
  for (size_t i = 0; i < kGuardBytes; ++i)
    if (end[i] != kGuardByte) {
      set_guard(end);
      return false;
    }
  return true;
}

struct ExecBinding {
  unsigned char* ptr = nullptr;  // buffer contents + offset, or inline bytes
  size_t available = 0;          // bytes from ptr to the end of the binding
  bool bound = false;
};

struct ExecDispatch {
  const KernelInfo* kernel = nullptr;
  std::string label;
  U3 threadgroups;        // threadgroups per grid
  U3 threadgroup_size;    // as dispatched
  U3 threads_per_grid;    // total threads (for dispatchThreads, the exact grid)
  ExecBinding buffers[kMaxBindings];
  size_t threadgroup_memory[kMaxBindings] = {};
  bool poison = true;
  // Order in which threadgroups start and in which the threads of a threadgroup are
  // scheduled (initially and when a barrier or collective releases them):
  // 0 forward, 1 reverse, 2 random (seeded: the threadgroup order from `seed`, each
  // threadgroup's thread order from `seed` and its position, so it does not depend on which
  // OS thread runs it). Code with a missing barrier gives different results under different
  // orders.
  int thread_order = 0;
  uint64_t seed = 0;
  // Where the elements of cooperative tensors lie (SimOptions::tensor_layout).
  tensor_ops::Layout tensor_layout = tensor_ops::Layout::sim;
};

// The kernel of the running dispatch (valid only while a kernel runs on the executor).
const KernelInfo& running_kernel();
// The running dispatch (same validity).
const ExecDispatch& running_dispatch();

// Runs dispatches on a pool of OS threads: the calling thread and threads - 1 helpers
// (started by the first run() with more than one threadgroup), each running whole
// threadgroups (a threadgroup's fibers never leave the OS thread that started it).
// Threadgroups of one dispatch, and of the dispatches given to one run(), may run at the
// same time, as on a GPU; with threads == 1 they run one after another on the caller's
// thread. Not reentrant: one run() at a time (the simulator's queue thread calls it).
class Executor {
 public:
  explicit Executor(unsigned threads);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;
  unsigned threads() const { return threads_; }

  // Runs every threadgroup of ds[0..n). Threadgroups are started in one sequence: ds[0]'s in
  // its thread_order, then ds[1]'s, ...; an OS thread takes the next one when it is free. If
  // threadgroups fail (a kernel fault, deadlock, divergent collective, a guard zone), the one
  // earliest in that sequence is reported, whichever OS thread found it first: its error is
  // rethrown (lily::gpu::Error naming the kernel, the threadgroup and the thread), and it is
  // the error threads == 1 reports. Threadgroups after it may or may not have run.
  void run(const ExecDispatch* ds, size_t n);

  struct Job;  // one run(): defined in executor.cpp

 private:
  void helper();
  unsigned threads_;
  std::vector<std::thread> helpers_;
  std::mutex mu_;
  std::condition_variable wake_, idle_;
  Job* job_ = nullptr;  // under mu_: the run() helpers may join
  unsigned wanted_ = 0;  // under mu_: helpers still to join job_
  unsigned active_ = 0;  // under mu_: helpers working on job_
  bool stop_ = false;
};

}  // namespace lily::sim
