// Token selection on the GPU (docs/goals.md, "GPU-resident token hand-off"): the step
// ends by writing the next token id into the next step's token slot.
//
//   sample_greedy   argmax of the fp32 logits (ties -> lowest index, NaN never wins).
//   argmax_partial[_bias] + sample_greedy_combine: the same argmax over many threadgroups
//                   (the decode step's); _bias adds the per-session logit bias [V] first.
//   sample_token    logit bias (optional, per-session [V] buffer), penalties (repetition /
//                   presence / frequency from the per-session count buffer), temperature,
//                   top-k, top-p, min-p (lily.sampling.Sampler's order),
//                   then a draw with a counter-based RNG: Philox4x32-10 keyed by the 64-bit
//                   seed, counter = (position, 0, 0, 0), so a (seed, position) pair always
//                   gives the same token. Optional log-probabilities of the raw logits.
//
// Both run as one threadgroup of up to kSamplerThreads (sample_args.h) threads (as many as the
// pipeline allows, a power of two from 32: sampler_threads, csrc/runtime/families/sample.h); thread t reads elements t, t + threads, ...
// (coalesced). sample_token works on an order-preserving integer key of the processed
// logits (larger logit, larger key; the key maps back to the float exactly):
//   * fast path (the usual settings): a radix select (4 passes, 8-bit digits, threadgroup
//     histograms) finds the key of the c-th largest token, c = top_k if 0 < top_k <= 1024,
//     else 1024; one pass collects those candidates into threadgroup memory, a bitonic sort
//     orders them (logit descending, id ascending: numpy's stable order), and a prefix sum
//     of their masses gives the nucleus (top-p), min-p (a prefix too) and the draw, which is
//     where the running mass in that order crosses u * Z. It applies when the candidates
//     hold the whole filtered set: top_k <= 1024, V <= 1024, or the 1024 candidates already
//     carry top_p of the mass.
//   * slow path (top_k = 0 or > 1024 with a nucleus wider than 1024 tokens, or with top_p = 1):
//     the kept set is "key >= tau"; the nucleus threshold is found by a bit-by-bit descent
//     (32 mass passes), and the draw walks the kept mass in the fixed order (thread,
//     element) - any fixed order samples the same distribution. Ties at the exact top-p
//     boundary value keep all tied tokens there.
#include <metal_stdlib>
#include "sample_args.h"
using namespace metal;

namespace sample_detail {

constant constexpr uint kNone = 0xFFFFFFFFu;

// Order-preserving map float -> uint (larger float, larger key); NaN is treated as -inf.
static inline uint key_of(float x) {
  const uint u = as_type<uint>(isnan(x) ? -INFINITY : x);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

// Penalties (repetition, then presence/frequency) and temperature, as lily.sampling.Sampler,
// of a logit with its bias already added. cnt: bit 31 = token occurs in the prompt, bits
// 0..30 = times generated so far.
static inline float processed(float logit, uint cnt, constant SampleArgs& a) {
  float x = isnan(logit) ? -INFINITY : logit;
  if (a.repetition_penalty != 1.0f && cnt != 0) {
    x = x > 0.0f ? x / a.repetition_penalty : x * a.repetition_penalty;
  }
  const uint gen = cnt & 0x7FFFFFFFu;
  if (gen != 0) {
    x -= a.presence_penalty + a.frequency_penalty * float(gen);
  }
  if (a.temperature > 0.0f) {
    x = x / a.temperature;
  }
  return x;
}

// Philox4x32-10 (Salmon et al. 2011); returns the first output word.
static inline uint philox(uint c0, uint c1, uint c2, uint c3, uint k0, uint k1) {
  for (uint r = 0; r < 10; ++r) {
    const uint hi0 = mulhi(0xD2511F53u, c0);
    const uint lo0 = 0xD2511F53u * c0;
    const uint hi1 = mulhi(0xCD9E8D57u, c2);
    const uint lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// Threadgroup-wide sum; every thread gets the result. scratch: [32].
static inline float tg_sum(float v, threadgroup float* scratch, uint sg, uint lane, uint nsg) {
  v = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) {
    scratch[sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float t = 0.0f;
  for (uint s = 0; s < nsg; ++s) {
    t += scratch[s];
  }
  return t;
}

// Threadgroup-wide argmax (largest value, then lowest index); every thread gets the result.
static inline void tg_argmax(float v, uint i, threadgroup float* sv, threadgroup uint* si,
                             uint sg, uint lane, uint nsg, thread float& best, thread uint& index) {
  const float m = simd_max(v);
  const uint c = simd_min(v == m ? i : kNone);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) {
    sv[sg] = m;
    si[sg] = c;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  best = sv[0];
  index = si[0];
  for (uint s = 1; s < nsg; ++s) {
    if (sv[s] > best || (sv[s] == best && si[s] < index)) {
      best = sv[s];
      index = si[s];
    }
  }
}

}  // namespace sample_detail

// ---- greedy argmax ----------------------------------------------------------------------------
// Best (value, lowest index) of `x` (+ `bias` with BIAS, added in float32 as the host sampler
// does) over the elements [begin, end) this thread visits (stride ntg); NaN counts as -inf;
// kNone if it visits none.
template <bool BIAS>
static inline void scan_argmax(device const float* x, device const float* bias, uint begin, uint end, uint tid,
                               uint ntg, thread float& best, thread uint& bi) {
  best = -INFINITY;
  bi = sample_detail::kNone;
  for (uint i = begin + tid; i < end; i += ntg) {
    const float xi = BIAS ? x[i] + bias[i] : x[i];
    const float v = isnan(xi) ? -INFINITY : xi;
    if (v > best || bi == sample_detail::kNone) {
      best = v;
      bi = i;
    }
  }
}

// sample_greedy: the whole argmax in one threadgroup (1 x kSamplerThreads threads).
[[max_total_threads_per_threadgroup(kSamplerThreads)]] kernel void sample_greedy(device const float* logits [[buffer(0)]],     // [V]
                          device uint* token_out [[buffer(1)]],         // [1] next step's token slot
                          constant SampleGreedyArgs& args [[buffer(2)]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint ntg [[threads_per_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float sv[32];
  threadgroup uint si[32];
  float best;
  uint bi;
  scan_argmax<false>(logits, logits, 0, args.vocab, tid, ntg, best, bi);
  float m;
  uint idx;
  sample_detail::tg_argmax(best, bi, sv, si, sg, lane, nsg, m, idx);
  if (tid == 0) {
    token_out[0] = idx;
  }
}

// The decode step's argmax over ~248K logits spread over the GPU: argmax_partial (grid
// ceil(V / slice) threadgroups of any multiple of 32 threads; threadgroup j writes the best
// (value, index) of its contiguous slice to part[j], as (float bits, index)), then
// sample_greedy_combine (1 threadgroup) reduces the partials in the same order (largest
// value, then lowest index: the slices are in index order), so the token equals
// sample_greedy's. A threadgroup whose slice is empty writes (-inf, kNone), which loses
// every tie. argmax_partial_bias: the same over logits + bias (a request's logit_bias, dense),
// a separate kernel so the unbiased step binds and reads nothing more.
template <bool BIAS>
static inline void argmax_slice(device const float* logits, device const float* bias, device uint2* part,
                                constant ArgmaxArgs& args, uint grp, uint tid, uint ntg, uint sg, uint lane,
                                uint nsg, threadgroup float* sv, threadgroup uint* si) {
  const uint begin = min(grp * args.slice, args.vocab);
  const uint end = min(begin + args.slice, args.vocab);
  float best;
  uint bi;
  scan_argmax<BIAS>(logits, bias, begin, end, tid, ntg, best, bi);
  float m;
  uint idx;
  sample_detail::tg_argmax(best, bi, sv, si, sg, lane, nsg, m, idx);
  if (tid == 0) {
    part[grp] = uint2(as_type<uint>(m), idx);
  }
}

[[max_total_threads_per_threadgroup(kArgmaxPartialThreads)]] kernel void argmax_partial(device const float* logits [[buffer(0)]],  // [V]
                           device uint2* part [[buffer(1)]],          // [ceil(V / slice)]
                           constant ArgmaxArgs& args [[buffer(2)]],
                           uint grp [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint ntg [[threads_per_threadgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float sv[32];
  threadgroup uint si[32];
  argmax_slice<false>(logits, logits, part, args, grp, tid, ntg, sg, lane, nsg, sv, si);
}

[[max_total_threads_per_threadgroup(kArgmaxPartialThreads)]] kernel void argmax_partial_bias(device const float* logits [[buffer(0)]],  // [V]
                                device uint2* part [[buffer(1)]],          // [ceil(V / slice)]
                                constant ArgmaxArgs& args [[buffer(2)]],
                                device const float* bias [[buffer(3)]],    // [V] added to the logits
                                uint grp [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint ntg [[threads_per_threadgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]],
                                uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float sv[32];
  threadgroup uint si[32];
  argmax_slice<true>(logits, bias, part, args, grp, tid, ntg, sg, lane, nsg, sv, si);
}

[[max_total_threads_per_threadgroup(kSamplerThreads)]] kernel void sample_greedy_combine(device const uint2* part [[buffer(0)]],  // [count] from argmax_partial
                                  device uint* token_out [[buffer(1)]],    // [1] next step's token slot
                                  constant ArgmaxArgs& args [[buffer(2)]], // vocab = count
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint ntg [[threads_per_threadgroup]],
                                  uint sg [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]],
                                  uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float sv[32];
  threadgroup uint si[32];
  float best = -INFINITY;
  uint bi = sample_detail::kNone;
  for (uint j = tid; j < args.vocab; j += ntg) {
    const float v = as_type<float>(part[j].x);
    const uint i = part[j].y;
    if (v > best || (v == best && i < bi)) {
      best = v;
      bi = i;
    }
  }
  float m;
  uint idx;
  sample_detail::tg_argmax(best, bi, sv, si, sg, lane, nsg, m, idx);
  if (tid == 0) {
    token_out[0] = idx;
  }
}

// ---- sample_token ----------------------------------------------------------------------------
namespace sample_detail {

constant constexpr uint kCand = 1024;  // candidate capacity of the fast path

// The float a key came from (inverse of key_of).
static inline float value_of(uint key) {
  return as_type<float>((key & 0x80000000u) != 0 ? (key ^ 0x80000000u) : ~key);
}

// The processed logit of token i: bias (if a.bias), penalties, temperature.
static inline float processed_at(device const float* logits, device const float* bias, device const uint* counts,
                                 uint i, constant SampleArgs& a) {
  return processed(a.bias != 0 ? logits[i] + bias[i] : logits[i], counts[i], a);
}

static inline float element(device const float* logits, device const float* bias, device const uint* counts,
                            uint i, constant SampleArgs& a, bool raw) {
  return raw ? (isnan(logits[i]) ? -INFINITY : logits[i]) : processed_at(logits, bias, counts, i, a);
}

// Key of the k-th largest element (1 <= k <= V): radix select over 8-bit digits, most
// significant first. hist: [256] threadgroup counters; sel: [2] threadgroup scratch.
static inline uint radix_select(device const float* logits, device const float* bias, device const uint* counts,
                                constant SampleArgs& a, bool raw, uint k,
                                threadgroup atomic_uint* hist, threadgroup uint* sel,
                                uint tid, uint ntg) {
  uint prefix = 0;
  uint mask = 0;
  uint remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (uint b = tid; b < 256; b += ntg) {
      atomic_store_explicit(&hist[b], 0u, memory_order_relaxed);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = tid; i < a.vocab; i += ntg) {
      const uint key = key_of(element(logits, bias, counts, i, a, raw));
      if ((key & mask) == prefix) {
        atomic_fetch_add_explicit(&hist[(key >> uint(shift)) & 255u], 1u, memory_order_relaxed);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
      uint cum = 0;
      uint b = 255;
      for (;; --b) {
        const uint h = atomic_load_explicit(&hist[b], memory_order_relaxed);
        if (cum + h >= remaining || b == 0) {
          remaining -= cum;
          break;
        }
        cum += h;
      }
      sel[0] = prefix | (b << uint(shift));
      sel[1] = remaining;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    prefix = sel[0];
    remaining = sel[1];
    mask |= 255u << uint(shift);
  }
  return prefix;
}

// Bitonic sort of kCand (key, id) pairs: key descending, id ascending.
static inline void sort_candidates(threadgroup uint* key, threadgroup uint* id, uint tid, uint ntg) {
  for (uint k = 2; k <= kCand; k <<= 1) {
    for (uint j = k >> 1; j > 0; j >>= 1) {
      for (uint i = tid; i < kCand; i += ntg) {
        const uint l = i ^ j;
        if (l > i) {
          const bool l_first = key[l] > key[i] || (key[l] == key[i] && id[l] < id[i]);
          const bool i_first = key[i] > key[l] || (key[i] == key[l] && id[i] < id[l]);
          if ((i & k) == 0 ? l_first : i_first) {
            const uint tk = key[i];
            const uint ti = id[i];
            key[i] = key[l];
            id[i] = id[l];
            key[l] = tk;
            id[l] = ti;
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
}

// Inclusive prefix sum of v[0..kCand) into csum (threadgroup), each thread a contiguous chunk
// (ntg must divide kCand). scratch: [32]. Returns the total.
static inline float prefix_sum(threadgroup const float* v, threadgroup float* csum, threadgroup float* scratch,
                               uint tid, uint ntg, uint sg, uint lane, uint nsg) {
  const uint chunk = kCand / ntg;
  float mine = 0.0f;
  for (uint c = 0; c < chunk; ++c) {
    mine += v[tid * chunk + c];
  }
  const float incl = simd_prefix_inclusive_sum(mine);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 31 || tid == ntg - 1) {
    scratch[sg] = incl;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float run = incl - mine;
  float total = 0.0f;
  for (uint s = 0; s < nsg; ++s) {
    run += s < sg ? scratch[s] : 0.0f;
    total += scratch[s];
  }
  for (uint c = 0; c < chunk; ++c) {
    run += v[tid * chunk + c];
    csum[tid * chunk + c] = run;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return total;
}

}  // namespace sample_detail

// Grid: 1 threadgroup of kSamplerThreads threads (or any multiple of 32 dividing it).
[[max_total_threads_per_threadgroup(kSamplerThreads)]] kernel void sample_token(device const float* logits [[buffer(0)]],  // [V] raw logits
                         device uint* counts [[buffer(1)]],         // [V] per-session counts (bit 31: in prompt); +1 at the token if update_counts
                         device const uint* position [[buffer(2)]], // [1] RNG counter (the token's position)
                         device uint* token_out [[buffer(3)]],      // [1] next step's token slot
                         device float* logprob_out [[buffer(4)]],   // [1 + top_logprobs]: chosen, then alternatives (if logprobs)
                         device uint* top_ids [[buffer(5)]],        // [max(top_logprobs, 1)] alternative ids (if top_logprobs)
                         constant SampleArgs& args [[buffer(6)]],
                         device const float* bias [[buffer(7)]],    // [V] logit bias (read if args.bias)
                         uint tid [[thread_index_in_threadgroup]],
                         uint ntg [[threads_per_threadgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint nsg [[simdgroups_per_threadgroup]]) {
  using namespace sample_detail;
  threadgroup float sv[32];
  threadgroup uint si[32];
  threadgroup uint sel[2];
  threadgroup uint chosen;
  threadgroup atomic_uint hist[256];
  threadgroup atomic_uint cand_n;
  threadgroup uint cand_key[kCand];
  threadgroup uint cand_id[kCand];
  threadgroup float cand_e[kCand];
  threadgroup float csum[kCand];
  const uint V = args.vocab;

  // pass 1: max and argmax of the processed logits
  float best = -INFINITY;
  uint bi = kNone;
  for (uint i = tid; i < V; i += ntg) {
    const float x = processed_at(logits, bias, counts, i, args);
    if (x > best || bi == kNone) {
      best = x;
      bi = i;
    }
  }
  float M;
  uint amax;
  tg_argmax(best, bi, sv, si, sg, lane, nsg, M, amax);

  uint token = amax;
  if (args.temperature > 0.0f && args.top_k != 1) {
    const uint kk = args.top_k > 0 && args.top_k < V ? args.top_k : 0;  // effective top-k
    const uint c = kk > 0 ? min(kk, kCand) : min(V, kCand);            // candidates wanted
    const uint tau_c = c < V ? radix_select(logits, bias, counts, args, false, c, hist, sel, tid, ntg) : 0u;
    const uint tau_k = kk == 0 ? 0u : (kk <= kCand ? tau_c : radix_select(logits, bias, counts, args, false, kk, hist, sel, tid, ntg));

    // collect the candidates; mass of the top-k set
    if (tid == 0) {
      atomic_store_explicit(&cand_n, 0u, memory_order_relaxed);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float zk = 0.0f;
    for (uint i = tid; i < V; i += ntg) {
      const float x = processed_at(logits, bias, counts, i, args);
      const uint key = key_of(x);
      zk += key >= tau_k ? exp(x - M) : 0.0f;
      if (key >= tau_c) {
        const uint slot = atomic_fetch_add_explicit(&cand_n, 1u, memory_order_relaxed);
        if (slot < kCand) {
          cand_key[slot] = key;
          cand_id[slot] = i;
        }
      }
    }
    const float Zk = tg_sum(zk, sv, sg, lane, nsg);  // (its barriers also publish the candidates)
    const uint n_c = atomic_load_explicit(&cand_n, memory_order_relaxed);
    const float p_target = args.top_p * Zk;

    bool done = false;
    if (n_c <= kCand) {
      for (uint j = tid; j < kCand; j += ntg) {
        if (j >= n_c) {
          cand_key[j] = 0u;  // below every real key
          cand_id[j] = kNone;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      sort_candidates(cand_key, cand_id, tid, ntg);
      for (uint j = tid; j < kCand; j += ntg) {
        cand_e[j] = j < n_c ? exp(value_of(cand_key[j]) - M) : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const float cmass = prefix_sum(cand_e, csum, sv, tid, ntg, sg, lane, nsg);
      // the candidates hold the filtered set: the whole top-k set, or the nucleus
      const bool covers = (kk > 0 && kk <= kCand) || c >= V || (args.top_p < 1.0f && cmass >= p_target);
      if (covers) {
        done = true;
        // kept = sorted prefix [0, jend): nucleus (first j with csum >= top_p * Zk), then min-p
        if (tid == 0) {
          sel[0] = n_c;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (args.top_p < 1.0f) {
          for (uint j = tid; j < n_c; j += ntg) {
            if (csum[j] >= p_target && (j == 0 || csum[j - 1] < p_target)) {
              sel[0] = j + 1;
            }
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        uint jend = sel[0];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (args.min_p > 0.0f) {
          if (tid == 0) {
            sel[1] = jend;
          }
          threadgroup_barrier(mem_flags::mem_threadgroup);
          for (uint j = tid; j < jend; j += ntg) {
            if (cand_e[j] < args.min_p && (j == 0 || cand_e[j - 1] >= args.min_p)) {
              sel[1] = j;
            }
          }
          threadgroup_barrier(mem_flags::mem_threadgroup);
          jend = max(sel[1], 1u);
        }
        const uint r = philox(position[0], 0u, 0u, 0u, args.seed_lo, args.seed_hi);
        const float target = float(r >> 8) * (1.0f / 16777216.0f) * csum[jend - 1];
        if (tid == 0) {
          chosen = cand_id[jend - 1];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint j = tid; j < jend; j += ntg) {
          if (csum[j] > target && (j == 0 || csum[j - 1] <= target)) {
            chosen = cand_id[j];
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        token = chosen;
      }
    }

    if (!done) {
      // slow path: nucleus threshold by bit descent on the mass, draw in (thread, element) order
      uint floor_key = tau_k;
      if (args.top_p < 1.0f) {
        uint tau = 0;
        for (int bit = 31; bit >= 0; --bit) {
          const uint cand = tau | (1u << uint(bit));
          const uint thr = max(cand, floor_key);
          float mass = 0.0f;
          for (uint i = tid; i < V; i += ntg) {
            const float x = processed_at(logits, bias, counts, i, args);
            mass += key_of(x) >= thr ? exp(x - M) : 0.0f;
          }
          if (tg_sum(mass, sv, sg, lane, nsg) >= p_target) {
            tau = cand;
          }
        }
        floor_key = max(floor_key, tau);
      }
      float mine = 0.0f;
      for (uint i = tid; i < V; i += ntg) {
        const float x = processed_at(logits, bias, counts, i, args);
        const float e = exp(x - M);
        if (key_of(x) >= floor_key && e >= args.min_p) {
          mine += e;
        }
      }
      const float incl = simd_prefix_inclusive_sum(mine);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (lane == 31 || tid == ntg - 1) {
        sv[sg] = incl;
      }
      if (tid == 0) {
        chosen = amax;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      float before = incl - mine;
      float Z = 0.0f;
      for (uint s = 0; s < nsg; ++s) {
        before += s < sg ? sv[s] : 0.0f;
        Z += sv[s];
      }
      const uint r = philox(position[0], 0u, 0u, 0u, args.seed_lo, args.seed_hi);
      const float target = float(r >> 8) * (1.0f / 16777216.0f) * Z;
      if (mine > 0.0f && target >= before && target < before + mine) {
        float run = before;
        uint last = kNone;
        for (uint i = tid; i < V; i += ntg) {
          const float x = processed_at(logits, bias, counts, i, args);
          const float e = exp(x - M);
          if (key_of(x) >= floor_key && e >= args.min_p) {
            last = i;
            run += e;
            if (target < run) {
              break;
            }
          }
        }
        chosen = last;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      token = chosen;
    }
  }

  // log-probabilities of the raw logits (no bias: lily.sampling.Sampler.logprob)
  if (args.logprobs != 0 || args.top_logprobs != 0) {
    float m = -INFINITY;
    float s = 0.0f;
    for (uint i = tid; i < V; i += ntg) {
      const float x = isnan(logits[i]) ? -INFINITY : logits[i];
      if (x > m) {
        s = s * exp(m - x) + 1.0f;
        m = x;
      } else {
        s += exp(x - m);
      }
    }
    float rmax;
    uint ridx;
    tg_argmax(m, tid, sv, si, sg, lane, nsg, rmax, ridx);
    const float lse = rmax + log(tg_sum(m == -INFINITY ? 0.0f : s * exp(m - rmax), sv, sg, lane, nsg));
    if (tid == 0 && args.logprobs != 0) {
      logprob_out[0] = (isnan(logits[token]) ? -INFINITY : logits[token]) - lse;
    }
    const uint n = min(min(args.top_logprobs, 20u), V);
    if (n > 0) {
      const uint tau = radix_select(logits, bias, counts, args, true, n, hist, sel, tid, ntg);
      if (tid == 0) {
        atomic_store_explicit(&cand_n, 0u, memory_order_relaxed);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint i = tid; i < V; i += ntg) {
        if (key_of(logits[i]) >= tau) {
          const uint slot = atomic_fetch_add_explicit(&cand_n, 1u, memory_order_relaxed);
          if (slot < kCand) {
            cand_key[slot] = key_of(logits[i]);
            cand_id[slot] = i;
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const uint k = min(atomic_load_explicit(&cand_n, memory_order_relaxed), kCand);
      for (uint j = tid; j < kCand; j += ntg) {
        if (j >= k) {
          cand_key[j] = 0u;
          cand_id[j] = kNone;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      sort_candidates(cand_key, cand_id, tid, ntg);
      for (uint j = tid; j < n; j += ntg) {
        top_ids[j] = cand_id[j];
        logprob_out[1 + j] = value_of(cand_key[j]) - lse;
      }
    }
  }

  if (tid == 0) {
    token_out[0] = token;
    if (args.update_counts != 0) {
      counts[token] += 1u;
    }
  }
}
