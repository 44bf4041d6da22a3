// Fiber stacks and context switches (see fibers.h). The switch is chosen at build time:
//  * x86-64 Linux: a few lines of assembly (LILY_SWITCH_ASM);
//  * elsewhere (macOS arm64): _setjmp/_longjmp (LILY_SWITCH_SJLJ), which save the registers
//    but not the signal mask, so a switch makes no system call; ucontext only enters a stack
//    the first time it is used, and the loop it starts there runs every later fiber given
//    that stack;
//  * -DLILY_SIM_UCONTEXT: swapcontext for every switch (LILY_SWITCH_UCONTEXT), which saves and
//    restores the signal mask, one system call per switch; -DLILY_SIM_SJLJ picks the second
//    on x86-64 Linux too (tests/sim/test_sim_fibers.py runs all three).
#if defined(LILY_SIM_UCONTEXT)
#define LILY_SWITCH_UCONTEXT 1
#elif defined(__x86_64__) && defined(__linux__) && !defined(LILY_SIM_SJLJ)
#define LILY_SWITCH_ASM 1
#else
#define LILY_SWITCH_SJLJ 1
// glibc's fortified _longjmp refuses to jump to another stack
#undef _FORTIFY_SOURCE
#endif
#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 600  // ucontext (deprecated on macOS, but available); before any header
#define _DARWIN_C_SOURCE 1
#endif
#include "gpu/sim/fibers.h"

#include <cstdint>
#include <cstdlib>
#include <new>
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

#ifndef LILY_SWITCH_ASM
#include <setjmp.h>
#include <ucontext.h>
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wdeprecated-declarations"  // ucontext on macOS
#endif
#endif

namespace lily::sim {

#ifdef LILY_SWITCH_ASM
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

#ifndef LILY_SWITCH_ASM
// What a stack needs besides the fiber's frames, at the top of its mapping (so Fiber stays
// platform-free; Fiber::context points at it).
struct StackTop {
  ucontext_t boot;  // ucontext: the fiber's context; sjlj: enters the stack's loop once
#ifdef LILY_SWITCH_SJLJ
  jmp_buf resume;       // where the fiber on this stack continues (its suspend, or the loop)
  bool booted = false;  // the loop runs on this stack
  bool idle = true;     // the loop waits for a fiber: the stack may be reused
#endif
};
constexpr size_t kContextBytes = (sizeof(StackTop) + 63) & ~size_t(63);
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
#if defined(LILY_SWITCH_ASM)
  void* host_sp = nullptr;
#elif defined(LILY_SWITCH_SJLJ)
  jmp_buf host_jb;
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

#ifndef LILY_SWITCH_ASM
StackTop& top(Fiber& f) { return *static_cast<StackTop*>(f.context); }
#endif

// AddressSanitizer's fiber annotations: the host's stack left for f's, and back in the host.
void asan_enter(FiberHost::Impl& h, Fiber& f) {
#ifdef LILY_ASAN
  __sanitizer_start_switch_fiber(&h.host_fake, f.stack, f.stack_size);
#else
  (void)h, (void)f;
#endif
}
void asan_entered_host(FiberHost::Impl& h) {
#ifdef LILY_ASAN
  __sanitizer_finish_switch_fiber(h.host_fake, nullptr, nullptr);
#else
  (void)h;
#endif
}
// f's stack left for the host's; `exiting`: f's frames are gone for good (ASan frees them).
void asan_leave(FiberHost::Impl& h, Fiber& f, bool exiting) {
#ifdef LILY_ASAN
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f.asan_fake_stack, h.host_bottom, h.host_size);
#else
  (void)h, (void)f, (void)exiting;
#endif
}
// On a fiber's stack, once switched to: `first`: the fiber's first frame.
void asan_entered_fiber(FiberHost::Impl& h, Fiber& f, bool first) {
#ifdef LILY_ASAN
  if (first) __sanitizer_finish_switch_fiber(nullptr, &h.host_bottom, &h.host_size);
  else __sanitizer_finish_switch_fiber(f.asan_fake_stack, nullptr, nullptr);
#else
  (void)h, (void)f, (void)first;
#endif
}

// Back to the host from fiber f, until f is resumed (not when exiting).
void switch_out(FiberHost::Impl& h, Fiber& f, bool exiting) {
  asan_leave(h, f, exiting);
#if defined(LILY_SWITCH_ASM)
  lily_sim_switch(&f.context, h.host_sp);
#elif defined(LILY_SWITCH_SJLJ)
  if (_setjmp(top(f).resume) == 0) _longjmp(h.host_jb, 1);
#else
  swapcontext(&top(f).boot, &h.host_ctx);
#endif
  asan_entered_fiber(h, f, false);
}

#ifdef LILY_SWITCH_SJLJ
// The loop a stack runs from its first use on: each fiber given the stack, one after another.
// A finished fiber's last switch saves the loop's place for the next one.
[[noreturn]] void stack_loop() {
  StackTop& t = top(*t_host->current);
  for (;;) {
    FiberHost::Impl& h = *t_host;
    Fiber& f = *h.current;
    asan_entered_fiber(h, f, true);
    t.idle = false;
    f.entry(f.arg);
    t.idle = true;
    asan_leave(h, f, true);
    if (_setjmp(t.resume) == 0) _longjmp(h.host_jb, 1);
  }
}
#else
// First frame of every fiber.
[[noreturn]] void fiber_main() {
  FiberHost::Impl& h = *t_host;
  Fiber& f = *h.current;
  asan_entered_fiber(h, f, true);
  f.entry(f.arg);
  switch_out(h, f, true);
  std::abort();  // unreachable: a finished fiber is never resumed
}
#endif

void unmap(const Stack& s) {
  const size_t ps = page_size();
#ifdef LILY_ASAN
  // The pages go back to the system with the redzones of the fibers' last frames still
  // in ASan's shadow; whoever maps them next (the interpreter's allocator) would be
  // reported for writing "stack redzones".
  __asan_unpoison_memory_region(s.base, s.size);
#endif
  ::munmap(s.base - ps, s.size + ps);
}

}  // namespace

FiberHost::FiberHost() : impl_(std::make_unique<Impl>()) {}

FiberHost::~FiberHost() {
  for (Stack& s : impl_->pool) unmap(s);
}

void FiberHost::start(Fiber& f, void (*entry)(void*), void* arg) {
  Stack s;
  bool fresh = impl_->pool.empty();
  if (!fresh) {
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
#ifdef LILY_SWITCH_ASM
  (void)fresh;
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
  f.context = s.base + f.stack_size;
#ifdef LILY_SWITCH_SJLJ
  if (!fresh) return;  // its loop waits for the fiber (release() keeps only idle stacks)
  new (f.context) StackTop;
#endif
  ucontext_t* ctx = &top(f).boot;
  getcontext(ctx);
  ctx->uc_stack.ss_sp = f.stack;
  ctx->uc_stack.ss_size = f.stack_size;
  ctx->uc_link = nullptr;
#ifdef LILY_SWITCH_SJLJ
  makecontext(ctx, reinterpret_cast<void (*)()>(&stack_loop), 0);
#else
  makecontext(ctx, reinterpret_cast<void (*)()>(&fiber_main), 0);
#endif
#endif
}

void FiberHost::resume(Fiber& f) {
  Impl& h = *impl_;
  FiberHost::Impl* prev = t_host;
  t_host = &h;
  h.current = &f;
  f.started = true;
  asan_enter(h, f);
#if defined(LILY_SWITCH_ASM)
  lily_sim_switch(&h.host_sp, f.context);
#elif defined(LILY_SWITCH_SJLJ)
  if (_setjmp(h.host_jb) == 0) {
    StackTop& t = top(f);
    if (t.booted) _longjmp(t.resume, 1);
    t.booted = true;
    ucontext_t from;  // never resumed: the stack's loop comes back with _longjmp
    swapcontext(&from, &t.boot);
  }
#else
  swapcontext(&h.host_ctx, &top(f).boot);
#endif
  asan_entered_host(h);
  h.current = nullptr;
  t_host = prev;
}

void FiberHost::suspend(Fiber& f) { switch_out(*impl_, f, false); }

void FiberHost::release(Fiber& f) {
  if (!f.stack) return;
#ifdef LILY_SWITCH_ASM
  impl_->pool.push_back(Stack{f.stack, f.stack_size});
#else
  const Stack s{f.stack, f.stack_size + kContextBytes};
#ifdef LILY_SWITCH_SJLJ
  if (!top(f).idle) {
    unmap(s);  // left in the middle of a fiber: its loop cannot take another one
    f.stack = nullptr;
    f.context = nullptr;
    return;
  }
#endif
  impl_->pool.push_back(s);
#endif
  f.stack = nullptr;
  f.context = nullptr;
}

}  // namespace lily::sim
