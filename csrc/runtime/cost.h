// The cost table: what one recorded dispatch asks of the GPU, for the performance model
// (lily.lab.estimate, docs/performance.md): arithmetic per execution path and the bytes it
// moves from memory. The one place that knows each kernel's cost: keyed by kernel name,
// computed from the recorded geometry, the argument structs and the declared ranges
// (gpu::DispatchRecord).
#pragma once

#include <array>
#include <optional>
#include <string>

#include "gpu/device.h"

namespace lily::runtime {

// Execution paths of an Apple GPU core, each with its own peak rate in the machine table.
enum class Path : int {
  alu_f32,      // scalar/SIMD fp32 ALU (includes dequantization, softmax, reductions)
  alu_f16,      // half / bfloat ALU
  sgmm_f32,     // simdgroup_matrix, fp32 operands
  sgmm_f16,     // simdgroup_matrix, half operands (fp32 accumulation)
  sgmm_bf16,    // simdgroup_matrix, bfloat operands (fp32 accumulation)
  tensor_f32,   // Metal 4 tensor ops (M5 neural accelerators), fp32 operands
  tensor_f16,   // tensor ops, half operands
  tensor_bf16,  // tensor ops, bfloat operands
  count
};
constexpr int kPaths = int(Path::count);
const char* path_name(Path p);

// Experts `rows` tokens are expected to reach with `k` of `experts` each, routing taken as
// uniform: E (1 - (1 - k/E)^rows) (a prefill chunk's expert tiles, a batched decode step's
// union of the rows' experts).
double expected_experts(uint32_t rows, uint32_t k, uint32_t experts);

// Kinds of dependent latency on a threadgroup's critical path, each priced by the
// performance model at its own latency (lily.lab.estimate LATENCY_SECONDS / LATENCY_CYCLES,
// docs/performance.md "Latency chains"): a load whose address, or whose issue, waits for an
// earlier result (in-order issue: a load after a barrier, a load inside a loop whose
// iteration waits on the previous one's result), from DRAM (`dram`: weights, the KV cache, the recurrent state and its ring)
// or from data the stage before wrote (`mem`: small vectors likely still in a cache); a
// threadgroup-memory load (`local`); a threadgroup barrier with the threadgroup-memory
// exchange it orders (`barrier`); a simdgroup reduction instruction (`reduce`: simd_sum,
// simd_max, simd_min); a dependent ALU or shuffle operation (`alu`).
enum class Lat : int { dram, mem, local, barrier, reduce, alu, count };
constexpr int kLats = int(Lat::count);
const char* lat_name(Lat k);

struct Cost {
  std::string family;                // kernel family for breakdowns ("attention", "routed experts", ...)
  std::array<double, kPaths> flops{};  // floating-point operations per path (an FMA counts 2)
  double bytes = 0;                  // bytes moved from/to memory (see dispatch_cost)
  uint64_t threadgroup_memory = 0;   // static threadgroup arrays of the kernel (bytes), where known
  // Dependent latencies of the longest threadgroup, by kind, after its first device load
  // (that round trip is part of every dispatch, so of the fitted stage gap): `chain` the
  // critical path, `lead` the part of it before the threadgroup's bulk traffic starts (a
  // prologue: the norm, the routing, the query preparation), which nothing of the same
  // dispatch overlaps when all its threadgroups start together, and `loop` the loads of loops
  // with a run-time trip count whose iterations do not depend on each other's loads (one per
  // iteration; how many iterations' loads overlap is the model's loop_overlap, the compiler's
  // unrolling). Loops of a compile-time trip count are taken as unrolled: no chain.
  std::array<double, kLats> chain{}, lead{}, loop{};
};

// The cost of `r`, or nullopt when the table has no entry for r.kernel. Bytes are the
// declared ranges, except routed-expert weight stacks (declared whole): decode counts the
// top-k experts, prefill the experts a chunk is expected to reach under uniform routing.
// Throws std::invalid_argument if a known kernel's argument struct is missing.
std::optional<Cost> dispatch_cost(const gpu::DispatchRecord& r);

}  // namespace lily::runtime
