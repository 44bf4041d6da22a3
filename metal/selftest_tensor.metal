// Self-test kernels for the Metal 4 tensor-operation subset (docs/device-layer.md, "Metal 4
// tensor operations"): every supported form of mpp::tensor_ops::matmul2d and of cooperative
// tensors, compared with numpy in tests/sim/test_sim_tensor.py. Valid MSL 4 (-std=metal4.0):
// on macOS the build compiles it into lily_selftest_tensor.metallib (a compile check, not
// installed); only the simulator registers these kernels.
//
// Matrices are row-major in memory; a tensor lists the innermost extent first, so a matrix
// [rows][cols] is a tensor with extents (cols, rows).
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

struct TensorTestArgs {
  uint M;    // rows of A and C
  uint N;    // columns of B and C
  uint K;    // reduction length
  uint lda;  // row pitch of A in elements (>= K)
};

// ---- device operands and destination, execution_simdgroups<4>, dynamic k ---------------
// C[M, N] = A[M, K] B[K, N]; one 64 x 32 tile of C per threadgroup of 128 threads, grid
// (ceil(N / 32), ceil(M / 64)) threadgroups. Edge tiles rely on matmul2d's edge checks
// against the slices' extents.
template <typename TA, typename TB>
kernel void st_tensor_mm_device(device TA* a [[buffer(0)]],
                                device TB* b [[buffer(1)]],
                                device float* c [[buffer(2)]],
                                constant TensorTestArgs& p [[buffer(3)]],
                                uint2 tg [[threadgroup_position_in_grid]]) {
  constexpr auto desc = matmul2d_descriptor(64, 32, static_cast<int>(dynamic_extent));
  matmul2d<desc, execution_simdgroups<4>> op;
  auto A = tensor<device TA, dextents<int32_t, 2>, tensor_inline>(a, dextents<int32_t, 2>(p.K, p.M));
  auto B = tensor<device TB, dextents<int32_t, 2>, tensor_inline>(b, dextents<int32_t, 2>(p.N, p.K));
  auto C = tensor<device float, dextents<int32_t, 2>, tensor_inline>(c, dextents<int32_t, 2>(p.N, p.M));
  auto mA = A.slice(0, tg.y * 64);
  auto mB = B.slice(tg.x * 32, 0);
  auto mC = C.slice(tg.x * 32, tg.y * 64);
  op.run(mA, mB, mC);
}
template [[host_name("st_tensor_mm_device_f16_f16")]] [[kernel]] decltype(st_tensor_mm_device<half, half>) st_tensor_mm_device<half, half>;
template [[host_name("st_tensor_mm_device_f32_f32")]] [[kernel]] decltype(st_tensor_mm_device<float, float>) st_tensor_mm_device<float, float>;
template [[host_name("st_tensor_mm_device_bf16_bf16")]] [[kernel]] decltype(st_tensor_mm_device<bfloat, bfloat>) st_tensor_mm_device<bfloat, bfloat>;
template [[host_name("st_tensor_mm_device_f32_f16")]] [[kernel]] decltype(st_tensor_mm_device<float, half>) st_tensor_mm_device<float, half>;
template [[host_name("st_tensor_mm_device_bf16_f32")]] [[kernel]] decltype(st_tensor_mm_device<bfloat, float>) st_tensor_mm_device<bfloat, float>;
template [[host_name("st_tensor_mm_device_f16_bf16")]] [[kernel]] decltype(st_tensor_mm_device<half, bfloat>) st_tensor_mm_device<half, bfloat>;

// ---- threadgroup operands, cooperative destination accumulated over K ------------------
// C[M, N] = A[M, K] W[N, K]^T + bias[N] (the GEMM shape of a linear layer: W row-major
// [out][in]); A and W are float in memory, converted to TL / TR while staged into
// threadgroup tiles of 32 x 32 per K step; the tiles are stored transposed when TRANS_L /
// !TRANS_R ask for it. 64 threads (execution_simdgroups<2>) per 32 x 32 tile of C, grid
// (ceil(N / 32), ceil(M / 32)) threadgroups; K a multiple of 32. Edge tiles give the
// operands the valid rows/columns as extents and store element by element.
template <typename TL, typename TR, bool TRANS_L, bool TRANS_R>
kernel void st_tensor_mm_staged(device const float* a [[buffer(0)]],
                                device const float* w [[buffer(1)]],
                                device const float* bias [[buffer(2)]],
                                device float* c [[buffer(3)]],
                                constant TensorTestArgs& p [[buffer(4)]],
                                uint2 tg [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]]) {
  constexpr int TM = 32, TN = 32, TK = 32, THREADS = 64;
  threadgroup TL a_t[TM * TK];
  threadgroup TR w_t[TN * TK];
  constexpr auto desc = matmul2d_descriptor(TM, TN, TK, TRANS_L, TRANS_R, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<2>> op;
  const uint m0 = tg.y * TM, n0 = tg.x * TN;
  const int rows = min(int(p.M - m0), TM), cols = min(int(p.N - n0), TN);
  // left: [rows][TK] (extents (TK, rows)) or transposed [TK][TM] (extents (rows, TK))
  auto tA = tensor<threadgroup TL, dextents<int32_t, 2>, tensor_inline>(
      a_t, TRANS_L ? dextents<int32_t, 2>(rows, TK) : dextents<int32_t, 2>(TK, rows),
      array<int, 2>{1, TRANS_L ? TM : TK});
  // right (K x n): [TK][TN] (extents (cols, TK)) or transposed [TN][TK] (extents (TK, cols))
  auto tW = tensor<threadgroup TR, dextents<int32_t, 2>, tensor_inline>(
      w_t, TRANS_R ? dextents<int32_t, 2>(TK, cols) : dextents<int32_t, 2>(cols, TK),
      array<int, 2>{1, TRANS_R ? TK : TN});
  auto acc = op.template get_destination_cooperative_tensor<decltype(tA), decltype(tW), float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) {
      acc[i] = 0.0f;
    }
  }
  for (uint k0 = 0; k0 < p.K; k0 += TK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous run() has read the tiles
    for (uint i = tid; i < uint(TM * TK); i += THREADS) {
      const uint r = i / TK, kk = i % TK;
      const float v = int(r) < rows ? a[(m0 + r) * p.lda + k0 + kk] : 0.0f;
      a_t[TRANS_L ? kk * TM + r : r * TK + kk] = TL(v);
    }
    for (uint i = tid; i < uint(TN * TK); i += THREADS) {
      const uint n = i / TK, kk = i % TK;
      const float v = int(n) < cols ? w[(n0 + n) * p.K + k0 + kk] : 0.0f;
      w_t[TRANS_R ? n * TK + kk : kk * TN + n] = TR(v);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    op.run(tA, tW, acc);
  }
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) {
      continue;
    }
    const auto idx = acc.get_multidimensional_index(i);  // {column, row} in the tile
    if (idx[1] < rows && idx[0] < cols) {
      c[(m0 + idx[1]) * p.N + n0 + idx[0]] = acc[i] + bias[n0 + idx[0]];
    }
  }
}
template [[host_name("st_tensor_mm_staged_f32_f32_nt")]] [[kernel]] decltype(st_tensor_mm_staged<float, float, false, true>) st_tensor_mm_staged<float, float, false, true>;
template [[host_name("st_tensor_mm_staged_f32_f32_nn")]] [[kernel]] decltype(st_tensor_mm_staged<float, float, false, false>) st_tensor_mm_staged<float, float, false, false>;
template [[host_name("st_tensor_mm_staged_f32_f32_tn")]] [[kernel]] decltype(st_tensor_mm_staged<float, float, true, false>) st_tensor_mm_staged<float, float, true, false>;
template [[host_name("st_tensor_mm_staged_f32_f32_tt")]] [[kernel]] decltype(st_tensor_mm_staged<float, float, true, true>) st_tensor_mm_staged<float, float, true, true>;
template [[host_name("st_tensor_mm_staged_f16_f16_nt")]] [[kernel]] decltype(st_tensor_mm_staged<half, half, false, true>) st_tensor_mm_staged<half, half, false, true>;
template [[host_name("st_tensor_mm_staged_bf16_bf16_nt")]] [[kernel]] decltype(st_tensor_mm_staged<bfloat, bfloat, false, true>) st_tensor_mm_staged<bfloat, bfloat, false, true>;
template [[host_name("st_tensor_mm_staged_f32_f16_nt")]] [[kernel]] decltype(st_tensor_mm_staged<float, half, false, true>) st_tensor_mm_staged<float, half, false, true>;
template [[host_name("st_tensor_mm_staged_f32_bf16_nt")]] [[kernel]] decltype(st_tensor_mm_staged<float, bfloat, false, true>) st_tensor_mm_staged<float, bfloat, false, true>;

// ---- execution_simdgroup: one 16 x 32 tile per simdgroup, device operands with strides -
// C[M, N] = 0.5 * A[M, K] W[N, K]^T, A float with row pitch lda, W half; 64 threads (two
// simdgroups, stacked along M) per threadgroup, grid (ceil(N / 32), ceil(M / 32)). The
// product lands in a cooperative tensor (mode multiply: no initialisation), is scaled in
// registers and stored with cooperative_tensor::store (skipping elements past the edges).
kernel void st_tensor_mm_simdgroup(device float* a [[buffer(0)]],
                                   device half* w [[buffer(1)]],
                                   device float* c [[buffer(2)]],
                                   constant TensorTestArgs& p [[buffer(3)]],
                                   uint2 tg [[threadgroup_position_in_grid]],
                                   ushort sg [[simdgroup_index_in_threadgroup]]) {
  const uint m0 = (tg.y * 2 + sg) * 16, n0 = tg.x * 32;
  if (m0 >= p.M) {
    return;  // the whole simdgroup: its operations' scope is the simdgroup
  }
  constexpr auto desc = matmul2d_descriptor(16, 32, static_cast<int>(dynamic_extent), false, true);
  matmul2d<desc, execution_simdgroup> op;
  auto A = tensor(a, dextents<int32_t, 2>(p.K, p.M), array<int, 2>{1, int(p.lda)});
  auto W = tensor<device half, dextents<int32_t, 2>, tensor_inline>(w, dextents<int32_t, 2>(p.K, p.N));
  auto C = tensor<device float, dextents<int32_t, 2>, tensor_inline>(c, dextents<int32_t, 2>(p.N, p.M));
  auto mA = A.slice(0, m0);
  auto mW = W.slice(0, n0);
  auto mC = C.slice(n0, m0);
  auto prod = op.get_destination_cooperative_tensor<decltype(mA), decltype(mW), float>();
  op.run(mA, mW, prod);
  for (uint16_t i = 0; i < prod.get_capacity(); ++i) {
    if (prod.is_valid_element(i)) {
      prod[i] *= 0.5f;
    }
  }
  prod.store(mC);
}

// ---- execution_thread, a device destination accumulated in place, static slices --------
// C[M, N] += A[M, K] B[K, N] (C holds the addend on entry), A half, B float; each thread
// owns one 16 x 16 tile of C and runs K / 32 multiply_accumulate steps on slices of static
// K extent 32 (slice<32, dynamic_extent>). 4 threads per threadgroup along the tile
// columns; grid (ceil(ceil(N / 16) / 4), ceil(M / 16)) threadgroups; K a multiple of 32.
kernel void st_tensor_mm_thread(device half* a [[buffer(0)]],
                                device float* b [[buffer(1)]],
                                device float* c [[buffer(2)]],
                                constant TensorTestArgs& p [[buffer(3)]],
                                uint2 tg [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]]) {
  const uint n0 = (tg.x * 4 + tid) * 16, m0 = tg.y * 16;
  if (n0 >= p.N) {
    return;
  }
  constexpr auto desc = matmul2d_descriptor(16, 16, 32, false, false, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_thread> op;
  auto A = tensor<device half, dextents<int32_t, 2>, tensor_inline>(a, dextents<int32_t, 2>(p.K, p.M));
  auto B = tensor<device float, dextents<int32_t, 2>, tensor_inline>(b, dextents<int32_t, 2>(p.N, p.K));
  auto C = tensor<device float, dextents<int32_t, 2>, tensor_inline>(c, dextents<int32_t, 2>(p.N, p.M)).slice(n0, m0);
  for (uint k0 = 0; k0 < p.K; k0 += 32) {
    auto sA = A.slice<32, dynamic_extent>(k0, m0);
    auto sB = B.slice<dynamic_extent, 32>(n0, k0);
    op.run(sA, sB, C);
  }
}

// ---- cooperative load, accumulate over a dynamic K, store -------------------------------
// D[M, N] = Cin[M, N] + A[M, K] B[K, N], A bfloat, B half; as st_tensor_mm_device (64 x 32
// tiles, 128 threads) but the destination is a cooperative tensor loaded from Cin.
kernel void st_tensor_coop_load(device bfloat* a [[buffer(0)]],
                                device half* b [[buffer(1)]],
                                device float* cin [[buffer(2)]],
                                device float* d [[buffer(3)]],
                                constant TensorTestArgs& p [[buffer(4)]],
                                uint2 tg [[threadgroup_position_in_grid]]) {
  constexpr auto desc = matmul2d_descriptor(64, 32, static_cast<int>(dynamic_extent), false, false, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<4>> op;
  using Dims = dextents<int32_t, 2>;
  auto mA = tensor<device bfloat, Dims, tensor_inline>(a, Dims(p.K, p.M)).slice(0, tg.y * 64);
  auto mB = tensor<device half, Dims, tensor_inline>(b, Dims(p.N, p.K)).slice(tg.x * 32, 0);
  auto mCin = tensor<device float, Dims, tensor_inline>(cin, Dims(p.N, p.M)).slice(tg.x * 32, tg.y * 64);
  auto mD = tensor<device float, Dims, tensor_inline>(d, Dims(p.N, p.M)).slice(tg.x * 32, tg.y * 64);
  auto acc = op.get_destination_cooperative_tensor<decltype(mA), decltype(mB), float>();
  acc.load(mCin);
  op.run(mA, mB, acc);
  acc.store(mD);
}

// ---- cooperative input tensors filled from device memory ---------------------------------
// C[M, N] = A[M, K] B[K, N], A and B float row-major in memory, converted to TL / TR as each
// thread fills its slots of the left and right cooperative inputs (coordinates from
// get_multidimensional_index: the operands seen as tensors with extents (K, m) or, with
// TRANS_L, (m, K); (n, K) or, with TRANS_R, (K, n)), elements past M, N or K zero. Two
// simdgroups per threadgroup, each its own 16 x 32 tile of C on execution_simdgroup in K
// steps of 32; grid (ceil(N / 32), ceil(M / 32)). mode 1: lane 0 leaves its first valid
// left slot unfilled (the simulator's poison must reach C).
template <typename TL, typename TR, bool TRANS_L, bool TRANS_R>
kernel void st_tensor_coop_inputs(device const float* a [[buffer(0)]],
                                  device const float* b [[buffer(1)]],
                                  device float* c [[buffer(2)]],
                                  constant TensorTestArgs& p [[buffer(3)]],
                                  constant uint& mode [[buffer(4)]],
                                  uint2 tg [[threadgroup_position_in_grid]],
                                  ushort sg [[simdgroup_index_in_threadgroup]],
                                  ushort lane [[thread_index_in_simdgroup]]) {
  const int m0 = int(tg.y * 2 + sg) * 16, n0 = int(tg.x) * 32;
  if (m0 >= int(p.M)) {
    return;  // the whole simdgroup
  }
  constexpr auto desc = matmul2d_descriptor(16, 32, 32, TRANS_L, TRANS_R, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroup> op;
  auto ca = op.template get_left_input_cooperative_tensor<TL, TR, float>();
  auto cb = op.template get_right_input_cooperative_tensor<TL, TR, float>();
  auto acc = op.template get_destination_cooperative_tensor<remove_addrspace_t<decltype(ca)>, remove_addrspace_t<decltype(cb)>, float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) {
      acc[i] = 0.0f;
    }
  }
  for (int k0 = 0; k0 < int(p.K); k0 += 32) {
    bool skipped = mode != 1 || lane != 0;
    for (uint16_t i = 0; i < ca.get_capacity(); ++i) {
      if (!ca.is_valid_element(i)) {
        continue;
      }
      if (!skipped) {
        skipped = true;
        continue;
      }
      const auto at = ca.get_multidimensional_index(i);
      const int r = m0 + (TRANS_L ? at[0] : at[1]), k = k0 + (TRANS_L ? at[1] : at[0]);
      ca[i] = TL(r < int(p.M) && k < int(p.K) ? a[r * int(p.lda) + k] : 0.0f);
    }
    for (uint16_t i = 0; i < cb.get_capacity(); ++i) {
      if (cb.is_valid_element(i)) {
        const auto at = cb.get_multidimensional_index(i);
        const int n = n0 + (TRANS_R ? at[1] : at[0]), k = k0 + (TRANS_R ? at[0] : at[1]);
        cb[i] = TR(n < int(p.N) && k < int(p.K) ? b[k * int(p.N) + n] : 0.0f);
      }
    }
    op.run(ca, cb, acc);
  }
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) {
      const auto at = acc.get_multidimensional_index(i);  // {column, row}
      if (m0 + at[1] < int(p.M) && n0 + at[0] < int(p.N)) {
        c[(m0 + at[1]) * int(p.N) + n0 + at[0]] = acc[i];
      }
    }
  }
}
template [[host_name("st_tensor_coop_inputs_f32_f32_nn")]] [[kernel]] decltype(st_tensor_coop_inputs<float, float, false, false>) st_tensor_coop_inputs<float, float, false, false>;
template [[host_name("st_tensor_coop_inputs_f32_f32_tt")]] [[kernel]] decltype(st_tensor_coop_inputs<float, float, true, true>) st_tensor_coop_inputs<float, float, true, true>;
template [[host_name("st_tensor_coop_inputs_bf16_bf16_nt")]] [[kernel]] decltype(st_tensor_coop_inputs<bfloat, bfloat, false, true>) st_tensor_coop_inputs<bfloat, bfloat, false, true>;
template [[host_name("st_tensor_coop_inputs_f16_f16_tn")]] [[kernel]] decltype(st_tensor_coop_inputs<half, half, true, false>) st_tensor_coop_inputs<half, half, true, false>;
template [[host_name("st_tensor_coop_inputs_f32_bf16_nt")]] [[kernel]] decltype(st_tensor_coop_inputs<float, bfloat, false, true>) st_tensor_coop_inputs<float, bfloat, false, true>;

// A cooperative left input from device memory times a threadgroup tensor (the prefill GEMMs'
// form): C[M, N] = A[M, K] W[N, K]^T, W staged as bfloat [N][K + 8] (all of it: N <= 32,
// K <= 64), A converted to bfloat in the left input. 4 simdgroups (execution_simdgroups<4>),
// one 64 x 32 tile of C per threadgroup, k = 32 per run; grid (1, ceil(M / 64)).
kernel void st_tensor_coop_left_tg(device const float* a [[buffer(0)]],
                                   device const float* w [[buffer(1)]],
                                   device float* c [[buffer(2)]],
                                   constant TensorTestArgs& p [[buffer(3)]],
                                   uint2 tg [[threadgroup_position_in_grid]],
                                   uint tid [[thread_index_in_threadgroup]]) {
  constexpr int LD = 64 + 8;
  threadgroup bfloat wt[32 * LD];
  for (uint i = tid; i < 32 * LD; i += 128) {
    const uint n = i / LD, k = i % LD;
    wt[i] = bfloat(n < p.N && k < p.K ? w[n * p.K + k] : 0.0f);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  constexpr auto desc = matmul2d_descriptor(64, 32, 32, false, true, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, execution_simdgroups<4>> op;
  const int m0 = int(tg.y) * 64;
  auto ca = op.get_left_input_cooperative_tensor<bfloat, bfloat, float>();
  using W = tensor<threadgroup bfloat, extents<int32_t, 32, 32>, tensor_inline>;
  auto acc = op.get_destination_cooperative_tensor<remove_addrspace_t<decltype(ca)>, W, float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) {
      acc[i] = 0.0f;
    }
  }
  for (int k0 = 0; k0 < 64; k0 += 32) {
    for (uint16_t i = 0; i < ca.get_capacity(); ++i) {
      if (ca.is_valid_element(i)) {
        const auto at = ca.get_multidimensional_index(i);  // {k, row}
        const int r = m0 + at[1], k = k0 + at[0];
        ca[i] = bfloat(r < int(p.M) && k < int(p.K) ? a[r * int(p.lda) + k] : 0.0f);
      }
    }
    W tw(wt + k0, extents<int32_t, 32, 32>(), array<int, 2>{1, LD});
    op.run(ca, tw, acc);
  }
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) {
      const auto at = acc.get_multidimensional_index(i);
      if (m0 + at[1] < int(p.M) && at[0] < int(p.N)) {
        c[(m0 + at[1]) * int(p.N) + at[0]] = acc[i];
      }
    }
  }
}

// ---- where the elements of cooperative tensors lie --------------------------------------
// The threads of one scope (Scope: execution_simdgroup, 32 threads, or
// execution_simdgroups<2>, 64) dump, for every thread t and slot of the destination
// (16 x 32), left input (16 x 32, k = 32) and right input (32 x 32) of a
// matmul2d_descriptor(16, 32, 32, TRANS_L, TRANS_R), {valid, index along extent 0, along
// extent 1}, or {-1, -1, -1} past get_capacity(): out[((role * T + t) * 64 + slot) * 3],
// role 0 destination, 1 left, 2 right. tests/sim/test_sim_tensor.py compares them with
// the layouts of tensor_ops.h (the simulator's and the M5's fragment layout).
template <typename CT>
inline void st_dump_slots(thread CT& ct, device int* out) {
  for (uint16_t i = 0; i < 64; ++i) {
    if (i >= ct.get_capacity()) {
      out[i * 3] = out[i * 3 + 1] = out[i * 3 + 2] = -1;
      continue;
    }
    const auto at = ct.get_multidimensional_index(i);
    out[i * 3] = int(ct.is_valid_element(i));
    out[i * 3 + 1] = int(at[0]);
    out[i * 3 + 2] = int(at[1]);
  }
}

template <typename Scope, int T, bool TRANS_L, bool TRANS_R>
kernel void st_tensor_layout(device int* out [[buffer(0)]],
                             uint tid [[thread_index_in_threadgroup]]) {
  constexpr auto desc = matmul2d_descriptor(16, 32, 32, TRANS_L, TRANS_R, false,
                                            matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<desc, Scope> op;
  auto ca = op.template get_left_input_cooperative_tensor<float, float, float>();
  auto cb = op.template get_right_input_cooperative_tensor<float, float, float>();
  auto cd = op.template get_destination_cooperative_tensor<remove_addrspace_t<decltype(ca)>, remove_addrspace_t<decltype(cb)>, float>();
  st_dump_slots(cd, out + (0 * T + tid) * 64 * 3);
  st_dump_slots(ca, out + (1 * T + tid) * 64 * 3);
  st_dump_slots(cb, out + (2 * T + tid) * 64 * 3);
}
template [[host_name("st_tensor_layout_sg_nn")]] [[kernel]] decltype(st_tensor_layout<execution_simdgroup, 32, false, false>) st_tensor_layout<execution_simdgroup, 32, false, false>;
template [[host_name("st_tensor_layout_sg_nt")]] [[kernel]] decltype(st_tensor_layout<execution_simdgroup, 32, false, true>) st_tensor_layout<execution_simdgroup, 32, false, true>;
template [[host_name("st_tensor_layout_sg_tn")]] [[kernel]] decltype(st_tensor_layout<execution_simdgroup, 32, true, false>) st_tensor_layout<execution_simdgroup, 32, true, false>;
template [[host_name("st_tensor_layout_sg_tt")]] [[kernel]] decltype(st_tensor_layout<execution_simdgroup, 32, true, true>) st_tensor_layout<execution_simdgroup, 32, true, true>;
template [[host_name("st_tensor_layout_sg2_nn")]] [[kernel]] decltype(st_tensor_layout<execution_simdgroups<2>, 64, false, false>) st_tensor_layout<execution_simdgroups<2>, 64, false, false>;

// ---- misuse the simulator must report (the tests expect each dispatch to fail) ---------
// mode 0: the threads stage a 32 x 32 tile and call run() without a threadgroup_barrier
// (a race: the operation may read the tile before other simdgroups wrote it); mode 1: with
// the barrier (correct). C[32, 32] = T T^T. 64 threads.
kernel void st_tensor_race(device const float* x [[buffer(0)]],
                           device float* c [[buffer(1)]],
                           constant uint& mode [[buffer(2)]],
                           uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float t[32 * 32];
  for (uint i = tid; i < 32 * 32; i += 64) {
    t[i] = x[i];
  }
  if (mode == 1) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  constexpr auto desc = matmul2d_descriptor(32, 32, static_cast<int>(dynamic_extent), false, true);
  matmul2d<desc, execution_simdgroups<2>> op;
  auto T = tensor<threadgroup float, extents<int32_t, 32, 32>, tensor_inline>(t, extents<int32_t, 32, 32>());
  auto C = tensor<device float, extents<int32_t, 32, 32>, tensor_inline>(c, extents<int32_t, 32, 32>());
  op.run(T, T, C);
}

// mode 0: only simdgroup 0 calls run() of an execution_simdgroups<2> operation; mode 1:
// the simdgroups call it on different operands (each its own row block); mode 2: correct.
kernel void st_tensor_divergent(device float* x [[buffer(0)]],
                                device float* c [[buffer(1)]],
                                constant uint& mode [[buffer(2)]],
                                ushort sg [[simdgroup_index_in_threadgroup]]) {
  constexpr auto desc = matmul2d_descriptor(32, 32, static_cast<int>(dynamic_extent), false, true);
  matmul2d<desc, execution_simdgroups<2>> op;
  auto X = tensor<device float, dextents<int32_t, 2>, tensor_inline>(x, dextents<int32_t, 2>(32, 64));
  auto C = tensor<device float, dextents<int32_t, 2>, tensor_inline>(c, dextents<int32_t, 2>(32, 32));
  if (mode == 0 && sg != 0) {
    return;
  }
  auto rows = X.slice(0, mode == 1 ? sg * 32 : 0);
  op.run(rows, rows, C);
}
