// Cooperative fibers for the simulator: stacks, context switches and the AddressSanitizer
// fiber annotations. Knows nothing of Metal: the executor (executor.cpp) decides which
// fiber runs when and what a barrier or collective means.
// Kept apart so the platform code (assembly, ucontext, mmap) is in one small file and
// the Metal semantics read without it.
#pragma once

#include <cstddef>
#include <memory>

namespace lily::sim {

// One cooperatively scheduled thread of execution. Plain data owned by the caller and
// written only by FiberHost (the caller reads `started`).
struct Fiber {
  unsigned char* stack = nullptr;  // lowest usable address (above the guard page)
  size_t stack_size = 0;
  void* context = nullptr;         // saved stack pointer, or the ucontext_t (platform)
  void* asan_fake_stack = nullptr;
  void (*entry)(void*) = nullptr;
  void* arg = nullptr;
  bool started = false;            // has run at least once (its stack is in use)
};

// Runs fibers on the calling OS thread, from its own stack. One per OS thread; not
// reentrant (a fiber does not start fibers).
class FiberHost {
 public:
  FiberHost();
  ~FiberHost();  // unmaps the pooled stacks
  FiberHost(const FiberHost&) = delete;
  FiberHost& operator=(const FiberHost&) = delete;

  // Gives f a stack (reused from the pool when one is free). Its first resume() calls
  // entry(arg) on that stack; entry must not throw; when it returns, f is finished and
  // that resume() returns.
  void start(Fiber& f, void (*entry)(void*), void* arg);
  // Runs f until it suspends or finishes. Called from the host's own stack.
  void resume(Fiber& f);
  // Called on the running fiber f's stack: back to the host, until f is resumed.
  void suspend(Fiber& f);
  // Returns f's stack to the pool (f finished, or never started).
  void release(Fiber& f);

  struct Impl;  // platform state, defined in fibers.cpp

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace lily::sim
