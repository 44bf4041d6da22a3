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
                              device float* out [[buffer(3)]],
                              uint tid [[thread_index_in_threadgroup]]) {
  // threadgroup fp32 tiles with a padded row stride into a cooperative tensor stored back
  // to threadgroup memory: the operation of metal/gemm_tensor.metal
  threadgroup float tiles[96 * 36];
  for (uint i = tid; i < 96 * 36; i += 128) {
    tiles[i] = xf[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  {
    constexpr auto d = matmul2d_descriptor(32, 64, 32, false, true, false, matmul2d_descriptor::mode::multiply_accumulate);
    matmul2d<d, execution_simdgroups<4>> tg_op;
    auto tA = tensor<threadgroup float, extents<int32_t, 32, 32>, tensor_inline>(tiles, extents<int32_t, 32, 32>(),
                                                                                 array<int, 2>{1, 36});
    auto tW = tensor<threadgroup float, extents<int32_t, 32, 64>, tensor_inline>(tiles + 32 * 36,
                                                                                 extents<int32_t, 32, 64>(),
                                                                                 array<int, 2>{1, 36});
    auto c = tg_op.get_destination_cooperative_tensor<decltype(tA), decltype(tW), float>();
    for (uint16_t i = 0; i < c.get_capacity(); ++i) {
      if (c.is_valid_element(i)) {
        c[i] = 0.0f;
      }
    }
    tg_op.run(tA, tW, c);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    auto st = tensor<threadgroup float, extents<int32_t, 64, 32>, tensor_inline>(tiles, extents<int32_t, 64, 32>(),
                                                                                 array<int, 2>{1, 68});
    c.store(st);
  }
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
