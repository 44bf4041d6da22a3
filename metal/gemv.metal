// Decode GEMV on MLX affine-quantized weights (batch 1): y = W x, and the embedding lookup.
// Host-side facts (grid, threadgroup, buffers and byte ranges): docs/kernels.md.
#include <metal_stdlib>
using namespace metal;

#include "common.h"

// ---- gemv_q<BITS>: row-parallel GEMV ------------------------------------------------
// Each simdgroup owns kGemvRowsPerSimdgroup (8) consecutive rows. It splits into teams of
// T lanes (T = the largest power of two <= the chunks per row, in [4, 32]); a team owns
// T/4 of the rows, its lanes read consecutive 16-byte chunks of those rows (adjacent lanes,
// adjacent bytes) and load each x chunk once for all the team's rows. fp32 accumulation,
// dequantisation in registers, a butterfly (simd_shuffle_xor) sum over the team; lane r
// of a team stores row r. ADD: y[row] += W x (residual update for o_proj/out_proj).
// Threadgroup: a multiple of 32 threads (64 recommended); any number of threadgroups
// >= ceil(rows / (8 * simdgroups)); rows past `rows` are skipped.
template <int BITS, bool ADD>
kernel void gemv_q(device const uint4* w [[buffer(0)]],         // weight [rows, cols*BITS/32] uint32
                   device const bfloat* scales [[buffer(1)]],   // [rows, cols/64]
                   device const bfloat* biases [[buffer(2)]],   // [rows, cols/64]
                   device const float4* x [[buffer(3)]],        // [cols] fp32
                   device float* y [[buffer(4)]],               // [rows] fp32 (read too when ADD)
                   constant GemvArgs& args [[buffer(5)]],
                   uint tg [[threadgroup_position_in_grid]],
                   uint sg [[simdgroup_index_in_threadgroup]],
                   uint nsg [[simdgroups_per_threadgroup]],
                   uint lane [[thread_index_in_simdgroup]]) {
  const uint chunks = args.cols * BITS / 128;
  const uint groups = args.cols / kQuantGroup;
  const QTeam t = q_team(chunks, kGemvRowsPerSimdgroup, lane);
  const uint row0 = (tg * nsg + sg) * kGemvRowsPerSimdgroup + t.team * t.rows;
  const uint nrows = row0 < args.rows ? min(t.rows, args.rows - row0) : 0u;

  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (nrows > 0) {
    for (uint c = t.lane; c < chunks; c += t.size) {
      float4 xs[QChunk<BITS>::float4s];
      const float xsum = q_load_x<BITS>(x, c, 1.0f, xs);
      q_chunk_rows<BITS>(w, scales, biases, chunks, groups, row0, nrows, c, xs, xsum, acc);
    }
  }
  const float v = team_reduce_rows(acc, t);
  if (t.lane < nrows) {
    const uint row = row0 + t.lane;
    y[row] = ADD ? y[row] + v : v;
  }
}
template [[host_name("gemv_q4")]] [[kernel]] decltype(gemv_q<4, false>) gemv_q<4, false>;
template [[host_name("gemv_q8")]] [[kernel]] decltype(gemv_q<8, false>) gemv_q<8, false>;
template [[host_name("gemv_q4_add")]] [[kernel]] decltype(gemv_q<4, true>) gemv_q<4, true>;
template [[host_name("gemv_q8_add")]] [[kernel]] decltype(gemv_q<8, true>) gemv_q<8, true>;

// ---- embed_q<BITS>: dequantize one embedding row ------------------------------------
// The token id is read from a device buffer (the token slot the previous step's sampler
// wrote), so the step needs no CPU round trip. One thread per packed uint32 word:
// grid = cols * BITS / 32 threads.
template <int BITS>
kernel void embed_q(device const uint* w [[buffer(0)]],         // table [vocab, cols*BITS/32] uint32
                    device const bfloat* scales [[buffer(1)]],  // [vocab, cols/64]
                    device const bfloat* biases [[buffer(2)]],  // [vocab, cols/64]
                    device const uint* token [[buffer(3)]],     // token[0]: the id
                    device float* out [[buffer(4)]],            // [cols] fp32 hidden state
                    constant EmbedArgs& args [[buffer(5)]],
                    uint gid [[thread_position_in_grid]]) {
  constexpr uint per_word = 32 / BITS;
  constexpr uint mask = (1u << BITS) - 1u;
  const uint words = args.cols / per_word;
  if (gid >= words) {
    return;
  }
  const uint id = min(token[0], args.vocab - 1u);
  const uint word = w[id * words + gid];
  const uint g = id * (args.cols / kQuantGroup) + gid * per_word / kQuantGroup;
  const float s = float(scales[g]);
  const float b = float(biases[g]);
  for (uint j = 0; j < per_word; ++j) {
    out[gid * per_word + j] = s * float((word >> (BITS * j)) & mask) + b;
  }
}
template [[host_name("embed_q4")]] [[kernel]] decltype(embed_q<4>) embed_q<4>;
