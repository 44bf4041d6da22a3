// The simulator's execution model, as seen by the <metal_stdlib> shim and by the
// generated kernel code: the current thread's coordinates, barriers, simd collectives
// and threadgroup memory. Implemented in executor.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace lily::sim {

constexpr int kSimdWidth = 32;
constexpr size_t kCollectiveSlot = 64;  // bytes per lane for a collective's operand/result
constexpr size_t kMaxThreadgroupMemory = 32768;

struct U3 {
  uint32_t x = 0, y = 0, z = 0;
};

// Coordinates of the running simulated thread (see MSL kernel attributes).
struct ThreadCoords {
  U3 thread_position_in_grid;
  U3 thread_position_in_threadgroup;
  U3 threadgroup_position_in_grid;
  U3 threads_per_threadgroup;           // size of this (possibly partial) threadgroup
  U3 dispatch_threads_per_threadgroup;  // size given at dispatch
  U3 threads_per_grid;
  U3 threadgroups_per_grid;
  uint32_t thread_index_in_threadgroup = 0;
  uint32_t simdgroup_index_in_threadgroup = 0;
  uint32_t thread_index_in_simdgroup = 0;
  uint32_t simdgroups_per_threadgroup = 0;
  uint32_t threads_per_simdgroup = kSimdWidth;
};

// What a collective's compute function sees: the operands of the simdgroup's lanes that
// are active (have not returned), their per-lane arguments, and the result slots.
struct CollectiveView {
  int lanes = 0;  // lanes in this simdgroup (< 32 for a partial last simdgroup)
  bool active[kSimdWidth];
  uint32_t arg[kSimdWidth];
  const unsigned char* in[kSimdWidth];
  unsigned char* out[kSimdWidth];
};
using CollectiveFn = void (*)(CollectiveView&);

// The operations at which a simdgroup's lanes meet: simdgroup_barrier, the simd_* and quad_*
// collectives, and simdgroup-scoped tensor operations. A lane arriving at a different one
// than its waiting lanes is reported as divergence, named by simdgroup_op_name.
enum class SimdgroupOp : int {
  none = 0, barrier, sum, product, min, max, band, bor, bxor, prefix_incl_sum,
  prefix_excl_sum, prefix_incl_product, prefix_excl_product, shuffle, shuffle_xor,
  shuffle_up, shuffle_down, broadcast, ballot, any, all, shuffle_rotate_down,
  shuffle_rotate_up, broadcast_first, is_first, shuffle_and_fill_up, shuffle_and_fill_down,
  quad_sum, quad_product, quad_min, quad_max, quad_prefix_incl_sum, quad_prefix_excl_sum,
  quad_shuffle, quad_shuffle_xor, quad_shuffle_up, quad_shuffle_down, quad_broadcast,
  tensor_op,  // a Metal 4 tensor operation with execution_simdgroup scope (see tensor_ops.h)
};
const char* simdgroup_op_name(SimdgroupOp op);

// Current thread (valid only while a kernel runs on the executor).
const ThreadCoords& coords();
// Pointer to binding [[buffer(index)]] of the running dispatch (after its offset), and
// the bytes available from there; throws when unbound.
unsigned char* buffer_arg(uint32_t index, size_t* available);
// Pointer to dynamic [[threadgroup(index)]] memory of the running threadgroup.
unsigned char* threadgroup_arg(uint32_t index);
// Storage for a `threadgroup T x;` declaration (key identifies the declaration).
void* threadgroup_var(const void* key, size_t size, size_t align);

void threadgroup_barrier();
// A rendezvous of every thread of the threadgroup, distinct from threadgroup_barrier: used
// by the Metal 4 tensor operations with execution_simdgroups<N> scope. `what` names the
// operation (a string literal); threads meeting different rendezvous, or a rendezvous and a
// barrier, are reported as divergence, a thread returning while others wait is an error.
void threadgroup_rendezvous(const char* what);

// State owned by one running threadgroup on behalf of a shim component (the tensor ops):
// created on first use, destroyed with the threadgroup. finish() runs once every thread
// has returned; a non-empty result fails the dispatch with that message.
struct ThreadgroupExtension {
  virtual ~ThreadgroupExtension() = default;
  virtual std::string finish() { return {}; }
};
// The running threadgroup's extension for `key`, made by make() on first use.
ThreadgroupExtension& threadgroup_extension(const void* key, ThreadgroupExtension* (*make)());
// Deposits this lane's operand, waits for the simdgroup's active lanes, and returns this
// lane's result slot (valid until this lane's next collective).
const unsigned char* simd_collective(SimdgroupOp op, const void* operand, size_t size,
                                     uint32_t arg, CollectiveFn fn);
// simdgroup_matrix arithmetic. The shim keeps the whole matrix in every lane, so every lane
// of a simdgroup performs the same product on the same values; `fn(a, b, c, d)` (d may alias
// c) is a pure function of the operand bytes. The first lane of the simdgroup to reach its
// n-th matrix operation computes it; a later lane whose n-th operation has the same function
// and byte-identical operands copies that result instead of recomputing it (any other lane
// computes its own). The results are exactly those of computing in every lane.
using MatrixFn = void (*)(const void* a, const void* b, const void* c, void* d);
constexpr size_t kMatrixOperandMax = 256;  // bytes of one operand or result (8x8 float)
void simd_matrix_op(MatrixFn fn, const void* a, size_t a_size, const void* b, size_t b_size,
                    const void* c, size_t c_size, void* d, size_t d_size);
// Poison byte pattern for undefined results (NaN for every float type).
constexpr unsigned char kPoison = 0xFF;

[[noreturn]] void kernel_fail(const std::string& message);
// Fails the dispatch: the memory of [[buffer(index)]]/[[threadgroup(index)]] is not aligned
// to the parameter's pointee type.
[[noreturn]] void misaligned_arg(const char* kind, uint32_t index, size_t align);

}  // namespace lily::sim
