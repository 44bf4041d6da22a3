// Prefill GEMMs on MLX affine-quantized weights, simdgroup_matrix path (docs/prefill.md,
// "GEMM: dense and grouped expert GEMM"):
//   gemm_q4, gemm_q8, gemm_q4_add_h     y[m, n] (=|+=) x[m, k] W[n, k]^T
//   gemm_q4_add_hs                      y += (x * s) W^T  (s: a half scale per group of a row: the GDN out_proj)
//   gemm_q4_bf16                        y = bfloat(x W^T)  (the GDN z, the attention's q|gate, k, v)
//   gemm_swiglu_q4                      y = bfloat(g[m] * silu(x Wg^T) * (x Wu^T))  (g: a row scale)
// (the grouped expert GEMMs, moe_gemm_*, are in metal/moe_prefill.metal). A threadgroup
// computes a BM x BN block of the output. Per step of kGemmBK = 64 columns of k it copies
// BM bfloat activation rows and dequantizes BN weight rows (gate and up: two weight tiles)
// to bfloat in threadgroup memory (gemm_tiles.h), then each simdgroup multiplies its
// (8 FM) x (8 FN) block with 8x8 bfloat simdgroup_matrix products (MSL 3.1, every Apple GPU
// family Lily runs on) accumulated in fp32 registers. The dequantized weight never leaves
// threadgroup memory. At the end the accumulators are staged through threadgroup memory and
// stored as scalars (any row stride, edges, scatter; gemm_swiglu_q4 and gemm_q4_bf16 store
// bfloat).
#include <metal_stdlib>
using namespace metal;

#include "common.h"
#include "gemm_tiles.h"
#include "prefill_args.h"

// ---- dense GEMMs -------------------------------------------------------------------------
// Grid (ceil(n / BN), ceil(m / BM)) threadgroups of 32 * SM * SN threads: threadgroup
// (i, j) computes y rows [j BM, j BM + BM) x columns [i BN, i BN + BN).
// x: an A source (gemm_tiles.h: bfloat rows, or GemmAScaled).
// NB = 1: y = x W^T (ADD: y += x W^T); NB = 2: y = silu(x W0^T) * (x W1^T). With a row
// scale g (not null), each result of row r is multiplied by g[r * ldg] before it is stored.
template <int BITS, uint NB, bool ADD, uint BM, uint BN, uint SM, uint SN, typename XS, typename Y>
inline void gemm_dense(threadgroup float4* smem4, device const uint* w0, device const bfloat* s0,
                       device const bfloat* b0, device const uint* w1, device const bfloat* s1,
                       device const bfloat* b1, XS x, device Y* y,
                       constant GemmArgs& args, uint2 tgp, uint tid, uint sg,
                       device const float* g = nullptr, uint ldg = 0) {
  constexpr uint NT = 32 * SM * SN;
  const uint n0 = tgp.x * BN;
  const uint m0 = tgp.y * BM;
  if (n0 >= args.n || m0 >= args.m) {
    return;  // the whole threadgroup (a grid larger than needed)
  }
  const uint rows = min(BM, args.m - m0);
  const GemmARows<BM, NT> a = gemm_a_rows<BM, NT>(GemmDenseRows{m0, args.m, args.lda}, tid);
  gemm_accumulate<BITS, NB, BM, BN, SM, SN>(smem4, x, a, w0, s0, b0, w1, s1, b1, n0, args.n,
                                            args.k, rows, tid, sg);
  const threadgroup float* smem = (const threadgroup float*)smem4;
  const GemmRowSink<ADD, Y> sink{y + m0 * args.ldy + n0, args.ldy, g ? g + m0 * ldg : nullptr, ldg};
  for (uint i = tid; i < BM * BN; i += NT) {
    const uint r = i / BN;
    const uint c = i % BN;
    if (r < rows && n0 + c < args.n) {
      sink.put(r, c, gemm_staged<NB, BM, BN>(smem, r, c));
    }
  }
}

// Dense configuration (kGemmBM, kGemmBN, kGemmSwigluBN, kGemmThreads: gemm_args.h): 2 x 2
// simdgroups of 32 x 32 (4 x 4 fragments); SwiGLU 4 x 1 simdgroups of 16 x 32 (64 weight rows
// per step as well).

// x: bfloat rows (gemm_q4, gemm_q8: the normed rows xn; gemm_q4_add_h: the attention output
// and the shared expert's hidden). Y: float, or bfloat (gemm_q4_bf16: the sums rounded to
// bfloat; never ADD).
template <int BITS, bool ADD, typename Y = float>
[[max_total_threads_per_threadgroup(kGemmThreads)]] kernel void gemm_q(device const uint4* w [[buffer(0)]],        // W.weight uint32 [n, k*BITS/32]
                   device const bfloat* scales [[buffer(1)]],  // [n, k/64]
                   device const bfloat* biases [[buffer(2)]],  // [n, k/64]
                   device const bfloat* x [[buffer(3)]],       // bfloat [m, lda]
                   device Y* y [[buffer(4)]],                  // fp32 or bfloat [m, ldy] (read too when ADD)
                   constant GemmArgs& args [[buffer(5)]],
                   uint2 tgp [[threadgroup_position_in_grid]],
                   uint tid [[thread_index_in_threadgroup]],
                   uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 smem4[GemmSmem<kGemmBM, kGemmBN, 1>::float4s];
  device const uint* wu = (device const uint*)w;
  gemm_dense<BITS, 1, ADD, kGemmBM, kGemmBN, kGemmSM, kGemmSN>(smem4, wu, scales, biases, wu, scales, biases,
                                                  x, y, args, tgp, tid, sg);
}
template [[host_name("gemm_q4")]] [[kernel]] decltype(gemm_q<4, false>) gemm_q<4, false>;
template [[host_name("gemm_q8")]] [[kernel]] decltype(gemm_q<8, false>) gemm_q<8, false>;
template [[host_name("gemm_q4_add_h")]] [[kernel]] decltype(gemm_q<4, true>) gemm_q<4, true>;
template [[host_name("gemm_q4_bf16")]] [[kernel]] decltype(gemm_q<4, false, bfloat>) gemm_q<4, false, bfloat>;

// y += (x * s) W^T: x bfloat [m, lda] whose element i is scaled by s[i >> shift] while staged
// (GemmAScaled; prefill_args.h GemmAScaleArgs). The GDN out_proj: u times gdn_norm_scale's
// factors, one per (token, head, scan split) (metal/gdn_prefill.metal).
[[max_total_threads_per_threadgroup(kGemmThreads)]] kernel void gemm_q4_add_hs(device const uint4* w [[buffer(0)]],        // W.weight uint32 [n, k/8]
                           device const bfloat* scales [[buffer(1)]],  // [n, k/64]
                           device const bfloat* biases [[buffer(2)]],  // [n, k/64]
                           device const bfloat* x [[buffer(3)]],       // bfloat [m, lda]
                           device float* y [[buffer(4)]],              // fp32 [m, ldy], read and written
                           constant GemmArgs& args [[buffer(5)]],
                           device const half* s [[buffer(6)]],         // half [m, lda >> shift]
                           constant GemmAScaleArgs& sa [[buffer(7)]],
                           uint2 tgp [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 smem4[GemmSmem<kGemmBM, kGemmBN, 1>::float4s];
  device const uint* wu = (device const uint*)w;
  gemm_dense<4, 1, true, kGemmBM, kGemmBN, kGemmSM, kGemmSN>(smem4, wu, scales, biases, wu, scales, biases,
                                                GemmAScaled{x, s, sa.shift}, y, args, tgp, tid, sg);
}

// The shared expert's gate/up, scaled per row by the shared expert gate:
// y = bfloat(g[m * ldg] * silu(x Wg^T) * (x Wu^T)), Wg and Wu both [n, k]. g is the routing
// weights' last column (sigmoid of the shared gate logit, written by moe_route_topk), so the
// shared down projection can add its product straight into the residual (gemm_q4_add_h).
[[max_total_threads_per_threadgroup(kGemmThreads)]] kernel void gemm_swiglu_q4(device const uint4* wg [[buffer(0)]],       // gate_proj.weight [n, k/8]
                           device const bfloat* gs [[buffer(1)]],      // gate_proj.scales [n, k/64]
                           device const bfloat* gb [[buffer(2)]],      // gate_proj.biases [n, k/64]
                           device const uint4* wu [[buffer(3)]],       // up_proj.weight [n, k/8]
                           device const bfloat* us [[buffer(4)]],      // up_proj.scales
                           device const bfloat* ub [[buffer(5)]],      // up_proj.biases
                           device const bfloat* x [[buffer(6)]],       // bfloat [m, lda]
                           device bfloat* y [[buffer(7)]],             // bfloat [m, ldy]
                           constant GemmArgs& args [[buffer(8)]],
                           device const float* g [[buffer(9)]],        // row scale, row r at g[r * ldg]
                           constant GemmRowScaleArgs& gs_args [[buffer(10)]],
                           uint2 tgp [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float4 smem4[GemmSmem<kGemmBM, kGemmSwigluBN, 2>::float4s];
  gemm_dense<4, 2, false, kGemmBM, kGemmSwigluBN, kGemmSwigluSM, kGemmSwigluSN>(smem4, (device const uint*)wg, gs, gb,
                                                 (device const uint*)wu, us, ub, x, y, args, tgp,
                                                 tid, sg, g, gs_args.ldg);
}
