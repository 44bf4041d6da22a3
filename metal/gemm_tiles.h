// Threadgroup tiles of the prefill GEMMs (docs/prefill.md, "GEMM"), shared by the dense
// kernels (metal/gemm.metal, gemm_tensor.metal) and the grouped expert kernels
// (metal/moe_prefill.metal, moe_prefill_tensor.metal): the same half tiles, filled the same
// way, consumed by 8x8 simdgroup_matrix products (M1-M4) or Metal 4 tensor operations (M5).
//
// A GEMM step covers kGemmBK = 64 consecutive k (one quantization group, so one scale and
// one bias per weight row and step):
//   * A tile  [BM][kGemmLd] half: BM activation rows, copied as they are from half rows in
//     device memory (their producers wrote them with the saturating conversion gemm_half;
//     fp32 rows would be converted with gemm_half while staged: no kernel has them now), or
//     times a half scale per group of a row's elements (GemmAScaled: the GDN out_proj);
//     rows gathered through per-thread row offsets (GemmARows), rows past the tile zero;
//   * W tile  [BN][kGemmLd] half: BN weight rows dequantized from the MLX affine layout
//     (w = fma(q, half(scale), half(bias)) in half; fp32 and clamped for a group whose values
//     leave the half range), row n of the tile = output column n0 + n, rows past the matrix
//     zero. The dequantized weight exists only here.
// Products accumulate in fp32 (simdgroup_float8x8 / float cooperative tensors): a product
// of two halves is exact in fp32, so the only roundings are the operands' and the fp32 sum.
// Tiles are row-major with a row stride of kGemmLd = kGemmBK + 8 halves (144 bytes): the 16
// padding bytes shift consecutive rows across the memory banks for the 8x8 fragment loads
// and keep every row 16-byte aligned.
#pragma once

#include <metal_stdlib>
using namespace metal;

#include "common.h"
#include "prefill_args.h"

// k elements per GEMM step (= kQuantGroup: one scale/bias per row and step).
constant constexpr uint kGemmBK = 64;
// Row stride of the A and W tiles, in halves.
constant constexpr uint kGemmLd = kGemmBK + 8;
// Float4s per tile row (one float4 = 4 consecutive k).
constant constexpr uint kGemmRow4 = kGemmBK / 4;
// Codes dequantized by one loader work item (one row, 16 consecutive k: 8 bytes at 4 bits,
// 16 bytes at 8 bits); kGemmBK / kGemmChunk items per row and step.
constant constexpr uint kGemmChunk = 16;
constant constexpr uint kGemmChunks = kGemmBK / kGemmChunk;
// GemmARows offset of a tile row with no source row (the row is zero-filled).
constant constexpr uint kGemmNoRow = 0xFFFFFFFFu;
// kGemmHalfMax, gemm_half (the saturating conversion to half) and gemm_put: common.h.

// ---- A tile: activation rows ------------------------------------------------------------
// The A source XS: device const half4* (activations stored as half), device const float4*
// (fp32 activations, converted here; no kernel has them now) or GemmAScaled (half
// activations times a half scale per group of elements: the GDN out_proj). Thread tid loads,
// for i < per, the 4-element piece (tid % kGemmRow4) of tile row (tid + i * NT) / kGemmRow4:
// consecutive threads read consecutive 8-byte (half) or 16-byte (fp32) pieces of a row (128
// or 256 contiguous bytes per row and step). off[i] is that row's start in x in pieces (row *
// lda / 4),
// or kGemmNoRow. The offsets are fixed for the whole k loop: a kernel fills them once.
template <uint BM, uint NT>
struct GemmARows {
  static constant constexpr uint per = BM * kGemmRow4 / NT;
  uint off[per];
};

// Half rows x whose element i (from x's start) is taken times s[i >> shift] (prefill_args.h
// GemmAScaleArgs): one half multiply per element, the product rounded to half. A group of
// 2^shift >= 4 elements holds whole pieces, so a piece has one scale.
struct GemmAScaled {
  device const half4* x;
  device const half* s;
  uint shift;
};

// Piece j (in pieces from x's start) of the A rows, as half.
inline half4 gemm_a_piece(device const half4* x, uint j) { return x[j]; }
inline half4 gemm_a_piece(device const float4* x, uint j) { return gemm_half(x[j]); }
inline half4 gemm_a_piece(GemmAScaled x, uint j) { return x.x[j] * x.s[(4 * j) >> x.shift]; }

// Tile row of the i-th A element of thread tid.
template <uint BM, uint NT>
inline uint gemm_a_row(uint tid, uint i) {
  return (tid + i * NT) / kGemmRow4;
}

// Dense rows: tile row r is x row m0 + r (if < m).
template <uint BM, uint NT>
inline GemmARows<BM, NT> gemm_a_rows_dense(uint m0, uint m, uint lda, uint tid) {
  GemmARows<BM, NT> a;
  for (uint i = 0; i < GemmARows<BM, NT>::per; ++i) {
    const uint row = m0 + gemm_a_row<BM, NT>(tid, i);
    a.off[i] = row < m ? row * (lda / 4) : kGemmNoRow;
  }
  return a;
}

// Grouped rows of one tile: tile row r < rows is x row src(begin + r), where the source is
//   GATHER = true:  perm[begin + r] / top_k (the token of the assignment; clamped to m - 1),
//   GATHER = false: begin + r (slot order, e.g. hx of the down projection).
template <uint BM, uint NT, bool GATHER>
inline GemmARows<BM, NT> gemm_a_rows_tile(device const uint* perm, uint begin, uint rows,
                                          uint top_k, uint m, uint lda, uint tid) {
  GemmARows<BM, NT> a;
  for (uint i = 0; i < GemmARows<BM, NT>::per; ++i) {
    const uint r = gemm_a_row<BM, NT>(tid, i);
    uint src = kGemmNoRow;
    if (r < rows) {
      src = GATHER ? min(perm[begin + r] / top_k, m - 1u) : begin + r;
    }
    a.off[i] = src != kGemmNoRow ? src * (lda / 4) : kGemmNoRow;
  }
  return a;
}

// Copies the A tile of step k0 (columns [k0, k0 + kGemmBK)) into As [BM][kGemmLd] as half.
template <uint BM, uint NT, typename XS>
inline void gemm_load_a(threadgroup half* As, XS x, thread const GemmARows<BM, NT>& a, uint k0, uint tid) {
  const uint c4 = tid % kGemmRow4;
  for (uint i = 0; i < GemmARows<BM, NT>::per; ++i) {
    const uint r = gemm_a_row<BM, NT>(tid, i);
    *(threadgroup half4*)(As + r * kGemmLd + 4 * c4) =
        a.off[i] != kGemmNoRow ? gemm_a_piece(x, a.off[i] + k0 / 4 + c4) : half4(0.0h);
  }
}

// ---- W tile: dequantized weight rows ------------------------------------------------------
// Codes to half without a conversion per code: OR-ing a code into the mantissa of a half whose
// mantissa step is 1 (0x6400 = 1024) or 1/16 (0x5400 = 64, the code 4 bits up) gives
// 1024 + q or 64 + q exactly, and one half subtraction leaves q. Two codes per 32-bit
// operation: 17 operations for 8 4-bit codes (shift, 4 and, 4 or, 4 half2 subtractions, 4
// half2 FMAs with the dequantization), against a shift, mask, conversion and FMA per code.
// The values are the same exact integers, so the results are bit-identical.
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

// Work item c < BN * kGemmChunks of a step: weight row n0 + c / kGemmChunks, codes
// [k0 + 16 (c % kGemmChunks), +16); thread tid takes c = tid, tid + NT, ... (four adjacent
// threads read one row's 32 or 64 contiguous bytes of the step).
//   w       the matrix (one expert of a stack: already offset) as uint32 [n, k * BITS / 32]
//   scales  bf16 [n, k / 64], biases likewise
template <int BITS, uint BN, uint NT>
inline void gemm_load_w(threadgroup half* Ws, device const uint* w, device const bfloat* scales,
                        device const bfloat* biases, uint n0, uint n, uint k, uint k0, uint tid) {
  constexpr uint items = BN * kGemmChunks;
  const uint words = k * BITS / 32;    // uint32 per weight row
  const uint groups = k / kQuantGroup;
  for (uint c = tid; c < items; c += NT) {
    const uint r = c / kGemmChunks;
    const uint h = c % kGemmChunks;
    const uint row = n0 + r;
    threadgroup half4* dst = (threadgroup half4*)(Ws + r * kGemmLd + kGemmChunk * h);
    if (row >= n) {
      for (uint j = 0; j < kGemmChunk / 4; ++j) {
        dst[j] = half4(0.0h);
      }
      continue;
    }
    const uint g = row * groups + k0 / kQuantGroup;
    const float s = float(scales[g]);
    const float b = float(biases[g]);
    // s q + b is monotone in q: its extremes are b and s (2^BITS - 1) + b. A group whose
    // extremes stay in the half range (s and b then do too) is dequantized with half FMAs:
    // the weight is staged as half anyway, and half arithmetic is the cheaper ALU path
    // (docs/prefill.md, "GEMM"). Only a malformed group takes fp32 and the per-weight clamp.
    const bool sat = max(fabs(b), fabs(s * float((1u << BITS) - 1u) + b)) > kGemmHalfMax;
    const half4 hs = half4(half(s)), hb = half4(half(b));
    const uint base = row * words + (k0 + kGemmChunk * h) * BITS / 32;
    half4 codes[4];  // the 16 codes as exact half integers, in order
    if (BITS == 4) {
      const uint2 q = *(device const uint2*)(w + base);  // 16 codes, low nibble first
      for (uint j = 0; j < 2; ++j) {
        half2 p[4];
        gemm_codes4(j == 0 ? q.x : q.y, p);
        codes[2 * j] = half4(p[0].x, p[1].x, p[2].x, p[3].x);
        codes[2 * j + 1] = half4(p[0].y, p[1].y, p[2].y, p[3].y);
      }
    } else {
      const uint4 q = *(device const uint4*)(w + base);  // 16 codes, low byte first
      for (uint j = 0; j < 4; ++j) {
        half2 p[2];
        gemm_codes8(q[j], p);
        codes[j] = half4(p[0].x, p[1].x, p[0].y, p[1].y);
      }
    }
    for (uint j = 0; j < 4; ++j) {
      dst[j] = sat ? gemm_half(float4(codes[j]) * s + b) : fma(codes[j], hs, hb);
    }
  }
}

// Fills the tiles of step k0: the A tile, then the NB weight tiles (consecutive in Ws at a
// stride of BN * kGemmLd halves). The caller places the barrier.
template <int BITS, uint NB, uint BM, uint BN, uint NT, typename XS>
inline void gemm_load_step(threadgroup half* As, threadgroup half* Ws, XS x,
                           thread const GemmARows<BM, NT>& a, device const uint* w0,
                           device const bfloat* s0, device const bfloat* b0, device const uint* w1,
                           device const bfloat* s1, device const bfloat* b1, uint n0, uint n, uint k,
                           uint k0, uint tid) {
  gemm_load_a<BM, NT>(As, x, a, k0, tid);
  gemm_load_w<BITS, BN, NT>(Ws, w0, s0, b0, n0, n, k, k0, tid);
  if (NB == 2) {
    gemm_load_w<BITS, BN, NT>(Ws + BN * kGemmLd, w1, s1, b1, n0, n, k, k0, tid);
  }
}

// Where the results go: a GEMM kernel passes a sink whose put(r, c, v) stores result v of
// tile row r < rows, tile column c < min(BN, n - n0).
//   GemmRowSink: row r at y + r * ldy, column c at + c (y already at the tile's first row
//                and column); ADD: y += v (fp32), else gemm_put (half: saturating). With a
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

// ---- threadgroup memory ------------------------------------------------------------------
// Bytes of a GEMM with NB weight tiles: the half A and W tiles of a step, reused at the end
// for the NB staged fp32 BM x (BN + 4) output blocks. Declared as float4 (16-byte aligned).
template <uint BM, uint BN, uint NB>
struct GemmSmem {
  static constant constexpr uint ldc = BN + 4;
  static constant constexpr uint tiles = (BM + NB * BN) * kGemmLd * 2;
  static constant constexpr uint staged = NB * BM * ldc * 4;
  static constant constexpr uint bytes = tiles > staged ? tiles : staged;
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
// product b. The NB weight tiles are consecutive in Ws at a stride of BN * kGemmLd halves.
template <uint FM, uint FN, uint NB, uint BN>
struct GemmFragments {
  simdgroup_float8x8 acc[NB * FM * FN];

  void clear() {
    for (uint i = 0; i < NB * FM * FN; ++i) {
      acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }

  // One step: acc_b += A[rows] * W_b[cols]^T over the kGemmBK columns of the tiles (half
  // operands, fp32 accumulation). Each A fragment is loaded once for all NB products and FN
  // column fragments.
  void step(const threadgroup half* As, const threadgroup half* Ws, uint row0, uint col0, uint live_m,
            uint live_n) {
    for (uint kk = 0; kk < kGemmBK; kk += 8) {
      simdgroup_half8x8 a[FM];
      for (uint i = 0; i < FM; ++i) {
        if (i < live_m) {
          simdgroup_load(a[i], As, kGemmLd, ulong2(kk, row0 + 8 * i));
        }
      }
      for (uint b = 0; b < NB; ++b) {
        for (uint j = 0; j < FN; ++j) {
          if (j < live_n) {
            simdgroup_half8x8 wt;  // W^T fragment: rows = k, columns = output columns
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
  threadgroup half* As = (threadgroup half*)smem4;
  threadgroup half* Ws = As + BM * kGemmLd;
  const uint row0 = (sg / SN) * 8 * FM;
  const uint col0 = (sg % SN) * 8 * FN;
  const uint live_m = gemm_live(rows, row0, FM);
  const uint live_n = gemm_live(min(BN, n - n0), col0, FN);

  GemmFragments<FM, FN, NB, BN> frags;
  frags.clear();
  for (uint k0 = 0; k0 < k; k0 += kGemmBK) {
    gemm_load_step<BITS, NB, BM, BN, NT>(As, Ws, x, a, w0, s0, b0, w1, s1, b1, n0, n, k, k0, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (live_m > 0 && live_n > 0) {  // uniform over the simdgroup
      frags.step(As, Ws, row0, col0, live_m, live_n);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  frags.store((threadgroup float*)smem4, BM, ldc, row0, col0, live_m, live_n);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
