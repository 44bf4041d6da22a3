// The kernels' argument structs and shared constants as the host sees them: the headers
// under metal/ that hold only 32-bit `uint`/`float` fields, `constant constexpr` constants (and
// inline or constexpr functions of them, like gdn_ring, moe_gemm_bn) and include nothing are
// included here with `uint` defined as uint32_t and `constant` (MSL's address space of
// program-scope constants) as nothing, so host and kernels share one definition
// (docs/conventions.md: one header of argument structs included by both sides). Each struct's
// field list (LILY_ARGS_<T>, beside it) is checked here against its offsets and size, and
// with the constants reflected for Python (arg_layouts, kernel_constants: lily._core.KERNEL_ARGS
// / CONSTANTS).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace lily::kernels {
using uint = uint32_t;
#define constant
#include "decode_args.h"
#include "mixer_args.h"
#include "sample_args.h"
#include "prefill_args.h"
#include "gemm_args.h"
#include "batch_args.h"
#undef constant

#define LILY_ARG_STRUCTS(S) \
  LILY_DECODE_ARG_STRUCTS(S) LILY_MIXER_ARG_STRUCTS(S) LILY_SAMPLE_ARG_STRUCTS(S) LILY_PREFILL_ARG_STRUCTS(S) \
  LILY_BATCH_ARG_STRUCTS(S)
#define LILY_KERNEL_CONSTANTS(C) LILY_DECODE_CONSTANTS(C) LILY_MIXER_CONSTANTS(C) LILY_SAMPLE_CONSTANTS(C) \
  LILY_PREFILL_CONSTANTS(C) \
  LILY_GEMM_CONSTANTS(C) LILY_BATCH_CONSTANTS(C)

// Every field is a 4-byte uint or float (or an array of them) and LILY_ARGS_<T> lists them all,
// in order, with no padding between or after: the layout the kernels and Python assume.
namespace reflect {
template <class T>
constexpr bool is_word() {
  using E = std::remove_all_extents_t<T>;
  return std::is_same_v<E, uint> || std::is_same_v<E, float>;
}
struct Span {
  size_t offset, size;
  bool word;
};
template <class S, size_t N>
constexpr bool tiles(const Span (&fields)[N]) {
  size_t at = 0;
  for (const Span& f : fields) {
    if (!f.word || f.offset != at) return false;
    at += f.size;
  }
  return at == sizeof(S);
}
}  // namespace reflect
#define LILY_ARG_SPAN(f) reflect::Span{offsetof(S, f), sizeof(S::f), reflect::is_word<decltype(S::f)>()},
#define LILY_ARG_CHECK(T)                                                  \
  static_assert(                                                           \
      [] {                                                                 \
        using S = T;                                                       \
        constexpr reflect::Span fields[] = {LILY_ARGS_##T(LILY_ARG_SPAN)}; \
        return reflect::tiles<S>(fields);                                  \
      }(),                                                                 \
      #T ": LILY_ARGS_" #T " must list every field (4-byte uint/float) in order, with no padding");
LILY_ARG_STRUCTS(LILY_ARG_CHECK)
#undef LILY_ARG_CHECK

// One field of an argument struct: its name, "uint" or "float", byte offset and element count
// (1, or the length of an array field).
struct ArgField {
  const char* name;
  const char* type;
  uint32_t offset;
  uint32_t count;
};
struct ArgLayout {
  const char* name;
  uint32_t size;  // bytes
  std::vector<ArgField> fields;
};

// Every argument struct of the metal/*_args.h headers, in their order.
inline const std::vector<ArgLayout>& arg_layouts() {
#define LILY_ARG_FIELD(f)                                                                           \
  ArgField{#f, std::is_same_v<std::remove_all_extents_t<decltype(S::f)>, float> ? "float" : "uint", \
           uint32_t(offsetof(S, f)), uint32_t(sizeof(S::f) / 4)},
#define LILY_ARG_LAYOUT(T)                                                      \
  [] {                                                                          \
    using S = T;                                                                \
    return ArgLayout{#T, uint32_t(sizeof(T)), {LILY_ARGS_##T(LILY_ARG_FIELD)}}; \
  }(),
  static const std::vector<ArgLayout> layouts = {LILY_ARG_STRUCTS(LILY_ARG_LAYOUT)};
#undef LILY_ARG_LAYOUT
#undef LILY_ARG_FIELD
  return layouts;
}

// The constants of the metal/*_args.h headers the host reflects (their LILY_*_CONSTANTS lists):
// uint or float.
struct KernelConstant {
  const char* name;
  double value;
  bool is_float;
};
inline const std::vector<KernelConstant>& kernel_constants() {
#define LILY_KERNEL_CONSTANT(c) KernelConstant{#c, double(c), std::is_floating_point_v<decltype(c)>},
  static const std::vector<KernelConstant> constants = {LILY_KERNEL_CONSTANTS(LILY_KERNEL_CONSTANT)};
#undef LILY_KERNEL_CONSTANT
  return constants;
}
#undef LILY_ARG_SPAN
}  // namespace lily::kernels
