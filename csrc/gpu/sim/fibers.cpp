// Fiber stacks and context switches (see fibers.h). x86-64 Linux switches with a few lines
// of assembly; elsewhere (macOS arm64) with ucontext, which also saves the signal mask.
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 600  // ucontext (deprecated on macOS, but available); before any header
#define _DARWIN_C_SOURCE 1
#endif
#include "gpu/sim/fibers.h"

#include <cstdint>
#include <cstdlib>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "gpu/device.h"

#if defined(__SANITIZE_ADDRESS__)
#define LILY_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LILY_ASAN 1
#endif
#endif
#ifdef LILY_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__) && defined(__linux__) && !defined(LILY_SIM_UCONTEXT)
#define LILY_ASM_SWITCH 1
#else
#include <ucontext.h>
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wdeprecated-declarations"  // ucontext on macOS
#endif
#endif

namespace lily::sim {

#ifdef LILY_ASM_SWITCH
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack,
// stores the stack pointer in *save_sp and returns on new_sp's stack.
extern "C" void lily_sim_switch(void** save_sp, void* new_sp);
asm(R"(
  .text
  .globl lily_sim_switch
  .hidden lily_sim_switch
  .type lily_sim_switch,@function
lily_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size lily_sim_switch,.-lily_sim_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

namespace {

// ASan's fake frames and redzones make kernel frames several times larger.
#ifdef LILY_ASAN
constexpr size_t kStackSize = 1024 * 1024;
#else
constexpr size_t kStackSize = 256 * 1024;
#endif

#ifndef LILY_ASM_SWITCH
// The ucontext_t sits at the top of the fiber's mapping, so Fiber stays platform-free.
constexpr size_t kContextBytes = (sizeof(ucontext_t) + 63) & ~size_t(63);
#endif

size_t page_size() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

struct Stack {
  unsigned char* base;  // lowest usable address (above the guard page)
  size_t size;          // the whole mapping above the guard page
};

}  // namespace

struct FiberHost::Impl {
  std::vector<Stack> pool;
  Fiber* current = nullptr;
#ifdef LILY_ASM_SWITCH
  void* host_sp = nullptr;
#else
  ucontext_t host_ctx;
#endif
#ifdef LILY_ASAN
  void* host_fake = nullptr;
  const void* host_bottom = nullptr;
  size_t host_size = 0;
#endif
};

namespace {

thread_local FiberHost::Impl* t_host = nullptr;  // the host resuming a fiber on this thread

// Back to the host from fiber f; `exiting`: f's frames are gone for good (ASan frees them).
void switch_out(FiberHost::Impl& h, Fiber& f, bool exiting) {
#ifdef LILY_ASAN
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f.asan_fake_stack, h.host_bottom, h.host_size);
#else
  (void)exiting;
#endif
#ifdef LILY_ASM_SWITCH
  lily_sim_switch(&f.context, h.host_sp);
#else
  swapcontext(static_cast<ucontext_t*>(f.context), &h.host_ctx);
#endif
#ifdef LILY_ASAN
  __sanitizer_finish_switch_fiber(f.asan_fake_stack, nullptr, nullptr);
#endif
}

// First frame of every fiber.
[[noreturn]] void fiber_main() {
  FiberHost::Impl& h = *t_host;
  Fiber& f = *h.current;
#ifdef LILY_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &h.host_bottom, &h.host_size);
#endif
  f.entry(f.arg);
  switch_out(h, f, true);
  std::abort();  // unreachable: a finished fiber is never resumed
}

}  // namespace

FiberHost::FiberHost() : impl_(std::make_unique<Impl>()) {}

FiberHost::~FiberHost() {
  const size_t ps = page_size();
  for (Stack& s : impl_->pool) {
#ifdef LILY_ASAN
    // The pages go back to the system with the redzones of the fibers' last frames still
    // in ASan's shadow; whoever maps them next (the interpreter's allocator) would be
    // reported for writing "stack redzones".
    __asan_unpoison_memory_region(s.base, s.size);
#endif
    ::munmap(s.base - ps, s.size + ps);
  }
}

void FiberHost::start(Fiber& f, void (*entry)(void*), void* arg) {
  Stack s;
  if (!impl_->pool.empty()) {
    s = impl_->pool.back();
    impl_->pool.pop_back();
  } else {
    const size_t ps = page_size();
    void* p = ::mmap(nullptr, kStackSize + ps, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw gpu::Error("simulator: cannot allocate a fiber stack");
    ::mprotect(p, ps, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
    s = Stack{static_cast<unsigned char*>(p) + ps, kStackSize};
  }
#ifdef LILY_ASAN
  // A reused stack still carries the redzones of the frames of the fiber that ran on it.
  __asan_unpoison_memory_region(s.base, s.size);
#endif
  f.stack = s.base;
  f.entry = entry;
  f.arg = arg;
  f.started = false;
  f.asan_fake_stack = nullptr;
#ifdef LILY_ASM_SWITCH
  f.stack_size = s.size;
  uintptr_t top = reinterpret_cast<uintptr_t>(s.base + s.size) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                                  // fake return address
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);            // popped by ret
  for (int i = 0; i < 6; ++i) *--sp = 0;                      // rbp rbx r12 r13 r14 r15
  *--sp = uint64_t(0x1F80) | (uint64_t(0x037F) << 32);        // mxcsr, x87 control word
  f.context = sp;
#else
  f.stack_size = s.size - kContextBytes;
  auto* ctx = reinterpret_cast<ucontext_t*>(s.base + f.stack_size);
  f.context = ctx;
  getcontext(ctx);
  ctx->uc_stack.ss_sp = f.stack;
  ctx->uc_stack.ss_size = f.stack_size;
  ctx->uc_link = nullptr;
  makecontext(ctx, reinterpret_cast<void (*)()>(&fiber_main), 0);
#endif
}

void FiberHost::resume(Fiber& f) {
  Impl& h = *impl_;
  FiberHost::Impl* prev = t_host;
  t_host = &h;
  h.current = &f;
  f.started = true;
#ifdef LILY_ASAN
  __sanitizer_start_switch_fiber(&h.host_fake, f.stack, f.stack_size);
#endif
#ifdef LILY_ASM_SWITCH
  lily_sim_switch(&h.host_sp, f.context);
#else
  swapcontext(&h.host_ctx, static_cast<ucontext_t*>(f.context));
#endif
#ifdef LILY_ASAN
  __sanitizer_finish_switch_fiber(h.host_fake, nullptr, nullptr);
#endif
  h.current = nullptr;
  t_host = prev;
}

void FiberHost::suspend(Fiber& f) { switch_out(*impl_, f, false); }

void FiberHost::release(Fiber& f) {
  if (!f.stack) return;
#ifdef LILY_ASM_SWITCH
  impl_->pool.push_back(Stack{f.stack, f.stack_size});
#else
  impl_->pool.push_back(Stack{f.stack, f.stack_size + kContextBytes});
#endif
  f.stack = nullptr;
  f.context = nullptr;
}

}  // namespace lily::sim
