// The simulator's executor: runs one dispatch of a registered kernel, threadgroup by
// threadgroup, each threadgroup's threads as cooperatively scheduled fibers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gpu/sim/kernel_registry.h"

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
  // 0 forward, 1 reverse, 2 random (seeded). Code with a missing barrier gives different
  // results under different orders.
  int thread_order = 0;
  uint64_t seed = 0;
};

// The kernel of the running dispatch (valid only while a kernel runs on the executor).
const KernelInfo& running_kernel();

// Runs every threadgroup of d. Throws lily::gpu::Error naming the kernel, the threadgroup
// and the thread on a kernel fault, deadlock or divergent collective.
void execute(const ExecDispatch& d);

}  // namespace lily::sim
