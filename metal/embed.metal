// Embedding lookups on the MLX affine-quantized table: one row for a decode step (embed_q,
// the token id read on the GPU) and the rows of a prefill chunk (embed_rows_q). The decode
// step fuses its lookup into the first norm_gemv (embed_norm_gemv_q, gemv.metal), with the
// same arithmetic. Host-side facts: docs/kernels.md (embed_q4, embed_rows_q4).
#include <metal_stdlib>
using namespace metal;

#include "common.h"

// ---- embed_q<BITS>: dequantize one embedding row ------------------------------------
// The token id is read from a device buffer (the token slot the previous step's sampler
// wrote), so the step needs no CPU round trip. One thread per packed uint32 word:
// grid = cols * BITS / 32 threads.
template <int BITS>
[[max_total_threads_per_threadgroup(kEmbedThreads)]] kernel void embed_q(device const uint* w [[buffer(0)]],         // table [vocab, cols*BITS/32] uint32
                    device const bfloat* scales [[buffer(1)]],  // [vocab, cols/64]
                    device const bfloat* biases [[buffer(2)]],  // [vocab, cols/64]
                    device const uint* token [[buffer(3)]],     // token[0]: the id
                    device float* out [[buffer(4)]],            // [cols] fp32 hidden state
                    constant EmbedArgs& args [[buffer(5)]],
                    uint gid [[thread_position_in_grid]]) {
  constexpr uint per_word = 32 / BITS;
  static_assert(BITS != 4 || per_word == kEmbedValuesPerThread, "decode_args.h's embed geometry");
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

// ---- embed_rows_q<BITS>: dequantize the embedding rows of a prefill chunk ---------------
// out[r, :] = table[tokens[r]] for r < rows (the token ids are known when the chunk is
// encoded; they sit in a device buffer the host filled). Same arithmetic as embed_q.
// dispatchThreads grid (cols * BITS / 32, rows): one packed word per thread.
template <int BITS>
[[max_total_threads_per_threadgroup(kEmbedThreads)]] kernel void embed_rows_q(device const uint* w [[buffer(0)]],         // table [vocab, cols*BITS/32] uint32
                         device const bfloat* scales [[buffer(1)]],  // [vocab, cols/64]
                         device const bfloat* biases [[buffer(2)]],  // [vocab, cols/64]
                         device const uint* tokens [[buffer(3)]],    // [rows] token ids
                         device float* out [[buffer(4)]],            // [rows, cols] fp32
                         constant EmbedArgs& args [[buffer(5)]],
                         uint2 gid [[thread_position_in_grid]]) {
  constexpr uint per_word = 32 / BITS;
  static_assert(BITS != 4 || per_word == kEmbedValuesPerThread, "decode_args.h's embed geometry");
  constexpr uint mask = (1u << BITS) - 1u;
  const uint words = args.cols / per_word;
  if (gid.x >= words) {
    return;
  }
  const uint id = min(tokens[gid.y], args.vocab - 1u);
  const uint word = w[id * words + gid.x];
  const uint g = id * (args.cols / kQuantGroup) + gid.x * per_word / kQuantGroup;
  const float s = float(scales[g]);
  const float b = float(biases[g]);
  device float* o = out + gid.y * args.cols + gid.x * per_word;
  for (uint j = 0; j < per_word; ++j) {
    o[j] = s * float((word >> (BITS * j)) & mask) + b;
  }
}
template [[host_name("embed_rows_q4")]] [[kernel]] decltype(embed_rows_q<4>) embed_rows_q<4>;
