// Prefill attention, Metal 4 tensor-operation path for apple10-family GPUs (M5: per-core
// neural accelerators) (docs/prefill.md, "Attention"). Twins of attn_prefill_d<D>_g<G> and
// attn_prefill_split_d<D>_g<G> (attention_prefill.metal) with identical bindings, argument
// structs and outputs; the combine kernel is shared. Grid: (ceil(M / BQ), Hq / G[, splits])
// threadgroups of 128 threads, BQ = 16 / G chunk rows: pair r < 16 of a threadgroup is chunk
// row block * BQ + r % BQ of query head y * G + r / BQ.
//
// Per 32-row KV tile (attention_prefill.h: the same tiles and online softmax as the simdgroup
// kernels):
//   load K as half (all threads), barrier;
//   S = Q K^T   one matmul2d (16 x 32, k = D, half x half -> fp32) over the 4 simdgroups,
//               Q (16 pairs, times the scale, half) staged once in threadgroup memory;
//   barrier; load V as half while 4 threads per row run the fp32 online softmax (P -> half);
//   barrier; O (16 x D fp32, a cooperative tensor: registers) *= corr per row, when a row's
//               reference max moved (a flag per simdgroup);
//   O += P V    one matmul2d (16 x D, k = 32); barrier.
// Threadgroup memory (D = 256): Q 8 KiB + K/V tile 16 KiB + S 2 KiB + P 1 KiB: the 32 KiB
// limit is why a threadgroup holds 16 pairs here (64 on the simdgroup path, where Q lives in
// registers).
// MSL 4.0: built into lily_tensor.metallib (half x half -> float: MacOSX 26.0 SDK
// MPPTensorOpsMatMul2d.h operand table).
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

#include "common.h"  // sigmoid
#include "prefill_args.h"
#include "attention_prefill.h"

namespace attn_prefill_tensor_detail {
using namespace attn_prefill_shared;

constant constexpr uint kThreads = 128;  // 4 simdgroups: the scope of every tensor operation
constant constexpr uint kRows = 16;      // (chunk row, head) pairs per threadgroup: the matmuls' m

template <uint D, uint G, bool SPLIT>
static inline void attend(device const float* q, device const float* qg, device const bfloat* k_cache,
                          device const bfloat* v_cache, device float* out, device float* part_ml,
                          device float* part_o, constant AttnPrefillArgs& args, uint block, uint h0,
                          uint split,
                          threadgroup half* qs,    // [kRows, D] Q * scale
                          threadgroup half* kv,    // [kTile, D] K or V tile
                          threadgroup float* ss,   // [kRows, kTile] scores
                          threadgroup half* ps,    // [kRows, kTile] P
                          threadgroup float* rowv, // [3 * kRows + 4] corr, then 1 / l (or l) and m; rescale flags
                          uint tid) {
  constexpr uint BQ = kRows / G;
  const uint Hq = args.num_q_heads;
  const uint M = args.rows;
  const uint kvh = h0 / (Hq / args.num_kv_heads);
  const uint row0 = block * BQ;
  const uint last = min(row0 + BQ, M) - 1;
  uint kbeg;
  uint kend;
  if (!kv_range<SPLIT>(args, last, split, kbeg, kend)) {
    return;  // uniform: no row of this block reaches split `split`
  }
  for (uint e = tid; e < kRows * D / 4; e += kThreads) {  // Q * scale as half; rows past the chunk 0
    const uint r = (4 * e) / D;
    const uint d = (4 * e) % D;
    const uint row = row0 + r % BQ;
    float4 x = float4(0.0f);
    if (row < M) {
      x = ((device const float4*)(q + (ulong(row) * Hq + h0 + r / BQ) * D))[d / 4] * args.scale;
    }
    ((threadgroup half4*)qs)[e] = half4(x);
  }

  using QTile = tensor<threadgroup half, extents<int32_t, D, kRows>, tensor_inline>;
  using KVTile = tensor<threadgroup half, extents<int32_t, D, kTile>, tensor_inline>;
  using PTile = tensor<threadgroup half, extents<int32_t, kTile, kRows>, tensor_inline>;
  using STile = tensor<threadgroup float, extents<int32_t, kTile, kRows>, tensor_inline>;
  QTile tQ(qs, extents<int32_t, D, kRows>());
  KVTile tKV(kv, extents<int32_t, D, kTile>());
  PTile tP(ps, extents<int32_t, kTile, kRows>());
  STile tS(ss, extents<int32_t, kTile, kRows>());
  // S (kRows x kTile) = Q K^T: K's rows are the right operand's columns (transpose_right)
  constexpr auto qk_desc = matmul2d_descriptor(kRows, kTile, D, false, true, false, matmul2d_descriptor::mode::multiply);
  // O (kRows x D) += P V
  constexpr auto pv_desc =
      matmul2d_descriptor(kRows, D, kTile, false, false, false, matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<qk_desc, execution_simdgroups<kThreads / 32>> qk;
  matmul2d<pv_desc, execution_simdgroups<kThreads / 32>> pv;
  auto o = pv.template get_destination_cooperative_tensor<PTile, KVTile, float>();
  for (uint16_t i = 0; i < o.get_capacity(); ++i) {
    if (o.is_valid_element(i)) {
      o[i] = 0.0f;
    }
  }

  // softmax role (threads < 64): row sr, columns 8 su .. 8 su + 7, 4 threads per row: the
  // simdgroup kernel's layout, so l is summed in the same order and both paths agree bit for
  // bit on the simulator
  const uint sr = min(tid / 4, kRows - 1);
  const uint su = tid % 4;
  const uint spos = args.p0 + min(row0 + sr % BQ, M - 1);  // rows past the chunk copy the last one
  float m = -INFINITY;
  float l = 0.0f;
  device const bfloat* khead = k_cache + ulong(kvh) * args.capacity * D;
  device const bfloat* vhead = v_cache + ulong(kvh) * args.capacity * D;

  for (uint t0 = kbeg; t0 < kend; t0 += kTile) {
    load_tile<D, kThreads>(khead, t0, kend, kv, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // K (and, the first time, Q) complete
    qk.run(tQ, tKV, tS);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // S complete, K no longer read
    load_tile<D, kThreads>(vhead, t0, kend, kv, tid);
    bool moved = false;
    if (tid < 4 * kRows) {  // uniform per simdgroup: simdgroups 0 and 1
      float s[8];
      for (uint j = 0; j < 8; ++j) {
        const uint key = t0 + 8 * su + j;
        const float x = ss[sr * kTile + 8 * su + j];
        s[j] = (key <= spos && key < kend) ? x : -INFINITY;
      }
      const float corr = softmax_row<8, 4>(s, m, l, ps + sr * kTile + 8 * su);
      moved = simd_any(corr != 1.0f);  // any of the simdgroup's 8 rows
      if (su == 0) {
        rowv[sr] = corr;
      }
    }
    if (tid % 32 == 0) {
      rowv[3 * kRows + tid / 32] = moved ? 1.0f : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // P, corr, the flags and the V tile complete
    bool rescale = false;  // uniform: every thread reads the same flags
    for (uint g = 0; g < kThreads / 32; ++g) {
      rescale = rescale || rowv[3 * kRows + g] != 0.0f;
    }
    if (rescale) {  // rare after the first tiles (lazy rescaling)
      for (uint16_t i = 0; i < o.get_capacity(); ++i) {
        if (o.is_valid_element(i)) {
          o[i] *= rowv[o.get_multidimensional_index(i)[1]];
        }
      }
    }
    pv.run(tP, tKV, o);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // kv, S, P and corr free for the next tile
  }

  if (tid < 4 * kRows && su == 0) {
    rowv[kRows + sr] = SPLIT ? l : 1.0f / l;
    rowv[2 * kRows + sr] = m;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // each thread writes its own elements of O (no staging)
  for (uint16_t i = 0; i < o.get_capacity(); ++i) {
    if (!o.is_valid_element(i)) {
      continue;
    }
    const auto at = o.get_multidimensional_index(i);  // {column, row}
    const uint r = uint(at[1]);
    const uint d = uint(at[0]);
    const uint row = row0 + r % BQ;
    const uint h = h0 + r / BQ;
    if (row >= M) {
      continue;
    }
    if (SPLIT) {
      const ulong slot = (ulong(split) * M + row) * Hq + h;
      part_o[slot * D + d] = o[i];
      if (d == 0) {
        part_ml[2 * slot] = rowv[2 * kRows + r];
        part_ml[2 * slot + 1] = rowv[kRows + r];
      }
    } else {
      const float gate = qg[(ulong(row) * Hq + h) * 2 * D + D + d];
      out[(ulong(row) * Hq + h) * D + d] = o[i] * rowv[kRows + r] * sigmoid(gate);
    }
  }
}

}  // namespace attn_prefill_tensor_detail

// ---- attn_prefill_tensor: as attn_prefill (attention_prefill.metal)
template <uint D, uint G>
[[max_total_threads_per_threadgroup(128)]] kernel void attn_prefill_tensor(device const float* q [[buffer(0)]],         // [M, Hq, D]
                                device const float* qg [[buffer(1)]],        // [M, Hq*2*D] (gate: second D of each head)
                                device const bfloat* k_cache [[buffer(2)]],  // [Hkv, capacity, D], rows [0, p0 + M) read
                                device const bfloat* v_cache [[buffer(3)]],  // [Hkv, capacity, D], rows [0, p0 + M) read
                                device float* out [[buffer(4)]],             // [M, Hq*D] attention * sigmoid(gate)
                                constant AttnPrefillArgs& args [[buffer(5)]],
                                uint2 tg [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]]) {
  using namespace attn_prefill_tensor_detail;
  static_assert(G == 2 || G == 4 || G == 8, "G: 2, 4 or 8 query heads per threadgroup");
  static_assert(D % 32 == 0 && D <= 256, "D: a multiple of 32, at most 256");
  threadgroup half4 qs4[kRows * D / 4];
  threadgroup half4 kv4[kTile * D / 4];
  threadgroup float ss[kRows * kTile];
  threadgroup half ps[kRows * kTile];
  threadgroup float rowv[3 * kRows + kThreads / 32];
  const uint nblocks = (args.rows + kRows / G - 1) / (kRows / G);
  if (tg.x >= nblocks) {
    return;
  }
  attend<D, G, false>(q, qg, k_cache, v_cache, out, out, out, args, nblocks - 1 - tg.x, tg.y * G, 0,
                      (threadgroup half*)qs4, (threadgroup half*)kv4, ss, ps, rowv, tid);
}

// ---- attn_prefill_split_tensor: as attn_prefill_split (partials for attn_prefill_combine)
template <uint D, uint G>
[[max_total_threads_per_threadgroup(128)]] kernel void attn_prefill_split_tensor(device const float* q [[buffer(0)]],         // [M, Hq, D]
                                      device const bfloat* k_cache [[buffer(1)]],  // [Hkv, capacity, D]
                                      device const bfloat* v_cache [[buffer(2)]],  // [Hkv, capacity, D]
                                      device float* part_ml [[buffer(3)]],         // [num_splits, M, Hq, 2]
                                      device float* part_o [[buffer(4)]],          // [num_splits, M, Hq, D]
                                      constant AttnPrefillArgs& args [[buffer(5)]],
                                      uint3 tg [[threadgroup_position_in_grid]],
                                      uint tid [[thread_index_in_threadgroup]]) {
  using namespace attn_prefill_tensor_detail;
  static_assert(G == 2 || G == 4 || G == 8, "G: 2, 4 or 8 query heads per threadgroup");
  static_assert(D % 32 == 0 && D <= 256, "D: a multiple of 32, at most 256");
  threadgroup half4 qs4[kRows * D / 4];
  threadgroup half4 kv4[kTile * D / 4];
  threadgroup float ss[kRows * kTile];
  threadgroup half ps[kRows * kTile];
  threadgroup float rowv[3 * kRows + kThreads / 32];
  const uint nblocks = (args.rows + kRows / G - 1) / (kRows / G);
  if (tg.x >= nblocks || tg.z >= args.num_splits) {
    return;
  }
  attend<D, G, true>(q, q, k_cache, v_cache, part_o, part_ml, part_o, args, nblocks - 1 - tg.x, tg.y * G,
                     tg.z, (threadgroup half*)qs4, (threadgroup half*)kv4, ss, ps, rowv, tid);
}

// Instantiations: as attention_prefill.metal.
template [[host_name("attn_prefill_d256_g8_tensor")]] [[kernel]] decltype(attn_prefill_tensor<256, 8>) attn_prefill_tensor<256, 8>;
template [[host_name("attn_prefill_d256_g4_tensor")]] [[kernel]] decltype(attn_prefill_tensor<256, 4>) attn_prefill_tensor<256, 4>;
template [[host_name("attn_prefill_d256_g2_tensor")]] [[kernel]] decltype(attn_prefill_tensor<256, 2>) attn_prefill_tensor<256, 2>;
template [[host_name("attn_prefill_d64_g8_tensor")]] [[kernel]] decltype(attn_prefill_tensor<64, 8>) attn_prefill_tensor<64, 8>;
template [[host_name("attn_prefill_d64_g4_tensor")]] [[kernel]] decltype(attn_prefill_tensor<64, 4>) attn_prefill_tensor<64, 4>;
template [[host_name("attn_prefill_d64_g2_tensor")]] [[kernel]] decltype(attn_prefill_tensor<64, 2>) attn_prefill_tensor<64, 2>;
template [[host_name("attn_prefill_split_d256_g8_tensor")]] [[kernel]] decltype(attn_prefill_split_tensor<256, 8>) attn_prefill_split_tensor<256, 8>;
template [[host_name("attn_prefill_split_d256_g4_tensor")]] [[kernel]] decltype(attn_prefill_split_tensor<256, 4>) attn_prefill_split_tensor<256, 4>;
template [[host_name("attn_prefill_split_d256_g2_tensor")]] [[kernel]] decltype(attn_prefill_split_tensor<256, 2>) attn_prefill_split_tensor<256, 2>;
template [[host_name("attn_prefill_split_d64_g8_tensor")]] [[kernel]] decltype(attn_prefill_split_tensor<64, 8>) attn_prefill_split_tensor<64, 8>;
template [[host_name("attn_prefill_split_d64_g4_tensor")]] [[kernel]] decltype(attn_prefill_split_tensor<64, 4>) attn_prefill_split_tensor<64, 4>;
template [[host_name("attn_prefill_split_d64_g2_tensor")]] [[kernel]] decltype(attn_prefill_split_tensor<64, 2>) attn_prefill_split_tensor<64, 2>;
