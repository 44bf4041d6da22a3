// The sparse MoE block of the decode step (batch 1), in three dispatches after the router
// GEMV (gemv_q8 on mlp.gate):
//   moe_route              softmax -> top-k -> renormalise; plus the shared-expert gate
//   moe_gate_up_swiglu_q4  h_j = silu(Wg_j x) * (Wu_j x) for the k experts and the shared one
//   moe_down_q4            residual += sum_j w_j Wd_j h_j + sigmoid(g_s) Wd_s h_s
// or in two after norm_gemv_q8 (router + shared gate rows, xn out):
//   moe_route_gate_up_swiglu_q4  the routing recomputed per simdgroup (no barrier), then gate/up
//   moe_down_q4
// A batched decode step (issue 31) runs two, each over all its rows:
//   moe_route_gate_up_batch_q4_b*  each row's routing (as the fused kernel's), then each expert
//                                  of the union of the rows' picks and the shared expert read
//                                  once, applied to every row that picked it
//   moe_down_batch_q4_b*           the down projections of the same union and the shared
//                                  expert, each read once
// Host-side facts (grid, threadgroup, buffers and byte ranges): docs/kernels.md.
#include <metal_stdlib>
using namespace metal;

#include "common.h"
#include "batch_args.h"
#include "route.h"  // route_topk (shared with prefill), route_topk_simd: router softmax + top-k

// ---- moe_route ------------------------------------------------------------------------
// One threadgroup of 32..1024 threads (>= top_k; round_up(experts, 32) recommended).
//   p = softmax(logits) in fp32; the k largest p in descending order, ties to the lower
//   index (numpy argsort(-p, kind="stable")); w_j = p_j / sum(p_top) when norm_topk.
// The shared-expert gate (an 8-bit [1, hidden] row) is one dot product over x; it is
// computed here, so the MoE block needs no extra dispatch for it:
//   weights[top_k] = sigmoid(shared_expert_gate . x).
[[max_total_threads_per_threadgroup(1024)]] kernel void moe_route(device const float* logits [[buffer(0)]],   // [experts] router output
                      device const float4* x [[buffer(1)]],       // [hidden] normalised input
                      device const uint* gate_w [[buffer(2)]],    // shared_expert_gate.weight [1, hidden/4] (8-bit)
                      device const bfloat* gate_s [[buffer(3)]],  // shared_expert_gate.scales [1, hidden/64]
                      device const bfloat* gate_b [[buffer(4)]],  // shared_expert_gate.biases [1, hidden/64]
                      device uint* ids [[buffer(5)]],             // [top_k] selected experts
                      device float* weights [[buffer(6)]],        // [top_k + 1] routing weights, shared gate
                      constant RouteArgs& args [[buffer(7)]],
                      uint tid [[thread_position_in_threadgroup]],
                      uint tcount [[threads_per_threadgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]],
                      uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float probs[kRouteMaxExperts];
  threadgroup float rowsum[32];
  threadgroup float scratch[32];
  threadgroup float best_p[32];
  threadgroup uint best_i[32];
  const uint n = min(args.experts, kRouteMaxExperts);
  const uint k = args.top_k;

  const RoutePicks pk = route_topk(logits, n, k, 0u, probs, rowsum, scratch, best_p, best_i, tid,
                                   tcount, sg, lane, nsg);
  if (tid < k) {
    ids[tid] = pk.my_id;
    weights[tid] = args.norm_topk ? pk.my_p / pk.top_sum : pk.my_p;
  }

  // shared-expert gate: 8-bit row . x (four codes per word, one float4 of x)
  const uint words = args.hidden / 4;
  float d = 0.0f;
  for (uint i = tid; i < words; i += tcount) {
    const uint q = gate_w[i];
    const float4 xv = x[i];
    const uint g = i * 4 / kQuantGroup;
    const float4 qf = float4((uint4(q) >> uint4(0u, 8u, 16u, 24u)) & uint4(0xFFu));
    d += float(gate_s[g]) * dot(qf, xv) + float(gate_b[g]) * ((xv.x + xv.y) + (xv.z + xv.w));
  }
  d = threadgroup_sum(d, scratch, sg, lane, nsg);
  if (tid == 0) {
    weights[k] = sigmoid(d);
  }
}

// ---- gate/up rows of one slot (the gate/up kernels, batch 1 and batched) ----------------
// Rows of one slot (gate/up matrices gw.., uw.. of `rows` rows: an expert's or the shared
// expert's) owned by this simdgroup of threadgroup column tgx, for nb <= NR vectors x_i =
// x + xo[i] (float4s): h[ho[i] + row] = silu(Wg x_i)[row] * (Wu x_i)[row]. Each weight chunk
// is loaded once and applied to every vector, each in the order of NR = 1, so a batched row's
// h is bit for bit its batch-1 one.
template <uint NR>
inline void gate_up_rows(device const float4* x, thread const uint* xo, device float* h,
                         thread const uint* ho, uint nb, device const uint4* gw,
                         device const bfloat* gs, device const bfloat* gb, device const uint4* uw,
                         device const bfloat* us, device const bfloat* ub, uint hidden, uint rows,
                         uint tgx, uint sg, uint nsg, uint lane) {
  const uint chunks = hidden / 32;  // 4-bit: 32 codes per 16-byte chunk
  const uint groups = hidden / kQuantGroup;
  const QTeam t = q_team(chunks, kGateUpRowsPerSimdgroup, lane);
  const uint row0 = (tgx * nsg + sg) * kGateUpRowsPerSimdgroup + t.team * t.rows;
  const uint nrows = row0 < rows ? min(t.rows, rows - row0) : 0u;

  float ag[NR][8];
  float au[NR][8];
  for (uint b = 0; b < NR; ++b) {
    for (uint r = 0; r < 8; ++r) {
      ag[b][r] = 0.0f;
      au[b][r] = 0.0f;
    }
  }
  if (nrows > 0) {
    for (uint c = t.lane; c < chunks; c += t.size) {
      QChunkRows wg;
      QChunkRows wu;
      q_chunk_load<4>(gw, gs, gb, chunks, groups, row0, nrows, c, wg);
      q_chunk_load<4>(uw, us, ub, chunks, groups, row0, nrows, c, wu);
      for (uint b = 0; b < NR; ++b) {
        if (b < nb) {
          float4 xs[QChunk<4>::float4s];
          const float xsum = q_load_x<4>(x + xo[b], c, 1.0f, xs);
          q_chunk_fma<4>(wg, nrows, xs, xsum, ag[b]);
          q_chunk_fma<4>(wu, nrows, xs, xsum, au[b]);
        }
      }
    }
  }
  for (uint b = 0; b < NR; ++b) {
    if (b < nb) {  // uniform: every lane runs the same team reductions
      const float g = team_reduce_rows(ag[b], t);
      const float u = team_reduce_rows(au[b], t);
      if (t.lane < nrows) {
        h[ho[b] + row0 + t.lane] = silu(g) * u;
      }
    }
  }
}

// Rows of slot `slot` (expert e, or the shared expert when shared) of one vector x, as the
// batch-1 gate/up kernels compute them: h[slot * inter + row].
inline void gate_up_slot(device const float4* x, uint slot, bool shared, uint e,
                         device const uint4* gate_w, device const bfloat* gate_s,
                         device const bfloat* gate_b, device const uint4* up_w,
                         device const bfloat* up_s, device const bfloat* up_b,
                         device const uint4* sgate_w, device const bfloat* sgate_s,
                         device const bfloat* sgate_b, device const uint4* sup_w,
                         device const bfloat* sup_s, device const bfloat* sup_b, device float* h,
                         uint hidden, uint inter, uint inter_shared, uint tgx, uint sg, uint nsg,
                         uint lane) {
  const uint rows = shared ? inter_shared : inter;
  const uint wo = e * rows * (hidden / 32);          // expert offset in chunks
  const uint so = e * rows * (hidden / kQuantGroup);  // expert offset in groups
  const uint xo[1] = {0u};
  const uint ho[1] = {slot * inter};
  gate_up_rows<1>(x, xo, h, ho, 1u, shared ? sgate_w : gate_w + wo, shared ? sgate_s : gate_s + so,
                  shared ? sgate_b : gate_b + so, shared ? sup_w : up_w + wo,
                  shared ? sup_s : up_s + so, shared ? sup_b : up_b + so, hidden, rows, tgx, sg,
                  nsg, lane);
}

// ---- moe_gate_up_swiglu_q4 ------------------------------------------------------------
// Threadgroup grid (ceil(max(inter, inter_shared) / (4 * simdgroups)), top_k + 1): y = slot
// j (expert ids[j] for j < top_k, the shared expert for j = top_k). Each simdgroup owns
// kGateUpRowsPerSimdgroup rows of the slot; its teams compute the gate and the up dot
// of a row together from one load of x, and store h = silu(gate) * up. Nothing but h
// leaves registers.
[[max_total_threads_per_threadgroup(256)]] kernel void moe_gate_up_swiglu_q4(
    device const float4* x [[buffer(0)]],        // [hidden] normalised input
    device const uint* ids [[buffer(1)]],        // [top_k] from moe_route
    device const uint4* gate_w [[buffer(2)]],    // switch_mlp.gate_proj.weight [E, inter, hidden/8]
    device const bfloat* gate_s [[buffer(3)]],   // switch_mlp.gate_proj.scales [E, inter, hidden/64]
    device const bfloat* gate_b [[buffer(4)]],   // switch_mlp.gate_proj.biases
    device const uint4* up_w [[buffer(5)]],      // switch_mlp.up_proj.weight [E, inter, hidden/8]
    device const bfloat* up_s [[buffer(6)]],     // switch_mlp.up_proj.scales
    device const bfloat* up_b [[buffer(7)]],     // switch_mlp.up_proj.biases
    device const uint4* sgate_w [[buffer(8)]],   // shared_expert.gate_proj.weight [inter_shared, hidden/8]
    device const bfloat* sgate_s [[buffer(9)]],  // shared_expert.gate_proj.scales
    device const bfloat* sgate_b [[buffer(10)]], // shared_expert.gate_proj.biases
    device const uint4* sup_w [[buffer(11)]],    // shared_expert.up_proj.weight [inter_shared, hidden/8]
    device const bfloat* sup_s [[buffer(12)]],   // shared_expert.up_proj.scales
    device const bfloat* sup_b [[buffer(13)]],   // shared_expert.up_proj.biases
    device float* h [[buffer(14)]],              // [top_k * inter + inter_shared] fp32
    constant MoeArgs& args [[buffer(15)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint slot = tg.y;
  const bool shared = slot >= args.top_k;
  const uint e = shared ? 0u : min(ids[slot], args.experts - 1u);
  gate_up_slot(x, slot, shared, e, gate_w, gate_s, gate_b, up_w, up_s, up_b, sgate_w, sgate_s,
               sgate_b, sup_w, sup_s, sup_b, h, args.hidden, args.inter, args.inter_shared, tg.x,
               sg, nsg, lane);
}

// ---- moe_route_gate_up_swiglu_q4 ------------------------------------------------------
// moe_route fused into moe_gate_up_swiglu_q4 (one dispatch and one barrier stage fewer).
// Same grid and hbuf as moe_gate_up_swiglu_q4. Every simdgroup of routed slot j computes
// the router softmax and the first j+1 top-k rounds from the logits itself
// (route_topk_simd: registers and shuffles, no threadgroup memory, no barrier; 8 registers
// per lane for up to 256 experts, each round a 3-level tree over them and two reductions), so
// its first weight load waits for no other simdgroup; the shared-slot threadgroups skip the
// routing. Simdgroup 0 of threadgroup (0, 0) runs all k rounds and stores ids [k] and
// weights [k+1] for moe_down_q4, with weights[k] = sigmoid(logits[experts]): the
// shared-expert gate logit is row E of the router output (norm_gemv_q8 with mlp.gate and
// mlp.shared_expert_gate). The picks and weights are bit-identical to moe_route's on the
// same logits.
[[max_total_threads_per_threadgroup(256)]] kernel void moe_route_gate_up_swiglu_q4(
    device const float4* x [[buffer(0)]],        // [hidden] normalised input (xn)
    device const float* logits [[buffer(1)]],    // [experts + 1] router logits, then the shared gate logit
    device const uint4* gate_w [[buffer(2)]],    // switch_mlp.gate_proj.weight [E, inter, hidden/8]
    device const bfloat* gate_s [[buffer(3)]],   // switch_mlp.gate_proj.scales [E, inter, hidden/64]
    device const bfloat* gate_b [[buffer(4)]],   // switch_mlp.gate_proj.biases
    device const uint4* up_w [[buffer(5)]],      // switch_mlp.up_proj.weight [E, inter, hidden/8]
    device const bfloat* up_s [[buffer(6)]],     // switch_mlp.up_proj.scales
    device const bfloat* up_b [[buffer(7)]],     // switch_mlp.up_proj.biases
    device const uint4* sgate_w [[buffer(8)]],   // shared_expert.gate_proj.weight [inter_shared, hidden/8]
    device const bfloat* sgate_s [[buffer(9)]],  // shared_expert.gate_proj.scales
    device const bfloat* sgate_b [[buffer(10)]], // shared_expert.gate_proj.biases
    device const uint4* sup_w [[buffer(11)]],    // shared_expert.up_proj.weight [inter_shared, hidden/8]
    device const bfloat* sup_s [[buffer(12)]],   // shared_expert.up_proj.scales
    device const bfloat* sup_b [[buffer(13)]],   // shared_expert.up_proj.biases
    device float* h [[buffer(14)]],              // [top_k * inter + inter_shared] fp32
    device uint* ids [[buffer(15)]],             // [top_k] selected experts (threadgroup (0, 0))
    device float* weights [[buffer(16)]],        // [top_k + 1] routing weights, shared gate (threadgroup (0, 0))
    constant MoeRouteArgs& args [[buffer(17)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint n = min(args.experts, kRouteMaxExperts);
  const uint k = args.top_k;
  const uint slot = tg.y;
  const bool shared = slot >= k;
  const bool leader = tg.x == 0 && tg.y == 0;
  // uniform over each simdgroup (its shuffles); only the leader's simdgroup 0 needs all k
  const uint rounds = shared ? 0u : (leader && sg == 0 ? k : slot + 1);
  uint e = 0;
  if (rounds > 0) {
    const RoutePicks pk = n <= 32 * kRouteSimdRowsSmall
                              ? route_topk_simd<kRouteSimdRowsSmall>(logits, n, rounds, slot, lane)
                              : route_topk_simd<kRouteSimdRowsMax>(logits, n, rounds, slot, lane);
    if (leader && sg == 0) {
      if (lane < k) {
        ids[lane] = pk.my_id;
        weights[lane] = args.norm_topk ? pk.my_p / pk.top_sum : pk.my_p;
      }
      if (lane == 0) {
        weights[k] = sigmoid(logits[args.experts]);
      }
    }
    e = min(pk.want_id, args.experts - 1u);  // the pick of round `slot`
  }
  gate_up_slot(x, slot, shared, e, gate_w, gate_s, gate_b, up_w, up_s, up_b, sgate_w, sgate_s,
               sgate_b, sup_w, sup_s, sup_b, h, args.hidden, args.inter, args.inter_shared, tg.x,
               sg, nsg, lane);
}

// ---- moe_down_q4 ----------------------------------------------------------------------
// residual[r] += sum_{j<k} w_j (Wd_{ids[j]} h_j)[r] + w_k (Wd_shared h_k)[r], w = weights
// from moe_route (w_k = the shared-expert gate). The (slot, chunk) pairs of all k+1 slots
// form one index space that the lanes of a team stride over, so small intermediate sizes
// still keep every lane busy; w_j is folded into the x chunk. Threadgroup grid
// ceil(hidden / (kGemvRowsPerSimdgroup * simdgroups / kGemvSplitK)) of a multiple of 64 threads; each group of kGemvRowsPerSimdgroup rows of the residual is
// shared by kGemvSplitK simdgroups (split ks: the runs ks, ks + 2, ... of the index space; gemv_q's
// split-K, joined by q_split_join).
//
// moe_down_body<NR>: that work for nb <= NR rows of a batched decode step (threadgroups of 64
// threads: kGemvRowsPerSimdgroup rows each), row b's h, ids, weights and residual at + b * their
// stride, each expert of the union of the rows' picks read once. A row's batch-1 sums
// interleave its slots lane by lane, so the work goes in two phases: each (expert of the union,
// chunk) and (shared expert, chunk) is loaded once, by one thread, and its term for each of the
// threadgroup's rows and each row b that picked it (w_j folded into x as in the batch-1 loop)
// is stored in terms [NR, total, kGemvRowsPerSimdgroup]; then every lane adds its rows' terms
// in the batch-1 order (the same (slot, chunk) runs), so each row's sums are bit for bit its
// batch-1 ones. picks / owner: NR * 32 uints each; part: NR * kSplitJoinMax floats.
template <uint NR>
inline void moe_down_body(device const float4* h, uint h_stride, device const uint* ids,
                          uint ids_stride, device const float* weights, uint w_stride,
                          device const uint4* down_w, device const bfloat* down_s,
                          device const bfloat* down_b, device const uint4* sdown_w,
                          device const bfloat* sdown_s, device const bfloat* sdown_b,
                          device float* residual, uint r_stride, uint nb, constant MoeArgs& args,
                          threadgroup float* part, threadgroup float* terms,
                          threadgroup uint* picks, threadgroup uint* owner, uint tg, uint tid,
                          uint tcount, uint sg, uint nsg, uint lane) {
  const uint k = args.top_k;
  const uint chunks = args.inter / 32;
  const uint groups = args.inter / kQuantGroup;
  const uint schunks = args.inter_shared / 32;
  const uint sgroups = args.inter_shared / kQuantGroup;
  const uint routed = k * chunks;
  const uint total = routed + schunks;

  const QTeam t = q_team(total, kGemvRowsPerSimdgroup, lane);
  const uint ks = sg % kGemvSplitK;
  const uint slot = sg / kGemvSplitK * kGemvRowsPerSimdgroup + t.team * t.rows;  // within the threadgroup
  const uint row0 = tg * (nsg / kGemvSplitK) * kGemvRowsPerSimdgroup + slot;
  const uint nrows = row0 < args.hidden ? min(t.rows, args.hidden - row0) : 0u;

  float acc[NR][8];
  for (uint b = 0; b < NR; ++b) {
    for (uint r = 0; r < 8; ++r) {
      acc[b][r] = 0.0f;
    }
  }
  if (NR == 1) {
    if (nrows > 0) {
      for (uint f = t.lane + ks * t.size; f < total; f += kGemvSplitK * t.size) {
        const bool shared = f >= routed;
        const uint j = shared ? k : f / chunks;
        const uint c = shared ? f - routed : f - j * chunks;
        const uint e = shared ? 0u : min(ids[j], args.experts - 1u);
        device const uint4* w = shared ? sdown_w : down_w + e * args.hidden * chunks;
        device const bfloat* s = shared ? sdown_s : down_s + e * args.hidden * groups;
        device const bfloat* bb = shared ? sdown_b : down_b + e * args.hidden * groups;
        float4 xs[QChunk<4>::float4s];
        const float xsum = q_load_x<4>(h + j * args.inter / 4, c, weights[j], xs);
        q_chunk_rows<4>(w, s, bb, shared ? schunks : chunks, shared ? sgroups : groups, row0,
                        nrows, c, xs, xsum, acc[0]);
      }
    }
  } else {
    // the rows' picks (clamped as above), and which entry is its expert's first pick
    const uint entries = nb * k;
    for (uint i = tid; i < entries; i += tcount) {
      picks[i] = min(ids[(i / k) * ids_stride + i % k], args.experts - 1u);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = tid; i < entries; i += tcount) {
      uint seen = 0;
      for (uint s = 0; s < i; ++s) {
        seen |= picks[s] == picks[i] ? 1u : 0u;
      }
      owner[i] = 1u - seen;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // phase 1: each (owned expert or the shared one, chunk) once, its terms for every row using it
    const uint trow0 = tg * kGemvRowsPerSimdgroup;
    const uint tn = trow0 < args.hidden ? min(kGemvRowsPerSimdgroup, args.hidden - trow0) : 0u;
    const uint items = entries * chunks + schunks;
    for (uint i = tid; i < items && tn > 0; i += tcount) {
      const bool shared = i >= entries * chunks;
      const uint u = shared ? 0u : i / chunks;
      const uint c = shared ? i - entries * chunks : i % chunks;
      if (!shared && owner[u] == 0) {
        continue;
      }
      const uint e = shared ? 0u : picks[u];
      QChunkRows wr;
      q_chunk_load<4>(shared ? sdown_w : down_w + e * args.hidden * chunks,
                      shared ? sdown_s : down_s + e * args.hidden * groups,
                      shared ? sdown_b : down_b + e * args.hidden * groups,
                      shared ? schunks : chunks, shared ? sgroups : groups, trow0, tn, c, wr);
      for (uint b = 0; b < nb; ++b) {
        uint j = shared ? k : kMoeNoSlot;
        for (uint jj = 0; !shared && jj < k; ++jj) {
          j = picks[b * k + jj] == e ? jj : j;
        }
        if (j == kMoeNoSlot) {
          continue;
        }
        float4 xs[QChunk<4>::float4s];
        const float xsum =
            q_load_x<4>(h + b * h_stride + j * args.inter / 4, c, weights[b * w_stride + j], xs);
        threadgroup float* out = terms + (b * total + (shared ? routed + c : j * chunks + c)) * kGemvRowsPerSimdgroup;
        for (uint r = 0; r < kGemvRowsPerSimdgroup; ++r) {
          if (r < tn) {
            out[r] = wr.s[r] * q_dot_chunk<4>(wr.q[r], xs) + wr.b[r] * xsum;  // q_chunk_fma's term
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // phase 2: each lane's (slot, chunk) runs in the batch-1 order
    if (nrows > 0) {
      for (uint f = t.lane + ks * t.size; f < total; f += kGemvSplitK * t.size) {
        for (uint b = 0; b < NR; ++b) {
          for (uint r = 0; r < 8; ++r) {
            if (b < nb && r < nrows) {
              acc[b][r] += terms[(b * total + f) * kGemvRowsPerSimdgroup + slot + r];
            }
          }
        }
      }
    }
  }
  for (uint b = 0; b < NR; ++b) {
    if (b < nb) {  // uniform: every thread joins the same splits
      float v = team_reduce_rows(acc[b], t);
      if (q_split_join(v, part + b * kSplitJoinMax, t.lane, nrows, slot, ks, kGemvSplitK) &&
          t.lane < nrows) {
        residual[b * r_stride + row0 + t.lane] += v;
      }
    }
  }
}

[[max_total_threads_per_threadgroup(256)]] kernel void moe_down_q4(device const float4* h [[buffer(0)]],         // [top_k * inter + inter_shared]
                        device const uint* ids [[buffer(1)]],          // [top_k]
                        device const float* weights [[buffer(2)]],     // [top_k + 1]
                        device const uint4* down_w [[buffer(3)]],      // switch_mlp.down_proj.weight [E, hidden, inter/8]
                        device const bfloat* down_s [[buffer(4)]],     // [E, hidden, inter/64]
                        device const bfloat* down_b [[buffer(5)]],
                        device const uint4* sdown_w [[buffer(6)]],     // shared_expert.down_proj.weight [hidden, inter_shared/8]
                        device const bfloat* sdown_s [[buffer(7)]],    // [hidden, inter_shared/64]
                        device const bfloat* sdown_b [[buffer(8)]],
                        device float* residual [[buffer(9)]],          // [hidden] fp32, updated in place
                        constant MoeArgs& args [[buffer(10)]],
                        uint tg [[threadgroup_position_in_grid]],
                        uint sg [[simdgroup_index_in_threadgroup]],
                        uint nsg [[simdgroups_per_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float part[kSplitJoinMax];
  threadgroup uint none[1];  // the batched phases' arrays, unused by one row
  moe_down_body<1>(h, 0u, ids, 0u, weights, 0u, down_w, down_s, down_b, sdown_w, sdown_s, sdown_b,
                   residual, 0u, 1u, args, part, part, none, none, tg, 0u, 1u, sg, nsg, lane);
}

// ---- batched decode (issue 31): the shared expert and the down projection of several rows ----
// Bindings: the batch-1 kernel's, its buffers holding the rows one after another (strides in
// MoeBatchArgs, batch_args.h), and that struct after the batch-1 one.

// moe_route_gate_up_swiglu_q4 of nb = bargs.rows <= NR rows, each expert of the union of the
// rows' picks read once: threadgroup grid (ceil(max(inter, inter_shared) / (kGateUpRowsPerSimdgroup
// * simdgroups)), rows * top_k + 1). Column y = b * top_k + j < rows * top_k is row b's slot j:
// every simdgroup routes row b as the batch-1 kernel does (route_topk_simd, j + 1 rounds; the
// leader, threadgroup (0, b * top_k) simdgroup 0, all k, storing row b's ids and weights), so
// it has expert e. Then, from each other row's router logits, the round at which that row
// picks e (route_rank_simd: no row's picks need another's stores, so no barrier stage): a
// column whose expert an earlier row also picked stops (that row's column serves it), the
// others load e's gate/up chunks once for row b and every later row that picked e, each into
// its own slot. The last column is the shared expert for every row (slot top_k). Each row's
// ids, weights and h are bit for bit its batch-1 dispatch's (gate_up_rows, the same routing);
// rows whose router probabilities hold fewer than top_k finite values (NaN logits) may differ.
template <uint NR>
[[max_total_threads_per_threadgroup(256)]] kernel void moe_route_gate_up_batch_q4(
    device const float4* x [[buffer(0)]],        // [rows, x_stride] normalised inputs (xn)
    device const float* logits [[buffer(1)]],    // [rows, logits_stride] router logits | shared gate logit
    device const uint4* gate_w [[buffer(2)]],    // switch_mlp.gate_proj.weight [E, inter, hidden/8]
    device const bfloat* gate_s [[buffer(3)]],   // switch_mlp.gate_proj.scales [E, inter, hidden/64]
    device const bfloat* gate_b [[buffer(4)]],   // switch_mlp.gate_proj.biases
    device const uint4* up_w [[buffer(5)]],      // switch_mlp.up_proj.weight [E, inter, hidden/8]
    device const bfloat* up_s [[buffer(6)]],     // switch_mlp.up_proj.scales
    device const bfloat* up_b [[buffer(7)]],     // switch_mlp.up_proj.biases
    device const uint4* sgate_w [[buffer(8)]],   // shared_expert.gate_proj.weight [inter_shared, hidden/8]
    device const bfloat* sgate_s [[buffer(9)]],  // shared_expert.gate_proj.scales
    device const bfloat* sgate_b [[buffer(10)]], // shared_expert.gate_proj.biases
    device const uint4* sup_w [[buffer(11)]],    // shared_expert.up_proj.weight [inter_shared, hidden/8]
    device const bfloat* sup_s [[buffer(12)]],   // shared_expert.up_proj.scales
    device const bfloat* sup_b [[buffer(13)]],   // shared_expert.up_proj.biases
    device float* h [[buffer(14)]],              // [rows, h_stride] fp32 [top_k * inter + inter_shared] each
    device uint* ids [[buffer(15)]],             // [rows, ids_stride] selected experts (leaders)
    device float* weights [[buffer(16)]],        // [rows, w_stride] routing weights, shared gate (leaders)
    constant MoeRouteArgs& args [[buffer(17)]], constant MoeBatchArgs& bargs [[buffer(18)]],
    uint2 tg [[threadgroup_position_in_grid]], uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  const uint n = min(args.experts, kRouteMaxExperts);
  const uint k = args.top_k;
  const uint rows = min(bargs.rows, NR);
  const bool shared = tg.y >= rows * k;
  const uint row = shared ? 0u : tg.y / k;
  const uint slot = shared ? k : tg.y % k;
  uint xo[NR];
  uint ho[NR];
  uint nb = 0;
  uint e = 0;
  if (shared) {
    for (uint b = 0; b < rows; ++b) {
      xo[b] = b * (bargs.x_stride / 4);
      ho[b] = b * bargs.h_stride + k * args.inter;
    }
    nb = rows;
  } else {
    const bool leader = tg.x == 0 && slot == 0 && sg == 0;
    device const float* lg = logits + row * bargs.logits_stride;
    const RoutePicks pk = n <= 32 * kRouteSimdRowsSmall
                              ? route_topk_simd<kRouteSimdRowsSmall>(lg, n, leader ? k : slot + 1, slot, lane)
                              : route_topk_simd<kRouteSimdRowsMax>(lg, n, leader ? k : slot + 1, slot, lane);
    if (leader) {
      if (lane < k) {
        ids[row * bargs.ids_stride + lane] = pk.my_id;
        weights[row * bargs.w_stride + lane] = args.norm_topk ? pk.my_p / pk.top_sum : pk.my_p;
      }
      if (lane == 0) {
        weights[row * bargs.w_stride + k] = sigmoid(lg[args.experts]);
      }
    }
    e = min(pk.want_id, args.experts - 1u);
    xo[0] = row * (bargs.x_stride / 4);
    ho[0] = row * bargs.h_stride + slot * args.inter;
    nb = 1;
    for (uint b = 0; b < rows; ++b) {  // uniform over the threadgroup
      if (b == row) {
        continue;
      }
      float p[kRouteSimdRowsMax];
      uint at;
      if (n <= 32 * kRouteSimdRowsSmall) {
        route_probs_simd<kRouteSimdRowsSmall>(logits + b * bargs.logits_stride, n, lane, p);
        at = route_rank_simd<kRouteSimdRowsSmall>(p, e, lane);
      } else {
        route_probs_simd<kRouteSimdRowsMax>(logits + b * bargs.logits_stride, n, lane, p);
        at = route_rank_simd<kRouteSimdRowsMax>(p, e, lane);
      }
      if (at < k) {
        if (b < row) {
          return;  // row b's column serves e (uniform: no barriers follow)
        }
        xo[nb] = b * (bargs.x_stride / 4);
        ho[nb] = b * bargs.h_stride + at * args.inter;
        ++nb;
      }
    }
  }
  const uint rows_w = shared ? args.inter_shared : args.inter;
  const uint wo = e * rows_w * (args.hidden / 32);
  const uint so = e * rows_w * (args.hidden / kQuantGroup);
  gate_up_rows<NR>(x, xo, h, ho, nb, shared ? sgate_w : gate_w + wo, shared ? sgate_s : gate_s + so,
                   shared ? sgate_b : gate_b + so, shared ? sup_w : up_w + wo,
                   shared ? sup_s : up_s + so, shared ? sup_b : up_b + so, args.hidden, rows_w, tg.x,
                   sg, nsg, lane);
}
template [[host_name("moe_route_gate_up_batch_q4_b2")]] [[kernel]] decltype(moe_route_gate_up_batch_q4<2>) moe_route_gate_up_batch_q4<2>;
template [[host_name("moe_route_gate_up_batch_q4_b4")]] [[kernel]] decltype(moe_route_gate_up_batch_q4<4>) moe_route_gate_up_batch_q4<4>;
template [[host_name("moe_route_gate_up_batch_q4_b8")]] [[kernel]] decltype(moe_route_gate_up_batch_q4<8>) moe_route_gate_up_batch_q4<8>;

// moe_down_q4 of nb = bargs.rows <= NR rows (moe_down_body): each expert of the union of the
// rows' picks and the shared expert read once; same grid as moe_down_q4, kGemvThreads threads a
// threadgroup (the terms hold kGemvRowsPerSimdgroup rows); k * inter + inter_shared at most
// 32 * kMoeBatchMaxChunks.
template <uint NR>
[[max_total_threads_per_threadgroup(kGemvThreads)]] kernel void moe_down_batch_q4(
    device const float4* h [[buffer(0)]],        // [rows, h_stride]
    device const uint* ids [[buffer(1)]],        // [rows, ids_stride]
    device const float* weights [[buffer(2)]],   // [rows, w_stride]
    device const uint4* down_w [[buffer(3)]],    // switch_mlp.down_proj.weight [E, hidden, inter/8]
    device const bfloat* down_s [[buffer(4)]],   // [E, hidden, inter/64]
    device const bfloat* down_b [[buffer(5)]],
    device const uint4* sdown_w [[buffer(6)]],   // shared_expert.down_proj.weight [hidden, inter_shared/8]
    device const bfloat* sdown_s [[buffer(7)]],  // [hidden, inter_shared/64]
    device const bfloat* sdown_b [[buffer(8)]],
    device float* residual [[buffer(9)]],        // [rows, x_stride] fp32, updated in place
    constant MoeArgs& args [[buffer(10)]], constant MoeBatchArgs& bargs [[buffer(11)]],
    uint tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
    uint tcount [[threads_per_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float part[NR * kSplitJoinMax];
  threadgroup float terms[NR * kMoeBatchMaxChunks * kGemvRowsPerSimdgroup];
  threadgroup uint picks[NR * 32];  // top_k <= 32
  threadgroup uint owner[NR * 32];
  moe_down_body<NR>(h, bargs.h_stride / 4, ids, bargs.ids_stride, weights, bargs.w_stride, down_w,
                    down_s, down_b, sdown_w, sdown_s, sdown_b, residual, bargs.x_stride,
                    min(bargs.rows, NR), args, part, terms, picks, owner, tg, tid, tcount, sg, nsg,
                    lane);
}
template [[host_name("moe_down_batch_q4_b2")]] [[kernel]] decltype(moe_down_batch_q4<2>) moe_down_batch_q4<2>;
template [[host_name("moe_down_batch_q4_b4")]] [[kernel]] decltype(moe_down_batch_q4<4>) moe_down_batch_q4<4>;
template [[host_name("moe_down_batch_q4_b8")]] [[kernel]] decltype(moe_down_batch_q4<8>) moe_down_batch_q4<8>;
