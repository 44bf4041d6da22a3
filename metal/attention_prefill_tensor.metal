// Prefill attention, Metal 4 tensor-operation path for apple10-family GPUs (M5: per-core
// neural accelerators) (docs/prefill.md, "Attention"). Twins of attn_prefill_d<D>_g<G> and
// attn_prefill_split_d<D>_g<G> (attention_prefill.metal) with the same tiles, fp32 online
// softmax, gate, output and argument bindings; the matrix operands are bfloat (as MLX's NAX
// attention): q * scale rounded to bf16 by attn_prefill_prep_d<D>_qbf in the layout
// [Hq / G, M, G, D], so the 64 (chunk row, head) pairs of a threadgroup are 64 consecutive
// rows of D bfloats read by the matmul straight from device memory (64 x 256 operands alone
// would fill the 32 KiB of threadgroup memory); K read straight from the bf16 cache as well
// (no conversion, no staging); V straight from the cache into registers, as MLX's NAX
// attention keeps its K and V fragments (steel_attention_nax.h): each thread fills its slots
// of the P V operation's cooperative right input, rows past the range zero; P rounded to
// bf16. The combine kernel is shared. Grid: (ceil(M / BQ), Hq / G[, splits]) threadgroups of
// 256 threads, BQ = 64 / G chunk rows: pair r < 64 of a threadgroup is chunk row
// block * BQ + r / G of query head y * G + r % G.
//
// Per 32-row KV tile (attention_prefill.h: the tiles and the online softmax shared with the
// simdgroup kernels):
//   every thread loads its V elements (the loads in flight across the product);
//   S = Q K^T   one matmul2d (64 x 32, k = D, bfloat x bfloat -> fp32) over the 8 simdgroups,
//               K the tile's cache rows (an extent of the rows before kend: S columns past it
//               are unspecified and masked by the softmax);
//   barrier; 4 threads per pair run the fp32 online softmax (P -> bfloat);
//   barrier; O (64 x D fp32, a cooperative tensor: registers) *= corr per pair, when a pair's
//               reference max moved (a flag per simdgroup);
//   O += P V    one matmul2d (64 x D, k = 32, V the cooperative right input); barrier.
// Three threadgroup barriers per tile. Threadgroup memory (D = 256): S 8 KiB + P 4 KiB +
// 800 B of per-pair values, 13,088 bytes (the V tile's 16 KiB no longer staged): two
// threadgroups per core even where a core holds only 32 KiB.
// MSL 4.0: built into lily_tensor.metallib (bfloat x bfloat -> float: the operand table of
// MacOSX 26.1 SDK's MPPTensorOpsMatMul2d.h; 26.0's header maps bfloat under __HAVE_BFLOAT__).
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
static inline void attend(device bfloat* qb, device const bfloat* qg, device const bfloat* k_cache,
                          device const bfloat* v_cache, device bfloat* out, device float* part_ml,
                          device float* part_o, constant AttnPrefillArgs& args, uint block, uint y,
                          uint split,
                          threadgroup float* ss,   // [kRows, kTile] scores
                          threadgroup bfloat* ps,  // [kRows, kTile] P
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
  using QRowsT = tensor<device bfloat, dextents<int32_t, 2>, tensor_inline>;
  using PTile = tensor<threadgroup bfloat, extents<int32_t, kTile, kRows>, tensor_inline>;
  using STile = tensor<threadgroup float, extents<int32_t, kTile, kRows>, tensor_inline>;
  QRowsT tQ(qb + (ulong(y) * M + row0) * G * D, dextents<int32_t, 2>(D, pairs));
  PTile tP(ps, extents<int32_t, kTile, kRows>());
  STile tS(ss, extents<int32_t, kTile, kRows>());
  // S (kRows x kTile) = Q K^T: K's rows are the right operand's columns (transpose_right)
  constexpr auto qk_desc = matmul2d_descriptor(kRows, kTile, D, false, true, false, matmul2d_descriptor::mode::multiply);
  // O (kRows x D) += P V
  constexpr auto pv_desc =
      matmul2d_descriptor(kRows, D, kTile, false, false, false, matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<qk_desc, execution_simdgroups<kThreads / 32>> qk;
  matmul2d<pv_desc, execution_simdgroups<kThreads / 32>> pv;
  // V (kTile x D): each thread's elements, {d, key} (the right operand's extents (D, kTile))
  auto vr = pv.template get_right_input_cooperative_tensor<bfloat, bfloat, float>();
  auto o = pv.template get_destination_cooperative_tensor<PTile, decltype(vr), float>();
  for (uint16_t i = 0; i < o.get_capacity(); ++i) {
    if (o.is_valid_element(i)) {
      o[i] = 0.0f;
    }
  }

  // softmax role: pair sr, columns 8 su .. 8 su + 7, 4 threads per pair: the simdgroup
  // kernel's layout, so l is summed in the same order
  const uint sr = tid / 4;
  const uint su = tid % 4;
  const bool live = sr < pairs;                   // uniform per group of 4 lanes
  const uint spos = args.p0 + row0 + sr / G;      // keys <= spos are attended
  float m = -INFINITY;
  float l = 0.0f;
  device const bfloat* khead = k_cache + ulong(kvh) * args.capacity * D;
  device const bfloat* vhead = v_cache + ulong(kvh) * args.capacity * D;
  // S starts at zero: Apple's header defines the product as C = A B + C with C assumed
  // zeroed, also in mode::multiply; each thread re-zeroes the scores it reads below
  for (uint i = tid; i < kRows * kTile; i += kThreads) {
    ss[i] = 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint t0 = kbeg; t0 < kend; t0 += kTile) {
    // V rows [t0, t0 + kTile) into registers (rows >= kend zero: 0 * v stays finite)
    for (uint16_t i = 0; i < vr.get_capacity(); ++i) {
      if (vr.is_valid_element(i)) {
        const auto at = vr.get_multidimensional_index(i);  // {d, key}
        const uint key = t0 + uint(at[1]);
        vr[i] = key < kend ? vhead[ulong(key) * D + uint(at[0])] : bfloat(0.0f);
      }
    }
    // K rows [t0, min(t0 + kTile, kend)) from the cache (only read: no barrier orders it;
    // tensor elements are non-const, as Apple's examples)
    QRowsT tK((device bfloat*)(khead + ulong(t0) * D), dextents<int32_t, 2>(D, min(kTile, kend - t0)));
    qk.run(tQ, tK, tS);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // S complete
    float s[8];
    for (uint j = 0; j < 8; ++j) {
      const uint key = t0 + 8 * su + j;
      const float x = ss[sr * kTile + 8 * su + j];
      ss[sr * kTile + 8 * su + j] = 0.0f;  // only this thread reads it; the loop's last barrier orders the next run
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
    threadgroup_barrier(mem_flags::mem_threadgroup);  // P, corr and the flags complete
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
    pv.run(tP, vr, o);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // S, P and corr free for the next tile
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
      const float gate = float(qg[(ulong(row) * Hq + h) * 2 * D + D + d]);
      out[(ulong(row) * Hq + h) * D + d] = bfloat(o[i] * rowv[kRows + r] * sigmoid(gate));
    }
  }
}

}  // namespace attn_prefill_tensor_detail

// ---- attn_prefill_tensor: as attn_prefill (attention_prefill.metal)
template <uint D, uint G>
[[max_total_threads_per_threadgroup(256)]] kernel void attn_prefill_tensor(device bfloat* qb [[buffer(0)]],             // [Hq/G, M, G, D] q * scale (attn_prefill_prep_d<D>_qbf); read only
                                device const bfloat* qg [[buffer(1)]],       // bfloat [M, Hq*2*D] (gate: second D of each head)
                                device const bfloat* k_cache [[buffer(2)]],  // [Hkv, capacity, D], rows [0, p0 + M) read
                                device const bfloat* v_cache [[buffer(3)]],  // [Hkv, capacity, D], rows [0, p0 + M) read
                                device bfloat* out [[buffer(4)]],            // bfloat [M, Hq*D] attention * sigmoid(gate)
                                constant AttnPrefillArgs& args [[buffer(5)]],
                                uint2 tg [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]]) {
  using namespace attn_prefill_tensor_detail;
  static_assert(G == 2 || G == 4 || G == 8, "G: 2, 4 or 8 query heads per threadgroup");
  static_assert(D % 32 == 0 && D <= 256, "D: a multiple of 32, at most 256");
  threadgroup float ss[kRows * kTile];
  threadgroup bfloat ps[kRows * kTile];
  threadgroup float rowv[3 * kRows + kThreads / 32];
  const uint nblocks = (args.rows + kRows / G - 1) / (kRows / G);
  if (tg.x >= nblocks) {
    return;
  }
  attend<D, G, false>(qb, qg, k_cache, v_cache, out, nullptr, nullptr, args, nblocks - 1 - tg.x, tg.y, 0, ss, ps,
                      rowv, tid);
}

// ---- attn_prefill_split_tensor: as attn_prefill_split (partials for attn_prefill_combine)
template <uint D, uint G>
[[max_total_threads_per_threadgroup(256)]] kernel void attn_prefill_split_tensor(device bfloat* qb [[buffer(0)]],             // [Hq/G, M, G, D] q * scale; read only
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
  threadgroup float ss[kRows * kTile];
  threadgroup bfloat ps[kRows * kTile];
  threadgroup float rowv[3 * kRows + kThreads / 32];
  const uint nblocks = (args.rows + kRows / G - 1) / (kRows / G);
  if (tg.x >= nblocks || tg.z >= args.num_splits) {
    return;
  }
  attend<D, G, true>(qb, nullptr, k_cache, v_cache, nullptr, part_ml, part_o, args, nblocks - 1 - tg.x, tg.y,
                     tg.z, ss, ps, rowv, tid);
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

// ---- start-up probe of the Metal backend: the attention's tensor operations -------------
// The Metal device builds this pipeline after tensor_ops_probe (gemm_tensor.metal): the
// attention's bfloat x bfloat -> float operations, which only MacOSX 26.1's operand table
// lists. Prefill takes the tensor path only where both probes build
// (Device::supports_bfloat_tensor_ops). As a kernel (one threadgroup of 128 threads; xb
// bfloat [64, 64]):
//   out_qk[32, 64] = xb[0:32] xb^T   S = Q K^T: bfloat device tensors, multiply into a
//                                    threadgroup fp32 tensor
//   out_pv[32, 64] = xb[0:32] xb     O += P V: a bfloat threadgroup tile times a cooperative
//                                    right input filled from device memory,
//                                    multiply_accumulate into an fp32 cooperative tensor
[[max_total_threads_per_threadgroup(128)]] kernel void tensor_ops_probe_bfloat(device const bfloat* xb [[buffer(0)]],
                                    device float* out_qk [[buffer(1)]],
                                    device float* out_pv [[buffer(2)]],
                                    uint tid [[thread_index_in_threadgroup]]) {
  constexpr uint BM = 32, BN = 64, K = 64;
  threadgroup float smem[BM * BN];
  threadgroup bfloat tiles[BM * K];  // P [BM][K]

  // S = Q K^T on bfloat device tensors (extents: k innermost), into threadgroup fp32
  using DevRows = tensor<device bfloat, dextents<int32_t, 2>, tensor_inline>;
  using Stage = tensor<threadgroup float, extents<int32_t, BN, BM>, tensor_inline>;
  DevRows tQ((device bfloat*)xb, dextents<int32_t, 2>(K, BM));
  DevRows tK((device bfloat*)xb, dextents<int32_t, 2>(K, BN));
  Stage tS(smem, extents<int32_t, BN, BM>());
  constexpr auto qk_desc = matmul2d_descriptor(BM, BN, K, false, true, false, matmul2d_descriptor::mode::multiply);
  matmul2d<qk_desc, execution_simdgroups<4>> qk;
  for (uint i = tid; i < BM * BN; i += 128) {  // a zeroed destination, as the kernels keep it
    smem[i] = 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  qk.run(tQ, tK, tS);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < BM * BN; i += 128) {
    out_qk[i] = smem[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // O += P V: P a bfloat threadgroup tile [BM][K], V [K][BN] in a cooperative right input
  threadgroup bfloat* Ps = tiles;
  for (uint i = tid; i < BM * K; i += 128) {
    Ps[i] = xb[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  using PTile = tensor<threadgroup bfloat, extents<int32_t, K, BM>, tensor_inline>;
  PTile tP(Ps, extents<int32_t, K, BM>());
  constexpr auto pv_desc =
      matmul2d_descriptor(BM, BN, K, false, false, false, matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<pv_desc, execution_simdgroups<4>> pv;
  auto vr = pv.get_right_input_cooperative_tensor<bfloat, bfloat, float>();
  for (uint16_t i = 0; i < vr.get_capacity(); ++i) {
    if (vr.is_valid_element(i)) {
      const auto at = vr.get_multidimensional_index(i);  // {column, k}
      vr[i] = xb[uint(at[1]) * BN + uint(at[0])];
    }
  }
  auto o = pv.get_destination_cooperative_tensor<PTile, decltype(vr), float>();
  for (uint16_t i = 0; i < o.get_capacity(); ++i) {
    if (o.is_valid_element(i)) {
      o[i] = 0.0f;
    }
  }
  pv.run(tP, vr, o);
  Stage tO(smem, extents<int32_t, BN, BM>());  // smem: its last reads were before the barrier above
  o.store(tO);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < BM * BN; i += 128) {
    out_pv[i] = smem[i];
  }
}
