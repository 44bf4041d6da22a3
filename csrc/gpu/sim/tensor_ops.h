// Reference semantics of the Metal 4 tensor-operation subset (docs/device-layer.md,
// "Metal 4 tensor operations"): the type-erased engine behind the <metal_tensor> and
// <MetalPerformancePrimitives/MetalPerformancePrimitives.h> shims. Implemented in
// tensor_ops.cpp on top of the executor (kernel_runtime.h).
//
// Model of one operation (matmul2d::run, cooperative_tensor::load/store) with an
// execution scope of T threads (execution_thread: 1, execution_simdgroup: the 32 lanes of
// the caller's simdgroup, execution_simdgroups<N>: the whole threadgroup of 32*N threads):
//   * every thread of the scope must call the same operations in the same order; the k-th
//     call of each thread belongs to the k-th instance of the scope. Different operations
//     in one instance, or an instance some thread never reaches, fail the dispatch;
//   * the call is a collective: a thread waits until every thread of the scope arrived;
//   * matmul2d::run reads its tensor operands when the first thread of the scope arrives
//     and checks, when the last arrives, that they did not change meanwhile (a write by a
//     thread of the scope racing with the operation: a missing threadgroup_barrier); a
//     cooperative input is the union of the slots every thread brings to the call (a slot
//     no thread filled is poison);
//   * arithmetic is float: each product float(a) * float(b) is rounded to float and added
//     to the destination element in increasing k order (starting from the destination's
//     value for multiply_accumulate, from 0 for multiply);
//   * elements the operation leaves unspecified (destination rows/columns beyond the
//     operands' extents) are poison (NaN).
#pragma once

#include <cstdint>

namespace lily::sim::tensor_ops {

enum class DType : uint8_t { f32, f16, bf16 };

// A rank-2 tensor_inline view: element (i0, i1) lives at data + i0 + i1 * stride1
// elements; extent 0 is the innermost dimension (a row-major matrix [rows][cols] has
// ext0 = cols, ext1 = rows, stride1 = the row pitch).
struct View {
  void* data = nullptr;
  DType dtype = DType::f32;
  int32_t ext0 = 0, ext1 = 0;
  int64_t stride1 = 0;
};

enum class ScopeKind : uint8_t { thread, simdgroup, simdgroups };
struct Scope {
  ScopeKind kind = ScopeKind::thread;
  int simdgroups = 1;  // N of execution_simdgroups<N>
};
constexpr int scope_threads(Scope s) {
  return s.kind == ScopeKind::thread ? 1 : s.kind == ScopeKind::simdgroup ? 32 : 32 * s.simdgroups;
}

// matmul2d with descriptor (m, n, k, ...): destination (m x n) (=|+=) left (m x K) * right (K x n).
// k < 0: K comes from the operands' extents (dynamic_extent).
struct Matmul {
  int m = 0, n = 0, k = -1;
  bool transpose_left = false, transpose_right = false, accumulate = false;
};

// Layout of a destination cooperative tensor in the simulator (implementation-defined in
// Metal: kernels must use get_capacity / is_valid_element / get_multidimensional_index).
// Slot i of the thread with index t in the scope holds element e = i * T + t of the
// m x n tile, row e % m and column e / m; it is valid when e < m * n. There is always at
// least one invalid slot per thread, so a kernel that ignores is_valid_element is caught.
constexpr int coop_capacity(int m, int n, int threads) { return (m * n + threads - 1) / threads + 1; }
constexpr bool coop_valid(int m, int n, int threads, int t, int slot) {
  return slot >= 0 && int64_t(slot) * threads + t < int64_t(m) * n;
}
constexpr int coop_row(int m, int threads, int t, int slot) { return int((int64_t(slot) * threads + t) % m); }
constexpr int coop_col(int m, int threads, int t, int slot) { return int((int64_t(slot) * threads + t) / m); }

// Layout of a cooperative *input* tensor (get_left_input_cooperative_tensor /
// get_right_input_cooperative_tensor; implementation-defined in Metal like the destination's,
// and not the destination's). The operand is seen as the tile its tensor_inline form would
// have: the left one (K, m) extents, with transpose_left (m, K); the right one (n, K), with
// transpose_right (K, n); get_multidimensional_index gives {index along extent 0, along
// extent 1}. Slot i of the thread with index t in a T-thread scope holds element
// e = i * T + (T - 1 - t) (the threads in reverse, so that a kernel assuming the slots of an
// input and of a destination hold the same elements is caught), at
// (e / ext1, e % ext1); valid when e < ext0 * ext1, with one invalid slot more, as above.
enum class Role : uint8_t { destination, left, right };
constexpr int input_ext0(const Matmul& op, Role r) {
  return r == Role::left ? (op.transpose_left ? op.m : op.k) : (op.transpose_right ? op.k : op.n);
}
constexpr int input_ext1(const Matmul& op, Role r) {
  return r == Role::left ? (op.transpose_left ? op.k : op.m) : (op.transpose_right ? op.n : op.k);
}
constexpr int input_capacity(const Matmul& op, Role r, int threads) {
  return (input_ext0(op, r) * input_ext1(op, r) + threads - 1) / threads + 1;
}
constexpr int64_t input_element(int threads, int t, int slot) {
  return int64_t(slot) * threads + (threads - 1 - t);
}
constexpr bool input_valid(const Matmul& op, Role r, int threads, int t, int slot) {
  return slot >= 0 && input_element(threads, t, slot) < int64_t(input_ext0(op, r)) * input_ext1(op, r);
}
constexpr int input_i0(const Matmul& op, Role r, int threads, int t, int slot) {
  return int(input_element(threads, t, slot) / input_ext1(op, r));
}
constexpr int input_i1(const Matmul& op, Role r, int threads, int t, int slot) {
  return int(input_element(threads, t, slot) % input_ext1(op, r));
}

// An operand of matmul2d::run: a tensor (view) or the calling thread's slots of a
// cooperative input tensor (coop: its get_capacity() values, converted to float exactly;
// dtype: its element type).
struct Operand {
  const View* view = nullptr;
  const float* coop = nullptr;
  DType dtype = DType::f32;
};

// Validates that the calling thread can take part in an operation of scope s (full
// simdgroups; execution_simdgroups<N> needs exactly N simdgroups in the threadgroup) and
// returns its index in the scope.
int scope_index(Scope s);

// One thread's call of matmul2d::run. left, right: tensors or cooperative inputs (then the
// descriptor's k is explicit). dst: a tensor destination (float), or nullptr with coop: the
// calling thread's cooperative-tensor slots (coop_capacity(m, n, T) floats).
void run(const Matmul& op, Scope s, const Operand& left, const Operand& right, const View* dst, float* coop);
// One thread's cooperative_tensor::load / store: its valid slots from/to a float view
// (elements outside the view's extents: load gives poison, store skips them).
void coop_load(const Matmul& op, Scope s, float* coop, const View& src);
void coop_store(const Matmul& op, Scope s, const float* coop, const View& dst);

// Fails the dispatch with a message naming the tensor operation.
[[noreturn]] void fail(const char* message);

}  // namespace lily::sim::tensor_ops
