// -*- C++ -*-
// A stand-in for <MetalPerformancePrimitives/MetalPerformancePrimitives.h> (Metal 4), for
// the simulator: mpp::tensor_ops::matmul2d, the subset Lily uses (docs/device-layer.md,
// "Metal 4 tensor operations"). Reference semantics in csrc/gpu/sim/tensor_ops.{h,cpp}.
// Outside the subset (a compile error here): convolution2d, relaxed_precision, an explicit
// k that is not a multiple of 32, m or n not a multiple of 16, cooperative inputs of an
// operation with a dynamic k or converted from another cooperative tensor
// (get_left_input_cooperative_tensor(src)), reduction destinations, element types other than
// half/bfloat/float inputs with a float destination.
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

// Layout tag of a cooperative tensor: the operation it belongs to (descriptor, scope, the
// operands' element types) and its role in it (destination, left or right input).
template <matmul2d_descriptor D, class Scope, class LeftElement, class RightElement, class Coord,
          ::lily::sim::tensor_ops::Role R = ::lily::sim::tensor_ops::Role::destination>
struct dest_layout {
  static constexpr ::lily::sim::tensor_ops::Matmul op{
      D.m, D.n, D.k == static_cast<int>(metal::dynamic_extent) ? -1 : D.k, D.transpose_left, D.transpose_right,
      D.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate};
  static constexpr ::lily::sim::tensor_ops::Scope scope = metal::detail::scope_of<Scope>::value;
  static constexpr ::lily::sim::tensor_ops::Role role = R;
  using left_element = LeftElement;
  using right_element = RightElement;
  using input_element =
      std::conditional_t<R == ::lily::sim::tensor_ops::Role::right, RightElement, LeftElement>;
  using coord_type = Coord;
};

template <class T> struct is_cooperative_ : std::false_type {};
template <class E, class X, class L> struct is_cooperative_<metal::cooperative_tensor<E, X, L>> : std::true_type {};
template <class T> struct is_cooperative : is_cooperative_<std::remove_cv_t<T>> {};

// The element type of an operand: a tensor_inline's, or a cooperative input's.
template <class T>
struct operand_element {
  using type = typename std::remove_cv_t<T>::element_type;
};
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
  using Role = ::lily::sim::tensor_ops::Role;
  template <class LE, class RE, class Coord, Role R = Role::destination>
  using layout = lily_detail::dest_layout<Descriptor, Scope, LE, RE, Coord, R>;

  // An operand of run(): a tensor_inline, or this operation's cooperative input of role R.
  template <class T, Role R>
  static constexpr bool is_operand() {
    if constexpr (metal::detail::is_inline_tensor<T>::value) return true;
    else if constexpr (lily_detail::is_cooperative<T>::value) {
      using L = typename std::remove_cv_t<T>::layout;
      return L::role == R &&
             std::is_same_v<
                 L, layout<typename L::left_element, typename L::right_element, typename L::coord_type, R>>;
    } else return false;
  }
  template <class T>
  static ::lily::sim::tensor_ops::Operand operand(const T& t, ::lily::sim::tensor_ops::View* v, float* vals) {
    ::lily::sim::tensor_ops::Operand o;
    if constexpr (metal::detail::is_inline_tensor<T>::value) {
      *v = t.view();
      o.view = v;
      o.dtype = v->dtype;
    } else {
      t.values(vals);
      o.coop = vals;
      o.dtype = metal::detail::tensor_dtype<typename T::element_type>();
    }
    return o;
  }
  template <class T>
  static constexpr int operand_slots() {
    if constexpr (lily_detail::is_cooperative<T>::value) return std::remove_cv_t<T>::capacity;
    else return 1;
  }

 public:
  static constexpr matmul2d_descriptor descriptor = Descriptor;
  using scope = Scope;

  matmul2d() = default;

  template <class LeftOperandType, class RightOperandType, class DestinationOperandType>
  void run(LeftOperandType& left, RightOperandType& right, DestinationOperandType& destination) const {
    static_assert(
        is_operand<LeftOperandType, Role::left>() && is_operand<RightOperandType, Role::right>(),
        "Lily's tensor subset: matmul2d::run's left and right operands must be tensor_inline tensors or "
        "this operation's cooperative left / right inputs");
    using LE = typename lily_detail::operand_element<LeftOperandType>::type;
    using RE = typename lily_detail::operand_element<RightOperandType>::type;
    static_assert(lily_detail::supported_inputs<LE, RE>,
                  "Lily's tensor subset: operand element types must be half, bfloat or float");
    constexpr ::lily::sim::tensor_ops::Matmul op = layout<LE, RE, int>::op;
    ::lily::sim::tensor_ops::View lv, rv;
    float lvals[operand_slots<LeftOperandType>()], rvals[operand_slots<RightOperandType>()];
    const ::lily::sim::tensor_ops::Operand lo = operand(left, &lv, lvals), ro = operand(right, &rv, rvals);
    if constexpr (metal::detail::is_inline_tensor<DestinationOperandType>::value) {
      static_assert(std::is_same_v<typename DestinationOperandType::element_type, float>,
                    "Lily's tensor subset: the destination's element type must be float");
      ::lily::sim::tensor_ops::View d = destination.view();
      ::lily::sim::tensor_ops::run(op, scope_, lo, ro, &d, nullptr);
    } else if constexpr (lily_detail::is_cooperative<DestinationOperandType>::value) {
      static_assert(!std::is_const_v<DestinationOperandType>, "matmul2d::run: the destination cannot be const");
      using Lay = typename DestinationOperandType::layout;
      static_assert(
          Lay::role == Role::destination && std::is_same_v<Lay, layout<LE, RE, typename Lay::coord_type>>,
          "matmul2d::run: the cooperative destination was made by an operation with another descriptor, "
          "scope or operand element types");
      ::lily::sim::tensor_ops::run(op, scope_, lo, ro, nullptr, destination.slots());
    } else {
      static_assert(metal::detail::dependent_false<DestinationOperandType>,
                    "matmul2d::run: the destination must be a tensor_inline or a destination cooperative tensor");
    }
  }

  // The destination as a cooperative tensor (registers spread over the scope's threads).
  template <class LeftOperandType, class RightOperandType, class ElementType, class CoordType = int>
  auto get_destination_cooperative_tensor() const {
    static_assert(is_operand<LeftOperandType, Role::left>() && is_operand<RightOperandType, Role::right>(),
                  "Lily's tensor subset: get_destination_cooperative_tensor<Left, Right, float>() takes the "
                  "operand types: tensor_inline tensors or this operation's cooperative inputs");
    using LE = typename lily_detail::operand_element<LeftOperandType>::type;
    using RE = typename lily_detail::operand_element<RightOperandType>::type;
    static_assert(lily_detail::supported_inputs<LE, RE>,
                  "Lily's tensor subset: operand element types must be half, bfloat or float");
    static_assert(std::is_same_v<ElementType, float>, "Lily's tensor subset: the destination element type must be float");
    static_assert(std::is_same_v<CoordType, int>, "Lily's tensor subset: the coordinate type must be int");
    return metal::cooperative_tensor<float, metal::extents<int, size_t(Descriptor.n), size_t(Descriptor.m)>,
                                     layout<LE, RE, CoordType>>();
  }

  // The left / right operand as a cooperative tensor of its element type (registers spread
  // over the scope's threads; MLX's NAX kernels keep their A and B fragments so), filled
  // element by element through get_multidimensional_index. The descriptor's k must be
  // explicit: the tile is m x k (left) or k x n (right).
  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int>
  auto get_left_input_cooperative_tensor() const {
    return input<Role::left, LeftElementType, RightElementType, ElementType, CoordType>();
  }
  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int>
  auto get_right_input_cooperative_tensor() const {
    return input<Role::right, LeftElementType, RightElementType, ElementType, CoordType>();
  }

 private:
  template <Role R, class LE, class RE, class DE, class CoordType>
  auto input() const {
    static_assert(lily_detail::supported_inputs<LE, RE>,
                  "Lily's tensor subset: operand element types must be half, bfloat or float");
    static_assert(std::is_same_v<DE, float>,
                  "Lily's tensor subset: the destination element type must be float");
    static_assert(std::is_same_v<CoordType, int>, "Lily's tensor subset: the coordinate type must be int");
    static_assert(Descriptor.k != static_cast<int>(metal::dynamic_extent),
                  "Lily's tensor subset: cooperative inputs need an explicit k in the descriptor");
    using L = layout<LE, RE, CoordType, R>;
    constexpr int e0 = ::lily::sim::tensor_ops::input_ext0(L::op, R),
                  e1 = ::lily::sim::tensor_ops::input_ext1(L::op, R);
    return metal::cooperative_tensor<typename L::input_element, metal::extents<int, size_t(e0), size_t(e1)>,
                                     L>();
  }
};

}  // namespace tensor_ops
}  // namespace mpp
