// Prefill attention, Metal 4 tensor-operation path for apple10-family GPUs (M5: per-core
// neural accelerators) (docs/prefill.md, "Attention"). Twins of attn_prefill_d<D>_g<G> and
// attn_prefill_split_d<D>_g<G> (attention_prefill.metal) with the same grid, KV tiles, fp32
// online softmax, gate, output and argument bindings; bfloat matrix operands (q * scale
// rounded to bf16 by attn_prefill_prep_d<D>_qbf in the layout [Hq / G, M, G, D], K and V as
// cached, P rounded to bf16), fp32 accumulation. The combine kernel is shared. Grid:
// (ceil(M / BQ), Hq / G[, splits]) threadgroups of kAttnPrefillThreads = 256 threads, BQ =
// kAttnPrefillPairs / G chunk rows: pair r < 64 of a threadgroup is chunk row block * BQ + r / G
// of query head y * G + r % G (prefill_args.h has every shape constant).
//
// Structure after MLX's attention_nax_dsplit (steel_attention_nax.h, its head-dim-256 kernel,
// measured on M5): the 64 pairs are 4 slabs of kAttnPrefillSlabRows = 16, each served by two
// simdgroups that split the head dim (simdgroup 2 s + h: slab s, dims [h D/2, (h + 1) D/2)).
// Every product is a simdgroup-scope matmul2d (no threadgroup-wide tensor operation): Q is
// loaded once into the simdgroup's registers (a cooperative left input, 16 x D/2), K is read
// by the product straight from the cache, O (16 x D/2 fp32, 64 floats per thread at D = 256)
// stays in registers as D/64 cooperative destinations of 32 columns, and V comes from the
// cache into registers 32 columns at a time (two slices double-buffered: the first one's loads
// issued at the start of the tile, each next one's during the product before). Per 32-row
// KV tile, S_h = Q_h K_h^T (each simdgroup its half of the dot products: 16 x 32, k = D/2),
// then one of two paths (attend_tensor picks it once per threadgroup):
//   registers, where the cooperative tensors hold the fragment layout of M5's tensor ops
//     (attn_register_layout, as MLX's NAX kernels assume it): the upper half stores its
//     partial S, barrier, the lower half adds its own (S = S_0 + S_1) and stores the sum,
//     barrier, both halves run the same fp32 online softmax on it (the lanes of a row:
//     xor 1 and 8), P from registers into the P V product, O *= their rows' corr;
//   threadgroup memory, any layout: the upper half stores its partial S, barrier, the lower
//     half adds its own, its 32 lanes run the softmax (2 lanes per pair, 16 columns each),
//     P -> bfloat into the slab's buffer, corr per pair, a rescale flag; barrier; both
//     halves: O *= corr (only when the slab's flag is set: lazy rescaling);
// then O += P V_h. Two threadgroup barriers per 32 KV rows either way (three in the
// threadgroup-scope design before, as pplx-garden's); everything else between the two
// simdgroups of a slab only. Unlike MLX's: relaxed_precision off (the simulator cannot model
// it), the score exchange one-way (the lower half sums: 8 KiB, not MLX's 16), exp not exp2.
// Threadgroup memory (D = 256 and 64 alike): scores 8 KiB + P 4 KiB + per-pair values 784 B,
// 13,072 bytes (the register path uses the scores' and 32 bytes of the values').
// MSL 4.0: built into lily_tensor.metallib (bfloat x bfloat -> float: the operand table of
// MacOSX 26.1 SDK's MPPTensorOpsMatMul2d.h; 26.0's header maps bfloat under __HAVE_BFLOAT__).
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

#include "common.h"  // sigmoid
#include "prefill_args.h"
#include "attention_prefill.h"

namespace attn_prefill_tensor_detail {
using namespace attn_prefill_shared;

constant constexpr uint kThreads = kAttnPrefillThreads;  // 8 simdgroups
constant constexpr uint kRows = kAttnPrefillPairs;       // (chunk row, head) pairs per threadgroup
constant constexpr uint kSlab = kAttnPrefillSlabRows;    // pairs per slab: the products' m
constant constexpr uint kSlabs = kRows / kSlab;
constant constexpr uint kCols = 32;                      // output columns per P V product
static_assert(2 * kSlabs == kThreads / 32, "two simdgroups (the head dim's halves) per slab");
static_assert(kTile == 32, "the softmax's lanes: 2 per pair, 16 columns each");
// Per-slab values (floats): corr [kSlab], then 1 / l (or l) [kSlab], m [kSlab], the rescale flag
constant constexpr uint kSlabValues = kAttnPrefillSlabValues;
static_assert(kThreads / 32 <= kSlabs * kSlabValues, "attend_tensor: a verdict per simdgroup in rowv");

// V rows [t0, t0 + kTile) of one KV head, columns [c0, c0 + kCols), into a P V product's
// cooperative right input {d, key}; rows >= kend zero (0 * v stays finite whatever the cache
// holds past the context).
template <uint D, class VIn>
static inline void load_v(thread VIn& v, device const bfloat* vhead, uint t0, uint kend, uint c0) {
  for (uint16_t i = 0; i < v.get_capacity(); ++i) {
    if (v.is_valid_element(i)) {
      const auto at = v.get_multidimensional_index(i);
      const uint key = t0 + uint(at[1]);
      v[i] = key < kend ? vhead[ulong(key) * D + c0 + uint(at[0])] : bfloat(0.0f);
    }
  }
}

// The fragment layout of Apple's execution_simdgroup tensor operations, which MLX's NAX
// kernels rely on (steel/attn/nax.h, measured on M5): a 16 x 32 tile (the scores, P as the
// P V product's left input, each O block) is two 16 x 16 fragments, slots 8 f .. 8 f + 7 of a
// lane fragment f's; element i of a fragment at row fm + 8 (i / 4), column 16 f + fn + i % 4.
// The rows a lane holds (fm, fm + 8) are shared by the lanes differing in bits 0 and 3 only.
constant constexpr ushort kNaxSlots = kSlab * kTile / 32;  // 16 per lane
constant constexpr ushort kNaxRowLanes = 9;                // softmax_row's LANE_BITS
// Which of its two rows a lane's slot holds (0: fm, 1: fm + 8), and the slot's place among
// the lane's 8 columns of that row.
static inline ushort nax_lane_row(ushort slot) { return (slot % 8) / 4; }
static inline ushort nax_lane_col(ushort slot) { return 4 * (slot / 8) + slot % 4; }
static inline ushort nax_row(ushort lane, ushort slot) {
  return (((lane >> 2) & 4) | ((lane >> 1) & 3)) + 8 * nax_lane_row(slot);
}
static inline ushort nax_col(ushort lane, ushort slot) {
  return 16 * (slot / 8) + (((lane >> 2) & 2) | (lane & 1)) * 4 + slot % 4;
}

// The attention's two simdgroup-scope products, one home for attend and the layout check:
// S_h (kSlab x kTile) = Q_h K_h^T (K's rows are the right operand's columns:
// transpose_right) and O[:, 32 j ..] (kSlab x 32) += P V[:, 32 j ..].
template <uint D>
constexpr matmul2d_descriptor attn_qk_desc() {
  return matmul2d_descriptor(kSlab, kTile, D / 2, false, true, false, matmul2d_descriptor::mode::multiply);
}
constexpr matmul2d_descriptor attn_pv_desc() {
  return matmul2d_descriptor(kSlab, kCols, kTile, false, false, false, matmul2d_descriptor::mode::multiply_accumulate);
}
// K rows read by the Q K^T product straight from the cache
using AttnDevRows = tensor<device bfloat, dextents<int32_t, 2>, tensor_inline>;
// What nax_layout saw, slot by slot: nothing in the attention; attn_layout_probe_d<D>_tensor's
// device records (prefill_args.h, kAttnLayoutProbeFields ints per slot).
struct no_layout_record {
  void slot(ushort, int, int, int, int, int) const {}
  void verdict(bool, int) const {}
};
struct device_layout_record {
  device int* slots;  // this tensor's and lane's [kAttnLayoutProbeSlots][kAttnLayoutProbeFields]
  device int* lane;   // {verdict, capacity}
  void slot(ushort i, int valid, int row, int col, int want_row, int want_col) const {
    if (i < kAttnLayoutProbeSlots) {
      device int* f = slots + i * kAttnLayoutProbeFields;
      f[0] = valid;
      f[1] = row;
      f[2] = col;
      f[3] = want_row;
      f[4] = want_col;
    }
  }
  void verdict(bool ok, int capacity) const {
    lane[0] = ok ? 1 : 0;
    lane[1] = capacity;
  }
};
// True when cooperative tensor t (a 16 x 32 tile, {column, row} indices) holds exactly the
// fragment layout above in this lane: slots below kNaxSlots valid at nax_row/nax_col, the
// rest invalid (-1: no coordinates). rec sees every slot and the verdict.
template <class T, class Rec>
static inline bool nax_layout(thread T& t, ushort lane, Rec rec) {
  bool ok = t.get_capacity() >= kNaxSlots;
  for (uint16_t i = 0; i < t.get_capacity(); ++i) {
    const bool valid = t.is_valid_element(i), fragment = i < kNaxSlots;
    int row = -1, col = -1;
    if (valid) {
      const auto at = t.get_multidimensional_index(i);
      col = int(at[0]);
      row = int(at[1]);
    }
    const int want_row = fragment ? int(nax_row(lane, i)) : -1, want_col = fragment ? int(nax_col(lane, i)) : -1;
    ok = ok && valid == fragment && row == want_row && col == want_col;
    rec.slot(i, valid ? 1 : 0, row, col, want_row, want_col);
  }
  rec.verdict(ok, int(t.get_capacity()));
  return ok;
}

// The register path's condition in this lane, its one home (attend_tensor, the probe): the
// scores (Q K^T's destination at head dim D), P (P V's left input) and O (P V's destination)
// as attend builds them each hold the fragment layout. All three are checked (and recorded).
template <uint D, class Rec>
static inline bool attn_register_layout(ushort lane, Rec s_rec, Rec p_rec, Rec o_rec) {
  constexpr auto qk_desc = attn_qk_desc<D>();
  constexpr auto pv_desc = attn_pv_desc();
  matmul2d<qk_desc, execution_simdgroup> qk;
  matmul2d<pv_desc, execution_simdgroup> pv;
  using QIn = decltype(qk.template get_left_input_cooperative_tensor<bfloat, bfloat, float>());
  using VIn = decltype(pv.template get_right_input_cooperative_tensor<bfloat, bfloat, float>());
  using PIn = decltype(pv.template get_left_input_cooperative_tensor<bfloat, bfloat, float>());
  auto s = qk.template get_destination_cooperative_tensor<QIn, AttnDevRows, float>();
  auto p = pv.template get_left_input_cooperative_tensor<bfloat, bfloat, float>();
  auto o = pv.template get_destination_cooperative_tensor<PIn, VIn, float>();
  const bool s_ok = nax_layout(s, lane, s_rec);
  const bool p_ok = nax_layout(p, lane, p_rec);
  const bool o_ok = nax_layout(o, lane, o_rec);
  return s_ok && p_ok && o_ok;
}

// One threadgroup's attention. NAX: the scores and P stay in registers (the fragment layout
// holds: attend_tensor checks it), else they pass through the slab's threadgroup buffers.
template <uint D, uint G, bool SPLIT, bool NAX>
static inline void attend(device bfloat* qb, device const bfloat* qg, device const bfloat* k_cache,
                          device const bfloat* v_cache, device bfloat* out, device float* part_ml,
                          device float* part_o, constant AttnPrefillArgs& args, uint block, uint y,
                          uint split,
                          threadgroup float* ss,    // [kSlabs][kSlab, kTile] scores
                          threadgroup bfloat* ps,   // [kSlabs][kSlab, kTile] P
                          threadgroup float* rowv,  // [kSlabs][kSlabValues]
                          uint sg, uint lane) {
  constexpr uint BQ = kRows / G;
  constexpr uint DH = D / 2;       // head dims per simdgroup
  constexpr uint NJ = DH / kCols;  // P V products per simdgroup and tile
  static_assert(DH % kCols == 0, "D: a multiple of 64");
  const uint Hq = args.num_q_heads;
  const uint M = args.rows;
  const uint h0 = y * G;
  const uint kvh = h0 / (Hq / args.num_kv_heads);
  const uint row0 = block * BQ;
  const uint pairs = min(BQ, M - row0) * G;  // pairs of chunk rows (the rest: past the chunk)
  uint kbeg;
  uint kend;
  if (!kv_range<SPLIT>(args, row0 + pairs / G - 1, split, kbeg, kend)) {
    return;  // uniform: no row of this block reaches split `split`
  }
  const uint slab = sg / 2;
  const uint dhalf = sg % 2;  // the head dims' half (not `half`: an MSL type)
  const uint first = slab * kSlab;  // the slab's first pair
  threadgroup float* s_sl = ss + slab * kSlab * kTile;
  threadgroup bfloat* p_sl = ps + slab * kSlab * kTile;
  threadgroup float* v_sl = rowv + slab * kSlabValues;

  using PTile = tensor<threadgroup bfloat, extents<int32_t, kTile, kSlab>, tensor_inline>;
  constexpr auto qk_desc = attn_qk_desc<D>();
  constexpr auto pv_desc = attn_pv_desc();
  matmul2d<qk_desc, execution_simdgroup> qk;
  matmul2d<pv_desc, execution_simdgroup> pv;

  // Q_h: the slab's 16 rows of head group y's [M * G, D] matrix, dims [half DH, half DH + DH),
  // {d, pair}; pairs past the chunk zero (their S rows are masked whole)
  auto q = qk.template get_left_input_cooperative_tensor<bfloat, bfloat, float>();
  device const bfloat* qrows = qb + (ulong(y) * M + row0) * G * D + dhalf * DH;
  for (uint16_t i = 0; i < q.get_capacity(); ++i) {
    if (q.is_valid_element(i)) {
      const auto at = q.get_multidimensional_index(i);
      const uint r = first + uint(at[1]);
      q[i] = r < pairs ? qrows[ulong(r) * D + uint(at[0])] : bfloat(0.0f);
    }
  }
  using VIn = decltype(pv.template get_right_input_cooperative_tensor<bfloat, bfloat, float>());
  using PIn = decltype(pv.template get_left_input_cooperative_tensor<bfloat, bfloat, float>());
  using ODest = decltype(pv.template get_destination_cooperative_tensor<conditional_t<NAX, PIn, PTile>, VIn, float>());
  ODest o[NJ];
  VIn vb[2];  // V's slices, double-buffered: the next one's loads in flight during a product
  for (uint j = 0; j < NJ; ++j) {
    for (uint16_t i = 0; i < o[j].get_capacity(); ++i) {
      if (o[j].is_valid_element(i)) {
        o[j][i] = 0.0f;
      }
    }
  }
  PTile tP(p_sl, extents<int32_t, kTile, kSlab>());
  auto pin = pv.template get_left_input_cooperative_tensor<bfloat, bfloat, float>();  // P from registers

  // softmax role of the threadgroup-memory path (the lower half): pair sr of the slab,
  // columns 16 su .. 16 su + 15; of the register path (both halves): rows nax_row(lane, 0)
  // and nax_row(lane, 4) of the slab, 8 columns each
  const uint sr = lane / 2;
  const uint su = lane % 2;
  uint spos[2];  // keys <= spos are attended
  bool live[2];
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};
  for (uint r = 0; r < 2; ++r) {
    const uint pr = first + (NAX ? nax_row(lane, 4 * r) : sr);
    live[r] = pr < pairs;
    spos[r] = args.p0 + row0 + pr / G;
  }
  device const bfloat* khead = k_cache + ulong(kvh) * args.capacity * D;
  device const bfloat* vhead = v_cache + ulong(kvh) * args.capacity * D;
  const array<int, 2> kstride{1, int(D)};

  for (uint t0 = kbeg; t0 < kend; t0 += kTile) {
    load_v<D>(vb[0], vhead, t0, kend, dhalf * DH);  // in flight across S, the softmax and the barriers
    // K_h: rows [t0, min(t0 + kTile, kend)) of the cache, this half's dims (only read: no
    // barrier orders it; S columns past the extent are unspecified and masked below)
    AttnDevRows tK((device bfloat*)(khead + ulong(t0) * D + dhalf * DH),
               dextents<int32_t, 2>(DH, min(kTile, kend - t0)), kstride);
    auto s = qk.template get_destination_cooperative_tensor<remove_addrspace_t<decltype(q)>, AttnDevRows, float>();
    qk.run(q, tK, s);
    bool moved;
    float corr[2] = {1.0f, 1.0f};
    if (NAX) {
      // S = S_0 + S_1 through the slab's buffer, slot-major (both halves hold the same
      // elements in the same slots): the upper half's partial in, the lower half adds its own
      // and writes the sum back, the upper half reads it; then both run the same softmax on
      // the same scores, so P and the correction agree bit for bit without an exchange
      threadgroup float* sx = s_sl + lane;
      if (dhalf == 1) {
        for (ushort i = 0; i < kNaxSlots; ++i) {
          sx[32 * i] = s[i];
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the upper halves' partials complete
      if (dhalf == 0) {
        for (ushort i = 0; i < kNaxSlots; ++i) {
          s[i] = s[i] + sx[32 * i];  // S_0 + S_1
          sx[32 * i] = s[i];
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the sums complete
      float sv[2][8];
      #pragma clang loop unroll(full)  // (as MLX's NAX loops) arrays indexed by the slot stay in registers
      for (ushort i = 0; i < kNaxSlots; ++i) {
        const uint r = nax_lane_row(i);
        const uint key = t0 + nax_col(lane, i);
        const float x = dhalf == 1 ? sx[32 * i] : s[i];
        sv[r][nax_lane_col(i)] = (live[r] && key <= spos[r] && key < kend) ? x : -INFINITY;
      }
      bfloat pv_[2][8];
      #pragma clang loop unroll(full)
      for (uint r = 0; r < 2; ++r) {
        corr[r] = softmax_row<8, kNaxRowLanes, bfloat>(sv[r], m[r], l[r], (thread bfloat*)pv_[r]);
      }
      #pragma clang loop unroll(full)
      for (ushort i = 0; i < kNaxSlots; ++i) {
        pin[i] = pv_[nax_lane_row(i)][nax_lane_col(i)];
      }
      moved = simd_any(corr[0] != 1.0f || corr[1] != 1.0f);
    } else {
      if (dhalf == 1) {  // the upper half's partial scores to the slab's buffer
        for (uint16_t i = 0; i < s.get_capacity(); ++i) {
          if (s.is_valid_element(i)) {
            const auto at = s.get_multidimensional_index(i);  // {key, pair}
            s_sl[uint(at[1]) * kTile + uint(at[0])] = s[i];
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the upper halves' partials complete
      if (dhalf == 0) {
        for (uint16_t i = 0; i < s.get_capacity(); ++i) {
          if (s.is_valid_element(i)) {
            const auto at = s.get_multidimensional_index(i);
            const uint e = uint(at[1]) * kTile + uint(at[0]);
            s_sl[e] = s[i] + s_sl[e];  // S_0 + S_1
          }
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);  // the slab's scores visible to its lanes
        float sv[16];
        for (uint j = 0; j < 16; ++j) {
          const uint key = t0 + 16 * su + j;
          const float x = s_sl[sr * kTile + 16 * su + j];
          sv[j] = (live[0] && key <= spos[0] && key < kend) ? x : -INFINITY;  // a select: no NaN enters
        }
        const float c = softmax_row<16, 1, bfloat>(sv, m[0], l[0], p_sl + sr * kTile + 16 * su);
        const bool any = simd_any(c != 1.0f);
        if (su == 0) {
          v_sl[sr] = c;
        }
        if (lane == 0) {
          v_sl[3 * kSlab] = any ? 1.0f : 0.0f;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // P, corr and the flag complete
      moved = v_sl[3 * kSlab] != 0.0f;
    }
    if (moved) {  // uniform per slab; rare after the first tiles (lazy rescaling)
      for (uint j = 0; j < NJ; ++j) {
        #pragma clang loop unroll(full)
        for (uint16_t i = 0; i < o[j].get_capacity(); ++i) {
          if (o[j].is_valid_element(i)) {
            o[j][i] *= NAX ? corr[nax_lane_row(i)] : v_sl[o[j].get_multidimensional_index(i)[1]];
          }
        }
      }
    }
    for (uint j = 0; j < NJ; ++j) {  // O[:, 32 j ..] += P V[:, half DH + 32 j ..]
      if (j + 1 < NJ) {
        load_v<D>(vb[(j + 1) % 2], vhead, t0, kend, dhalf * DH + (j + 1) * kCols);
      }
      if constexpr (NAX) {
        pv.run(pin, vb[j % 2], o[j]);
      } else {
        pv.run(tP, vb[j % 2], o[j]);
      }
    }
  }

  // per row: 1 / l (or l on the split path) and m; registers on the register path
  float rl[2];
  for (uint r = 0; r < 2; ++r) {
    rl[r] = SPLIT ? l[r] : 1.0f / l[r];
  }
  if (!NAX) {
    if (dhalf == 0 && su == 0) {
      v_sl[kSlab + sr] = rl[0];
      v_sl[2 * kSlab + sr] = m[0];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // each thread writes its own elements of O (no staging)
  for (uint j = 0; j < NJ; ++j) {
    #pragma clang loop unroll(full)
    for (uint16_t i = 0; i < o[j].get_capacity(); ++i) {
      if (!o[j].is_valid_element(i)) {
        continue;
      }
      const auto at = o[j].get_multidimensional_index(i);  // {column, pair}
      const uint r = first + uint(at[1]);
      if (r >= pairs) {
        continue;  // past the chunk
      }
      const uint row = row0 + r / G;
      const uint h = h0 + r % G;
      const uint d = dhalf * DH + j * kCols + uint(at[0]);
      const float lr = NAX ? rl[nax_lane_row(i)] : v_sl[kSlab + uint(at[1])];
      if (SPLIT) {
        const ulong slot = (ulong(split) * M + row) * Hq + h;
        part_o[slot * D + d] = o[j][i];
        if (d == 0) {
          part_ml[2 * slot] = NAX ? m[nax_lane_row(i)] : v_sl[2 * kSlab + uint(at[1])];
          part_ml[2 * slot + 1] = lr;
        }
      } else {
        const float gate = float(qg[(ulong(row) * Hq + h) * 2 * D + D + d]);
        out[(ulong(row) * Hq + h) * D + d] = bfloat(o[j][i] * lr * sigmoid(gate));
      }
    }
  }
}

// attend on the register path where every simdgroup of the threadgroup finds the fragment
// layout in its scores, P and O tensors (one barrier to agree), else on the threadgroup-memory
// path: the same results within the row sums' rounding (docs/prefill.md, "Attention").
template <uint D, uint G, bool SPLIT>
static inline void attend_tensor(device bfloat* qb, device const bfloat* qg, device const bfloat* k_cache,
                                 device const bfloat* v_cache, device bfloat* out, device float* part_ml,
                                 device float* part_o, constant AttnPrefillArgs& args, uint block, uint y,
                                 uint split, threadgroup float* ss, threadgroup bfloat* ps, threadgroup float* rowv,
                                 uint sg, uint lane) {
  const bool ok = simd_all(attn_register_layout<D>(lane, no_layout_record{}, no_layout_record{}, no_layout_record{}));
  // the simdgroups' verdicts in rowv's first floats: attend writes rowv only after a
  // barrier all of these reads precede
  if (lane == 0) {
    rowv[sg] = ok ? 1.0f : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  bool nax = true;
  for (uint i = 0; i < kThreads / 32; ++i) {
    nax = nax && rowv[i] != 0.0f;
  }
  if (nax) {
    attend<D, G, SPLIT, true>(qb, qg, k_cache, v_cache, out, part_ml, part_o, args, block, y, split, ss, ps, rowv,
                              sg, lane);
  } else {
    attend<D, G, SPLIT, false>(qb, qg, k_cache, v_cache, out, part_ml, part_o, args, block, y, split, ss, ps, rowv,
                               sg, lane);
  }
}
}  // namespace attn_prefill_tensor_detail

// ---- attn_prefill_tensor: as attn_prefill (attention_prefill.metal)
template <uint D, uint G>
[[max_total_threads_per_threadgroup(kAttnPrefillThreads)]] kernel void attn_prefill_tensor(device bfloat* qb [[buffer(0)]],             // [Hq/G, M, G, D] q * scale (attn_prefill_prep_d<D>_qbf); read only
                                device const bfloat* qg [[buffer(1)]],       // bfloat [M, Hq*2*D] (gate: second D of each head)
                                device const bfloat* k_cache [[buffer(2)]],  // [Hkv, capacity, D], rows [0, p0 + M) read
                                device const bfloat* v_cache [[buffer(3)]],  // [Hkv, capacity, D], rows [0, p0 + M) read
                                device bfloat* out [[buffer(4)]],            // bfloat [M, Hq*D] attention * sigmoid(gate)
                                constant AttnPrefillArgs& args [[buffer(5)]],
                                uint2 tg [[threadgroup_position_in_grid]],
                                uint sg [[simdgroup_index_in_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]]) {
  using namespace attn_prefill_tensor_detail;
  static_assert(G == 2 || G == 4 || G == 8, "G: 2, 4 or 8 query heads per threadgroup");
  static_assert(D % 64 == 0 && D <= 256, "D: a multiple of 64, at most 256");
  threadgroup float ss[kRows * kTile];
  threadgroup bfloat ps[kRows * kTile];
  threadgroup float rowv[kSlabs * kSlabValues];
  const uint nblocks = (args.rows + kRows / G - 1) / (kRows / G);
  if (tg.x >= nblocks) {
    return;
  }
  attend_tensor<D, G, false>(qb, qg, k_cache, v_cache, out, nullptr, nullptr, args, nblocks - 1 - tg.x, tg.y, 0, ss, ps,
                      rowv, sg, lane);
}

// ---- attn_prefill_split_tensor: as attn_prefill_split (partials for attn_prefill_combine)
template <uint D, uint G>
[[max_total_threads_per_threadgroup(kAttnPrefillThreads)]] kernel void attn_prefill_split_tensor(device bfloat* qb [[buffer(0)]],             // [Hq/G, M, G, D] q * scale; read only
                                      device const bfloat* k_cache [[buffer(1)]],  // [Hkv, capacity, D]
                                      device const bfloat* v_cache [[buffer(2)]],  // [Hkv, capacity, D]
                                      device float* part_ml [[buffer(3)]],         // [num_splits, M, Hq, 2]
                                      device float* part_o [[buffer(4)]],          // [num_splits, M, Hq, D]
                                      constant AttnPrefillArgs& args [[buffer(5)]],
                                      uint3 tg [[threadgroup_position_in_grid]],
                                      uint sg [[simdgroup_index_in_threadgroup]],
                                      uint lane [[thread_index_in_simdgroup]]) {
  using namespace attn_prefill_tensor_detail;
  static_assert(G == 2 || G == 4 || G == 8, "G: 2, 4 or 8 query heads per threadgroup");
  static_assert(D % 64 == 0 && D <= 256, "D: a multiple of 64, at most 256");
  threadgroup float ss[kRows * kTile];
  threadgroup bfloat ps[kRows * kTile];
  threadgroup float rowv[kSlabs * kSlabValues];
  const uint nblocks = (args.rows + kRows / G - 1) / (kRows / G);
  if (tg.x >= nblocks || tg.z >= args.num_splits) {
    return;
  }
  attend_tensor<D, G, true>(qb, nullptr, k_cache, v_cache, nullptr, part_ml, part_o, args, nblocks - 1 - tg.x, tg.y,
                     tg.z, ss, ps, rowv, sg, lane);
}

// Instantiations: as attention_prefill.metal.
template [[host_name("attn_prefill_d256_g8_tensor")]] [[kernel]] decltype(attn_prefill_tensor<256, 8>) attn_prefill_tensor<256, 8>;
template [[host_name("attn_prefill_d256_g4_tensor")]] [[kernel]] decltype(attn_prefill_tensor<256, 4>) attn_prefill_tensor<256, 4>;
template [[host_name("attn_prefill_d256_g2_tensor")]] [[kernel]] decltype(attn_prefill_tensor<256, 2>) attn_prefill_tensor<256, 2>;
template [[host_name("attn_prefill_d64_g8_tensor")]] [[kernel]] decltype(attn_prefill_tensor<64, 8>) attn_prefill_tensor<64, 8>;
template [[host_name("attn_prefill_d64_g4_tensor")]] [[kernel]] decltype(attn_prefill_tensor<64, 4>) attn_prefill_tensor<64, 4>;
template [[host_name("attn_prefill_d64_g2_tensor")]] [[kernel]] decltype(attn_prefill_tensor<64, 2>) attn_prefill_tensor<64, 2>;
template [[host_name("attn_prefill_split_d256_g8_tensor")]] [[kernel]] decltype(attn_prefill_split_tensor<256, 8>) attn_prefill_split_tensor<256, 8>;
template [[host_name("attn_prefill_split_d256_g4_tensor")]] [[kernel]] decltype(attn_prefill_split_tensor<256, 4>) attn_prefill_split_tensor<256, 4>;
template [[host_name("attn_prefill_split_d256_g2_tensor")]] [[kernel]] decltype(attn_prefill_split_tensor<256, 2>) attn_prefill_split_tensor<256, 2>;
template [[host_name("attn_prefill_split_d64_g8_tensor")]] [[kernel]] decltype(attn_prefill_split_tensor<64, 8>) attn_prefill_split_tensor<64, 8>;
template [[host_name("attn_prefill_split_d64_g4_tensor")]] [[kernel]] decltype(attn_prefill_split_tensor<64, 4>) attn_prefill_split_tensor<64, 4>;
template [[host_name("attn_prefill_split_d64_g2_tensor")]] [[kernel]] decltype(attn_prefill_split_tensor<64, 2>) attn_prefill_split_tensor<64, 2>;

// ---- attn_layout_probe_d<D>_tensor: which path the attention takes on this GPU, and why ---
// One simdgroup (kAttnLayoutProbeThreads) runs attn_register_layout<D> as attend_tensor does
// and records each tensor's slots (prefill_args.h): lily.lab's attention_path reports the
// path and the first slot that differs from the fragment layout. Slots never reached keep
// valid = -1.
template <uint D>
[[max_total_threads_per_threadgroup(kAttnLayoutProbeThreads)]] kernel void attn_layout_probe(device int* slots [[buffer(0)]],  // int [kAttnLayoutProbeTensors, 32, kAttnLayoutProbeSlots, kAttnLayoutProbeFields]
                                device int* lanes [[buffer(1)]],  // int [kAttnLayoutProbeTensors, 32, kAttnLayoutProbeLaneFields]
                                uint lane [[thread_index_in_simdgroup]]) {
  using namespace attn_prefill_tensor_detail;
  static_assert(kAttnLayoutProbeTensors == 3, "scores, P, O");
  static_assert(kAttnLayoutProbeThreads == 32, "one simdgroup");
  constexpr uint per_lane = kAttnLayoutProbeSlots * kAttnLayoutProbeFields;
  constexpr uint slots_per_tensor = kAttnLayoutProbeThreads * per_lane;
  constexpr uint lanes_per_tensor = kAttnLayoutProbeThreads * kAttnLayoutProbeLaneFields;
  for (uint t = 0; t < kAttnLayoutProbeTensors; ++t) {
    for (uint j = 0; j < per_lane; ++j) {
      slots[t * slots_per_tensor + lane * per_lane + j] = -1;
    }
  }
  device int* at = slots + lane * per_lane;
  device int* verdicts = lanes + lane * kAttnLayoutProbeLaneFields;
  const device_layout_record s_rec{at, verdicts}, p_rec{at + slots_per_tensor, verdicts + lanes_per_tensor},
      o_rec{at + 2 * slots_per_tensor, verdicts + 2 * lanes_per_tensor};
  attn_register_layout<D>(lane, s_rec, p_rec, o_rec);
}
template [[host_name("attn_layout_probe_d256_tensor")]] [[kernel]] decltype(attn_layout_probe<256>) attn_layout_probe<256>;
template [[host_name("attn_layout_probe_d64_tensor")]] [[kernel]] decltype(attn_layout_probe<64>) attn_layout_probe<64>;

// ---- start-up probe of the Metal backend: the attention's tensor operations -------------
// The Metal device builds this pipeline after tensor_ops_probe (gemm_tensor.metal): the
// attention's bfloat x bfloat -> float operations, which only MacOSX 26.1's operand table
// lists. Prefill takes the tensor path only where both probes build
// (Device::supports_bfloat_tensor_ops). As a kernel (one threadgroup of 128 threads; xb
// bfloat [64, 64]):
//   out_qk[32, 64] = xb[0:32] xb^T   S = Q K^T, a 16 x 32 block per simdgroup
//                                    (execution_simdgroup): a bfloat cooperative left input
//                                    times a bfloat device tensor into an fp32 cooperative
//                                    tensor
//   out_pv[32, 64] = xb[0:32] xb     O += P V: a bfloat threadgroup tile times a cooperative
//                                    right input filled from device memory,
//                                    multiply_accumulate into an fp32 cooperative tensor
[[max_total_threads_per_threadgroup(128)]] kernel void tensor_ops_probe_bfloat(device const bfloat* xb [[buffer(0)]],
                                    device float* out_qk [[buffer(1)]],
                                    device float* out_pv [[buffer(2)]],
                                    uint tid [[thread_index_in_threadgroup]]) {
  constexpr uint BM = 32, BN = 64, K = 64;
  threadgroup float smem[BM * BN];
  threadgroup bfloat tiles[BM * K];  // P [BM][K]

  // S = Q K^T as the attention runs it: each simdgroup a 16 x 32 block (execution_simdgroup),
  // Q a bfloat cooperative left input filled from device memory, K a bfloat device tensor
  // (extents: k innermost), into an fp32 cooperative destination, stored to threadgroup memory
  using attn_prefill_tensor_detail::AttnDevRows;  // K as the attention's product reads it
  using Stage = tensor<threadgroup float, extents<int32_t, BN, BM>, tensor_inline>;
  using StageBlock = tensor<threadgroup float, dextents<int32_t, 2>, tensor_inline>;
  const uint r0 = 16 * (tid / 64), c0 = 32 * (tid / 32 % 2);  // the simdgroup's block
  AttnDevRows tK((device bfloat*)xb + c0 * K, dextents<int32_t, 2>(K, 32));
  StageBlock tS(smem + r0 * BN + c0, dextents<int32_t, 2>(32, 16), array<int, 2>{1, int(BN)});
  constexpr auto qk_desc =
      matmul2d_descriptor(16, 32, K, false, true, false, matmul2d_descriptor::mode::multiply);
  matmul2d<qk_desc, execution_simdgroup> qk;
  auto q = qk.get_left_input_cooperative_tensor<bfloat, bfloat, float>();
  for (uint16_t i = 0; i < q.get_capacity(); ++i) {
    if (q.is_valid_element(i)) {
      const auto at = q.get_multidimensional_index(i);  // {k, row}
      q[i] = xb[(r0 + uint(at[1])) * K + uint(at[0])];
    }
  }
  auto s = qk.get_destination_cooperative_tensor<remove_addrspace_t<decltype(q)>, AttnDevRows, float>();
  qk.run(q, tK, s);
  s.store(tS);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < BM * BN; i += 128) {
    out_qk[i] = smem[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // O += P V: P a bfloat threadgroup tile [BM][K], V [K][BN] in a cooperative right input
  threadgroup bfloat* Ps = tiles;
  for (uint i = tid; i < BM * K; i += 128) {
    Ps[i] = xb[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  using PTile = tensor<threadgroup bfloat, extents<int32_t, K, BM>, tensor_inline>;
  PTile tP(Ps, extents<int32_t, K, BM>());
  constexpr auto pv_desc =
      matmul2d_descriptor(BM, BN, K, false, false, false, matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<pv_desc, execution_simdgroups<4>> pv;
  auto vr = pv.get_right_input_cooperative_tensor<bfloat, bfloat, float>();
  for (uint16_t i = 0; i < vr.get_capacity(); ++i) {
    if (vr.is_valid_element(i)) {
      const auto at = vr.get_multidimensional_index(i);  // {column, k}
      vr[i] = xb[uint(at[1]) * BN + uint(at[0])];
    }
  }
  auto o = pv.get_destination_cooperative_tensor<PTile, remove_addrspace_t<decltype(vr)>, float>();
  for (uint16_t i = 0; i < o.get_capacity(); ++i) {
    if (o.is_valid_element(i)) {
      o[i] = 0.0f;
    }
  }
  pv.run(tP, vr, o);
  Stage tO(smem, extents<int32_t, BN, BM>());  // smem: its last reads were before the barrier above
  o.store(tO);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < BM * BN; i += 128) {
    out_pv[i] = smem[i];
  }
}
