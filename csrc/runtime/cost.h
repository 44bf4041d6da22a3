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

struct Cost {
  std::string family;                // kernel family for breakdowns ("attention", "routed experts", ...)
  std::array<double, kPaths> flops{};  // floating-point operations per path (an FMA counts 2)
  double bytes = 0;                  // bytes moved from/to memory (see dispatch_cost)
  uint64_t threadgroup_memory = 0;   // static threadgroup arrays of the kernel (bytes), where known
};

// The cost of `r`, or nullopt when the table has no entry for r.kernel. Bytes are the
// declared ranges, except routed-expert weight stacks (declared whole): decode counts the
// top-k experts, prefill the experts a chunk is expected to reach under uniform routing.
// Throws std::invalid_argument if a known kernel's argument struct is missing.
std::optional<Cost> dispatch_cost(const gpu::DispatchRecord& r);

}  // namespace lily::runtime
