// Kernel host names (the [[host_name]]s of the template instantiations in metal/*.metal), built
// and read in one place: the plans resolve their pipelines with kernel_name, the cost table
// reads a kernel's parameters with kernel_param, and Python does both through lily._core
// (kernel_name, kernel_params). A name is the kernel's base, one "_<key><value>" per template
// parameter in the kernel's order (key: one letter), then its variant suffix:
//   gdn_scan_k128_v128_r32     gdn_scan, k = Dk, v = Dv, r = state rows per threadgroup
//   attn_prefill_d256_g4_tensor  attn_prefill, d = head_dim, g = query heads per threadgroup; _tensor
//   gemm_q4_add_h_tensor       gemm, q = weight bits; _add_h_tensor
//   moe_gemm_down_q4_t64       moe_gemm_down, q = bits, t = tile height
#pragma once

#include <cctype>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lily::runtime {

struct KernelParam {
  char key;
  uint32_t value;
};

inline std::string kernel_name(std::string_view base, const std::vector<KernelParam>& params,
                               std::string_view suffix = {}) {
  std::string name(base);
  for (const KernelParam& p : params) name += "_" + std::string(1, p.key) + std::to_string(p.value);
  return name += suffix;
}

// The parameters of a name, in order: each "_"-separated part that is one lowercase letter
// followed by digits.
inline std::vector<KernelParam> kernel_params(std::string_view name) {
  std::vector<KernelParam> out;
  size_t at = 0;
  while (at <= name.size()) {
    const size_t end = std::min(name.find('_', at), name.size());
    const std::string_view part = name.substr(at, end - at);
    bool digits = part.size() >= 2 && std::islower(static_cast<unsigned char>(part[0]));
    for (size_t i = 1; digits && i < part.size(); ++i)
      digits = std::isdigit(static_cast<unsigned char>(part[i]));
    if (digits) out.push_back({part[0], uint32_t(std::stoul(std::string(part.substr(1))))});
    at = end + 1;
  }
  return out;
}

// Parameter `key` of `name`; throws std::invalid_argument naming both when it has none.
inline uint32_t kernel_param(std::string_view name, char key) {
  for (const KernelParam& p : kernel_params(name))
    if (p.key == key) return p.value;
  throw std::invalid_argument(std::string(name) + ": no '_" + key + "<number>' parameter in the kernel name");
}

}  // namespace lily::runtime
