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

// The element-to-thread layouts of cooperative tensors (implementation-defined in Metal:
// kernels must use get_capacity / is_valid_element / get_multidimensional_index). A
// simulator device uses one of two (SimOptions::tensor_layout), chosen per dispatch:
//   * sim (the default): an adversarial layout, below, that no kernel assuming a layout
//     can meet by chance;
//   * nax: the fragment layout of Apple's M5 hardware for execution_simdgroup operations
//     (the one MLX's NAX kernels assume), for tiles whose two extents are multiples of 16;
//     every other scope or shape keeps the sim layout (nax_slot).
// The capacity of a cooperative tensor is a compile-time constant, the same in both.
enum class Layout : uint8_t { sim, nax };
// The layout of the device running the calling kernel (valid only inside a dispatch).
Layout current_layout();

// The sim layout of a destination: slot i of the thread with index t in the scope holds
// element e = i * T + t of the m x n tile, row e % m and column e / m; it is valid when
// e < m * n. There is always at least one invalid slot per thread, so a kernel that ignores
// is_valid_element is caught.
constexpr int coop_capacity(int m, int n, int threads) { return (m * n + threads - 1) / threads + 1; }
constexpr bool coop_valid(int m, int n, int threads, int t, int slot) {
  return slot >= 0 && int64_t(slot) * threads + t < int64_t(m) * n;
}
constexpr int coop_row(int m, int threads, int t, int slot) { return int((int64_t(slot) * threads + t) % m); }
constexpr int coop_col(int m, int threads, int t, int slot) { return int((int64_t(slot) * threads + t) / m); }

// The sim layout of a cooperative *input* tensor (get_left_input_cooperative_tensor /
// get_right_input_cooperative_tensor; not the destination's). The operand is seen as the
// tile its tensor_inline form would have: the left one (K, m) extents, with transpose_left
// (m, K); the right one (n, K), with transpose_right (K, n) (input_ext0 / input_ext1; of a
// destination, (n, m)); get_multidimensional_index gives {index along extent 0, along
// extent 1}. Slot i of the thread with index t in a T-thread scope holds element
// e = i * T + (T - 1 - t) (the threads in reverse, so that a kernel assuming the slots of an
// input and of a destination hold the same elements is caught), at
// (e / ext1, e % ext1); valid when e < ext0 * ext1, with one invalid slot more, as above.
enum class Role : uint8_t { destination, left, right };
constexpr int input_ext0(const Matmul& op, Role r) {
  return r == Role::destination ? op.n
         : r == Role::left      ? (op.transpose_left ? op.m : op.k)
                                : (op.transpose_right ? op.k : op.n);
}
constexpr int input_ext1(const Matmul& op, Role r) {
  return r == Role::destination ? op.m
         : r == Role::left      ? (op.transpose_left ? op.k : op.m)
                                : (op.transpose_right ? op.n : op.k);
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

// The nax layout: the tile (R = ext1 rows, C = ext0 columns) is cut into 16 x 16
// fragments, numbered row-major (f = fr * C/16 + fc), except for the right input, whose
// fragments are numbered k-major in both orientations (transposed, rows = n:
// f = fk * R/16 + fn), as MLX numbers them. Slot s of lane t holds element s % 8 of fragment
// s / 8, at row 16 fr + fm + (s % 8) / 4 * 8 and column 16 fc + fn + s % 4, with
// fm = bits {4, 2, 1} of t and fn = 4 * bits {3, 0} of t. Slots from R * C / 32 on are
// invalid. Returns false when the nax layout does not apply: another scope, or a shape the
// subset never forms (MetalPerformancePrimitives.h requires m, n multiples of 16, k of 32).
struct SlotIndex {
  bool valid = false;
  int i0 = 0, i1 = 0;  // along extent 0 (column) and extent 1 (row)
};
constexpr bool nax_slot(const Matmul& op, Role r, Scope s, int t, int slot, SlotIndex* out) {
  const int C = input_ext0(op, r), R = input_ext1(op, r);
  if (s.kind != ScopeKind::simdgroup || C <= 0 || R <= 0 || C % 16 != 0 || R % 16 != 0) return false;
  *out = SlotIndex{};
  if (slot < 0 || int64_t(slot) >= int64_t(R) * C / 32) return true;
  const int f = slot / 8, e = slot % 8;
  const bool k_major = r == Role::right && op.transpose_right;
  const int fr = k_major ? f % (R / 16) : f / (C / 16), fc = k_major ? f / (R / 16) : f % (C / 16);
  const int fm = ((t >> 2) & 4) | ((t >> 1) & 3), fn = (((t >> 2) & 2) | (t & 1)) * 4;
  *out = SlotIndex{true, 16 * fc + fn + e % 4, 16 * fr + fm + (e / 4) * 8};
  return true;
}

// Slot `slot` of the thread with index t in scope s, in layout l, for the tensor of role r.
constexpr SlotIndex slot_index(Layout l, const Matmul& op, Role r, Scope s, int t, int slot) {
  SlotIndex x;
  if (l == Layout::nax && nax_slot(op, r, s, t, slot, &x)) return x;
  const int T = scope_threads(s);
  if (r == Role::destination)
    return coop_valid(op.m, op.n, T, t, slot) ? SlotIndex{true, coop_col(op.m, T, t, slot), coop_row(op.m, T, t, slot)}
                                              : SlotIndex{};
  return input_valid(op, r, T, t, slot) ? SlotIndex{true, input_i0(op, r, T, t, slot), input_i1(op, r, T, t, slot)}
                                        : SlotIndex{};
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
