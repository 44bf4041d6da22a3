// Prefill GEMMs on MLX affine-quantized weights, simdgroup_matrix path (docs/prefill.md,
// "GEMM: dense and grouped expert GEMM"):
//   gemm_q4, gemm_q8, gemm_q4_add   y[m, n] (=|+=) x[m, k] W[n, k]^T
//   gemm_swiglu_q4                  y = silu(x Wg^T) * (x Wu^T)
//   moe_gemm_gate_up_q4_t{16,32,64} hx[s] = silu(x[perm[s] / top_k] Wg_e^T) * (x[...] Wu_e^T)
//   moe_gemm_down_q4_t{16,32,64}    yx[perm[s]] = hx[s] Wd_e^T
// A threadgroup computes a BM x BN block of the output. Per step of kGemmBK = 32 columns of k
// it copies BM activation rows and dequantizes BN weight rows (gate and up: two weight
// tiles) into threadgroup memory (gemm_tiles.h), then each simdgroup multiplies its
// (8 FM) x (8 FN) block with 8x8 simdgroup_matrix products accumulated in fp32 registers.
// The dequantized weight never leaves threadgroup memory. At the end the accumulators are
// staged through threadgroup memory and stored as scalars (any row stride, edges, scatter).
#include <metal_stdlib>
using namespace metal;

#include "common.h"
#include "gemm_tiles.h"
#include "prefill_args.h"

// Threadgroup memory (floats, a multiple of 4) of a GEMM with NB weight tiles: the A and W
// tiles of a step, reused at the end for the NB staged BM x (BN + 4) output blocks. Declared
// as float4 so that the tile rows (144 bytes apart) take 16-byte stores.
template <uint BM, uint BN, uint NB>
struct GemmSmem {
  static constant constexpr uint ldc = BN + 4;
  static constant constexpr uint tiles = (BM + NB * BN) * kGemmLd;
  static constant constexpr uint staged = NB * BM * ldc;
  static constant constexpr uint floats = tiles > staged ? tiles : staged;
};

// The k loop of one threadgroup: NB products of the A rows `a` with weight rows
// [n0, n0 + BN) of (w_b, s_b, b_b), b < NB, over the whole of k; `rows` = valid tile rows.
// Leaves the fp32 results in smem: block b, row r, column c at b * BM * ldc + r * ldc + c
// (only rows < rows and columns < n - n0 are meaningful), after a barrier.
template <int BITS, uint NB, uint BM, uint BN, uint SM, uint SN>
inline void gemm_accumulate(threadgroup float* smem, device const float4* x,
                            thread const GemmARows<BM, 32 * SM * SN>& a,
                            device const uint* w0, device const bfloat* s0, device const bfloat* b0,
                            device const uint* w1, device const bfloat* s1, device const bfloat* b1,
                            uint n0, uint n, uint k, uint rows, uint tid, uint sg) {
  constexpr uint NT = 32 * SM * SN;
  constexpr uint FM = BM / (8 * SM);
  constexpr uint FN = BN / (8 * SN);
  constexpr uint ldc = GemmSmem<BM, BN, NB>::ldc;
  threadgroup float* As = smem;
  threadgroup float* Ws = smem + BM * kGemmLd;
  const uint row0 = (sg / SN) * 8 * FM;
  const uint col0 = (sg % SN) * 8 * FN;
  const uint live_m = gemm_live(rows, row0, FM);
  const uint live_n = gemm_live(min(BN, n - n0), col0, FN);

  GemmFragments<float, FM, FN, NB, BN> frags;
  frags.clear();
  for (uint k0 = 0; k0 < k; k0 += kGemmBK) {
    gemm_load_a<float, BM, NT>(As, x, a, k0, tid);
    gemm_load_w<BITS, float, BN, NT>(Ws, w0, s0, b0, n0, n, k, k0, tid);
    if (NB == 2) {
      gemm_load_w<BITS, float, BN, NT>(Ws + BN * kGemmLd, w1, s1, b1, n0, n, k, k0, tid);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (live_m > 0 && live_n > 0) {  // uniform over the simdgroup
      frags.step(As, Ws, row0, col0, live_m, live_n);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  frags.store(smem, BM, ldc, row0, col0, live_m, live_n);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Staged result of tile row r, column c: the product, or silu(gate) * up for NB = 2.
template <uint NB, uint BM, uint BN>
inline float gemm_staged(const threadgroup float* smem, uint r, uint c) {
  constexpr uint ldc = GemmSmem<BM, BN, NB>::ldc;
  const float v = smem[r * ldc + c];
  return NB == 2 ? silu(v) * smem[BM * ldc + r * ldc + c] : v;
}

// ---- dense GEMMs -------------------------------------------------------------------------
// Grid (ceil(n / BN), ceil(m / BM)) threadgroups of 32 * SM * SN threads: threadgroup
// (i, j) computes y rows [j BM, j BM + BM) x columns [i BN, i BN + BN).
// NB = 1: y = x W^T (ADD: y += x W^T); NB = 2: y = silu(x W0^T) * (x W1^T).
template <int BITS, uint NB, bool ADD, uint BM, uint BN, uint SM, uint SN>
inline void gemm_dense(threadgroup float* smem, device const uint* w0, device const bfloat* s0,
                       device const bfloat* b0, device const uint* w1, device const bfloat* s1,
                       device const bfloat* b1, device const float4* x, device float* y,
                       constant GemmArgs& args, uint2 tgp, uint tid, uint sg) {
  constexpr uint NT = 32 * SM * SN;
  const uint n0 = tgp.x * BN;
  const uint m0 = tgp.y * BM;
  if (n0 >= args.n || m0 >= args.m) {
    return;  // the whole threadgroup (a grid larger than needed)
  }
  const uint rows = min(BM, args.m - m0);
  const GemmARows<BM, NT> a = gemm_a_rows_dense<BM, NT>(m0, args.m, args.lda, tid);
  gemm_accumulate<BITS, NB, BM, BN, SM, SN>(smem, x, a, w0, s0, b0, w1, s1, b1, n0, args.n,
                                            args.k, rows, tid, sg);
  for (uint i = tid; i < BM * BN; i += NT) {
    const uint r = i / BN;
    const uint c = i % BN;
    if (r < rows && n0 + c < args.n) {
      const float v = gemm_staged<NB, BM, BN>(smem, r, c);
      device float* dst = y + (m0 + r) * args.ldy + n0 + c;
      *dst = ADD ? *dst + v : v;
    }
  }
}

// Dense configuration: 32 x 64 output blocks, 2 x 2 simdgroups (128 threads).
constant constexpr uint kGemmBM = 32;
constant constexpr uint kGemmBN = 64;

template <int BITS, bool ADD>
[[max_total_threads_per_threadgroup(128)]] kernel void gemm_q(device const uint4* w [[buffer(0)]],        // W.weight uint32 [n, k*BITS/32]
                   device const bfloat* scales [[buffer(1)]],  // [n, k/64]
                   device const bfloat* biases [[buffer(2)]],  // [n, k/64]
                   device const float4* x [[buffer(3)]],       // fp32 [m, lda]
                   device float* y [[buffer(4)]],              // fp32 [m, ldy] (read too when ADD)
                   constant GemmArgs& args [[buffer(5)]],
                   uint2 tgp [[threadgroup_position_in_grid]],
                   uint tid [[thread_index_in_threadgroup]],
                   uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 smem4[GemmSmem<kGemmBM, kGemmBN, 1>::floats / 4];  // float4: 16-byte aligned tiles
  threadgroup float* smem = (threadgroup float*)smem4;
  device const uint* wu = (device const uint*)w;
  gemm_dense<BITS, 1, ADD, kGemmBM, kGemmBN, 2, 2>(smem, wu, scales, biases, wu, scales, biases,
                                                  x, y, args, tgp, tid, sg);
}
template [[host_name("gemm_q4")]] [[kernel]] decltype(gemm_q<4, false>) gemm_q<4, false>;
template [[host_name("gemm_q8")]] [[kernel]] decltype(gemm_q<8, false>) gemm_q<8, false>;
template [[host_name("gemm_q4_add")]] [[kernel]] decltype(gemm_q<4, true>) gemm_q<4, true>;

// The shared expert's gate/up: y = silu(x Wg^T) * (x Wu^T), Wg and Wu both [n, k].
[[max_total_threads_per_threadgroup(128)]] kernel void gemm_swiglu_q4(device const uint4* wg [[buffer(0)]],       // gate_proj.weight [n, k/8]
                           device const bfloat* gs [[buffer(1)]],      // gate_proj.scales [n, k/64]
                           device const bfloat* gb [[buffer(2)]],      // gate_proj.biases [n, k/64]
                           device const uint4* wu [[buffer(3)]],       // up_proj.weight [n, k/8]
                           device const bfloat* us [[buffer(4)]],      // up_proj.scales
                           device const bfloat* ub [[buffer(5)]],      // up_proj.biases
                           device const float4* x [[buffer(6)]],       // fp32 [m, lda]
                           device float* y [[buffer(7)]],              // fp32 [m, ldy]
                           constant GemmArgs& args [[buffer(8)]],
                           uint2 tgp [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 smem4[GemmSmem<kGemmBM, kGemmBN, 2>::floats / 4];  // float4: 16-byte aligned tiles
  threadgroup float* smem = (threadgroup float*)smem4;
  gemm_dense<4, 2, false, kGemmBM, kGemmBN, 2, 2>(smem, (device const uint*)wg, gs, gb,
                                                 (device const uint*)wu, us, ub, x, y, args, tgp,
                                                 tid, sg);
}

// ---- grouped expert GEMMs ------------------------------------------------------------------
// Grid (max_tiles, ceil(n / BN)) threadgroups of 32 * SM * SN threads: threadgroup (t, j)
// computes output columns [j BN, j BN + BN) of the slots of tile t; threadgroups with
// t >= tile_count return at once. BM = T, the tile height.
struct GemmTileInfo {
  uint expert;
  uint begin;
  uint rows;
};

inline GemmTileInfo gemm_tile_info(device const MoeTile* tiles, uint t, uint T,
                                   constant MoeGemmArgs& args) {
  const MoeTile tile = tiles[t];
  GemmTileInfo info;
  info.expert = min(tile.expert, args.experts - 1u);
  info.begin = tile.begin;
  // clamp to the tile height and to the slots of the chunk (a malformed map reads no further)
  const uint slots = args.m * args.top_k;
  info.rows = tile.begin < slots ? min(min(tile.rows, T), slots - tile.begin) : 0u;
  return info;
}

template <uint T, uint BN, uint SM, uint SN>
[[max_total_threads_per_threadgroup(128)]] kernel void moe_gemm_gate_up_q4(device const float4* x [[buffer(0)]],        // fp32 [m, lda]
                                device const uint* perm [[buffer(1)]],        // [m * top_k] slot -> row * top_k + j
                                device const MoeTile* tiles [[buffer(2)]],    // [max_tiles]
                                device const uint* tile_count [[buffer(3)]],  // [1]
                                device const uint4* wg [[buffer(4)]],         // gate_proj.weight [E, n, k/8]
                                device const bfloat* gs [[buffer(5)]],        // gate_proj.scales [E, n, k/64]
                                device const bfloat* gb [[buffer(6)]],        // gate_proj.biases [E, n, k/64]
                                device const uint4* wu [[buffer(7)]],         // up_proj.weight [E, n, k/8]
                                device const bfloat* us [[buffer(8)]],        // up_proj.scales
                                device const bfloat* ub [[buffer(9)]],        // up_proj.biases
                                device float* hx [[buffer(10)]],              // fp32 [m * top_k, ldy], slot order
                                constant MoeGemmArgs& args [[buffer(11)]],
                                uint2 tgp [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr uint NT = 32 * SM * SN;
  threadgroup float4 smem4[GemmSmem<T, BN, 2>::floats / 4];  // float4: 16-byte aligned tiles
  threadgroup float* smem = (threadgroup float*)smem4;
  const uint n0 = tgp.y * BN;
  if (tgp.x >= tile_count[0] || n0 >= args.n) {
    return;  // the whole threadgroup
  }
  const GemmTileInfo tile = gemm_tile_info(tiles, tgp.x, T, args);
  const uint wstride = args.n * (args.k / 8);  // uint32 per expert
  const uint gstride = args.n * (args.k / kQuantGroup);
  const GemmARows<T, NT> a = gemm_a_rows_tile<T, NT, true>(perm, tile.begin, tile.rows, args.top_k,
                                                           args.m, args.lda, tid);
  const uint e = tile.expert;
  gemm_accumulate<4, 2, T, BN, SM, SN>(smem, x, a, (device const uint*)wg + e * wstride,
                                       gs + e * gstride, gb + e * gstride,
                                       (device const uint*)wu + e * wstride, us + e * gstride,
                                       ub + e * gstride, n0, args.n, args.k, tile.rows, tid, sg);
  for (uint i = tid; i < T * BN; i += NT) {
    const uint r = i / BN;
    const uint c = i % BN;
    if (r < tile.rows && n0 + c < args.n) {
      hx[(tile.begin + r) * args.ldy + n0 + c] = gemm_staged<2, T, BN>(smem, r, c);
    }
  }
}

template <uint T, uint BN, uint SM, uint SN>
[[max_total_threads_per_threadgroup(128)]] kernel void moe_gemm_down_q4(device const float4* hx [[buffer(0)]],       // fp32 [m * top_k, lda], slot order
                             device const uint* perm [[buffer(1)]],       // [m * top_k]
                             device const MoeTile* tiles [[buffer(2)]],   // [max_tiles]
                             device const uint* tile_count [[buffer(3)]], // [1]
                             device const uint4* wd [[buffer(4)]],        // down_proj.weight [E, n, k/8]
                             device const bfloat* sd [[buffer(5)]],       // down_proj.scales [E, n, k/64]
                             device const bfloat* bd [[buffer(6)]],       // down_proj.biases [E, n, k/64]
                             device float* yx [[buffer(7)]],              // fp32 [m * top_k, ldy], by row * top_k + j
                             constant MoeGemmArgs& args [[buffer(8)]],
                             uint2 tgp [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr uint NT = 32 * SM * SN;
  threadgroup float4 smem4[GemmSmem<T, BN, 1>::floats / 4];  // float4: 16-byte aligned tiles
  threadgroup float* smem = (threadgroup float*)smem4;
  const uint n0 = tgp.y * BN;
  if (tgp.x >= tile_count[0] || n0 >= args.n) {
    return;  // the whole threadgroup
  }
  const GemmTileInfo tile = gemm_tile_info(tiles, tgp.x, T, args);
  const uint wstride = args.n * (args.k / 8);
  const uint gstride = args.n * (args.k / kQuantGroup);
  const GemmARows<T, NT> a = gemm_a_rows_tile<T, NT, false>(perm, tile.begin, tile.rows,
                                                            args.top_k, args.m, args.lda, tid);
  const uint e = tile.expert;
  device const uint* w = (device const uint*)wd + e * wstride;
  gemm_accumulate<4, 1, T, BN, SM, SN>(smem, hx, a, w, sd + e * gstride, bd + e * gstride, w,
                                       sd, bd, n0, args.n, args.k, tile.rows, tid, sg);
  const uint slots = args.m * args.top_k;
  for (uint i = tid; i < T * BN; i += NT) {
    const uint r = i / BN;
    const uint c = i % BN;
    if (r < tile.rows && n0 + c < args.n) {
      const uint dst = perm[tile.begin + r];
      if (dst < slots) {  // a malformed perm entry writes nothing
        yx[dst * args.ldy + n0 + c] = gemm_staged<1, T, BN>(smem, r, c);
      }
    }
  }
}

// T = 16: 16 x 64 blocks, 1 x 2 simdgroups (64 threads); T = 32: 32 x 64 blocks, 2 x 2
// simdgroups (128 threads); T = 64: 64 x 32 blocks, 4 x 1 simdgroups (128 threads; a 64 x 64
// gate/up block would stage 34 KiB of gate and up results, and 128 threads is the kernels'
// declared maximum).
// Each simdgroup owns a 16 x 32 block (2 x 4 fragments) in all.
template [[host_name("moe_gemm_gate_up_q4_t16")]] [[kernel]] decltype(moe_gemm_gate_up_q4<16, 64, 1, 2>) moe_gemm_gate_up_q4<16, 64, 1, 2>;
template [[host_name("moe_gemm_gate_up_q4_t32")]] [[kernel]] decltype(moe_gemm_gate_up_q4<32, 64, 2, 2>) moe_gemm_gate_up_q4<32, 64, 2, 2>;
template [[host_name("moe_gemm_gate_up_q4_t64")]] [[kernel]] decltype(moe_gemm_gate_up_q4<64, 32, 4, 1>) moe_gemm_gate_up_q4<64, 32, 4, 1>;
template [[host_name("moe_gemm_down_q4_t16")]] [[kernel]] decltype(moe_gemm_down_q4<16, 64, 1, 2>) moe_gemm_down_q4<16, 64, 1, 2>;
template [[host_name("moe_gemm_down_q4_t32")]] [[kernel]] decltype(moe_gemm_down_q4<32, 64, 2, 2>) moe_gemm_down_q4<32, 64, 2, 2>;
template [[host_name("moe_gemm_down_q4_t64")]] [[kernel]] decltype(moe_gemm_down_q4<64, 32, 4, 1>) moe_gemm_down_q4<64, 32, 4, 1>;
