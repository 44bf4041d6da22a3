// -*- C++ -*-
// A stand-in for <MetalPerformancePrimitives/MetalPerformancePrimitives.h> (Metal 4), for
// the simulator: mpp::tensor_ops::matmul2d, the subset Lily uses (docs/device-layer.md,
// "Metal 4 tensor operations"). Reference semantics in csrc/gpu/sim/tensor_ops.{h,cpp}.
// Outside the subset (a compile error here): convolution2d, relaxed_precision, an explicit
// k that is not a multiple of 32, m or n not a multiple of 16, cooperative input operands
// (get_left/right_input_cooperative_tensor), reduction destinations, element types other
// than half/bfloat/float inputs with a float destination.
#pragma once

#include <metal_tensor>

namespace mpp {
namespace tensor_ops {

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right;
  bool relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_ = static_cast<int>(metal::dynamic_extent),
                                bool transpose_left_ = false, bool transpose_right_ = false,
                                bool relaxed_precision_ = false, mode matmul_mode_ = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(matmul_mode_) {}
};

namespace lily_detail {
template <class L, class R> constexpr bool supported_inputs =
    metal::detail::is_tensor_element<L>::value && metal::detail::is_tensor_element<R>::value;

// Layout tag of a destination cooperative tensor: the operation it belongs to.
template <matmul2d_descriptor D, class Scope, class LeftElement, class RightElement, class Coord>
struct dest_layout {
  static constexpr ::lily::sim::tensor_ops::Matmul op{
      D.m, D.n, D.k == static_cast<int>(metal::dynamic_extent) ? -1 : D.k, D.transpose_left, D.transpose_right,
      D.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate};
  static constexpr ::lily::sim::tensor_ops::Scope scope = metal::detail::scope_of<Scope>::value;
  using coord_type = Coord;
};

template <class T> struct is_cooperative_ : std::false_type {};
template <class E, class X, class L> struct is_cooperative_<metal::cooperative_tensor<E, X, L>> : std::true_type {};
template <class T> struct is_cooperative : is_cooperative_<std::remove_cv_t<T>> {};
}  // namespace lily_detail

// C (m x n) = A (m x K) * B (K x n) [+ C]. Operands are rank-2 tensors with the innermost
// dimension first: A has extents (K, m) (transpose_left: (m, K)), B (n, K) (transpose_right:
// (K, n)), C (n, m). All threads of the execution scope must call run() uniformly.
template <matmul2d_descriptor Descriptor, typename Scope, class... Args> class matmul2d {
  static_assert(sizeof...(Args) == 0, "matmul2d: extra template arguments are not in Lily's tensor subset");
  static_assert(metal::detail::scope_of<Scope>::valid,
                "matmul2d: the scope must be metal::execution_thread, execution_simdgroup or execution_simdgroups<N>");
  static_assert(Descriptor.m > 0 && Descriptor.n > 0 && Descriptor.m % 16 == 0 && Descriptor.n % 16 == 0,
                "Lily's tensor subset: the descriptor's m and n must be positive multiples of 16 (tile shapes used by "
                "public Metal 4 kernels tested on M5)");
  static_assert(Descriptor.k != 0,
                "matmul2d_descriptor: k = 0 does not mean 'dynamic' (an old header comment says so; it is wrong): use "
                "static_cast<int>(dynamic_extent)");
  static_assert(Descriptor.k == static_cast<int>(metal::dynamic_extent) || (Descriptor.k > 0 && Descriptor.k % 32 == 0),
                "Lily's tensor subset: an explicit k must be a multiple of 32 (macOS 26.1's Metal truncates other "
                "values to a multiple of 32: a known bug), or dynamic_extent");
  static_assert(!Descriptor.relaxed_precision,
                "Lily's tensor subset: relaxed_precision = true lets the GPU trade accuracy in unspecified ways; the "
                "simulator cannot model it, so it is not supported");

  static constexpr ::lily::sim::tensor_ops::Scope scope_ = metal::detail::scope_of<Scope>::value;
  template <class LE, class RE, class Coord>
  using layout = lily_detail::dest_layout<Descriptor, Scope, LE, RE, Coord>;

 public:
  static constexpr matmul2d_descriptor descriptor = Descriptor;
  using scope = Scope;

  matmul2d() = default;

  template <class LeftOperandType, class RightOperandType, class DestinationOperandType>
  void run(LeftOperandType& left, RightOperandType& right, DestinationOperandType& destination) const {
    static_assert(metal::detail::is_inline_tensor<LeftOperandType>::value &&
                      metal::detail::is_inline_tensor<RightOperandType>::value,
                  "Lily's tensor subset: matmul2d::run's left and right operands must be tensor_inline tensors "
                  "(cooperative input operands are not supported)");
    using LE = typename LeftOperandType::element_type;
    using RE = typename RightOperandType::element_type;
    static_assert(lily_detail::supported_inputs<LE, RE>,
                  "Lily's tensor subset: operand element types must be half, bfloat or float");
    constexpr ::lily::sim::tensor_ops::Matmul op = layout<LE, RE, int>::op;
    if constexpr (metal::detail::is_inline_tensor<DestinationOperandType>::value) {
      static_assert(std::is_same_v<typename DestinationOperandType::element_type, float>,
                    "Lily's tensor subset: the destination's element type must be float");
      ::lily::sim::tensor_ops::View d = destination.view();
      ::lily::sim::tensor_ops::run(op, scope_, left.view(), right.view(), &d, nullptr);
    } else if constexpr (lily_detail::is_cooperative<DestinationOperandType>::value) {
      static_assert(!std::is_const_v<DestinationOperandType>, "matmul2d::run: the destination cannot be const");
      using Lay = typename DestinationOperandType::layout;
      static_assert(std::is_same_v<Lay, layout<LE, RE, typename Lay::coord_type>>,
                    "matmul2d::run: the cooperative destination was made by an operation with another descriptor, "
                    "scope or operand element types");
      ::lily::sim::tensor_ops::run(op, scope_, left.view(), right.view(), nullptr, destination.slots());
    } else {
      static_assert(metal::detail::dependent_false<DestinationOperandType>,
                    "matmul2d::run: the destination must be a tensor_inline or a destination cooperative tensor");
    }
  }

  // The destination as a cooperative tensor (registers spread over the scope's threads).
  template <class LeftOperandType, class RightOperandType, class ElementType, class CoordType = int>
  auto get_destination_cooperative_tensor() const {
    static_assert(metal::detail::is_inline_tensor<LeftOperandType>::value &&
                      metal::detail::is_inline_tensor<RightOperandType>::value,
                  "Lily's tensor subset: get_destination_cooperative_tensor<Left, Right, float>() takes the "
                  "tensor_inline operand types");
    using LE = typename std::remove_cv_t<LeftOperandType>::element_type;
    using RE = typename std::remove_cv_t<RightOperandType>::element_type;
    static_assert(lily_detail::supported_inputs<LE, RE>,
                  "Lily's tensor subset: operand element types must be half, bfloat or float");
    static_assert(std::is_same_v<ElementType, float>, "Lily's tensor subset: the destination element type must be float");
    static_assert(std::is_same_v<CoordType, int>, "Lily's tensor subset: the coordinate type must be int");
    return metal::cooperative_tensor<float, metal::extents<int, size_t(Descriptor.n), size_t(Descriptor.m)>,
                                     layout<LE, RE, CoordType>>();
  }
};

}  // namespace tensor_ops
}  // namespace mpp
