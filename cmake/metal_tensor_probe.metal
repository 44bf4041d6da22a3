// Configure-time probe (cmake/metal.cmake): does this SDK's Metal compiler build Metal 4
// tensor operations with the element-type combinations Lily's metal/*_tensor.metal use
// (float, half and bfloat inputs into a float cooperative destination; float x float and
// the bfloat rows need the macOS 26.1 SDK)? Not shipped.
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

kernel void lily_tensor_probe(device float* xf [[buffer(0)]],
                              device half* xh [[buffer(1)]],
                              device bfloat* xb [[buffer(2)]],
                              device float* out [[buffer(3)]]) {
  constexpr auto desc = matmul2d_descriptor(64, 32, static_cast<int>(dynamic_extent), false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<4>> op;
  using Sq = extents<int32_t, 64, 64>;
  auto F = tensor<device float, Sq, tensor_inline>(xf, Sq());
  auto H = tensor<device half, Sq, tensor_inline>(xh, Sq());
  auto B = tensor<device bfloat, Sq, tensor_inline>(xb, Sq());
  auto O = tensor<device float, extents<int32_t, 32, 64>, tensor_inline>(out, extents<int32_t, 32, 64>());
  auto acc = op.get_destination_cooperative_tensor<decltype(F), decltype(F), float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) {
      acc[i] = 0.0f;
    }
  }
  op.run(F, F, acc);
  op.run(F, H, O);
  op.run(H, H, O);
  op.run(B, B, O);
  op.run(F, B, O);
  acc.store(O);
}
