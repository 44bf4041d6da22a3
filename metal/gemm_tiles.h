// What the prefill GEMMs share (docs/prefill.md, "GEMM"): the dense kernels
// (metal/gemm.metal, gemm_tensor.metal) and the grouped expert kernels
// (metal/moe_prefill.metal, moe_prefill_tensor.metal) on bfloat operands, consumed by 8x8
// simdgroup_matrix products (M1-M4) or Metal 4 tensor operations (M5).
//
// A GEMM step covers kGemmBK = 64 consecutive k (one quantization group, so one scale and
// one bias per weight row and step):
//   * A rows: bfloat activations in device memory (their producers round fp32 to bfloat:
//     nothing is clipped, common.h), or times a half scale per group of a row's elements
//     (GemmAScaled: the GDN out_proj); rows gathered through a row source (GemmDenseRows,
//     GemmTileRows), rows past the tile zero. The simdgroup_matrix path copies them into a
//     threadgroup tile; the tensor path loads each thread's elements straight into its
//     registers (gemm_tensor.h);
//   * W tile [BN][kGemmLd] bfloat: BN weight rows dequantized from the MLX affine layout
//     (w = bfloat(fma(q, scale, bias)) in fp32: one rounding), row n of the tile = output
//     column n0 + n, rows past the matrix zero. The dequantized weight exists only here.
// Products accumulate in fp32 (simdgroup_float8x8 / float cooperative tensors): a product
// of two bfloats is exact in fp32, so the only roundings are the operands' and the fp32 sum.
// Tiles are row-major with a row stride of kGemmLd = kGemmBK + 8 elements (144 bytes): the
// 16 padding bytes shift consecutive rows across the memory banks and keep every row 16-byte
// aligned.
#pragma once

#include <metal_stdlib>
using namespace metal;

#include "common.h"
#include "gemm_args.h"  // kGemmBK, kGemmLd and the blocks (shared with the host)
#include "prefill_args.h"

// A k step holds one quantization group: one scale and bias per weight row and step (GemmWItems).
static_assert(kGemmBK == kQuantGroup, "a GEMM k step is one quantization group");

// 4-element pieces per tile row.
constant constexpr uint kGemmRow4 = kGemmBK / 4;
// Codes dequantized by one loader work item (one row, 16 consecutive k: 8 bytes at 4 bits,
// 16 bytes at 8 bits); kGemmBK / kGemmChunk items per row and step.
constant constexpr uint kGemmChunk = 16;
constant constexpr uint kGemmChunks = kGemmBK / kGemmChunk;
// Row offset of a tile row with no source row (the row is zero).
constant constexpr uint kGemmNoRow = 0xFFFFFFFFu;

// ---- A rows: where each tile row comes from --------------------------------------------
// A row source maps tile row r to the element offset of its A row (row * lda) or kGemmNoRow.
// Dense rows: tile row r is x row m0 + r (if < m).
struct GemmDenseRows {
  uint m0, m, lda;
  uint at(uint r) const { return m0 + r < m ? (m0 + r) * lda : kGemmNoRow; }
};

// Grouped rows of one tile: tile row r < rows is x row src(begin + r), where the source is
//   GATHER = true:  perm[begin + r] / top_k (the token of the assignment; clamped to m - 1),
//   GATHER = false: begin + r (slot order, e.g. hx of the down projection).
template <bool GATHER>
struct GemmTileRows {
  device const uint* perm;
  uint begin, rows, top_k, m, lda;
  uint at(uint r) const {
    if (r >= rows) { return kGemmNoRow; }
    return (GATHER ? min(perm[begin + r] / top_k, m - 1u) : begin + r) * lda;
  }
};

// ---- A sources ----------------------------------------------------------------------------
// bfloat rows (device const bfloat*), or GemmAScaled: bfloat rows x whose element i (from x's
// start) is taken times s[i >> shift] (prefill_args.h GemmAScaleArgs), the fp32 product
// rounded to bfloat once. A group of 2^shift >= 4 elements holds whole 4-element pieces.
struct GemmAScaled {
  device const bfloat* x;
  device const half* s;
  uint shift;
};

// Element i (from x's start) as the GEMM's bfloat operand.
inline bfloat gemm_a_elem(device const bfloat* x, uint i) { return x[i]; }
inline bfloat gemm_a_elem(GemmAScaled x, uint i) { return bfloat(float(x.x[i]) * float(x.s[i >> x.shift])); }
// The 4-element piece at element i (a multiple of 4).
inline bfloat4 gemm_a_piece(device const bfloat* x, uint i) { return *(device const bfloat4*)(x + i); }
inline bfloat4 gemm_a_piece(GemmAScaled x, uint i) {
  return bfloat4(float4(*(device const bfloat4*)(x.x + i)) * float(x.s[i >> x.shift]));
}

// ---- simdgroup_matrix path: the A tile ----------------------------------------------------
// Thread tid copies, for i < per, the 4-element piece (tid % kGemmRow4) of tile row
// (tid + i * NT) / kGemmRow4: consecutive threads read consecutive 8-byte pieces of a row
// (128 contiguous bytes per row and step). off[i] is that row's offset (the row source's),
// fixed for the whole k loop: a kernel fills them once.
template <uint BM, uint NT>
struct GemmARows {
  static constant constexpr uint per = BM * kGemmRow4 / NT;
  uint off[per];
};

// Tile row of the i-th A piece of thread tid.
template <uint BM, uint NT>
inline uint gemm_a_row(uint tid, uint i) {
  return (tid + i * NT) / kGemmRow4;
}

template <uint BM, uint NT, typename Rows>
inline GemmARows<BM, NT> gemm_a_rows(Rows src, uint tid) {
  GemmARows<BM, NT> a;
  for (uint i = 0; i < GemmARows<BM, NT>::per; ++i) { a.off[i] = src.at(gemm_a_row<BM, NT>(tid, i)); }
  return a;
}

// A thread's pieces of one step's A tile (columns [k0, k0 + kGemmBK)) in registers: fetched
// from device memory a step ahead, stored into As [BM][kGemmLd] after the barrier that frees it.
template <uint BM, uint NT>
struct GemmAStep {
  bfloat4 p[GemmARows<BM, NT>::per];

  template <typename XS>
  void fetch(XS x, thread const GemmARows<BM, NT>& a, uint k0, uint tid) {
    const uint c4 = tid % kGemmRow4;
    for (uint i = 0; i < GemmARows<BM, NT>::per; ++i) {
      p[i] = a.off[i] != kGemmNoRow ? gemm_a_piece(x, a.off[i] + k0 + 4 * c4) : bfloat4(0.0f);
    }
  }

  void put(threadgroup bfloat* As, uint tid) const {
    const uint c4 = tid % kGemmRow4;
    for (uint i = 0; i < GemmARows<BM, NT>::per; ++i) {
      *(threadgroup bfloat4*)(As + gemm_a_row<BM, NT>(tid, i) * kGemmLd + 4 * c4) = p[i];
    }
  }
};

// ---- W tile: dequantized weight rows ------------------------------------------------------
// Codes to exact small integers without a conversion per code: OR-ing a code into the
// mantissa of a half whose mantissa step is 1 (0x6400 = 1024) or 1/16 (0x5400 = 64, the code
// 4 bits up) gives 1024 + q or 64 + q exactly, and one half subtraction leaves q. Two codes per
// 32-bit operation: 13 operations for 8 4-bit codes (shift, 4 and, 4 or, 4 half2
// subtractions), against a shift, a mask and a conversion per code.
constant constexpr uint kHalfMagic1024 = 0x64006400u;  // half2(1024, 1024)
constant constexpr uint kHalfMagic64 = 0x54005400u;    // half2(64, 64)
// Codes 0-7 (low nibble first) of one word: p[i] = (q_i, q_{i+4}), i < 4.
inline void gemm_codes4(uint x, thread half2* p) {
  const uint y = x >> 8;
  p[0] = as_type<half2>((x & 0x000F000Fu) | kHalfMagic1024) - half2(1024.0h);
  p[1] = as_type<half2>((x & 0x00F000F0u) | kHalfMagic64) - half2(64.0h);
  p[2] = as_type<half2>((y & 0x000F000Fu) | kHalfMagic1024) - half2(1024.0h);
  p[3] = as_type<half2>((y & 0x00F000F0u) | kHalfMagic64) - half2(64.0h);
}
// Codes 0-3 (low byte first) of one word: p[0] = (q0, q2), p[1] = (q1, q3).
inline void gemm_codes8(uint x, thread half2* p) {
  p[0] = as_type<half2>((x & 0x00FF00FFu) | kHalfMagic1024) - half2(1024.0h);
  p[1] = as_type<half2>(((x >> 8) & 0x00FF00FFu) | kHalfMagic1024) - half2(1024.0h);
}

// 16 codes (4 bits: low nibble first; 8 bits: low byte first) as exact half integers, in order.
inline void gemm_codes16(uint2 q, thread half4* codes) {
  for (uint j = 0; j < 2; ++j) {
    half2 p[4];
    gemm_codes4(q[j], p);
    codes[2 * j] = half4(p[0].x, p[1].x, p[2].x, p[3].x);
    codes[2 * j + 1] = half4(p[0].y, p[1].y, p[2].y, p[3].y);
  }
}
inline void gemm_codes16(uint4 q, thread half4* codes) {
  for (uint j = 0; j < 4; ++j) {
    half2 p[2];
    gemm_codes8(q[j], p);
    codes[j] = half4(p[0].x, p[1].x, p[0].y, p[1].y);
  }
}

// Work item c < BN * kGemmChunks of a step: weight row n0 + c / kGemmChunks, codes
// [k0 + 16 (c % kGemmChunks), +16); thread tid takes c = tid, tid + NT, ... (four adjacent
// threads read one row's 32 or 64 contiguous bytes of the step). Each weight is
// bfloat(fma(q, scale, bias)) in fp32: q s is exact (8 x 8 significant bits at most), so the
// weight is rounded once, to the nearest bfloat of the checkpoint's value (or of its fp32
// rounding where the sum with the bias does not fit 24 bits).
//   w       the matrix (one expert of a stack: already offset) as uint32 [n, k * BITS / 32]
//   scales  bf16 [n, k / 64], biases likewise
// A step's items are fetched into registers (codes, scale and bias as stored) a step ahead of
// their dequantization into the tile, so their device loads are in flight during the step
// before's products. A row past the matrix fetches scale = bias = 0: its weights are 0.
template <int BITS>
struct GemmCodes;
template <>
struct GemmCodes<4> {
  using type = uint2;  // 16 4-bit codes
};
template <>
struct GemmCodes<8> {
  using type = uint4;  // 16 8-bit codes
};

template <int BITS, uint BN, uint NT>
struct GemmWItems {
  static constant constexpr uint items = BN * kGemmChunks;
  static constant constexpr uint per = (items + NT - 1) / NT;
  typename GemmCodes<BITS>::type q[per];
  bfloat s[per], b[per];

  void fetch(device const uint* w, device const bfloat* scales, device const bfloat* biases, uint n0, uint n,
             uint k, uint k0, uint tid) {
    const uint words = k * BITS / 32;  // uint32 per weight row
    const uint groups = k / kQuantGroup;
    for (uint i = 0; i < per; ++i) {
      const uint c = tid + i * NT;
      const uint row = n0 + c / kGemmChunks;
      if (c >= items || row >= n) {
        q[i] = typename GemmCodes<BITS>::type(0u);
        s[i] = b[i] = bfloat(0.0f);
        continue;
      }
      const uint g = row * groups + k0 / kQuantGroup;
      s[i] = scales[g];
      b[i] = biases[g];
      q[i] = *(device const typename GemmCodes<BITS>::type*)(w + row * words +
                                                             (k0 + kGemmChunk * (c % kGemmChunks)) * BITS / 32);
    }
  }

  void put(threadgroup bfloat* Ws, uint tid) const {
    for (uint i = 0; i < per; ++i) {
      const uint c = tid + i * NT;
      if (c >= items) { break; }
      threadgroup bfloat4* dst =
          (threadgroup bfloat4*)(Ws + (c / kGemmChunks) * kGemmLd + kGemmChunk * (c % kGemmChunks));
      half4 codes[4];
      gemm_codes16(q[i], codes);
      const float4 sc = float4(float(s[i])), bi = float4(float(b[i]));
      for (uint j = 0; j < 4; ++j) { dst[j] = bfloat4(fma(float4(codes[j]), sc, bi)); }
    }
  }
};

// The NB weight tiles of a step (consecutive in Ws at a stride of BN * kGemmLd) as a
// thread's GemmWItems; the caller places the barriers.
template <int BITS, uint NB, uint BN, uint NT>
struct GemmWStep {
  GemmWItems<BITS, BN, NT> t[NB];

  void fetch(device const uint* w0, device const bfloat* s0, device const bfloat* b0, device const uint* w1,
             device const bfloat* s1, device const bfloat* b1, uint n0, uint n, uint k, uint k0, uint tid) {
    t[0].fetch(w0, s0, b0, n0, n, k, k0, tid);
    if (NB == 2) { t[NB - 1].fetch(w1, s1, b1, n0, n, k, k0, tid); }
  }

  void put(threadgroup bfloat* Ws, uint tid) const {
    for (uint b = 0; b < NB; ++b) { t[b].put(Ws + b * BN * kGemmLd, tid); }
  }
};

// Where the results go: a GEMM kernel passes a sink whose put(r, c, v) stores result v of
// tile row r < rows, tile column c < min(BN, n - n0).
//   GemmRowSink: row r at y + r * ldy, column c at + c (y already at the tile's first row
//                and column); ADD: y += v (fp32), else gemm_put (bfloat: rounded). With a
//                row scale g (not null, at the tile's first row), v is first multiplied by
//                g[r * ldg].
template <bool ADD, typename Y>
struct GemmRowSink {
  device Y* y;
  uint ldy;
  device const float* g = nullptr;
  uint ldg = 0;
  void put(uint r, uint c, float v) const {
    gemm_put(y + r * ldy + c, g ? v * g[r * ldg] : v, ADD);
  }
};

// ---- threadgroup memory of the simdgroup_matrix path ---------------------------------------
// Bytes of a GEMM with NB weight tiles (gemm_smem_bytes, gemm_args.h: the bfloat A and W
// tiles of a step, reused at the end for the NB staged fp32 BM x ldc output blocks). Declared
// as float4 (16-byte aligned).
template <uint BM, uint BN, uint NB>
struct GemmSmem {
  static constant constexpr uint ldc = gemm_staged_ld(BN);
  static constant constexpr uint bytes = gemm_smem_bytes(BM, BN, NB);
  static constant constexpr uint float4s = (bytes + 15) / 16;
  static_assert(bytes <= 32768, "a GEMM's threadgroup memory must fit 32 KiB");
};

// Staged result of tile row r, column c: the product, or silu(gate) * up for NB = 2.
template <uint NB, uint BM, uint BN>
inline float gemm_staged(const threadgroup float* smem, uint r, uint c) {
  constexpr uint ldc = GemmSmem<BM, BN, NB>::ldc;
  const float v = smem[r * ldc + c];
  return NB == 2 ? silu(v) * smem[BM * ldc + r * ldc + c] : v;
}

// ---- grouped expert tiles ------------------------------------------------------------------
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

// ---- simdgroup_matrix path -----------------------------------------------------------------
// A simdgroup owns an (8 FM) x (8 FN) block of the threadgroup's output, at tile row row0 and
// tile column col0. Fragments whose rows (columns) all lie past the valid rows (columns) are
// skipped: live_m / live_n are the live fragment counts (uniform over the simdgroup).
inline uint gemm_live(uint valid, uint origin, uint frags) {
  return valid > origin ? min(frags, (valid - origin + 7) / 8) : 0u;
}

// The simdgroup's accumulators of NB products (NB = 2: gate then up, sharing the A tile):
// acc[(b * FM + i) * FN + j] is the fp32 8x8 block of rows row0 + 8i, columns col0 + 8j of
// product b. The NB weight tiles are consecutive in Ws at a stride of BN * kGemmLd elements.
template <uint FM, uint FN, uint NB, uint BN>
struct GemmFragments {
  simdgroup_float8x8 acc[NB * FM * FN];

  void clear() {
    for (uint i = 0; i < NB * FM * FN; ++i) {
      acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }

  // One step: acc_b += A[rows] * W_b[cols]^T over the kGemmBK columns of the tiles (bfloat
  // operands, fp32 accumulation). Each A fragment is loaded once for all NB products and FN
  // column fragments.
  void step(const threadgroup bfloat* As, const threadgroup bfloat* Ws, uint row0, uint col0, uint live_m,
            uint live_n) {
    for (uint kk = 0; kk < kGemmBK; kk += 8) {
      simdgroup_bfloat8x8 a[FM];
      for (uint i = 0; i < FM; ++i) {
        if (i < live_m) {
          simdgroup_load(a[i], As, kGemmLd, ulong2(kk, row0 + 8 * i));
        }
      }
      for (uint b = 0; b < NB; ++b) {
        for (uint j = 0; j < FN; ++j) {
          if (j < live_n) {
            simdgroup_bfloat8x8 wt;  // W^T fragment: rows = k, columns = output columns
            simdgroup_load(wt, Ws + b * BN * kGemmLd + (col0 + 8 * j) * kGemmLd + kk, kGemmLd, ulong2(0, 0), true);
            for (uint i = 0; i < FM; ++i) {
              if (i < live_m) {
                simdgroup_multiply_accumulate(acc[(b * FM + i) * FN + j], a[i], wt,
                                              acc[(b * FM + i) * FN + j]);
              }
            }
          }
        }
      }
    }
  }

  // Stores the live fragments: product b, row r, column c at C[b * rows_c * ldc + r * ldc + c].
  void store(threadgroup float* C, uint rows_c, uint ldc, uint row0, uint col0, uint live_m,
             uint live_n) {
    for (uint b = 0; b < NB; ++b) {
      for (uint i = 0; i < live_m; ++i) {
        for (uint j = 0; j < live_n; ++j) {
          simdgroup_store(acc[(b * FM + i) * FN + j], C + b * rows_c * ldc, ldc,
                          ulong2(col0 + 8 * j, row0 + 8 * i));
        }
      }
    }
  }
};

// The k loop of one threadgroup of SM x SN simdgroups: NB products of the A rows `a` with
// weight rows [n0, n0 + BN) of (w_b, s_b, b_b), b < NB, over the whole of k; `rows` = valid
// tile rows. Leaves the fp32 results in smem (as float): block b, row r, column c at
// b * BM * ldc + r * ldc + c (only rows < rows and columns < n - n0 are meaningful), after
// a barrier.
template <int BITS, uint NB, uint BM, uint BN, uint SM, uint SN, typename XS>
inline void gemm_accumulate(threadgroup float4* smem4, XS x,
                            thread const GemmARows<BM, 32 * SM * SN>& a,
                            device const uint* w0, device const bfloat* s0, device const bfloat* b0,
                            device const uint* w1, device const bfloat* s1, device const bfloat* b1,
                            uint n0, uint n, uint k, uint rows, uint tid, uint sg) {
  constexpr uint NT = 32 * SM * SN;
  constexpr uint FM = BM / (8 * SM);
  constexpr uint FN = BN / (8 * SN);
  constexpr uint ldc = GemmSmem<BM, BN, NB>::ldc;
  threadgroup bfloat* As = (threadgroup bfloat*)smem4;
  threadgroup bfloat* Ws = As + BM * kGemmLd;
  const uint row0 = (sg / SN) * 8 * FM;
  const uint col0 = (sg % SN) * 8 * FN;
  const uint live_m = gemm_live(rows, row0, FM);
  const uint live_n = gemm_live(min(BN, n - n0), col0, FN);

  GemmFragments<FM, FN, NB, BN> frags;
  frags.clear();
  // Register-staged double buffering: step k0 + kGemmBK's A pieces and weight codes are
  // fetched after the barrier that publishes step k0's tiles, so their loads are in flight
  // during step k0's products; the tiles hold one step (the footprint of a single buffer).
  GemmAStep<BM, NT> an;
  GemmWStep<BITS, NB, BN, NT> wn;
  an.fetch(x, a, 0, tid);
  wn.fetch(w0, s0, b0, w1, s1, b1, n0, n, k, 0, tid);
  for (uint k0 = 0; k0 < k; k0 += kGemmBK) {
    an.put(As, tid);
    wn.put(Ws, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (k0 + kGemmBK < k) {
      an.fetch(x, a, k0 + kGemmBK, tid);
      wn.fetch(w0, s0, b0, w1, s1, b1, n0, n, k, k0 + kGemmBK, tid);
    }
    if (live_m > 0 && live_n > 0) {  // uniform over the simdgroup
      frags.step(As, Ws, row0, col0, live_m, live_n);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  frags.store((threadgroup float*)smem4, BM, ldc, row0, col0, live_m, live_n);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
