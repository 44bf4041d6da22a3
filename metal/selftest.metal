// Self-test kernels for the device layer: each exercises MSL constructs the simulator
// supports and is compared with numpy in tests/sim/. They are valid MSL (on macOS the build
// compiles them into lily_selftest.metallib, a compile check that is not installed); only
// the simulator registers them, the shipped lily.metallib holds no st_ kernel.
#include <metal_stdlib>
using namespace metal;

// ---- elementwise, templated over the element type ------------------------------------
template <typename T>
kernel void st_add(device const T* a [[buffer(0)]],
                   device const T* b [[buffer(1)]],
                   device T* out [[buffer(2)]],
                   constant uint& n [[buffer(3)]],
                   uint gid [[thread_position_in_grid]]) {
  if (gid < n) {
    out[gid] = T(float(a[gid]) + float(b[gid]));
  }
}
template [[host_name("st_add_f32")]] [[kernel]] decltype(st_add<float>) st_add<float>;
template [[host_name("st_add_f16")]] [[kernel]] decltype(st_add<half>) st_add<half>;
template [[host_name("st_add_bf16")]] [[kernel]] decltype(st_add<bfloat>) st_add<bfloat>;

// ---- float -> half / bfloat conversions (round to nearest even) ------------------------
kernel void st_convert(device const float* x [[buffer(0)]],
                       device half* h [[buffer(1)]],
                       device bfloat* bf [[buffer(2)]],
                       constant uint& n [[buffer(3)]],
                       uint gid [[thread_position_in_grid]]) {
  if (gid >= n) {
    return;
  }
  h[gid] = half(x[gid]);
  bf[gid] = bfloat(x[gid]);
}

// ---- every coordinate attribute, for geometry checks ---------------------------------
struct CoordParams {
  uint width;   // grid width in threads (row pitch of the output)
  uint fields;  // values written per thread
};

kernel void st_coords(device uint* out [[buffer(0)]],
                      constant CoordParams& p [[buffer(1)]],
                      uint2 tpig [[thread_position_in_grid]],
                      uint2 tptg [[thread_position_in_threadgroup]],
                      uint2 tgpig [[threadgroup_position_in_grid]],
                      uint2 tptgs [[threads_per_threadgroup]],
                      uint2 tgpg [[threadgroups_per_grid]],
                      uint tiitg [[thread_index_in_threadgroup]],
                      ushort sgitg [[simdgroup_index_in_threadgroup]],
                      ushort tiisg [[thread_index_in_simdgroup]]) {
  device uint* o = out + (tpig.y * p.width + tpig.x) * p.fields;
  o[0] = tpig.x;
  o[1] = tpig.y;
  o[2] = tptg.x;
  o[3] = tptg.y;
  o[4] = tgpig.x;
  o[5] = tgpig.y;
  o[6] = tptgs.x;
  o[7] = tptgs.y;
  o[8] = tgpg.x;
  o[9] = tgpg.y;
  o[10] = tiitg;
  o[11] = sgitg;
  o[12] = tiisg;
}

// ---- threadgroup reduction: static threadgroup memory + threadgroup_barrier ----------
// One threadgroup per row; any threadgroup size up to 256.
kernel void st_row_sum(device const float* x [[buffer(0)]],
                       device float* out [[buffer(1)]],
                       constant uint& cols [[buffer(2)]],
                       uint row [[threadgroup_position_in_grid]],
                       uint tid [[thread_position_in_threadgroup]],
                       uint tcount [[threads_per_threadgroup]]) {
  threadgroup float partial[256];
  float s = 0.0f;
  for (uint c = tid; c < cols; c += tcount) {
    s += x[row * cols + c];
  }
  partial[tid] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = 128; stride > 0; stride >>= 1) {
    if (tid < stride && tid + stride < tcount) {
      partial[tid] += partial[tid + stride];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) {
    out[row] = partial[0];
  }
}

// ---- two-level reduction: simd_sum inside simdgroups, threadgroup memory across ------
kernel void st_row_max_simd(device const float* x [[buffer(0)]],
                            device float* out [[buffer(1)]],
                            constant uint& cols [[buffer(2)]],
                            uint row [[threadgroup_position_in_grid]],
                            uint tid [[thread_position_in_threadgroup]],
                            uint tcount [[threads_per_threadgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  float m = -INFINITY;
  for (uint c = tid; c < cols; c += tcount) {
    m = max(m, x[row * cols + c]);
  }
  m = simd_max(m);
  if (lane == 0) {
    partial[sg] = m;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    float v = lane < nsg ? partial[lane] : -INFINITY;
    v = simd_max(v);
    if (lane == 0) {
      out[row] = v;
    }
  }
}

// ---- simd collectives, one output plane per operation ---------------------------------
// out[k * n + gid] for k = operation index; the threadgroup size may leave the last
// simdgroup partial (inactive lanes are not part of any collective).
kernel void st_simd_ops(device const float* x [[buffer(0)]],
                        device const uint* u [[buffer(1)]],
                        device float* out [[buffer(2)]],
                        constant uint& n [[buffer(3)]],
                        uint gid [[thread_position_in_grid]],
                        ushort lane [[thread_index_in_simdgroup]]) {
  float v = x[gid];
  uint w = u[gid];
  out[0 * n + gid] = simd_sum(v);
  out[1 * n + gid] = simd_max(v);
  out[2 * n + gid] = simd_min(v);
  out[3 * n + gid] = simd_prefix_inclusive_sum(v);
  out[4 * n + gid] = simd_prefix_exclusive_sum(v);
  out[5 * n + gid] = simd_shuffle(v, ushort(w % 32));
  out[6 * n + gid] = simd_shuffle_xor(v, ushort(1));
  out[7 * n + gid] = simd_shuffle_up(v, ushort(3));
  out[8 * n + gid] = simd_shuffle_down(v, ushort(5));
  out[9 * n + gid] = simd_broadcast(v, ushort(0));
  bool big = v > 0.5f;
  simd_vote vote = simd_ballot(big);
  out[10 * n + gid] = float(popcount(uint(static_cast<simd_vote::vote_t>(vote))));
  out[11 * n + gid] = simd_any(big) ? 1.0f : 0.0f;
  out[12 * n + gid] = simd_all(v > -10.0f) ? 1.0f : 0.0f;
  out[13 * n + gid] = float(simd_sum(w));
  out[14 * n + gid] = float(lane);
}

// ---- dynamic threadgroup memory: reverse each threadgroup's block ---------------------
kernel void st_tg_reverse(device const float4* x [[buffer(0)]],
                          device float4* out [[buffer(1)]],
                          threadgroup float4* scratch [[threadgroup(0)]],
                          uint gid [[thread_position_in_grid]],
                          uint tid [[thread_position_in_threadgroup]],
                          uint tcount [[threads_per_threadgroup]]) {
  scratch[tid] = x[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = scratch[tcount - 1 - tid];
}

// ---- reads threadgroup memory nobody wrote (poisoning must expose it) -----------------
kernel void st_tg_uninit(device float* out [[buffer(0)]],
                         uint tid [[thread_position_in_threadgroup]],
                         uint gid [[thread_position_in_grid]]) {
  threadgroup float scratch[64];
  if (tid % 2 == 0) {
    scratch[tid] = 1.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = scratch[tid];
}

// ---- a float array read as float4: under-aligned (threadgroup storage is aligned only as
// declared, on a GPU as in the simulator); the sanitizer build must report it -------------
kernel void st_tg_underaligned(device float4* out [[buffer(0)]],
                               uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float a[8];
  a[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    out[0] = *(threadgroup float4*)(a);
  }
}

// ---- a barrier after some threads returned: must be reported, never hang ---------------
kernel void st_bad_barrier(device float* out [[buffer(0)]],
                           uint tid [[thread_position_in_threadgroup]]) {
  if (tid >= 16) {
    return;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = 1.0f;
}

// ---- atomics: device histogram, float sum, threadgroup counter ------------------------
kernel void st_atomics(device const uint* keys [[buffer(0)]],
                       device const float* vals [[buffer(1)]],
                       device atomic_uint* hist [[buffer(2)]],
                       device atomic_float* total [[buffer(3)]],
                       device atomic_uint* groups_seen [[buffer(4)]],
                       constant uint& n [[buffer(5)]],
                       uint gid [[thread_position_in_grid]],
                       uint tid [[thread_position_in_threadgroup]]) {
  threadgroup atomic_uint local;
  if (tid == 0) {
    atomic_store_explicit(&local, 0u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (gid < n) {
    atomic_fetch_add_explicit(&hist[keys[gid]], 1u, memory_order_relaxed);
    atomic_fetch_add_explicit(total, vals[gid], memory_order_relaxed);
    atomic_fetch_add_explicit(&local, 1u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0 && atomic_load_explicit(&local, memory_order_relaxed) > 0) {
    atomic_fetch_add_explicit(groups_seen, 1u, memory_order_relaxed);
  }
}

// ---- vectors, swizzles, as_type and math ------------------------------------------------
kernel void st_vec_math(device const float4* a [[buffer(0)]],
                        device const float4* b [[buffer(1)]],
                        device float4* out [[buffer(2)]],
                        device uint* bits [[buffer(3)]],
                        device half4* hout [[buffer(4)]],
                        constant uint& n [[buffer(5)]],
                        uint gid [[thread_position_in_grid]]) {
  if (gid >= n) {
    return;
  }
  float4 x = a[gid];
  float4 y = b[gid];
  float4 r = x.wzyx * 2.0f + y;                    // swizzle, scalar broadcast
  r.xy = r.yx;                                     // swizzle assignment
  r.z = dot(x, y) + fma(x.x, y.y, 1.0f);
  r.w = clamp(exp(-abs(x.w)) + rsqrt(y.w * y.w + 1.0f), 0.0f, 1.5f);
  float3 c = float3(x.xy, 1.0f);
  r += float4(c, 0.0f) * select(float4(1.0f), float4(-1.0f), x > y);
  out[gid] = r;
  bits[gid] = as_type<uint>(x.x);
  hout[gid] = half4(x) + half4(1.0h);
}

// ---- simdgroup matrices: C = A x B, one simdgroup per 8x8 tile of C ---------------------
template <typename T>
kernel void st_matmul(device const T* A [[buffer(0)]],
                      device const T* B [[buffer(1)]],
                      device float* C [[buffer(2)]],
                      constant uint3& mnk [[buffer(3)]],
                      uint2 tile [[threadgroup_position_in_grid]]) {
  const uint K = mnk.z;
  const uint N = mnk.y;
  simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint k = 0; k < K; k += 8) {
    simdgroup_matrix<T, 8, 8> a;
    simdgroup_matrix<T, 8, 8> b;
    simdgroup_load(a, A, K, ulong2(k, tile.y * 8));
    simdgroup_load(b, B, N, ulong2(tile.x * 8, k));
    simdgroup_multiply_accumulate(acc, a, b, acc);
  }
  simdgroup_store(acc, C, N, ulong2(tile.x * 8, tile.y * 8));
}
template [[host_name("st_matmul_f32")]] [[kernel]] decltype(st_matmul<float>) st_matmul<float>;
template [[host_name("st_matmul_f16")]] [[kernel]] decltype(st_matmul<half>) st_matmul<half>;

// ---- simdgroup matrices with lane-dependent operands -------------------------------------
// Undefined on a GPU (the operands of a simdgroup_matrix operation are simdgroup-wide); the
// simulator keeps a whole matrix per lane and must give every lane its own product even
// though it computes a product once per simdgroup when the lanes' operands agree.
// C[t] = A[t or 0] * B + (... three times, from acc = 1), for thread t.
kernel void st_matmul_lanes(device const float* A [[buffer(0)]],
                            device const float* B [[buffer(1)]],
                            device float* C [[buffer(2)]],
                            constant uint& same [[buffer(3)]],
                            uint tid [[thread_position_in_grid]]) {
  simdgroup_float8x8 a;
  simdgroup_float8x8 b;
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  simdgroup_load(a, A + (same != 0 ? 0u : tid * 64u), 8);
  simdgroup_load(b, B, 8);
  for (int i = 0; i < 3; ++i) {
    simdgroup_multiply_accumulate(acc, a, b, acc);
  }
  simdgroup_store(acc, C + tid * 64u, 8);
}

// ---- token slots: step reads the previous slot and writes the next ---------------------
kernel void st_token_step(device const uint* prev [[buffer(0)]],
                          device uint* next [[buffer(1)]],
                          uint gid [[thread_position_in_grid]]) {
  if (gid == 0) {
    next[0] = prev[0] * 3u + 1u;
  }
}

// ---- 4-bit unpacking, integer ops, half math, vector collectives ------------------------
// For each packed uint (8 nibbles): out[8 * i + j] = (nibble j - 8) * scale[i], plus
// per-thread integer/half results.
kernel void st_bits(device const uint* packed [[buffer(0)]],
                    device const half* scale [[buffer(1)]],
                    device float* deq [[buffer(2)]],
                    device uint* ints [[buffer(3)]],
                    device half* halves [[buffer(4)]],
                    device float2* vsum [[buffer(5)]],
                    constant uint& n [[buffer(6)]],
                    uint gid [[thread_position_in_grid]]) {
  uint w = gid < n ? packed[gid] : 0u;
  uchar4 bytes = as_type<uchar4>(w);
  float one = fast::exp(0.0f) * precise::sqrt(1.0f);  // exactly 1 in both namespaces
  float s = gid < n ? float(scale[gid]) * one : 0.0f;
  if (gid < n) {
    for (uint j = 0; j < 4; ++j) {
      uchar b = bytes[j];
      deq[8 * gid + 2 * j] = float(int(b & 0xFu) - 8) * s;
      deq[8 * gid + 2 * j + 1] = float(int(b >> 4) - 8) * s;
    }
    ushort2 hl = as_type<ushort2>(w);
    ints[4 * gid + 0] = uint(hl.y) ^ uint(hl.x);
    ints[4 * gid + 1] = min(w, 1000u) + uint(max(int(w % 7u) - 3, 0));
    ints[4 * gid + 2] = clz(w) + 32u * ctz(w | 0x80000000u) + popcount(w);
    half h = half(s);
    halves[gid] = exp(h * 0.5h) + sqrt(abs(h));
  }
  // simdgroup collectives on vectors and integers (every thread participates)
  float2 v = float2(s, float(w & 0xFFu));
  vsum[gid] = simd_sum(v) + float2(0.0f, float(simd_prefix_exclusive_sum(w & 1u)));
  if (gid < n) {
    ints[4 * gid + 3] = simd_max(w >> 8);
  }
}

// ---- collectives after some lanes returned: only live lanes take part (valid on GPU) ---
kernel void st_partial_sum(device const float* x [[buffer(0)]],
                           device float* out [[buffer(1)]],
                           constant uint& live [[buffer(2)]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint gid [[thread_position_in_grid]]) {
  if (lane >= live) {
    return;
  }
  out[gid] = simd_sum(x[gid]);
}

// ---- divergent synchronisation: must be reported, never hang -----------------------------
kernel void st_divergent(device float* out [[buffer(0)]],
                         constant uint& mode [[buffer(1)]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint tid [[thread_position_in_threadgroup]]) {
  float v = float(lane);
  if (mode == 0) {
    // lanes disagree on the collective
    out[tid] = lane < 16 ? simd_sum(v) : simd_max(v);
  } else {
    // half the simdgroup waits in a collective, the other half at a threadgroup barrier
    if (lane < 16) {
      out[tid] = simd_sum(v);
    } else {
      threadgroup_barrier(mem_flags::mem_threadgroup);
      out[tid] = v;
    }
  }
}

// ---- barriers in nested loops: a prefix sum over a threadgroup's block -------------------
kernel void st_block_scan(device const uint* x [[buffer(0)]],
                          device uint* out [[buffer(1)]],
                          constant uint& n [[buffer(2)]],
                          uint gid [[thread_position_in_grid]],
                          uint tid [[thread_position_in_threadgroup]],
                          uint tcount [[threads_per_threadgroup]]) {
  threadgroup uint buf[2][256];
  uint cur = 0;
  buf[cur][tid] = gid < n ? x[gid] : 0u;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint offset = 1; offset < tcount; offset <<= 1) {
    uint nxt = 1 - cur;
    uint v = buf[cur][tid];
    if (tid >= offset) {
      v += buf[cur][tid - offset];
    }
    buf[nxt][tid] = v;
    cur = nxt;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (gid < n) {
    out[gid] = buf[cur][tid];
  }
}

// ---- execution order made visible: each dispatch takes a ticket --------------------------
kernel void st_ticket(device atomic_uint* counter [[buffer(0)]],
                      device uint* tickets [[buffer(1)]],
                      constant uint& slot [[buffer(2)]],
                      uint gid [[thread_position_in_grid]]) {
  if (gid == 0) {
    tickets[slot] = atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
  }
}

// ---- 3-component vectors: float3 has float4's size and alignment, packed_float3 has none -
kernel void st_float3(device const float3* v [[buffer(0)]],
                      device const packed_float3* pv [[buffer(1)]],
                      device float* out [[buffer(2)]],
                      constant uint& n [[buffer(3)]],
                      uint gid [[thread_position_in_grid]]) {
  if (gid >= n) {
    return;
  }
  float3 a = v[gid];
  float3 b = float3(pv[gid]);
  out[2 * gid] = a.x + 10.0f * a.y + 100.0f * a.z;
  out[2 * gid + 1] = b.x + 10.0f * b.y + 100.0f * b.z;
}

// ---- a data race when use_barrier == 0: each thread reads its neighbour's slot -----------
kernel void st_neighbour(device const float* x [[buffer(0)]],
                         device float* out [[buffer(1)]],
                         constant uint& use_barrier [[buffer(2)]],
                         uint gid [[thread_position_in_grid]],
                         uint tid [[thread_position_in_threadgroup]],
                         uint tcount [[threads_per_threadgroup]]) {
  threadgroup float slots[1024];
  slots[tid] = x[gid];
  if (use_barrier != 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = slots[(tid + 1) % tcount];
}

// ---- quad collectives and simd_shuffle_and_fill ------------------------------------------
kernel void st_quad(device const float* x [[buffer(0)]],
                    device float* out [[buffer(1)]],
                    constant uint& n [[buffer(2)]],
                    uint gid [[thread_position_in_grid]]) {
  float v = x[gid];
  float f = -v;
  out[0 * n + gid] = quad_sum(v);
  out[1 * n + gid] = quad_max(v);
  out[2 * n + gid] = quad_prefix_exclusive_sum(v);
  out[3 * n + gid] = quad_shuffle(v, ushort(3));
  out[4 * n + gid] = quad_shuffle_xor(v, ushort(1));
  out[5 * n + gid] = quad_shuffle_down(v, ushort(1));
  out[6 * n + gid] = simd_shuffle_and_fill_down(v, f, ushort(3));
  out[7 * n + gid] = simd_shuffle_and_fill_up(v, f, ushort(2), ushort(8));
}

// ---- threadgroups racing on device memory ------------------------------------------------
// st_race_rmw: each threadgroup adds 1 to counter[0] `rounds` times without atomics: its
// threads read the counter, meet at a barrier, and thread 0 stores what it read plus one, so
// two threadgroups running at the same time lose updates (as on a GPU), while one after
// another (the serial simulator, in any order) they count exactly. st_count_atomic: every
// thread adds ones[r % 32] (= 1) `rounds` times in a row with an atomic: exact however
// threadgroups interleave, while a plain add would lose updates whenever two OS threads run
// it at once.
kernel void st_race_rmw(device uint* counter [[buffer(0)]],
                        constant uint& rounds [[buffer(1)]],
                        uint tid [[thread_index_in_threadgroup]]) {
  for (uint r = 0; r < rounds; ++r) {
    const uint seen = counter[0];
    threadgroup_barrier(mem_flags::mem_device);
    if (tid == 0) {
      counter[0] = seen + 1;
    }
    threadgroup_barrier(mem_flags::mem_device);
  }
}

kernel void st_count_atomic(device atomic_uint* counter [[buffer(0)]],
                            constant uint& rounds [[buffer(1)]],
                            device const uint* ones [[buffer(2)]]) {
  for (uint r = 0; r < rounds; ++r) {
    atomic_fetch_add_explicit(counter, ones[r % 32], memory_order_relaxed);  // read each time
  }
}

// ---- threadgroups running at the same time -------------------------------------------------
// Threadgroup `id` (first_bound.x + its position) raises flags[id], polls flags[id ^ 1] up to
// first_bound.y times and stores what it last saw in seen[id]. One after another (the serial
// simulator) the first of a pair gives up before its partner starts; on OS threads of their
// own the two meet. A test of the simulator only: Metal does not promise that threadgroups
// run at the same time, so no shipped kernel may wait for another.
kernel void st_meet(device atomic_uint* flags [[buffer(0)]],
                    device uint* seen [[buffer(1)]],
                    constant uint2& first_bound [[buffer(2)]],
                    uint group [[threadgroup_position_in_grid]]) {
  const uint id = first_bound.x + group;
  atomic_store_explicit(&flags[id], 1u, memory_order_relaxed);
  for (uint polls = 0; polls < first_bound.y; ++polls) {
    if (atomic_load_explicit(&flags[id ^ 1u], memory_order_relaxed) != 0u) {
      break;
    }
  }
  seen[id] = atomic_load_explicit(&flags[id ^ 1u], memory_order_relaxed);
}

// ---- every threadgroup faults, the first one last ------------------------------------------
// Thread 0 of threadgroup 0 first adds `spin` times to *sink; then, in every threadgroup, half
// of the threads return before a threadgroup_barrier (a kernel fault). On several OS threads
// the other threadgroups fault first; the simulator still reports the earliest in its start
// order, threadgroup 0 in forward order.
kernel void st_fault_late(device atomic_uint* sink [[buffer(0)]],
                          constant uint& spin [[buffer(1)]],
                          uint group [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]]) {
  for (uint i = 0; group == 0 && tid == 0 && i < spin; ++i) {
    atomic_fetch_add_explicit(sink, 1u, memory_order_relaxed);
  }
  if (tid >= 16) {
    return;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
