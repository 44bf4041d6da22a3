// Decode GEMV on MLX affine-quantized weights (batch 1): y = W x, RMSNorm fused in front of
// it (norm_gemv_q), and the embedding lookup fused into layer 0's first norm_gemv
// (embed_norm_gemv_q; the plain lookups are in embed.metal), and the Gated DeltaNet out_proj
// with the gated RMSNorm applied to its input (gemv_gated_q).
// Host-side facts (grid, threadgroup, buffers and byte ranges): docs/kernels.md.
#include <metal_stdlib>
using namespace metal;

#include "common.h"
#include "batch_args.h"

// ---- gemv_q<BITS>: row-parallel GEMV ------------------------------------------------
// Each group of R = kGemvRowsPerSimdgroup (4) consecutive rows is shared by kGemvSplitK (2)
// simdgroups (simdgroup sg: row group sg / 2, split sg % 2), split ks over the chunk runs ks,
// ks + 2, ... of the rows. A simdgroup splits into teams of T lanes (T = the largest power of
// two <= the chunks per row, in [32 / R, 32]); a team owns R T / 32 of the rows, its lanes
// read consecutive 16-byte chunks of those rows (adjacent lanes, adjacent bytes) and load each
// x chunk once for all the team's rows. fp32 accumulation, dequantisation in registers, a
// butterfly (simd_shuffle_xor) sum over the team, the splits' sums joined through threadgroup
// memory (q_split_join); lane r of a split-0 team stores row r. ADD: y[row] += W x (residual
// update for o_proj). Threadgroup: a multiple of 64 threads (64 recommended), at most 256;
// any number of threadgroups >= ceil(rows / (R * simdgroups / 2)); rows past `rows` are
// skipped. XSrc: where a chunk of x comes from (PlainX, GatedNormX), its load(c, xs) is
// q_load_x's contract.
//
// NR > 1 (gemv_batch_q): the same rows of nb <= NR vectors (the rows of a batched decode
// step): each weight chunk is loaded once and applied to every row's x chunk (x.load(b, ...)),
// row b accumulating into acc[b] in the order of NR = 1, so each row's y (y + b * y_stride) is
// bit for bit its batch-1 result. part holds NR * kSplitJoinMax floats.
template <int BITS, bool ADD, uint NR, typename XSrc>
inline void gemv_body(device const uint4* w, device const bfloat* scales, device const bfloat* biases,
                      XSrc x, device float* y, uint y_stride, uint nb, constant GemvArgs& args,
                      threadgroup float* part, uint tg, uint sg, uint nsg, uint lane) {
  const uint chunks = args.cols * BITS / 128;
  const uint groups = args.cols / kQuantGroup;
  const QTeam t = q_team(chunks, kGemvRowsPerSimdgroup, lane);
  const uint ks = sg % kGemvSplitK;
  const uint slot = sg / kGemvSplitK * kGemvRowsPerSimdgroup + t.team * t.rows;  // within the threadgroup
  const uint row0 = tg * (nsg / kGemvSplitK) * kGemvRowsPerSimdgroup + slot;
  const uint nrows = row0 < args.rows ? min(t.rows, args.rows - row0) : 0u;

  float acc[NR][8];
  for (uint b = 0; b < NR; ++b) {
    for (uint r = 0; r < 8; ++r) {
      acc[b][r] = 0.0f;
    }
  }
  if (nrows > 0) {
    for (uint c = t.lane + ks * t.size; c < chunks; c += kGemvSplitK * t.size) {
      QChunkRows wr;
      q_chunk_load<BITS>(w, scales, biases, chunks, groups, row0, nrows, c, wr);
      for (uint b = 0; b < NR; ++b) {
        if (b < nb) {
          float4 xs[QChunk<BITS>::float4s];
          const float xsum = x.load(b, c, xs);
          q_chunk_fma<BITS>(wr, nrows, xs, xsum, acc[b]);
        }
      }
    }
  }
  for (uint b = 0; b < NR; ++b) {
    if (b < nb) {  // uniform: every thread joins the same splits
      float v = team_reduce_rows(acc[b], t);
      if (q_split_join(v, part + b * kSplitJoinMax, t.lane, nrows, slot, ks, kGemvSplitK) && t.lane < nrows) {
        device float* yb = y + b * y_stride;
        const uint row = row0 + t.lane;
        yb[row] = ADD ? yb[row] + v : v;
      }
    }
  }
}

// x as it is in device memory; row b's x at x + b * stride (float4s).
template <int BITS>
struct PlainX {
  device const float4* x;
  uint stride;
  float load(uint b, uint c, thread float4* xs) const { return q_load_x<BITS>(x + b * stride, c, 1.0f, xs); }
};

// The Gated DeltaNet's y with its gated RMSNorm (GatedNormArgs) applied on load: per chunk
// (inside one head h) inv = 1 / sqrt(ss(h) / Dv + eps) from the head's NS partial sums of
// squares, then ((y * inv) * norm_w) * silu(z) (docs/model.md, "Gated DeltaNet"). Row b's
// y and z at + b * stride (float4s), its partial sums at ssq + b * ssq_stride.
template <int BITS>
struct GatedNormX {
  device const float4* y;   // [Hv*Dv] gdn_decode_step's y
  device const float* ssq;  // [Hv, NS] partial sums of y^2
  device const float4* z;   // [Hv*Dv] in_proj_z output
  device const bfloat* nw;  // [Dv] norm.weight
  uint dv;
  uint ns;
  float eps;
  uint stride;
  uint ssq_stride;
  float load(uint b, uint c, thread float4* xs) const {
    constexpr uint nf4 = QChunk<BITS>::float4s;
    const uint f0 = b * stride + c * nf4;  // first float4 of the chunk
    const uint h = c * nf4 * 4 / dv;
    float ss = 0.0f;
    for (uint j = 0; j < ns; ++j) {
      ss += ssq[b * ssq_stride + h * ns + j];
    }
    const float inv = 1.0f / sqrt(ss / float(dv) + eps);
    float s = 0.0f;
    for (uint i = 0; i < nf4; ++i) {
      const float4 zz = z[f0 + i];
      const float4 gate = float4(silu(zz.x), silu(zz.y), silu(zz.z), silu(zz.w));
      const float4 v = rms_apply4(y[f0 + i], inv, nw, (c * nf4 + i) % (dv / 4)) * gate;
      s += (v.x + v.y) + (v.z + v.w);
      xs[i] = q_position_scale<BITS>(v, i);
    }
    return s;
  }
};

template <int BITS, bool ADD>
[[max_total_threads_per_threadgroup(256)]] kernel void gemv_q(device const uint4* w [[buffer(0)]],         // weight [rows, cols*BITS/32] uint32
                   device const bfloat* scales [[buffer(1)]],   // [rows, cols/64]
                   device const bfloat* biases [[buffer(2)]],   // [rows, cols/64]
                   device const float4* x [[buffer(3)]],        // [cols] fp32
                   device float* y [[buffer(4)]],               // [rows] fp32 (read too when ADD)
                   constant GemvArgs& args [[buffer(5)]],
                   uint tg [[threadgroup_position_in_grid]],
                   uint sg [[simdgroup_index_in_threadgroup]],
                   uint nsg [[simdgroups_per_threadgroup]],
                   uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float part[kSplitJoinMax];
  gemv_body<BITS, ADD, 1>(w, scales, biases, PlainX<BITS>{x, 0}, y, 0, 1, args, part, tg, sg, nsg, lane);
}
template [[host_name("gemv_q4")]] [[kernel]] decltype(gemv_q<4, false>) gemv_q<4, false>;
template [[host_name("gemv_q8")]] [[kernel]] decltype(gemv_q<8, false>) gemv_q<8, false>;
template [[host_name("gemv_q4_add")]] [[kernel]] decltype(gemv_q<4, true>) gemv_q<4, true>;
template [[host_name("gemv_q8_add")]] [[kernel]] decltype(gemv_q<8, true>) gemv_q<8, true>;

// ---- gemv_gated_q<BITS>: out_proj of a Gated DeltaNet layer, y += W gated_norm(x) ------
// gemv_q_add whose x is gdn_decode_step's raw y, normalised on load (GatedNormX): the
// norm needs a head's Dv outputs, which the step spreads over NS threadgroups.
template <int BITS>
[[max_total_threads_per_threadgroup(256)]] kernel void gemv_gated_q(device const uint4* w [[buffer(0)]],       // weight [rows, cols*BITS/32] uint32
                         device const bfloat* scales [[buffer(1)]], // [rows, cols/64]
                         device const bfloat* biases [[buffer(2)]], // [rows, cols/64]
                         device const float4* x [[buffer(3)]],      // [cols] fp32 y = S q, cols = Hv*Dv
                         device float* y [[buffer(4)]],             // [rows] fp32, y += W x'
                         constant GemvArgs& args [[buffer(5)]],
                         device const float* ssq [[buffer(6)]],     // [Hv, NS] partial sums of x^2 per head
                         device const float4* z [[buffer(7)]],      // [cols] fp32 in_proj_z output
                         device const bfloat* nw [[buffer(8)]],     // [Dv] norm.weight
                         constant GatedNormArgs& gargs [[buffer(9)]],
                         uint tg [[threadgroup_position_in_grid]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint nsg [[simdgroups_per_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float part[kSplitJoinMax];
  const GatedNormX<BITS> src{x, ssq, z, nw, gargs.head_dim, gargs.splits, gargs.eps, 0, 0};
  gemv_body<BITS, true, 1>(w, scales, biases, src, y, 0, 1, args, part, tg, sg, nsg, lane);
}
template [[host_name("gemv_gated_q4_add")]] [[kernel]] decltype(gemv_gated_q<4>) gemv_gated_q<4>;
template [[host_name("gemv_gated_q8_add")]] [[kernel]] decltype(gemv_gated_q<8>) gemv_gated_q<8>;

// ---- norm_gemv_q<BITS>: RMSNorm fused into up to four GEMVs ----------------------------
// y_m = W_m xn for m < 4, xn = x * rsqrt(mean(x^2) + eps) * w, from the raw residual x.
// The rows of the matrices are laid out one after another in the grid, each matrix padded
// to whole threadgroups (a threadgroup's rows belong to one matrix): matrix m owns
// t_m = ceil(rows[m] / (R * simdgroups / S)) threadgroups, R = args.rows_per_simdgroup (1, 2,
// 4 or 8: 8 amortises each x chunk over more rows, 1 spreads a small matrix such as the
// 257-row router over enough simdgroups to fill the GPU), S = args.k_splits simdgroups per
// group of R rows (gemv_q's split-K; 2 for the router: 257 rows on 258 threadgroups),
// starting after those of matrices < m. Every threadgroup computes sum(x^2) itself (one pass
// over x, then a threadgroup sum: the same order in every threadgroup, so all of them use the
// same rsqrt) and applies
// (x * inv) * w while loading each x chunk; the GEMV itself is gemv_q's (teams of lanes,
// R rows per simdgroup). Each lane's first weight chunk is loaded before the norm
// (norm_gemv_start), so the norm's reduction and barriers run while that round trip is in
// flight instead of in front of it. With write_xn, threadgroup 0 also stores the whole
// normalised vector to xn (the values the dots used, bit for bit) for later kernels.
// Bindings of an unused slot (rows = 0) are never accessed (bind any buffer; the simulator
// requires every argument to be bound). xn must not overlap x.

// A threadgroup's share of norm_gemv: its matrix, its lanes' rows and their first chunk,
// already requested (norm_gemv_start).
struct NormGemvTile {
  bool has_rows;  // false: past the last matrix (threadgroup 0 may still store xn)
  uint m;         // the matrix
  device const uint4* w;
  device const bfloat* scales;
  device const bfloat* biases;
  device float* y;
  uint chunks;
  uint groups;
  QTeam t;
  uint splits;         // simdgroups sharing a row group (args.k_splits)
  uint ks;             // this simdgroup's split: chunk runs ks, ks + splits, ...
  uint slot;           // the team's first row within the threadgroup
  uint row0;
  uint nrows;          // this lane's rows (0: none)
  QChunkRows first;    // chunk t.lane + ks t.size of them (when nrows > 0 and it exists)
};

template <int BITS>
inline NormGemvTile norm_gemv_start(device const uint4* w0, device const bfloat* s0, device const bfloat* b0,
                                    device float* y0, device const uint4* w1, device const bfloat* s1,
                                    device const bfloat* b1, device float* y1, device const uint4* w2,
                                    device const bfloat* s2, device const bfloat* b2, device float* y2,
                                    device const uint4* w3, device const bfloat* s3, device const bfloat* b3,
                                    device float* y3, constant NormGemvArgs& args, uint tg, uint sg, uint nsg,
                                    uint lane) {
  // the matrix this threadgroup works on (uniform over the threadgroup)
  const uint rps = clamp(args.rows_per_simdgroup, 1u, 8u);  // 1, 2, 4 or 8 (checked by the host)
  const uint splits = clamp(args.k_splits, 1u, 2u);
  const uint tg_rows = rps * nsg / splits;
  uint m = 0;
  uint first = 0;  // first threadgroup of matrix m
  uint tiles = (args.rows[0] + tg_rows - 1) / tg_rows;
  while (m + 1 < kNormGemvMaxMatrices && tg >= first + tiles) {
    first += tiles;
    ++m;
    tiles = (args.rows[m] + tg_rows - 1) / tg_rows;
  }
  NormGemvTile tl;
  tl.has_rows = tg < first + tiles;
  tl.m = m;
  tl.w = m == 0 ? w0 : (m == 1 ? w1 : (m == 2 ? w2 : w3));
  tl.scales = m == 0 ? s0 : (m == 1 ? s1 : (m == 2 ? s2 : s3));
  tl.biases = m == 0 ? b0 : (m == 1 ? b1 : (m == 2 ? b2 : b3));
  tl.y = m == 0 ? y0 : (m == 1 ? y1 : (m == 2 ? y2 : y3));
  const uint rows = args.rows[m];
  tl.chunks = args.cols * BITS / 128;
  tl.groups = args.cols / kQuantGroup;
  tl.t = q_team(tl.chunks, rps, lane);
  tl.splits = splits;
  tl.ks = sg % splits;
  tl.slot = sg / splits * rps + tl.t.team * tl.t.rows;
  tl.row0 = (tg - first) * tg_rows + tl.slot;
  tl.nrows = tl.has_rows && tl.row0 < rows ? min(tl.t.rows, rows - tl.row0) : 0u;
  const uint c0 = tl.t.lane + tl.ks * tl.t.size;
  if (tl.nrows > 0 && c0 < tl.chunks) {
    q_chunk_load<BITS>(tl.w, tl.scales, tl.biases, tl.chunks, tl.groups, tl.row0, tl.nrows, c0, tl.first);
  }
  return tl;
}

// The norm and the rows of tile tl, on x: the raw residual in device memory or the embedding
// row in threadgroup memory (XPtr: a pointer to const float4). NR > 1 (norm_gemv_batch_q):
// nb <= NR rows (vectors) of a batched decode step, row b's x and xn at + b * x_stride
// (float4s), its outputs at y_m + b * y_stride[m]; each row's norm and dots run in the order of
// NR = 1 (each weight chunk loaded once, applied to every row), so its outputs are bit for bit
// its batch-1 ones. part holds NR * kSplitJoinMax floats.
template <int BITS, uint NR, typename XPtr>
inline void norm_gemv_body(XPtr x, device const bfloat* nw, device float4* xn, thread const NormGemvTile& tl,
                           constant NormGemvArgs& args, uint nb, uint x_stride, uint y_stride,
                           threadgroup float* scratch, threadgroup float* part, uint tg, uint tid, uint tcount,
                           uint sg, uint nsg, uint lane) {
  if (!tl.has_rows && !(tg == 0 && args.write_xn != 0)) {
    return;  // the whole threadgroup: past the last matrix
  }

  // the norms: every threadgroup, same order
  const uint n4 = args.cols / 4;
  float inv[NR];
  for (uint b = 0; b < NR; ++b) {
    if (b < nb) {  // uniform
      const XPtr xb = x + b * x_stride;
      float4 sq = float4(0.0f);
      for (uint i = tid; i < n4; i += tcount) {
        const float4 v = xb[i];
        sq += v * v;
      }
      const float ss = threadgroup_sum((sq.x + sq.y) + (sq.z + sq.w), scratch, sg, lane, nsg);
      inv[b] = rsqrt(ss / float(args.cols) + args.eps);
      if (tg == 0 && args.write_xn != 0) {
        for (uint i = tid; i < n4; i += tcount) {
          xn[b * x_stride + i] = rms_apply4(xb[i], inv[b], nw, i);
        }
      }
    }
  }
  if (!tl.has_rows) {
    return;
  }

  const QTeam t = tl.t;
  const uint c0 = t.lane + tl.ks * t.size;
  const uint step = tl.splits * t.size;
  float acc[NR][8];
  for (uint b = 0; b < NR; ++b) {
    for (uint r = 0; r < 8; ++r) {
      acc[b][r] = 0.0f;
    }
  }
  if (tl.nrows > 0 && c0 < tl.chunks) {
    float4 xs[QChunk<BITS>::float4s];
    for (uint b = 0; b < NR; ++b) {
      if (b < nb) {
        const float xsum = q_load_x_norm<BITS>(x + b * x_stride, nw, c0, inv[b], xs);
        q_chunk_fma<BITS>(tl.first, tl.nrows, xs, xsum, acc[b]);
      }
    }
    for (uint c = c0 + step; c < tl.chunks; c += step) {
      QChunkRows wr;
      q_chunk_load<BITS>(tl.w, tl.scales, tl.biases, tl.chunks, tl.groups, tl.row0, tl.nrows, c, wr);
      for (uint b = 0; b < NR; ++b) {
        if (b < nb) {
          const float xsum = q_load_x_norm<BITS>(x + b * x_stride, nw, c, inv[b], xs);
          q_chunk_fma<BITS>(wr, tl.nrows, xs, xsum, acc[b]);
        }
      }
    }
  }
  for (uint b = 0; b < NR; ++b) {
    if (b < nb) {  // uniform: every thread joins the same splits
      float v = team_reduce_rows(acc[b], t);
      if (q_split_join(v, part + b * kSplitJoinMax, t.lane, tl.nrows, tl.slot, tl.ks, tl.splits) &&
          t.lane < tl.nrows) {
        tl.y[b * y_stride + tl.row0 + t.lane] = v;
      }
    }
  }
}

template <int BITS>
[[max_total_threads_per_threadgroup(256)]] kernel void norm_gemv_q(device const float4* x [[buffer(0)]],       // [cols] fp32 raw residual
                        device const bfloat* nw [[buffer(1)]],      // [cols] bf16 norm weight
                        device float4* xn [[buffer(2)]],            // [cols] fp32 normalised (write_xn)
                        device const uint4* w0 [[buffer(3)]],       // matrix 0 weight [rows0, cols*BITS/32]
                        device const bfloat* s0 [[buffer(4)]],      // matrix 0 scales [rows0, cols/64]
                        device const bfloat* b0 [[buffer(5)]],      // matrix 0 biases [rows0, cols/64]
                        device float* y0 [[buffer(6)]],             // [rows0] fp32
                        device const uint4* w1 [[buffer(7)]],       // matrix 1 ...
                        device const bfloat* s1 [[buffer(8)]],
                        device const bfloat* b1 [[buffer(9)]],
                        device float* y1 [[buffer(10)]],
                        device const uint4* w2 [[buffer(11)]],      // matrix 2 ...
                        device const bfloat* s2 [[buffer(12)]],
                        device const bfloat* b2 [[buffer(13)]],
                        device float* y2 [[buffer(14)]],
                        device const uint4* w3 [[buffer(15)]],      // matrix 3 ...
                        device const bfloat* s3 [[buffer(16)]],
                        device const bfloat* b3 [[buffer(17)]],
                        device float* y3 [[buffer(18)]],
                        constant NormGemvArgs& args [[buffer(19)]],
                        uint tg [[threadgroup_position_in_grid]],
                        uint tid [[thread_index_in_threadgroup]],
                        uint tcount [[threads_per_threadgroup]],
                        uint sg [[simdgroup_index_in_threadgroup]],
                        uint nsg [[simdgroups_per_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float scratch[32];
  threadgroup float part[kSplitJoinMax];
  const NormGemvTile tl = norm_gemv_start<BITS>(w0, s0, b0, y0, w1, s1, b1, y1, w2, s2, b2, y2, w3, s3, b3, y3,
                                                args, tg, sg, nsg, lane);
  norm_gemv_body<BITS, 1>(x, nw, xn, tl, args, 1, 0, 0, scratch, part, tg, tid, tcount, sg, nsg, lane);
}
template [[host_name("norm_gemv_q4")]] [[kernel]] decltype(norm_gemv_q<4>) norm_gemv_q<4>;
template [[host_name("norm_gemv_q8")]] [[kernel]] decltype(norm_gemv_q<8>) norm_gemv_q<8>;

// ---- embed_norm_gemv_q<BITS>: the embedding lookup fused into layer 0's first norm_gemv --
// Every threadgroup dequantizes the embedding row of token[0] (the token slot) into
// threadgroup memory with embed_q's arithmetic (embed.metal), threadgroup 0 stores it to h
// (the residual the rest of the step updates), and the row is then used as norm_gemv_q's x. Saves the
// embed dispatch and its barrier stage; each threadgroup re-reads one row (cols*BITS/8 bytes
// plus cols/32 of scales and biases, from cache). cols <= kEmbedMaxCols.
constant constexpr uint kEmbedMaxCols = 4096;

template <int BITS>
[[max_total_threads_per_threadgroup(256)]] kernel void embed_norm_gemv_q(device float4* h [[buffer(0)]],             // [cols] fp32 out: the embedding row (threadgroup 0)
                              device const bfloat* nw [[buffer(1)]],       // [cols] bf16 norm weight
                              device float4* xn [[buffer(2)]],             // [cols] fp32 normalised (write_xn)
                              device const uint4* w0 [[buffer(3)]],        // matrices 0..3 as in norm_gemv_q
                              device const bfloat* s0 [[buffer(4)]],
                              device const bfloat* b0 [[buffer(5)]],
                              device float* y0 [[buffer(6)]],
                              device const uint4* w1 [[buffer(7)]],
                              device const bfloat* s1 [[buffer(8)]],
                              device const bfloat* b1 [[buffer(9)]],
                              device float* y1 [[buffer(10)]],
                              device const uint4* w2 [[buffer(11)]],
                              device const bfloat* s2 [[buffer(12)]],
                              device const bfloat* b2 [[buffer(13)]],
                              device float* y2 [[buffer(14)]],
                              device const uint4* w3 [[buffer(15)]],
                              device const bfloat* s3 [[buffer(16)]],
                              device const bfloat* b3 [[buffer(17)]],
                              device float* y3 [[buffer(18)]],
                              constant NormGemvArgs& args [[buffer(19)]],
                              device const uint* emb_w [[buffer(20)]],     // embedding table [vocab, cols*BITS/32] uint32
                              device const bfloat* emb_s [[buffer(21)]],   // [vocab, cols/64]
                              device const bfloat* emb_b [[buffer(22)]],   // [vocab, cols/64]
                              device const uint* token [[buffer(23)]],     // token[0]: the id
                              constant EmbedArgs& eargs [[buffer(24)]],
                              uint tg [[threadgroup_position_in_grid]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint tcount [[threads_per_threadgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]],
                              uint nsg [[simdgroups_per_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float scratch[32];
  threadgroup float part[kSplitJoinMax];
  threadgroup float4 row[kEmbedMaxCols / 4];
  // the first weight chunk requested before the row's lookup, as norm_gemv_q does before its norm
  const NormGemvTile tl = norm_gemv_start<BITS>(w0, s0, b0, y0, w1, s1, b1, y1, w2, s2, b2, y2, w3, s3, b3, y3,
                                                args, tg, sg, nsg, lane);
  constexpr uint per_word = 32 / BITS;
  constexpr uint mask = (1u << BITS) - 1u;
  const uint words = eargs.cols / per_word;
  const uint id = min(token[0], eargs.vocab - 1u);
  threadgroup float* rowf = reinterpret_cast<threadgroup float*>(row);
  for (uint i = tid; i < words; i += tcount) {
    const uint word = emb_w[id * words + i];
    const uint g = id * (eargs.cols / kQuantGroup) + i * per_word / kQuantGroup;
    const float s = float(emb_s[g]);
    const float b = float(emb_b[g]);
    for (uint j = 0; j < per_word; ++j) {
      rowf[i * per_word + j] = s * float((word >> (BITS * j)) & mask) + b;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tg == 0) {
    for (uint i = tid; i < eargs.cols / 4; i += tcount) {
      h[i] = row[i];
    }
  }
  norm_gemv_body<BITS, 1>(static_cast<threadgroup const float4*>(row), nw, xn, tl, args, 1, 0, 0, scratch, part,
                          tg, tid, tcount, sg, nsg, lane);
}
template [[host_name("embed_norm_gemv_q4")]] [[kernel]] decltype(embed_norm_gemv_q<4>) embed_norm_gemv_q<4>;

// ---- batched decode (issue 31): the dense projections of several rows in one dispatch -----
// A batched decode step's rows (sequences, each at its own position) share the weights of the
// dense projections: these kernels load each weight chunk once for nb = args.rows <= NR rows
// and apply it to every row's x, each row's arithmetic that of the batch-1 kernel (the same
// dispatch geometry: same threadgroup size, rows per simdgroup and split), so each row's
// outputs are bit for bit those of its batch-1 dispatch. Bindings: the batch-1 kernel's, its
// buffers holding the rows one after another (strides in the NR-row argument struct,
// batch_args.h), and that struct after the batch-1 one. Threadgroup memory: NR times the
// batch-1 kernel's split-join scratch.

template <int BITS, uint NR>
[[max_total_threads_per_threadgroup(256)]] kernel void norm_gemv_batch_q(
    device const float4* x [[buffer(0)]],   // [rows, x_stride] fp32 raw residuals
    device const bfloat* nw [[buffer(1)]],  // [cols] bf16 norm weight
    device float4* xn [[buffer(2)]],        // [rows, x_stride] fp32 normalised (write_xn)
    device const uint4* w0 [[buffer(3)]], device const bfloat* s0 [[buffer(4)]], device const bfloat* b0 [[buffer(5)]],
    device float* y0 [[buffer(6)]],  // [rows, y_stride[0]] fp32
    device const uint4* w1 [[buffer(7)]], device const bfloat* s1 [[buffer(8)]], device const bfloat* b1 [[buffer(9)]],
    device float* y1 [[buffer(10)]],
    device const uint4* w2 [[buffer(11)]], device const bfloat* s2 [[buffer(12)]],
    device const bfloat* b2 [[buffer(13)]], device float* y2 [[buffer(14)]],
    device const uint4* w3 [[buffer(15)]], device const bfloat* s3 [[buffer(16)]],
    device const bfloat* b3 [[buffer(17)]], device float* y3 [[buffer(18)]],
    constant NormGemvArgs& args [[buffer(19)]], constant NormGemvBatchArgs& bargs [[buffer(20)]],
    uint tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
    uint tcount [[threads_per_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float scratch[32];
  threadgroup float part[NR * kSplitJoinMax];
  const NormGemvTile tl = norm_gemv_start<BITS>(w0, s0, b0, y0, w1, s1, b1, y1, w2, s2, b2, y2, w3, s3, b3, y3,
                                                args, tg, sg, nsg, lane);
  norm_gemv_body<BITS, NR>(x, nw, xn, tl, args, min(bargs.rows, NR), bargs.x_stride / 4, bargs.y_stride[tl.m],
                           scratch, part, tg, tid, tcount, sg, nsg, lane);
}
template [[host_name("norm_gemv_batch_q4_b2")]] [[kernel]] decltype(norm_gemv_batch_q<4, 2>) norm_gemv_batch_q<4, 2>;
template [[host_name("norm_gemv_batch_q4_b4")]] [[kernel]] decltype(norm_gemv_batch_q<4, 4>) norm_gemv_batch_q<4, 4>;
template [[host_name("norm_gemv_batch_q4_b8")]] [[kernel]] decltype(norm_gemv_batch_q<4, 8>) norm_gemv_batch_q<4, 8>;
template [[host_name("norm_gemv_batch_q8_b2")]] [[kernel]] decltype(norm_gemv_batch_q<8, 2>) norm_gemv_batch_q<8, 2>;
template [[host_name("norm_gemv_batch_q8_b4")]] [[kernel]] decltype(norm_gemv_batch_q<8, 4>) norm_gemv_batch_q<8, 4>;
template [[host_name("norm_gemv_batch_q8_b8")]] [[kernel]] decltype(norm_gemv_batch_q<8, 8>) norm_gemv_batch_q<8, 8>;

// gemv_q*_add of each row (o_proj).
template <int BITS, uint NR>
[[max_total_threads_per_threadgroup(256)]] kernel void gemv_batch_q(
    device const uint4* w [[buffer(0)]],       // weight [rows, cols*BITS/32] uint32
    device const bfloat* scales [[buffer(1)]], // [rows, cols/64]
    device const bfloat* biases [[buffer(2)]], // [rows, cols/64]
    device const float4* x [[buffer(3)]],      // [batch rows, x_stride] fp32
    device float* y [[buffer(4)]],             // [batch rows, y_stride] fp32, y += W x
    constant GemvArgs& args [[buffer(5)]], constant GemvBatchArgs& bargs [[buffer(6)]],
    uint tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float part[NR * kSplitJoinMax];
  gemv_body<BITS, true, NR>(w, scales, biases, PlainX<BITS>{x, bargs.x_stride / 4}, y, bargs.y_stride,
                            min(bargs.rows, NR), args, part, tg, sg, nsg, lane);
}
template [[host_name("gemv_batch_q4_b2_add")]] [[kernel]] decltype(gemv_batch_q<4, 2>) gemv_batch_q<4, 2>;
template [[host_name("gemv_batch_q4_b4_add")]] [[kernel]] decltype(gemv_batch_q<4, 4>) gemv_batch_q<4, 4>;
template [[host_name("gemv_batch_q4_b8_add")]] [[kernel]] decltype(gemv_batch_q<4, 8>) gemv_batch_q<4, 8>;
template [[host_name("gemv_batch_q8_b2_add")]] [[kernel]] decltype(gemv_batch_q<8, 2>) gemv_batch_q<8, 2>;
template [[host_name("gemv_batch_q8_b4_add")]] [[kernel]] decltype(gemv_batch_q<8, 4>) gemv_batch_q<8, 4>;
template [[host_name("gemv_batch_q8_b8_add")]] [[kernel]] decltype(gemv_batch_q<8, 8>) gemv_batch_q<8, 8>;

// gemv_gated_q*_add of each row (a Gated DeltaNet layer's out_proj).
template <int BITS, uint NR>
[[max_total_threads_per_threadgroup(256)]] kernel void gemv_gated_batch_q(
    device const uint4* w [[buffer(0)]],        // weight [rows, cols*BITS/32] uint32
    device const bfloat* scales [[buffer(1)]],  // [rows, cols/64]
    device const bfloat* biases [[buffer(2)]],  // [rows, cols/64]
    device const float4* x [[buffer(3)]],       // [batch rows, x_stride] fp32 y = S q
    device float* y [[buffer(4)]],              // [batch rows, y_stride] fp32, y += W x'
    constant GemvArgs& args [[buffer(5)]],
    device const float* ssq [[buffer(6)]],      // [batch rows, ssq_stride] partial sums of x^2 per head
    device const float4* z [[buffer(7)]],       // [batch rows, x_stride] fp32 in_proj_z output
    device const bfloat* nw [[buffer(8)]],      // [Dv] norm.weight
    constant GatedNormArgs& gargs [[buffer(9)]], constant GemvBatchArgs& bargs [[buffer(10)]],
    uint tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float part[NR * kSplitJoinMax];
  const GatedNormX<BITS> src{x, ssq, z, nw, gargs.head_dim, gargs.splits, gargs.eps, bargs.x_stride / 4,
                             bargs.ssq_stride};
  gemv_body<BITS, true, NR>(w, scales, biases, src, y, bargs.y_stride, min(bargs.rows, NR), args, part, tg, sg, nsg,
                            lane);
}
template [[host_name("gemv_gated_batch_q4_b2_add")]] [[kernel]] decltype(gemv_gated_batch_q<4, 2>) gemv_gated_batch_q<4, 2>;
template [[host_name("gemv_gated_batch_q4_b4_add")]] [[kernel]] decltype(gemv_gated_batch_q<4, 4>) gemv_gated_batch_q<4, 4>;
template [[host_name("gemv_gated_batch_q4_b8_add")]] [[kernel]] decltype(gemv_gated_batch_q<4, 8>) gemv_gated_batch_q<4, 8>;
template [[host_name("gemv_gated_batch_q8_b2_add")]] [[kernel]] decltype(gemv_gated_batch_q<8, 2>) gemv_gated_batch_q<8, 2>;
template [[host_name("gemv_gated_batch_q8_b4_add")]] [[kernel]] decltype(gemv_gated_batch_q<8, 4>) gemv_gated_batch_q<8, 4>;
template [[host_name("gemv_gated_batch_q8_b8_add")]] [[kernel]] decltype(gemv_gated_batch_q<8, 8>) gemv_gated_batch_q<8, 8>;
