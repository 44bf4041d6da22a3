// The Metal execution model on top of the fibers (fibers.h): threadgroups of simulated
// threads, the scheduler that orders them, barriers, simd collectives, simdgroup_matrix
// sharing, threadgroup memory with its guard zones, and the kernel registry.
#include "gpu/sim/executor.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>

#include "gpu/device.h"
#include "gpu/sim/fibers.h"

namespace lily::sim {

// ------------------------------------------------------------------ registry
namespace {
std::vector<KernelInfo>& registry() {
  static std::vector<KernelInfo> r;
  return r;
}
}  // namespace
void register_kernel(KernelInfo info) { registry().push_back(std::move(info)); }
const std::vector<KernelInfo>& registered_kernels() { return registry(); }

const char* simdgroup_op_name(SimdgroupOp op) {
  switch (op) {
    case SimdgroupOp::none: return "none";
    case SimdgroupOp::barrier: return "simdgroup_barrier";
    case SimdgroupOp::sum: return "simd_sum";
    case SimdgroupOp::product: return "simd_product";
    case SimdgroupOp::min: return "simd_min";
    case SimdgroupOp::max: return "simd_max";
    case SimdgroupOp::band: return "simd_and";
    case SimdgroupOp::bor: return "simd_or";
    case SimdgroupOp::bxor: return "simd_xor";
    case SimdgroupOp::prefix_incl_sum: return "simd_prefix_inclusive_sum";
    case SimdgroupOp::prefix_excl_sum: return "simd_prefix_exclusive_sum";
    case SimdgroupOp::prefix_incl_product: return "simd_prefix_inclusive_product";
    case SimdgroupOp::prefix_excl_product: return "simd_prefix_exclusive_product";
    case SimdgroupOp::shuffle: return "simd_shuffle";
    case SimdgroupOp::shuffle_xor: return "simd_shuffle_xor";
    case SimdgroupOp::shuffle_up: return "simd_shuffle_up";
    case SimdgroupOp::shuffle_down: return "simd_shuffle_down";
    case SimdgroupOp::broadcast: return "simd_broadcast";
    case SimdgroupOp::ballot: return "simd_ballot";
    case SimdgroupOp::any: return "simd_any";
    case SimdgroupOp::all: return "simd_all";
    case SimdgroupOp::shuffle_rotate_down: return "simd_shuffle_rotate_down";
    case SimdgroupOp::shuffle_rotate_up: return "simd_shuffle_rotate_up";
    case SimdgroupOp::broadcast_first: return "simd_broadcast_first";
    case SimdgroupOp::is_first: return "simd_is_first";
    case SimdgroupOp::shuffle_and_fill_up: return "simd_shuffle_and_fill_up";
    case SimdgroupOp::shuffle_and_fill_down: return "simd_shuffle_and_fill_down";
    case SimdgroupOp::quad_sum: return "quad_sum";
    case SimdgroupOp::quad_product: return "quad_product";
    case SimdgroupOp::quad_min: return "quad_min";
    case SimdgroupOp::quad_max: return "quad_max";
    case SimdgroupOp::quad_prefix_incl_sum: return "quad_prefix_inclusive_sum";
    case SimdgroupOp::quad_prefix_excl_sum: return "quad_prefix_exclusive_sum";
    case SimdgroupOp::quad_shuffle: return "quad_shuffle";
    case SimdgroupOp::quad_shuffle_xor: return "quad_shuffle_xor";
    case SimdgroupOp::quad_shuffle_up: return "quad_shuffle_up";
    case SimdgroupOp::quad_shuffle_down: return "quad_shuffle_down";
    case SimdgroupOp::quad_broadcast: return "quad_broadcast";
    case SimdgroupOp::tensor_op: return "a tensor operation (execution_simdgroup)";
  }
  return "?";
}

namespace {

// Thrown on a fiber for a kernel error; "aborted" unwinds a thread whose threadgroup has
// already failed (its message is the first error, kept in Threadgroup::error).
struct KernelFault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One simulated GPU thread: a fiber plus what Metal says about it.
struct Thread {
  enum class State { runnable, blocked, done };
  State state = State::runnable;
  ThreadCoords c;
  int simd = 0, lane = 0;
  bool at_barrier = false;
  bool at_rendezvous = false;
  uint64_t matrix_ops = 0;  // simdgroup_matrix operations this thread has performed
  Fiber fiber;
};

// One simdgroup_matrix operation computed by the first lane that reached it (simd_matrix_op),
// kept until every live lane of the simdgroup has passed it.
struct MatrixMemo {
  MatrixFn fn = nullptr;
  size_t size[3] = {};  // bytes of the operands a, b, c
  int uses = 0;         // lanes that have passed this operation
  alignas(16) unsigned char in[3][kMatrixOperandMax];
  alignas(16) unsigned char out[kMatrixOperandMax];
  MatrixMemo() {}  // user-provided: emplace_back() leaves the byte arrays uninitialised
};

// A simdgroup's collective in progress: lanes deposit operands in `in` and wait until
// every live lane has arrived; the last one computes every result (complete_collective).
struct SimdState {
  int lanes = 0, live = 0, arrived = 0;
  // Matrix operations [memo_head, memo_tail) of simd_matrix_op, operation i at
  // memo[i & (memo.size() - 1)] (a ring; the size is 0 or a power of two).
  std::vector<MatrixMemo> memo;
  uint64_t memo_head = 0, memo_tail = 0;
  SimdgroupOp op = SimdgroupOp::none;
  CollectiveFn fn = nullptr;
  int first_lane_in = -1;
  bool waiting[kSimdWidth] = {};
  uint32_t arg[kSimdWidth] = {};
  alignas(16) unsigned char in[kSimdWidth][kCollectiveSlot];
  alignas(16) unsigned char out[kSimdWidth][kCollectiveSlot];
};

// A `threadgroup T x;` declaration's storage, found by the address of the declaration.
struct TgVar {
  const void* key;
  void* ptr;
  size_t size;  // the guard zone follows
  void* base;   // the allocation (ptr is inside it: see threadgroup_var)
};

// One threadgroup being run: its threads, the run queue, and what they wait for. Threads
// run one at a time on one OS thread until they block, so no locks are needed.
struct Threadgroup {
  std::vector<Thread> threads;
  std::vector<SimdState> simds;
  std::deque<int> runq;  // runnable threads, in the dispatch's thread order
  int n = 0, done = 0, barrier_arrived = 0;
  int rendezvous_arrived = 0;
  const char* rendezvous_what = nullptr;
  std::vector<TgVar> vars;
  std::vector<std::pair<const void*, std::unique_ptr<ThreadgroupExtension>>> extensions;
  unsigned char* dyn[kMaxBindings] = {};
  size_t bytes = 0;     // threadgroup memory in use (limit kMaxThreadgroupMemory)
  bool failed = false;  // the first error stops the threadgroup; the rest unwind
  std::string error;
  int order_mode = 0;
  std::mt19937_64* rng = nullptr;  // order_mode 2: this threadgroup's own
  // Pushes threads onto the run queue in the configured order.
  void schedule(std::vector<int>& ts) {
    if (order_mode == 1) std::reverse(ts.begin(), ts.end());
    if (order_mode == 2) std::shuffle(ts.begin(), ts.end(), *rng);
    for (int t : ts) runq.push_back(t);
  }
};

// The executor on one OS thread: the fibers' host and the running dispatch.
struct Worker {
  FiberHost host;
  const ExecDispatch* d = nullptr;
  Threadgroup* tg = nullptr;
  Thread* cur = nullptr;
};

thread_local Worker* t_worker = nullptr;

Worker& worker() {
  if (!t_worker) throw std::logic_error("lily simulator: no kernel is running on this thread");
  return *t_worker;
}

// Runs thread t until it blocks or returns.
void run(Worker& w, Thread& t) {
  w.cur = &t;
  w.host.resume(t.fiber);
  w.cur = nullptr;
}

std::string where(const Thread& f) {
  std::ostringstream s;
  const ThreadCoords& c = f.c;
  s << "threadgroup (" << c.threadgroup_position_in_grid.x << "," << c.threadgroup_position_in_grid.y
    << "," << c.threadgroup_position_in_grid.z << ") thread (" << c.thread_position_in_threadgroup.x
    << "," << c.thread_position_in_threadgroup.y << "," << c.thread_position_in_threadgroup.z << ")";
  return s.str();
}

void fail_tg(Worker& w, const std::string& msg) {
  if (!w.tg->failed) {
    w.tg->failed = true;
    w.tg->error = msg;
  }
}

void complete_collective(Threadgroup& tg, SimdState& s, int base) {
  CollectiveView v;
  v.lanes = s.lanes;
  for (int l = 0; l < kSimdWidth; ++l) {
    v.active[l] = l < s.lanes && s.waiting[l];
    v.arg[l] = s.arg[l];
    v.in[l] = s.in[l];
    v.out[l] = s.out[l];
  }
  s.fn(v);
  Worker& w = worker();
  std::vector<int> woken;
  for (int l = 0; l < s.lanes; ++l)
    if (s.waiting[l]) {
      s.waiting[l] = false;
      Thread& f = tg.threads[base + l];
      if (&f != w.cur && f.state == Thread::State::blocked) {
        f.state = Thread::State::runnable;
        woken.push_back(base + l);
      }
    }
  tg.schedule(woken);
  s.arrived = 0;
  s.op = SimdgroupOp::none;
  s.fn = nullptr;
}

// The running thread waits (its state says for what) until another thread wakes it.
void block(Worker& w) {
  Thread& t = *w.cur;
  t.state = Thread::State::blocked;
  w.host.suspend(t.fiber);
  if (w.tg->failed) throw KernelFault("aborted");  // unwinds this fiber's stack
}

// The calling thread arrives where the whole threadgroup meets (a barrier, a rendezvous):
// the last to arrive wakes those waiting (marked by `waits`), the others wait.
void meet(Worker& w, int& arrived, bool Thread::*waits) {
  Threadgroup& tg = *w.tg;
  arrived += 1;
  if (arrived < tg.n) {
    w.cur->*waits = true;
    block(w);
    return;
  }
  arrived = 0;
  std::vector<int> woken;
  for (int t = 0; t < tg.n; ++t) {
    Thread& o = tg.threads[t];
    if (o.*waits) {
      o.*waits = false;
      o.state = Thread::State::runnable;
      woken.push_back(t);
    }
  }
  tg.schedule(woken);
}

// A returning thread: threads still waiting for it at a barrier are an error, and a
// collective its simdgroup's other lanes wait in may now be complete.
void thread_exit(Worker& w, Thread& f) {
  Threadgroup& tg = *w.tg;
  f.state = Thread::State::done;
  tg.done += 1;
  SimdState& s = tg.simds[f.simd];
  s.live -= 1;
  if (tg.barrier_arrived > 0 && !tg.failed)
    fail_tg(w, where(f) + " returned while " + std::to_string(tg.barrier_arrived) +
                   " thread(s) of its threadgroup wait at threadgroup_barrier (every thread must reach it)");
  if (tg.rendezvous_arrived > 0 && !tg.failed)
    fail_tg(w, where(f) + " returned while " + std::to_string(tg.rendezvous_arrived) + " thread(s) of its threadgroup wait in " +
                   tg.rendezvous_what + " (every thread of the execution scope must call it)");
  if (s.arrived > 0 && s.arrived == s.live && !tg.failed) complete_collective(tg, s, f.simd * kSimdWidth);
}

// A thread's body, on its fiber: the kernel, then the checks of a returning thread.
void thread_main(void* arg) {
  Worker& w = *static_cast<Worker*>(arg);
  Thread& f = *w.cur;
  try {
    w.d->kernel->invoke(w.d->kernel->fn, *w.d->kernel);
  } catch (const KernelFault& e) {
    if (std::strcmp(e.what(), "aborted") != 0) fail_tg(w, where(f) + ": " + e.what());
  } catch (const std::exception& e) {
    fail_tg(w, where(f) + ": " + e.what());
  } catch (...) {
    fail_tg(w, where(f) + ": unknown exception");
  }
  thread_exit(w, f);
}

std::string deadlock_report(const Threadgroup& tg) {
  std::ostringstream s;
  s << "deadlock: " << tg.n - tg.done << " of " << tg.n << " threads cannot proceed";
  if (tg.barrier_arrived) s << "; " << tg.barrier_arrived << " wait at threadgroup_barrier";
  if (tg.rendezvous_arrived) s << "; " << tg.rendezvous_arrived << " wait in " << tg.rendezvous_what;
  for (size_t i = 0; i < tg.simds.size(); ++i) {
    const SimdState& sg = tg.simds[i];
    if (sg.arrived)
      s << "; simdgroup " << i << ": " << sg.arrived << " of " << sg.live << " live lanes wait in "
        << simdgroup_op_name(sg.op);
  }
  s << " (a barrier or simd collective in divergent control flow?)";
  return s.str();
}

// Resumes every started, unfinished thread of a failed threadgroup: each throws from its
// blocking point and unwinds, so no stack is left half-used.
void unwind_all(Worker& w, Threadgroup& tg) {
  for (Thread& t : tg.threads)
    if (t.fiber.started && t.state != Thread::State::done) run(w, t);
}

// Runs threadgroup `tgpos` to the end; then checks for deadlock, guard zones and the
// extensions' end-of-threadgroup rules. Throws gpu::Error naming the kernel. `rng` orders
// the threads when d.thread_order is 2 (random).
void run_threadgroup(Worker& w, const ExecDispatch& d, U3 tgpos, std::mt19937_64* rng) {
  Threadgroup tg;
  tg.order_mode = d.thread_order;
  tg.rng = rng;
  w.d = &d;
  w.tg = &tg;
  U3 size = d.threadgroup_size;
  // dispatchThreads: the edge threadgroups are partial.
  uint32_t dims[3] = {size.x, size.y, size.z};
  uint32_t pos[3] = {tgpos.x, tgpos.y, tgpos.z};
  uint32_t grid[3] = {d.threads_per_grid.x, d.threads_per_grid.y, d.threads_per_grid.z};
  uint32_t full[3] = {size.x, size.y, size.z};
  for (int i = 0; i < 3; ++i) {
    uint64_t start = uint64_t(pos[i]) * full[i];
    if (start + dims[i] > grid[i]) dims[i] = uint32_t(grid[i] - start);
  }
  U3 actual{dims[0], dims[1], dims[2]};
  tg.n = int(uint64_t(actual.x) * actual.y * actual.z);
  int nsimd = (tg.n + kSimdWidth - 1) / kSimdWidth;
  tg.simds.resize(nsimd);
  for (int s = 0; s < nsimd; ++s) {
    tg.simds[s].lanes = std::min(kSimdWidth, tg.n - s * kSimdWidth);
    tg.simds[s].live = tg.simds[s].lanes;
  }
  // dynamic threadgroup memory
  struct Cleanup {
    Worker& w;
    Threadgroup& tg;
    ~Cleanup() {
      for (Thread& t : tg.threads) w.host.release(t.fiber);
      for (unsigned char*& p : tg.dyn) std::free(p);  // posix_memalign
      for (TgVar& v : tg.vars) std::free(v.base);
      w.tg = nullptr;
    }
  } cleanup{w, tg};
  for (uint32_t i = 0; i < kMaxBindings; ++i)
    if (d.threadgroup_memory[i]) {
      // Aligned for any MSL type (long4 needs 32); exact size, so ASan sees overruns.
      void* mem = nullptr;
      if (posix_memalign(&mem, kBindingAlignment, d.threadgroup_memory[i] + kGuardBytes) != 0)
        throw gpu::Error("simulator: out of memory for threadgroup memory");
      tg.dyn[i] = static_cast<unsigned char*>(mem);
      std::memset(tg.dyn[i], d.poison ? kPoison : 0, d.threadgroup_memory[i]);
      set_guard(tg.dyn[i] + d.threadgroup_memory[i]);
      tg.bytes += d.threadgroup_memory[i];
    }

  tg.threads.resize(tg.n);
  for (int t = 0; t < tg.n; ++t) {
    Thread& f = tg.threads[t];
    ThreadCoords& c = f.c;
    c.thread_position_in_threadgroup = U3{uint32_t(t) % actual.x, (uint32_t(t) / actual.x) % actual.y,
                                          uint32_t(t) / (actual.x * actual.y)};
    c.threadgroup_position_in_grid = tgpos;
    c.threads_per_threadgroup = actual;
    c.dispatch_threads_per_threadgroup = size;
    c.threads_per_grid = d.threads_per_grid;
    c.threadgroups_per_grid = d.threadgroups;
    c.thread_position_in_grid = U3{tgpos.x * size.x + c.thread_position_in_threadgroup.x,
                                   tgpos.y * size.y + c.thread_position_in_threadgroup.y,
                                   tgpos.z * size.z + c.thread_position_in_threadgroup.z};
    c.thread_index_in_threadgroup = uint32_t(t);
    c.simdgroup_index_in_threadgroup = uint32_t(t / kSimdWidth);
    c.thread_index_in_simdgroup = uint32_t(t % kSimdWidth);
    c.simdgroups_per_threadgroup = uint32_t(nsimd);
    c.threads_per_simdgroup = kSimdWidth;
    f.simd = t / kSimdWidth;
    f.lane = t % kSimdWidth;
    w.host.start(f.fiber, &thread_main, &w);
  }
  {
    std::vector<int> all(tg.n);
    std::iota(all.begin(), all.end(), 0);
    tg.schedule(all);
  }

  // Each thread runs until it blocks or returns; an empty queue with threads left is a deadlock.
  while (!tg.runq.empty()) {
    int t = tg.runq.front();
    tg.runq.pop_front();
    Thread& f = tg.threads[t];
    if (f.state != Thread::State::runnable) continue;
    run(w, f);
    if (tg.failed) break;
  }
  if (tg.failed) {
    unwind_all(w, tg);
    throw gpu::Error("kernel '" + d.label + "': " + tg.error);
  }
  auto where = [&] {
    return "kernel '" + d.label + "' threadgroup (" + std::to_string(tgpos.x) + "," + std::to_string(tgpos.y) +
           "," + std::to_string(tgpos.z) + "): ";
  };
  if (tg.done != tg.n) {
    std::string msg = deadlock_report(tg);
    tg.failed = true;
    unwind_all(w, tg);
    throw gpu::Error(where() + msg);
  }
  for (uint32_t i = 0; i < kMaxBindings; ++i)
    if (tg.dyn[i] && !check_guard(tg.dyn[i] + d.threadgroup_memory[i]))
      throw gpu::Error(where() + "wrote past the end of [[threadgroup(" + std::to_string(i) + ")]] memory (" +
                       std::to_string(d.threadgroup_memory[i]) + " bytes): an out-of-bounds index");
  for (const TgVar& v : tg.vars)
    if (!check_guard(static_cast<unsigned char*>(v.ptr) + v.size))
      throw gpu::Error(where() + "wrote past the end of a threadgroup array (" + std::to_string(v.size) +
                       " bytes): an out-of-bounds index");
  for (auto& e : tg.extensions) {
    std::string msg = e.second->finish();
    if (!msg.empty()) throw gpu::Error(where() + msg);
  }
}

}  // namespace

// ------------------------------------------------------------------ runtime API
const KernelInfo& running_kernel() { return *running_dispatch().kernel; }

const ExecDispatch& running_dispatch() { return *worker().d; }

const ThreadCoords& coords() {
  Worker& w = worker();
  if (!w.cur) throw std::logic_error("lily simulator: no current thread");
  return w.cur->c;
}

unsigned char* buffer_arg(uint32_t index, size_t* available) {
  Worker& w = worker();
  if (index >= kMaxBindings || !w.d->buffers[index].bound) kernel_fail("buffer(" + std::to_string(index) + ") is not bound");
  *available = w.d->buffers[index].available;
  return w.d->buffers[index].ptr;
}

unsigned char* threadgroup_arg(uint32_t index) {
  Worker& w = worker();
  if (index >= kMaxBindings || !w.tg->dyn[index])
    kernel_fail("threadgroup(" + std::to_string(index) + ") memory has no length set");
  return w.tg->dyn[index];
}

void* threadgroup_var(const void* key, size_t size, size_t align) {
  Worker& w = worker();
  Threadgroup& tg = *w.tg;
  for (const TgVar& v : tg.vars)
    if (v.key == key) return v.ptr;
  tg.bytes += size;
  if (tg.bytes > kMaxThreadgroupMemory)
    kernel_fail("threadgroup memory exceeds " + std::to_string(kMaxThreadgroupMemory) + " bytes (" +
                std::to_string(tg.bytes) + " requested)");
  // Aligned exactly as declared, never more (address = align mod 2 * align): a float array
  // read as float4 is misaligned here as it may be on a GPU, and the sanitizer build
  // (-fsanitize=alignment, tools/run_sim_asan.sh) reports the access.
  constexpr size_t kMaxAlign = 64;
  if (align == 0 || align > kMaxAlign || (align & (align - 1)))
    kernel_fail("threadgroup variable with unsupported alignment " + std::to_string(align));
  const size_t skew = align < kMaxAlign ? align : 0;
  void* base = nullptr;
  if (posix_memalign(&base, kMaxAlign, skew + size + kGuardBytes + 1) != 0)
    kernel_fail("out of memory for threadgroup variable");
  void* p = static_cast<unsigned char*>(base) + skew;
  std::memset(p, w.d->poison ? kPoison : 0, size);
  set_guard(static_cast<unsigned char*>(p) + size);
  tg.vars.push_back(TgVar{key, p, size, base});
  return p;
}

void threadgroup_barrier() {
  Worker& w = worker();
  Threadgroup& tg = *w.tg;
  if (tg.done > 0)
    kernel_fail("threadgroup_barrier reached after " + std::to_string(tg.done) +
                " thread(s) of the threadgroup returned (every thread must reach it)");
  if (tg.rendezvous_arrived > 0)
    kernel_fail("threadgroup_barrier reached while " + std::to_string(tg.rendezvous_arrived) +
                " thread(s) of the threadgroup wait in " + tg.rendezvous_what + " (divergent control flow?)");
  meet(w, tg.barrier_arrived, &Thread::at_barrier);
}

void threadgroup_rendezvous(const char* what) {
  Worker& w = worker();
  Threadgroup& tg = *w.tg;
  if (tg.done > 0)
    kernel_fail(std::string(what) + " reached after " + std::to_string(tg.done) +
                " thread(s) of the threadgroup returned (every thread of the execution scope must call it)");
  if (tg.barrier_arrived > 0)
    kernel_fail(std::string(what) + " called while " + std::to_string(tg.barrier_arrived) +
                " thread(s) of the threadgroup wait at threadgroup_barrier (divergent control flow?)");
  if (tg.rendezvous_arrived > 0 && std::strcmp(tg.rendezvous_what, what) != 0)
    kernel_fail(std::string("divergent tensor operations: this thread calls ") + what + " while " +
                std::to_string(tg.rendezvous_arrived) + " thread(s) wait in " + tg.rendezvous_what);
  tg.rendezvous_what = what;
  meet(w, tg.rendezvous_arrived, &Thread::at_rendezvous);
}

ThreadgroupExtension& threadgroup_extension(const void* key, ThreadgroupExtension* (*make)()) {
  Threadgroup& tg = *worker().tg;
  for (auto& e : tg.extensions)
    if (e.first == key) return *e.second;
  tg.extensions.emplace_back(key, std::unique_ptr<ThreadgroupExtension>(make()));
  return *tg.extensions.back().second;
}

const unsigned char* simd_collective(SimdgroupOp op, const void* operand, size_t size, uint32_t arg,
                                     CollectiveFn fn) {
  Worker& w = worker();
  Threadgroup& tg = *w.tg;
  Thread& f = *w.cur;
  SimdState& s = tg.simds[f.simd];
  if (s.arrived > 0 && (s.op != op || s.fn != fn))
    kernel_fail(std::string("divergent simd collectives in simdgroup ") + std::to_string(f.simd) + ": lane " +
                std::to_string(f.lane) + " calls " + simdgroup_op_name(op) + " while lane " +
                std::to_string(s.first_lane_in) + " waits in " + simdgroup_op_name(s.op) +
                (s.op == op ? " with another operand type" : ""));
  if (s.arrived == 0) {
    s.op = op;
    s.fn = fn;
    s.first_lane_in = f.lane;
  }
  if (size) std::memcpy(s.in[f.lane], operand, size);
  s.arg[f.lane] = arg;
  s.waiting[f.lane] = true;
  s.arrived += 1;
  if (s.arrived == s.live) {
    complete_collective(tg, s, f.simd * kSimdWidth);
  } else {
    block(w);
  }
  return s.out[f.lane];
}

void simd_matrix_op(MatrixFn fn, const void* a, size_t a_size, const void* b, size_t b_size,
                    const void* c, size_t c_size, void* d, size_t d_size) {
  Worker& w = worker();
  Thread& f = *w.cur;
  SimdState& s = w.tg->simds[f.simd];
  const uint64_t n = f.matrix_ops++;
  if (n >= s.memo_head && n < s.memo_tail) {  // an earlier lane computed operation n
    const uint64_t mask = s.memo.size() - 1;
    MatrixMemo& m = s.memo[n & mask];
    m.uses += 1;
    if (m.fn == fn && m.size[0] == a_size && m.size[1] == b_size && m.size[2] == c_size &&
        std::memcmp(m.in[0], a, a_size) == 0 && std::memcmp(m.in[1], b, b_size) == 0 &&
        std::memcmp(m.in[2], c, c_size) == 0)
      std::memcpy(d, m.out, d_size);
    else
      fn(a, b, c, d);  // this lane's operands differ: its own result
    while (s.memo_head < s.memo_tail && s.memo[s.memo_head & mask].uses >= s.live) s.memo_head += 1;
    return;
  }
  const bool fits = a_size <= kMatrixOperandMax && b_size <= kMatrixOperandMax &&
                    c_size <= kMatrixOperandMax && d_size <= kMatrixOperandMax;
  if (s.live < 2 || n != s.memo_tail || !fits) {  // nobody to share with (or lanes out of step)
    fn(a, b, c, d);
    return;
  }
  if (s.memo_tail - s.memo_head == s.memo.size()) {  // full: double the ring, keep the order
    std::vector<MatrixMemo> grown(std::max<size_t>(64, 2 * s.memo.size()));
    for (uint64_t i = s.memo_head; i < s.memo_tail; ++i)
      grown[i & (grown.size() - 1)] = s.memo[i & (s.memo.size() - 1)];
    s.memo.swap(grown);
  }
  MatrixMemo& m = s.memo[n & (s.memo.size() - 1)];
  s.memo_tail += 1;
  m.fn = fn;
  m.uses = 1;
  m.size[0] = a_size;
  m.size[1] = b_size;
  m.size[2] = c_size;
  std::memcpy(m.in[0], a, a_size);
  std::memcpy(m.in[1], b, b_size);
  std::memcpy(m.in[2], c, c_size);
  fn(a, b, c, d);
  std::memcpy(m.out, d, d_size);
}

void kernel_fail(const std::string& message) { throw KernelFault(message); }

void misaligned_arg(const char* kind, uint32_t index, size_t align) {
  kernel_fail(std::string(kind) + "(" + std::to_string(index) + ") memory is not aligned to " +
              std::to_string(align) + " bytes, the alignment of the parameter's type");
}

// ------------------------------------------------------------------ dispatch
// Threadgroups run in one sequence per run() (Metal gives no order among them): a forward,
// reverse or shuffled order shows kernels that depend on one; several OS threads take them
// from the sequence as they become free, so neighbouring threadgroups run at the same time.
struct Executor::Job {
  const ExecDispatch* ds = nullptr;
  size_t n = 0;
  std::vector<uint64_t> start;               // ds[i]'s threadgroups are [start[i], start[i + 1])
  std::vector<std::vector<uint32_t>> order;  // thread_order 2: ds[i]'s threadgroups (linear) in run order
  std::atomic<uint64_t> next{0};             // the next sequence number to start
  std::atomic<uint64_t> limit{0};            // none from here on is started: the earliest failure
  std::mutex mu;
  uint64_t failed_at = UINT64_MAX;  // under mu: the earliest failure and its error
  std::exception_ptr error;
};

namespace {

// The seed of a threadgroup's thread order in random mode: a function of the dispatch's seed
// and the threadgroup (splitmix64), never of the OS thread or of what ran before on it.
uint64_t threadgroup_seed(uint64_t seed, uint64_t linear) {
  uint64_t z = seed + (linear + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// This OS thread's worker (its fibers' host), kept for the thread's lifetime.
Worker& this_worker() {
  thread_local std::unique_ptr<Worker> own;
  if (!own) own = std::make_unique<Worker>();
  return *own;
}

// Starts threadgroups of `job` on this OS thread until none is left to start.
void work(Executor::Job& job) {
  Worker& w = this_worker();
  Worker* prev = t_worker;
  t_worker = &w;
  struct Restore {
    Worker& w;
    Worker* prev;
    ~Restore() {
      w.d = nullptr;
      t_worker = prev;
    }
  } restore{w, prev};
  size_t i = 0;
  for (;;) {
    const uint64_t k = job.next.fetch_add(1, std::memory_order_relaxed);
    if (k >= job.limit.load(std::memory_order_relaxed)) return;  // every later one too
    while (k >= job.start[i + 1]) ++i;  // sequence numbers only grow on one thread
    const ExecDispatch& d = job.ds[i];
    const uint64_t j = k - job.start[i], count = job.start[i + 1] - job.start[i];
    const uint64_t linear = d.thread_order == 0 ? j : d.thread_order == 1 ? count - 1 - j : job.order[i][j];
    const uint64_t gx = d.threadgroups.x, gxy = gx * d.threadgroups.y;
    const U3 pos{uint32_t(linear % gx), uint32_t(linear % gxy / gx), uint32_t(linear / gxy)};
    try {
      if (d.thread_order == 2) {
        std::mt19937_64 rng(threadgroup_seed(d.seed, linear));
        run_threadgroup(w, d, pos, &rng);
      } else {
        run_threadgroup(w, d, pos, nullptr);
      }
    } catch (...) {
      std::lock_guard<std::mutex> g(job.mu);
      if (k < job.failed_at) {
        job.failed_at = k;
        job.error = std::current_exception();
        job.limit.store(k, std::memory_order_relaxed);
      }
    }
  }
}

}  // namespace

Executor::Executor(unsigned threads) : threads_(std::max(1u, threads)) {}

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : helpers_) t.join();
}

void Executor::helper() {
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    wake_.wait(g, [&] { return stop_ || wanted_ > 0; });
    if (stop_) return;
    Job* job = job_;
    wanted_ -= 1;
    active_ += 1;
    g.unlock();
    work(*job);
    g.lock();
    if (--active_ == 0) idle_.notify_all();
  }
}

void Executor::run(const ExecDispatch* ds, size_t n) {
  Job job;
  job.ds = ds;
  job.n = n;
  job.start.resize(n + 1);
  job.order.resize(n);
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const ExecDispatch& d = ds[i];
    const uint64_t count = uint64_t(d.threadgroups.x) * d.threadgroups.y * d.threadgroups.z;
    job.start[i] = total;
    total += count;
    if (d.thread_order == 2) {  // the threadgroup order of the serial simulator, from the same seed
      std::vector<uint32_t>& o = job.order[i];
      o.resize(count);
      std::iota(o.begin(), o.end(), 0u);
      std::mt19937_64 rng(d.seed);
      std::shuffle(o.begin(), o.end(), rng);
    }
  }
  job.start[n] = total;
  job.limit.store(total, std::memory_order_relaxed);
  // Helpers only for threadgroups the calling thread cannot start at once.
  const unsigned helpers = unsigned(std::min<uint64_t>(threads_ - 1, total ? total - 1 : 0));
  if (helpers) {
    // started at the first run that needs them: a device that never runs a wide dispatch
    // (most of the tests' devices) has no idle threads
    if (helpers_.empty())
      for (unsigned t = 1; t < threads_; ++t) helpers_.emplace_back([this] { helper(); });
    {
      std::lock_guard<std::mutex> g(mu_);
      job_ = &job;
      wanted_ = helpers;
    }
    for (unsigned h = 0; h < helpers; ++h) wake_.notify_one();
  }
  work(job);
  if (helpers) {
    std::unique_lock<std::mutex> g(mu_);
    wanted_ = 0;  // a helper not yet awake stays out: nothing is left to start
    job_ = nullptr;
    idle_.wait(g, [&] { return active_ == 0; });
  }
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace lily::sim
