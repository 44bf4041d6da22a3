// Tile loaders of the prefill GEMMs (metal/gemm.metal; docs/prefill.md, "GEMM"), shared by
// the simdgroup_matrix kernels and the Metal 4 tensor-operation variants (*_tensor): the
// same threadgroup tiles, filled the same way, consumed by different multiply paths.
//
// A GEMM step covers kGemmBK = 32 consecutive k (half a quantization group, so one scale
// and one bias per weight row and step):
//   * A tile  [BM][kGemmLd]: BM activation rows (fp32 in device memory), rows gathered
//     through per-thread row offsets (GemmARows), rows past the tile zero;
//   * W tile  [BN][kGemmLd]: BN weight rows dequantized from the MLX affine layout
//     (w = scale * q + bias, fp32), row n of the tile = output column n0 + n, rows past the
//     matrix zero. The dequantized weight exists only here, one step at a time.
// Tiles are row-major with a row stride of kGemmLd = kGemmBK + 4 elements: the 4 padding
// elements spread the rows of an 8x8 fragment load over the memory banks and keep every row
// 16-byte aligned for float4 stores. The element type T is a template parameter (float in
// gemm.metal; see docs/prefill.md for why).
#pragma once

#include <metal_stdlib>
using namespace metal;

#include "common.h"
#include "prefill_args.h"

// k elements per GEMM step (kGemmBK divides kQuantGroup: one scale/bias per row and step).
constant constexpr uint kGemmBK = 32;
// Row stride of the A and W tiles, in elements.
constant constexpr uint kGemmLd = kGemmBK + 4;
// Float4s per tile row (one float4 = 4 consecutive k).
constant constexpr uint kGemmRow4 = kGemmBK / 4;
// Codes dequantized by one loader work item (one row, 16 consecutive k: 8 bytes at 4 bits,
// 16 bytes at 8 bits).
constant constexpr uint kGemmChunk = 16;
// GemmARows offset of a tile row with no source row (the row is zero-filled).
constant constexpr uint kGemmNoRow = 0xFFFFFFFFu;

// ---- A tile: activation rows ------------------------------------------------------------
// Thread tid loads, for i < per, float4 (tid % kGemmRow4) of tile row (tid + i * NT) /
// kGemmRow4: consecutive threads read consecutive 16-byte pieces of a row (128 contiguous
// bytes per row and step). off[i] is that row's start in x in float4 units (row * lda / 4),
// or kGemmNoRow. The offsets are fixed for the whole k loop: a kernel fills them once.
template <uint BM, uint NT>
struct GemmARows {
  static constant constexpr uint per = BM * kGemmRow4 / NT;
  uint off[per];
};

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

// Copies the A tile of step k0 (columns [k0, k0 + kGemmBK)) into As [BM][kGemmLd].
template <typename T, uint BM, uint NT>
inline void gemm_load_a(threadgroup T* As, device const float4* x, thread const GemmARows<BM, NT>& a,
                        uint k0, uint tid) {
  const uint c4 = tid % kGemmRow4;
  for (uint i = 0; i < GemmARows<BM, NT>::per; ++i) {
    const uint r = gemm_a_row<BM, NT>(tid, i);
    const float4 v = a.off[i] != kGemmNoRow ? x[a.off[i] + k0 / 4 + c4] : float4(0.0f);
    *(threadgroup vec<T, 4>*)(As + r * kGemmLd + 4 * c4) = vec<T, 4>(v);
  }
}

// ---- W tile: dequantized weight rows ------------------------------------------------------
// Work item c < BN * 2 of a step: weight row n0 + c / 2, codes [k0 + 16 (c % 2), +16); thread
// tid takes c = tid, tid + NT, ... (two adjacent threads read one row's 8 or 16 contiguous
// bytes of the step; the next row of the tile is the next pair of threads).
//   w       the matrix (one expert of a stack: already offset) as uint32 [n, k * BITS / 32]
//   scales  bf16 [n, k / 64], biases likewise
template <int BITS, typename T, uint BN, uint NT>
inline void gemm_load_w(threadgroup T* Ws, device const uint* w, device const bfloat* scales,
                        device const bfloat* biases, uint n0, uint n, uint k, uint k0, uint tid) {
  constexpr uint items = BN * (kGemmBK / kGemmChunk);
  const uint words = k * BITS / 32;    // uint32 per weight row
  const uint groups = k / kQuantGroup;
  for (uint c = tid; c < items; c += NT) {
    const uint r = c / 2;
    const uint h = c % 2;
    const uint row = n0 + r;
    threadgroup vec<T, 4>* dst = (threadgroup vec<T, 4>*)(Ws + r * kGemmLd + kGemmChunk * h);
    if (row >= n) {
      for (uint j = 0; j < kGemmChunk / 4; ++j) {
        dst[j] = vec<T, 4>(0.0f);
      }
      continue;
    }
    const uint g = row * groups + k0 / kQuantGroup;
    const float s = float(scales[g]);
    const float b = float(biases[g]);
    const uint base = row * words + (k0 + kGemmChunk * h) * BITS / 32;
    if (BITS == 4) {
      const uint2 q = *(device const uint2*)(w + base);  // 16 codes, low nibble first
      for (uint j = 0; j < 4; ++j) {
        const uint word = j < 2 ? q.x : q.y;
        const uint4 f = (uint4(word) >> (uint4(16 * (j % 2)) + uint4(0, 4, 8, 12))) & 15u;
        dst[j] = vec<T, 4>(float4(f) * s + b);
      }
    } else {
      const uint4 q = *(device const uint4*)(w + base);  // 16 codes, low byte first
      for (uint j = 0; j < 4; ++j) {
        const uint4 f = (uint4(q[j]) >> uint4(0, 8, 16, 24)) & 255u;
        dst[j] = vec<T, 4>(float4(f) * s + b);
      }
    }
  }
}

// ---- fragments -----------------------------------------------------------------------------
// A simdgroup owns an (8 FM) x (8 FN) block of the threadgroup's output, at tile row row0 and
// tile column col0. Fragments whose rows (columns) all lie past the valid rows (columns) are
// skipped: live_m / live_n are the live fragment counts (uniform over the simdgroup).
inline uint gemm_live(uint valid, uint origin, uint frags) {
  return valid > origin ? min(frags, (valid - origin + 7) / 8) : 0u;
}

// The simdgroup's accumulators of NB products (NB = 2: gate then up, sharing the A tile):
// acc[(b * FM + i) * FN + j] is the fp32 8x8 block of rows row0 + 8i, columns col0 + 8j of
// product b. The NB weight tiles are consecutive in Ws at a stride of BN * kGemmLd elements.
template <typename T, uint FM, uint FN, uint NB, uint BN>
struct GemmFragments {
  simdgroup_float8x8 acc[NB * FM * FN];

  void clear() {
    for (uint i = 0; i < NB * FM * FN; ++i) {
      acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }

  // One step: acc_b += A[rows] * W_b[cols]^T over the kGemmBK columns of the tiles. Each A
  // fragment is loaded once for all NB products and FN column fragments.
  void step(const threadgroup T* As, const threadgroup T* Ws, uint row0, uint col0, uint live_m,
            uint live_n) {
    for (uint kk = 0; kk < kGemmBK; kk += 8) {
      simdgroup_matrix<T, 8, 8> a[FM];
      for (uint i = 0; i < FM; ++i) {
        if (i < live_m) {
          simdgroup_load(a[i], As, kGemmLd, ulong2(kk, row0 + 8 * i));
        }
      }
      for (uint b = 0; b < NB; ++b) {
        for (uint j = 0; j < FN; ++j) {
          if (j < live_n) {
            simdgroup_matrix<T, 8, 8> wt;  // W^T fragment: rows = k, columns = output columns
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
