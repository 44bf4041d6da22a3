// Prefill attention, Metal 4 tensor-operation path for apple10-family GPUs (M5: per-core
// neural accelerators) (docs/prefill.md, "Attention"). Twins of attn_prefill_d<D>_g<G> and
// attn_prefill_split_d<D>_g<G> (attention_prefill.metal) with the same K/V, gate, output and
// argument bindings; the query operand differs: half q * scale, saturated, laid out
// [Hq / G, M, G, D] by attn_prefill_prep_d<D>_qh, so the 64 (chunk row, head) pairs of a
// threadgroup are 64 consecutive rows of D halves and Q is read by the matmul straight from
// device memory (not staged: 64 x 256 halves alone would fill the 32 KiB of threadgroup
// memory). The combine kernel is shared. Grid: (ceil(M / BQ), Hq / G[, splits]) threadgroups
// of 256 threads, BQ = 64 / G chunk rows: pair r < 64 of a threadgroup is chunk row
// block * BQ + r / G of query head y * G + r % G.
//
// Per 32-row KV tile (attention_prefill.h: the same tiles, saturating K/V conversion and
// online softmax as the simdgroup kernels):
//   load K as half (all threads), barrier;
//   S = Q K^T   one matmul2d (64 x 32, k = D, half x half -> fp32) over the 8 simdgroups;
//   barrier; load V as half while 4 threads per pair run the fp32 online softmax (P -> half);
//   barrier; O (64 x D fp32, a cooperative tensor: registers) *= corr per pair, when a pair's
//               reference max moved (a flag per simdgroup);
//   O += P V    one matmul2d (64 x D, k = 32); barrier.
// Threadgroup memory (D = 256): K/V tile 16 KiB + S 8 KiB + P 4 KiB + 800 B of per-pair
// values: 29,472 bytes of the 32 KiB limit.
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

constant constexpr uint kThreads = 256;  // 8 simdgroups: the scope of every tensor operation
constant constexpr uint kRows = 64;      // (chunk row, head) pairs per threadgroup: the matmuls' m

template <uint D, uint G, bool SPLIT>
static inline void attend(device half* qh, device const float* qg, device const bfloat* k_cache,
                          device const bfloat* v_cache, device float* out, device float* part_ml,
                          device float* part_o, constant AttnPrefillArgs& args, uint block, uint y,
                          uint split,
                          threadgroup half* kv,    // [kTile, D] K or V tile
                          threadgroup float* ss,   // [kRows, kTile] scores
                          threadgroup half* ps,    // [kRows, kTile] P
                          threadgroup float* rowv, // [3 * kRows + 8] corr, then 1 / l (or l) and m; rescale flags
                          uint tid) {
  constexpr uint BQ = kRows / G;
  const uint Hq = args.num_q_heads;
  const uint M = args.rows;
  const uint h0 = y * G;
  const uint kvh = h0 / (Hq / args.num_kv_heads);
  const uint row0 = block * BQ;
  const uint pairs = min(BQ, M - row0) * G;  // pairs of chunk rows (the rest: past the chunk)
  uint kbeg;
  uint kend;
  if (!kv_range<SPLIT>(args, row0 + pairs / G - 1, split, kbeg, kend)) {
    return;  // uniform: no row of this block reaches split `split`
  }

  // Q: rows [row0 * G, row0 * G + pairs) of head group y's [M * G, D] matrix. Its extent is
  // the pairs of chunk rows: the matmul leaves S rows past it undefined, and the softmax
  // masks those rows whole.
  using QRowsT = tensor<device half, dextents<int32_t, 2>, tensor_inline>;
  using KVTile = tensor<threadgroup half, extents<int32_t, D, kTile>, tensor_inline>;
  using PTile = tensor<threadgroup half, extents<int32_t, kTile, kRows>, tensor_inline>;
  using STile = tensor<threadgroup float, extents<int32_t, kTile, kRows>, tensor_inline>;
  QRowsT tQ(qh + (ulong(y) * M + row0) * G * D, dextents<int32_t, 2>(D, pairs));
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

  // softmax role: pair sr, columns 8 su .. 8 su + 7, 4 threads per pair: the simdgroup
  // kernel's layout, so l is summed in the same order and both paths agree bit for bit on
  // the simulator
  const uint sr = tid / 4;
  const uint su = tid % 4;
  const bool live = sr < pairs;                   // uniform per group of 4 lanes
  const uint spos = args.p0 + row0 + sr / G;      // keys <= spos are attended
  float m = -INFINITY;
  float l = 0.0f;
  device const bfloat* khead = k_cache + ulong(kvh) * args.capacity * D;
  device const bfloat* vhead = v_cache + ulong(kvh) * args.capacity * D;

  for (uint t0 = kbeg; t0 < kend; t0 += kTile) {
    load_tile<D, kThreads>(khead, t0, kend, kv, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // K complete
    qk.run(tQ, tKV, tS);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // S complete, K no longer read
    load_tile<D, kThreads>(vhead, t0, kend, kv, tid);
    float s[8];
    for (uint j = 0; j < 8; ++j) {
      const uint key = t0 + 8 * su + j;
      const float x = ss[sr * kTile + 8 * su + j];
      s[j] = (live && key <= spos && key < kend) ? x : -INFINITY;
    }
    const float corr = softmax_row<8, 4>(s, m, l, ps + sr * kTile + 8 * su);
    const bool moved = simd_any(corr != 1.0f);  // any of the simdgroup's 8 pairs
    if (su == 0) {
      rowv[sr] = corr;
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

  if (su == 0) {
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
    if (r >= pairs) {
      continue;  // past the chunk
    }
    const uint row = row0 + r / G;
    const uint h = h0 + r % G;
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
[[max_total_threads_per_threadgroup(256)]] kernel void attn_prefill_tensor(device half* qh [[buffer(0)]],               // [Hq/G, M, G, D] q * scale (attn_prefill_prep_d<D>_qh); read only
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
  threadgroup half4 kv4[kTile * D / 4];  // half4: load_tile writes it as half4
  threadgroup float ss[kRows * kTile];
  threadgroup half ps[kRows * kTile];
  threadgroup float rowv[3 * kRows + kThreads / 32];
  const uint nblocks = (args.rows + kRows / G - 1) / (kRows / G);
  if (tg.x >= nblocks) {
    return;
  }
  attend<D, G, false>(qh, qg, k_cache, v_cache, out, out, out, args, nblocks - 1 - tg.x, tg.y, 0,
                      (threadgroup half*)kv4, ss, ps, rowv, tid);
}

// ---- attn_prefill_split_tensor: as attn_prefill_split (partials for attn_prefill_combine)
template <uint D, uint G>
[[max_total_threads_per_threadgroup(256)]] kernel void attn_prefill_split_tensor(device half* qh [[buffer(0)]],               // [Hq/G, M, G, D] q * scale; read only
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
  threadgroup half4 kv4[kTile * D / 4];  // half4: load_tile writes it as half4
  threadgroup float ss[kRows * kTile];
  threadgroup half ps[kRows * kTile];
  threadgroup float rowv[3 * kRows + kThreads / 32];
  const uint nblocks = (args.rows + kRows / G - 1) / (kRows / G);
  if (tg.x >= nblocks || tg.z >= args.num_splits) {
    return;
  }
  attend<D, G, true>(qh, nullptr, k_cache, v_cache, part_o, part_ml, part_o, args, nblocks - 1 - tg.x, tg.y,
                     tg.z, (threadgroup half*)kv4, ss, ps, rowv, tid);
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
