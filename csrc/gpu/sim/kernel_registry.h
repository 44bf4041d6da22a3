// Kernel registration for the simulator. The source transform (msl2cpp.py) turns each
// `template [[host_name("x")]] [[kernel]] decltype(f<T>) f<T>;` (and each non-template
// `kernel void f(...)`) into a static Registrar that records the function, its parameters'
// MSL attributes and an invoker that builds the arguments for the running thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gpu/sim/kernel_runtime.h"

namespace lily::sim {

enum class Attr : uint8_t {
  buffer,
  threadgroup,
  thread_position_in_grid,
  thread_position_in_threadgroup,
  threadgroup_position_in_grid,
  threads_per_threadgroup,
  dispatch_threads_per_threadgroup,
  threads_per_grid,
  threadgroups_per_grid,
  thread_index_in_threadgroup,
  simdgroup_index_in_threadgroup,
  thread_index_in_simdgroup,
  simdgroups_per_threadgroup,
  threads_per_simdgroup,
};

struct ParamAttr {
  Attr attr;
  uint32_t index;    // [[buffer(index)]] / [[threadgroup(index)]]
  const char* decl;  // the parameter as written in the .metal source, e.g. "device const uint4* w"
};

struct ParamInfo {
  Attr attr;
  uint32_t index;
  bool pointer;     // T* (bound to a buffer or threadgroup memory)
  bool reference;   // T& (bound to a buffer: needs ref_size bytes)
  size_t ref_size;  // sizeof(T) for references
  size_t align;     // alignof(T) for T* and T& (1 for void*): the binding's offset must be a multiple
  const char* decl; // as in ParamAttr
};

struct KernelInfo {
  std::string name;         // host name
  std::string where;        // "file.metal:line" of the instantiation
  std::vector<ParamInfo> params;
  uint32_t max_threads = 1024;
  std::string error;        // a parameter the simulator cannot bind (reported at lookup)
  // Defined in a metal/*_tensor.metal file (Metal 4 tensor operations): on a Mac it lives
  // in lily_tensor.metallib, so the simulator offers it only when the device's GPU family
  // supports tensor operations (apple10).
  bool tensor_ops = false;
  // A tensor-op kernel whose file declares bfloat tensors (msl2cpp.py): offered only where
  // bfloat tensor operations are too (SimOptions::bfloat_tensor_ops). The executor fails any
  // other kernel that runs a bfloat tensor operation, so the flag cannot silently be wrong.
  bool tensor_bfloat = false;
  void (*invoke)(void (*fn)(), const KernelInfo& k) = nullptr;
  void (*fn)() = nullptr;
};

void register_kernel(KernelInfo info);
const std::vector<KernelInfo>& registered_kernels();

namespace detail {

template <class A> A position_arg(const U3& u) {
  using D = std::decay_t<A>;
  if constexpr (std::is_arithmetic_v<D>) {
    return D(u.x);
  } else {
    D r{};
    r.x = decltype(r.x)(u.x);
    if constexpr (sizeof(r) >= 2 * sizeof(r.x)) r[1] = decltype(r.x)(u.y);
    if constexpr (sizeof(r) >= 3 * sizeof(r.x)) r[2] = decltype(r.x)(u.z);
    return r;
  }
}

// Alignment of what a pointer/reference parameter points at (void: 1).
template <class A> constexpr size_t pointee_align() {
  using T = std::remove_cv_t<std::remove_pointer_t<std::remove_reference_t<A>>>;
  if constexpr (std::is_void_v<T>) return 1;
  else return alignof(T);
}

// Binding memory for a pointer/reference parameter. Dispatch validation rejects offsets
// that are not a multiple of the pointee's alignment; this is the last line of defence
// (a misaligned vector access would crash the process).
inline unsigned char* checked_arg(const ParamInfo& p) {
  unsigned char* ptr;
  if (p.attr == Attr::threadgroup) {
    ptr = threadgroup_arg(p.index);
  } else {
    size_t avail = 0;
    ptr = buffer_arg(p.index, &avail);
  }
  if (reinterpret_cast<uintptr_t>(ptr) % p.align)
    misaligned_arg(p.attr == Attr::threadgroup ? "threadgroup" : "buffer", p.index, p.align);
  return ptr;
}

template <class A> A make_arg(const ParamInfo& p) {
  if constexpr (std::is_pointer_v<A>) {
    return reinterpret_cast<A>(checked_arg(p));
  } else if constexpr (std::is_reference_v<A>) {
    return *reinterpret_cast<std::remove_reference_t<A>*>(checked_arg(p));
  } else {
    const ThreadCoords& c = coords();
    switch (p.attr) {
      case Attr::thread_position_in_grid: return position_arg<A>(c.thread_position_in_grid);
      case Attr::thread_position_in_threadgroup: return position_arg<A>(c.thread_position_in_threadgroup);
      case Attr::threadgroup_position_in_grid: return position_arg<A>(c.threadgroup_position_in_grid);
      case Attr::threads_per_threadgroup: return position_arg<A>(c.threads_per_threadgroup);
      case Attr::dispatch_threads_per_threadgroup: return position_arg<A>(c.dispatch_threads_per_threadgroup);
      case Attr::threads_per_grid: return position_arg<A>(c.threads_per_grid);
      case Attr::threadgroups_per_grid: return position_arg<A>(c.threadgroups_per_grid);
      case Attr::thread_index_in_threadgroup: return position_arg<A>(U3{c.thread_index_in_threadgroup, 0, 0});
      case Attr::simdgroup_index_in_threadgroup: return position_arg<A>(U3{c.simdgroup_index_in_threadgroup, 0, 0});
      case Attr::thread_index_in_simdgroup: return position_arg<A>(U3{c.thread_index_in_simdgroup, 0, 0});
      case Attr::simdgroups_per_threadgroup: return position_arg<A>(U3{c.simdgroups_per_threadgroup, 0, 0});
      case Attr::threads_per_simdgroup: return position_arg<A>(U3{c.threads_per_simdgroup, 0, 0});
      default: kernel_fail("internal: bad positional attribute");
    }
  }
}

template <class A> ParamInfo describe(const ParamAttr& a) {
  ParamInfo p{a.attr, a.index, std::is_pointer_v<A>, std::is_reference_v<A>, 0, 1, a.decl};
  if constexpr (std::is_reference_v<A>) p.ref_size = sizeof(std::remove_reference_t<A>);
  if constexpr (std::is_pointer_v<A> || std::is_reference_v<A>) p.align = pointee_align<A>();
  return p;
}

}  // namespace detail

template <class Sig> struct Registrar;
template <class... Args> struct Registrar<void(Args...)> {
  using Fn = void (*)(Args...);
  template <size_t... I>
  static void call(Fn f, const KernelInfo& k, std::index_sequence<I...>) {
    f(detail::make_arg<Args>(k.params[I])...);
  }
  static void invoke(void (*fn)(), const KernelInfo& k) {
    call(reinterpret_cast<Fn>(fn), k, std::index_sequence_for<Args...>{});
  }
  Registrar(const char* name, Fn f, const ParamAttr* attrs, size_t n, uint32_t max_threads,
            const char* where, bool tensor_ops = false, bool tensor_bfloat = false) {
    KernelInfo k;
    k.name = name;
    k.where = where;
    k.tensor_ops = tensor_ops;
    k.tensor_bfloat = tensor_bfloat;
    k.max_threads = max_threads;
    k.invoke = &invoke;
    k.fn = reinterpret_cast<void (*)()>(f);
    if (n != sizeof...(Args)) {
      k.error = "parameter count mismatch between the transform and the signature";
    } else {
      size_t i = 0;
      ((k.params.push_back(detail::describe<Args>(attrs[i])), ++i), ...);
      for (size_t j = 0; j < k.params.size(); ++j) {
        const ParamInfo& p = k.params[j];
        bool bound = p.attr == Attr::buffer || p.attr == Attr::threadgroup;
        if (bound && !p.pointer && !p.reference)
          k.error = "parameter " + std::to_string(j) + " has [[buffer]]/[[threadgroup]] but is not a pointer or reference";
        if (!bound && (p.pointer || p.reference))
          k.error = "parameter " + std::to_string(j) + " is a pointer/reference without [[buffer]]/[[threadgroup]]";
        if (p.attr == Attr::threadgroup && !p.pointer)
          k.error = "parameter " + std::to_string(j) + ": [[threadgroup]] parameters must be pointers";
      }
    }
    register_kernel(std::move(k));
  }
};

}  // namespace lily::sim
