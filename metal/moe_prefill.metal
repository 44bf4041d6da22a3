// Expert routing of a prefill chunk on the GPU, and the MoE combine (docs/prefill.md,
// "Expert routing on the GPU"). Per MoE layer, after the router GEMM wrote logits_r:
//   moe_route_clear    zero the block histogram (any stage before moe_route_topk; it only
//                      conflicts with the previous layer's moe_route_scatter)
//   moe_route_topk     one row per threadgroup: softmax -> top-k -> weights (decode's
//                      route_topk, bit-identical picks and weights), shared-expert gate,
//                      and the row's k assignments counted into its block of the histogram
//   moe_route_scatter  one block of rows per threadgroup: prefix scans of the histogram
//                      (expert starts, tile starts per tile class), the block's assignments
//                      scattered into the grouped order (stable: increasing row within an
//                      expert), the tile map and count of each class, the per-expert counts
// then the grouped expert GEMMs over the tile maps, one dispatch per tile class in one barrier
// stage (moe_gemm_gate_up_q4_t*, moe_gemm_down_q4_t*, below), and after them:
//   moe_combine        h[row] += sum_j w[row, j] yx[row*k + j]  (yx bfloat; the shared expert
//                      was added into h by its down projection)
//   moe_combine_norm   the same, then xn[row] = the next layer's input RMSNorm of h[row] (bfloat)
// Nothing is left on the device between chunks but outputs: the only counters (the block
// histogram) are zeroed by moe_route_clear inside the same command buffer.
#include <metal_stdlib>
using namespace metal;

#include "common.h"
#include "gemm_tiles.h"
#include "prefill_args.h"
#include "route.h"  // route_topk: router softmax + top-k (shared with decode)

// Exclusive prefix sum of v over the threads of a threadgroup in thread order (thread i
// gets v_0 + ... + v_{i-1}); `total` gets the sum over all threads. sums holds >= 32
// uints; it may be reused by the next call (the first barrier protects it). The
// threadgroup size must be a multiple of 32.
inline uint route_exclusive_sum(uint v, threadgroup uint* sums, uint sg, uint lane, uint nsg,
                                thread uint& total) {
  const uint before_lane = simd_prefix_exclusive_sum(v);
  const uint simd_total = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) {
    sums[sg] = simd_total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint before = 0;
  uint all = 0;
  for (uint g = 0; g < nsg; ++g) {
    const uint s = sums[g];
    before += g < sg ? s : 0u;
    all += s;
  }
  total = all;
  return before + before_lane;
}

inline uint route_blocks(constant MoeRoutePrefillArgs& args) {
  return (args.rows + args.block_rows - 1) / args.block_rows;
}

// ---- moe_route_clear -------------------------------------------------------------------
// block_counts[0 .. blocks * experts) = 0. dispatchThreads, one thread per counter.
[[max_total_threads_per_threadgroup(kMoeRouteClearThreads)]] kernel void moe_route_clear(device uint* block_counts [[buffer(0)]],  // [blocks, experts]
                            constant MoeRoutePrefillArgs& args [[buffer(1)]],
                            uint gid [[thread_position_in_grid]]) {
  if (gid < route_blocks(args) * args.experts) {
    block_counts[gid] = 0u;
  }
}

// ---- moe_route_topk --------------------------------------------------------------------
// Threadgroup `row` (32..1024 threads, >= top_k; round_up(experts, 32) recommended):
//   p = softmax(logits_r[row, 0..E)) in fp32; the k largest p in descending order, ties to
//   the lower index; w[row, j] = p_j / sum(p_top) (p_j without norm_topk);
//   w[row, k] = sigmoid(logits_r[row, E]); block_counts[row / block_rows, ids[row, j]] += 1.
// The same route_topk as decode's moe_route / moe_route_gate_up_swiglu_q4, so the picks and
// weights are bit-identical to decode on the same logits row.
[[max_total_threads_per_threadgroup(kMoeRouteMaxThreads)]] kernel void moe_route_topk(device const float* logits [[buffer(0)]],         // [rows, experts + 1] router logits, shared gate logit last
                           device uint* ids [[buffer(1)]],                   // [rows, top_k] picked experts
                           device float* w [[buffer(2)]],                    // [rows, top_k + 1] routing weights, shared gate
                           device atomic_uint* block_counts [[buffer(3)]],   // [blocks, experts], zeroed by moe_route_clear
                           constant MoeRoutePrefillArgs& args [[buffer(4)]],
                           uint row [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint tcount [[threads_per_threadgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float probs[kRouteMaxExperts];
  threadgroup float rowsum[32];
  threadgroup float scratch[32];
  threadgroup float best_p[32];
  threadgroup uint best_i[32];
  if (row >= args.rows) {  // uniform over the threadgroup
    return;
  }
  const uint n = min(args.experts, kRouteMaxExperts);
  const uint k = args.top_k;
  device const float* lr = logits + row * (args.experts + 1);

  const RoutePicks pk = route_topk(lr, n, k, 0u, probs, rowsum, scratch, best_p, best_i, tid,
                                   tcount, sg, lane, nsg);
  if (tid < k) {
    // always a valid expert (only NaN logits leave a round without a pick)
    const uint e = min(pk.my_id, n - 1u);
    ids[row * k + tid] = e;
    w[row * (k + 1) + tid] = args.norm_topk ? pk.my_p / pk.top_sum : pk.my_p;
    atomic_fetch_add_explicit(&block_counts[(row / args.block_rows) * args.experts + e], 1u,
                              memory_order_relaxed);
  }
  if (tid == 0) {
    w[row * (k + 1) + k] = sigmoid(lr[args.experts]);
  }
}

// ---- moe_route_scatter -----------------------------------------------------------------
// Threadgroup b (a multiple of 32 threads, <= 1024; round_up(experts, 32) recommended) of
// blocks = ceil(rows / block_rows): the assignments a = row*k + j of rows
// [b*block_rows, (b+1)*block_rows).
//   * Every threadgroup sums the histogram columns itself (count[e] over all blocks, pre[e]
//     over the blocks before b) and scans them: start[e] = sum_{e'<e} count[e'], and per tile
//     class c (prefill_args.h) tile_end[c][e] = the class-c tiles of experts 0..e. No
//     grid-wide step, so the scans cost no dispatch and no barrier stage (blocks * experts
//     reads per threadgroup).
//   * perm[start[e] + pre[e] + r] = a, r = the assignments of expert e before a in the block:
//     slots of an expert hold increasing assignment indices (deterministic; perm equals
//     numpy argsort(ids.ravel(), kind="stable")).
//   * The tile maps, spread over the threadgroups: expert e's slots are cut into count[e] / T
//     full tiles, {e, start[e] + t*T, T, 0}, in class 0, and the remainder r = count[e] % T
//     (if any) into one tile {e, start[e] + count[e] - r, r, 0} of class
//     moe_tail_class(T, r). Class c's map is at entries [moe_class_base(c), ...) of `tiles`,
//     in expert order; tile_count[c] = its tiles and counts[e] = count[e] (threadgroup 0).
[[max_total_threads_per_threadgroup(kMoeRouteMaxThreads)]] kernel void moe_route_scatter(device const uint* ids [[buffer(0)]],           // [rows, top_k] from moe_route_topk
                              device const uint* block_counts [[buffer(1)]],  // [blocks, experts] from moe_route_topk
                              device uint* perm [[buffer(2)]],                // [rows * top_k] grouped order: slot -> assignment
                              device MoeTile* tiles [[buffer(3)]],            // the class maps, moe_class_base / _capacity
                              device uint* tile_count [[buffer(4)]],          // [moe_tile_classes(T)] tiles per class map
                              device uint* counts [[buffer(5)]],              // [experts] assignments per expert
                              constant MoeRoutePrefillArgs& args [[buffer(6)]],
                              uint b [[threadgroup_position_in_grid]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint tcount [[threads_per_threadgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]],
                              uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup uint start[kRouteMaxExperts + 1];                 // first slot of expert e; start[E] = rows * k
  threadgroup uint tile_end[kMoeTileClasses][kRouteMaxExperts];  // class-c tiles of experts 0..e
  threadgroup uint cursor[kRouteMaxExperts];                    // first slot of expert e in this block
  threadgroup uint blk[kMoeRouteMaxBlockSlots];                 // the block's expert ids
  threadgroup uint sums[32];
  const uint nblocks = route_blocks(args);
  if (b >= nblocks) {  // uniform over the threadgroup
    return;
  }
  const uint E = min(args.experts, kRouteMaxExperts);
  const uint k = args.top_k;
  const uint T = args.tile_rows;
  const uint classes = moe_tile_classes(T);

  // histogram columns and the scans, tcount experts per round
  uint base = 0;                          // assignments of the experts before this round
  uint tbase[kMoeTileClasses] = {0, 0, 0};  // tiles of each class of the experts before this round
  for (uint e0 = 0; e0 < E; e0 += tcount) {  // uniform: barriers inside
    const uint e = e0 + tid;
    uint total = 0;
    uint before = 0;
    if (e < E) {
      for (uint bb = 0; bb < nblocks; ++bb) {
        const uint c = block_counts[bb * args.experts + e];
        total += c;
        before += bb < b ? c : 0u;
      }
    }
    uint round_n = 0;
    const uint s = base + route_exclusive_sum(total, sums, sg, lane, nsg, round_n);
    const uint r = total % T;
    const uint tail = r > 0 ? moe_tail_class(T, r) : kMoeTileClasses;
    for (uint c = 0; c < classes; ++c) {  // uniform
      const uint tiles_c = (c == 0 ? total / T : 0u) + (tail == c ? 1u : 0u);
      uint round_t = 0;
      const uint t = tbase[c] + route_exclusive_sum(tiles_c, sums, sg, lane, nsg, round_t);
      if (e < E) {
        tile_end[c][e] = t + tiles_c;
      }
      tbase[c] += round_t;
    }
    if (e < E) {
      start[e] = s;
      cursor[e] = s + before;
      if (b == 0) {
        counts[e] = total;
      }
    }
    base += round_n;
  }
  // Bounds of perm and tiles: never exceeded by a histogram of these ids; they only keep
  // the stores inside the buffers if the histogram was not cleared (a host error).
  const uint n = args.rows * k;
  uint ntiles[kMoeTileClasses];
  for (uint c = 0; c < classes; ++c) {
    ntiles[c] = min(tbase[c], moe_class_capacity(n, E, T, c));
  }
  if (tid == 0) {
    start[E] = base;
  }
  if (b == 0 && tid < classes) {
    tile_count[tid] = ntiles[tid];
  }
  const uint a0 = b * args.block_rows * k;
  const uint na = min(args.block_rows * k, n - a0);
  for (uint a = tid; a < na; a += tcount) {
    blk[a] = min(ids[a0 + a], E - 1u);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // tile maps: tile i of class c by threadgroup (i / tcount) % blocks, coalesced 16-byte stores
  for (uint c = 0; c < classes; ++c) {
    device MoeTile* map = tiles + moe_class_base(n, E, T, c);
    for (uint i = b * tcount + tid; i < ntiles[c]; i += nblocks * tcount) {
      uint lo = 0;
      uint hi = E - 1;
      while (lo < hi) {  // the first expert with tile_end > i (never one without class-c tiles)
        const uint mid = (lo + hi) / 2;
        if (tile_end[c][mid] > i) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      const uint first_tile = lo > 0 ? tile_end[c][lo - 1] : 0u;
      const uint count_e = start[lo + 1] - start[lo];
      // class 0: the t-th full tile (or the remainder after them); others: the remainder
      const uint begin = start[lo] + (c == 0 ? (i - first_tile) * T : count_e - count_e % T);
      MoeTile tile;
      tile.expert = lo;
      tile.begin = begin;
      tile.rows = min(T, start[lo + 1] - begin);
      tile.pad = 0u;
      map[i] = tile;
    }
  }

  // stable scatter: rank among the block's earlier assignments of the same expert
  for (uint a = tid; a < na; a += tcount) {
    const uint e = blk[a];
    uint r = 0;
    for (uint i = 0; i < a; ++i) {
      r += blk[i] == e ? 1u : 0u;
    }
    const uint slot = cursor[e] + r;
    if (slot < n) {
      perm[slot] = a0 + a;
    }
  }
}

// ---- moe_combine, moe_combine_norm ---------------------------------------------------------
//   h[row] += w_0 yx[row*k] + w_1 yx[row*k + 1] + ... + w_{k-1} yx[row*k + k-1]
// with w_j = w[row, j], summed in that order (j increasing), in fp32; yx is bfloat (the down
// projections' stored outputs), h fp32. The shared expert is already in h: its down
// projection adds into h (gemm_q4_add_h, its hidden scaled by the shared gate w[row, k]).
// Float4 c of a row:
inline void combine4(device float4* h, device const bfloat4* yx, device const float* w,
                     constant MoeCombineArgs& args, uint row, uint c) {
  const uint c4 = args.hidden / 4;
  const uint k = args.top_k;
  device const float* wr = w + row * (k + 1);
  device const bfloat4* y = yx + row * k * c4 + c;
  float4 acc = wr[0] * float4(y[0]);
  for (uint j = 1; j < k; ++j) {
    acc += wr[j] * float4(y[j * c4]);
  }
  h[row * c4 + c] += acc;
}

// moe_combine (the last layer): dispatchThreads grid (hidden / 4, rows), thread (c, row)
// owns float4 c of the row.
[[max_total_threads_per_threadgroup(kMoeCombineThreads)]] kernel void moe_combine(device float4* h [[buffer(0)]],          // [rows, hidden] residual, updated in place
                        device const bfloat4* yx [[buffer(1)]],  // bfloat [rows * top_k, hidden] expert outputs, row*k + j
                        device const float* w [[buffer(2)]],     // [rows, top_k + 1] routing weights, shared gate
                        constant MoeCombineArgs& args [[buffer(3)]],
                        uint2 gid [[thread_position_in_grid]]) {
  if (gid.x >= args.hidden / 4 || gid.y >= args.rows) {
    return;
  }
  combine4(h, yx, w, args, gid.y, gid.x);
}

// moe_combine_norm (layers 0 .. L-2): the combine, then the next layer's input RMSNorm of the
// updated row, xn[row] = bfloat(h * rsqrt(mean(h^2) + eps) * norm_w) (rms_row of common.h),
// so no separate rms_norm_bf16 dispatch re-reads h. One threadgroup per row: its threads
// update float4s tid, tid + tcount, ... of h, then (the device barrier makes the row's new
// values visible to the whole threadgroup) normalise it exactly as rms_norm_bf16 does with the
// same thread count: with tcount = rms_norm_bf16's (256 in prefill.cpp), h and xn are
// bit-identical to moe_combine followed by rms_norm_bf16. Any threadgroup size that is a
// multiple of 32, up to 1024.
[[max_total_threads_per_threadgroup(1024)]] kernel void moe_combine_norm(device float4* h [[buffer(0)]],          // [rows, hidden] residual, updated in place
                             device const bfloat4* yx [[buffer(1)]],  // bfloat [rows * top_k, hidden] expert outputs, row*k + j
                             device const float* w [[buffer(2)]],     // [rows, top_k + 1] routing weights, shared gate
                             constant MoeCombineArgs& args [[buffer(3)]],
                             device const bfloat* norm_w [[buffer(4)]],  // [hidden] next layer's input_layernorm.weight
                             device bfloat* xn [[buffer(5)]],         // bfloat [rows, hidden] normed
                             constant NormArgs& norm [[buffer(6)]],   // n = hidden, eps
                             uint row [[threadgroup_position_in_grid]],
                             uint tid [[thread_position_in_threadgroup]],
                             uint tcount [[threads_per_threadgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]],
                             uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float scratch[32];
  if (row >= args.rows) {
    return;  // the whole threadgroup
  }
  for (uint c = tid; c < args.hidden / 4; c += tcount) {
    combine4(h, yx, w, args, row, c);
  }
  threadgroup_barrier(mem_flags::mem_device);
  rms_row((device const float*)(h + row * (args.hidden / 4)), norm_w, xn + row * args.hidden, args.hidden,
          norm.eps, scratch, tid, tcount, sg, lane, nsg);
}

// ---- grouped expert GEMMs ------------------------------------------------------------------
// moe_gemm_gate_up_q4_t{16,32,64}  hx[s] = silu(x[perm[s] / top_k] Wg_e^T) * (x[...] Wu_e^T)
// moe_gemm_down_q4_t{16,32,64}     yx[perm[s]] = bfloat(hx[s] Wd_e^T)  (read by moe_combine)
// simdgroup_matrix path with bfloat operands and fp32 accumulation (gemm_tiles.h; the dense
// GEMMs of metal/gemm.metal use the same k loop; the tensor-op twins are in
// moe_prefill_tensor.metal).
// One dispatch per tile class (prefill_args.h), bound to that class's map and count; the
// classes of a chunk write disjoint slots and share a barrier stage. Grid (max_tiles,
// ceil(n / BN)) threadgroups of 32 * SM * SN threads, max_tiles the class capacity:
// threadgroup (t, j) computes output columns [j BN, j BN + BN) of the slots of tile t;
// threadgroups with t >= tile_count return at once. BM = T, the class height.
template <uint T>
[[max_total_threads_per_threadgroup(kMoeGemmMaxThreads)]] kernel void moe_gemm_gate_up_q4(device const bfloat* x [[buffer(0)]],        // bfloat [m, lda] (xn)
                                device const uint* perm [[buffer(1)]],        // [m * top_k] slot -> row * top_k + j
                                device const MoeTile* tiles [[buffer(2)]],    // [max_tiles] the class's map
                                device const uint* tile_count [[buffer(3)]],  // [1] the class's count
                                device const uint4* wg [[buffer(4)]],         // gate_proj.weight [E, n, k/8]
                                device const bfloat* gs [[buffer(5)]],        // gate_proj.scales [E, n, k/64]
                                device const bfloat* gb [[buffer(6)]],        // gate_proj.biases [E, n, k/64]
                                device const uint4* wu [[buffer(7)]],         // up_proj.weight [E, n, k/8]
                                device const bfloat* us [[buffer(8)]],        // up_proj.scales
                                device const bfloat* ub [[buffer(9)]],        // up_proj.biases
                                device bfloat* hx [[buffer(10)]],             // bfloat [m * top_k, ldy], slot order
                                constant MoeGemmArgs& args [[buffer(11)]],
                                uint2 tgp [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr uint BN = moe_gemm_bn(T, false, 2), SM = moe_gemm_sm(T, false, 2), SN = moe_gemm_sn(T, false, 2);
  constexpr uint NT = moe_gemm_threads(T, false, 2);
  static_assert(NT <= kMoeGemmMaxThreads, "the kernel's declared maximum");
  threadgroup float4 smem4[GemmSmem<T, BN, 2>::float4s];
  const uint n0 = tgp.y * BN;
  if (tgp.x >= tile_count[0] || n0 >= args.n) {
    return;  // the whole threadgroup
  }
  const GemmTileInfo tile = gemm_tile_info(tiles, tgp.x, T, args);
  const uint wstride = args.n * (args.k / 8);  // uint32 per expert
  const uint gstride = args.n * (args.k / kQuantGroup);
  const GemmARows<T, NT> a = gemm_a_rows<T, NT>(
      GemmTileRows<true>{perm, tile.begin, tile.rows, args.top_k, args.m, args.lda}, tid);
  const uint e = tile.expert;
  gemm_accumulate<4, 2, T, BN, SM, SN>(smem4, x, a, (device const uint*)wg + e * wstride,
                                       gs + e * gstride, gb + e * gstride,
                                       (device const uint*)wu + e * wstride, us + e * gstride,
                                       ub + e * gstride, n0, args.n, args.k, tile.rows, tid, sg);
  const threadgroup float* smem = (const threadgroup float*)smem4;
  for (uint i = tid; i < T * BN; i += NT) {
    const uint r = i / BN;
    const uint c = i % BN;
    if (r < tile.rows && n0 + c < args.n) {
      gemm_put(hx + (tile.begin + r) * args.ldy + n0 + c, gemm_staged<2, T, BN>(smem, r, c), false);
    }
  }
}

template <uint T>
[[max_total_threads_per_threadgroup(kMoeGemmMaxThreads)]] kernel void moe_gemm_down_q4(device const bfloat* hx [[buffer(0)]],       // bfloat [m * top_k, lda], slot order
                             device const uint* perm [[buffer(1)]],       // [m * top_k]
                             device const MoeTile* tiles [[buffer(2)]],   // [max_tiles] the class's map
                             device const uint* tile_count [[buffer(3)]], // [1] the class's count
                             device const uint4* wd [[buffer(4)]],        // down_proj.weight [E, n, k/8]
                             device const bfloat* sd [[buffer(5)]],       // down_proj.scales [E, n, k/64]
                             device const bfloat* bd [[buffer(6)]],       // down_proj.biases [E, n, k/64]
                             device bfloat* yx [[buffer(7)]],             // bfloat [m * top_k, ldy], by row * top_k + j
                             constant MoeGemmArgs& args [[buffer(8)]],
                             uint2 tgp [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr uint BN = moe_gemm_bn(T, false, 1), SM = moe_gemm_sm(T, false, 1), SN = moe_gemm_sn(T, false, 1);
  constexpr uint NT = moe_gemm_threads(T, false, 1);
  static_assert(NT <= kMoeGemmMaxThreads, "the kernel's declared maximum");
  threadgroup float4 smem4[GemmSmem<T, BN, 1>::float4s];
  const uint n0 = tgp.y * BN;
  if (tgp.x >= tile_count[0] || n0 >= args.n) {
    return;  // the whole threadgroup
  }
  const GemmTileInfo tile = gemm_tile_info(tiles, tgp.x, T, args);
  const uint wstride = args.n * (args.k / 8);
  const uint gstride = args.n * (args.k / kQuantGroup);
  const GemmARows<T, NT> a = gemm_a_rows<T, NT>(
      GemmTileRows<false>{perm, tile.begin, tile.rows, args.top_k, args.m, args.lda}, tid);
  const uint e = tile.expert;
  device const uint* w = (device const uint*)wd + e * wstride;
  gemm_accumulate<4, 1, T, BN, SM, SN>(smem4, hx, a, w, sd + e * gstride, bd + e * gstride, w,
                                       sd, bd, n0, args.n, args.k, tile.rows, tid, sg);
  const threadgroup float* smem = (const threadgroup float*)smem4;
  const uint slots = args.m * args.top_k;
  for (uint i = tid; i < T * BN; i += NT) {
    const uint r = i / BN;
    const uint c = i % BN;
    if (r < tile.rows && n0 + c < args.n) {
      const uint dst = perm[tile.begin + r];
      if (dst < slots) {  // a malformed perm entry writes nothing
        gemm_put(yx + dst * args.ldy + n0 + c, gemm_staged<1, T, BN>(smem, r, c), false);
      }
    }
  }
}

// The tile heights of this path and, per height, the simdgroups SM x SN and output columns
// BN: moe_gemm_sm / _sn / _bn (prefill_args.h, shared with the host's moe_geometry). Every
// simdgroup owns a 16 x 32 block (2 x 4 fragments) of each product, the down projection at
// T = 64 a 32 x 32 block (4 x 4).
template [[host_name("moe_gemm_gate_up_q4_t16")]] [[kernel]] decltype(moe_gemm_gate_up_q4<16>) moe_gemm_gate_up_q4<16>;
template [[host_name("moe_gemm_gate_up_q4_t32")]] [[kernel]] decltype(moe_gemm_gate_up_q4<32>) moe_gemm_gate_up_q4<32>;
template [[host_name("moe_gemm_gate_up_q4_t64")]] [[kernel]] decltype(moe_gemm_gate_up_q4<64>) moe_gemm_gate_up_q4<64>;
template [[host_name("moe_gemm_down_q4_t16")]] [[kernel]] decltype(moe_gemm_down_q4<16>) moe_gemm_down_q4<16>;
template [[host_name("moe_gemm_down_q4_t32")]] [[kernel]] decltype(moe_gemm_down_q4<32>) moe_gemm_down_q4<32>;
template [[host_name("moe_gemm_down_q4_t64")]] [[kernel]] decltype(moe_gemm_down_q4<64>) moe_gemm_down_q4<64>;
