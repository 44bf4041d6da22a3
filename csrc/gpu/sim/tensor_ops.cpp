// The Metal 4 tensor-operation engine of the simulator (see tensor_ops.h for the model).
// Built with -ffp-contract=off: a product and the sum it feeds are rounded separately.
#include "gpu/sim/tensor_ops.h"

#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "gpu/sim/executor.h"
#include "gpu/sim/kernel_runtime.h"

namespace lily::sim::tensor_ops {
namespace {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float";
    case DType::f16: return "half";
    case DType::bf16: return "bfloat";
  }
  return "?";
}

size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

float load_elem(const View& v, int64_t i0, int64_t i1) {
  const unsigned char* p = static_cast<const unsigned char*>(v.data) + (i0 + i1 * v.stride1) * int64_t(dtype_size(v.dtype));
  switch (v.dtype) {
    case DType::f32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::f16: {
      _Float16 h;
      std::memcpy(&h, p, 2);
      return float(h);
    }
    case DType::bf16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      uint32_t u = uint32_t(b) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
  }
  return 0.0f;
}

void store_f32(const View& v, int64_t i0, int64_t i1, float x) {
  std::memcpy(static_cast<unsigned char*>(v.data) + (i0 + i1 * v.stride1) * 4, &x, 4);
}

float poison() {
  uint32_t u = 0xFFFFFFFFu;  // the simulator's poison pattern, a NaN
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

std::string describe_view(const View& v) {
  std::ostringstream s;
  s << dtype_name(v.dtype) << " tensor at " << v.data << " with extents (" << v.ext0 << ", " << v.ext1
    << ") and strides (1, " << v.stride1 << ")";
  return s.str();
}

std::string describe_scope(Scope s) {
  switch (s.kind) {
    case ScopeKind::thread: return "execution_thread";
    case ScopeKind::simdgroup: return "execution_simdgroup";
    case ScopeKind::simdgroups: return "execution_simdgroups<" + std::to_string(s.simdgroups) + ">";
  }
  return "?";
}

std::string describe_op(const Matmul& op) {
  std::ostringstream s;
  s << "matmul2d_descriptor(" << op.m << ", " << op.n << ", " << (op.k < 0 ? std::string("dynamic_extent") : std::to_string(op.k))
    << ", " << (op.transpose_left ? "true" : "false") << ", " << (op.transpose_right ? "true" : "false") << ", false, "
    << (op.accumulate ? "multiply_accumulate" : "multiply") << ")";
  return s.str();
}

// What a thread calls: the operation and its operands (identical for every thread of an
// instance). Compared field by field; described only for messages.
struct Signature {
  enum class Kind : uint8_t { run, load, store } kind = Kind::run;
  Matmul op;
  Scope scope;
  View a, b;       // run: left, right; load/store: the tensor in a
  bool a_coop = false, b_coop = false;  // run: a cooperative input (its element type in a.dtype / b.dtype)
  bool dst = false;  // run: a tensor destination (in view d) rather than a cooperative one
  View d;
};

bool same_view(const View& x, const View& y) {
  return x.data == y.data && x.dtype == y.dtype && x.ext0 == y.ext0 && x.ext1 == y.ext1 && x.stride1 == y.stride1;
}

// Two operands of one instance: the same tensor, or cooperative inputs of one element type
// (each thread holds its own part).
bool same_operand(const View& x, bool x_coop, const View& y, bool y_coop) {
  return x_coop == y_coop && (x_coop ? x.dtype == y.dtype : same_view(x, y));
}

bool operator==(const Signature& x, const Signature& y) {
  return x.kind == y.kind && x.op.m == y.op.m && x.op.n == y.op.n && x.op.k == y.op.k &&
         x.op.transpose_left == y.op.transpose_left && x.op.transpose_right == y.op.transpose_right &&
         x.op.accumulate == y.op.accumulate && x.scope.kind == y.scope.kind &&
         x.scope.simdgroups == y.scope.simdgroups && same_operand(x.a, x.a_coop, y.a, y.a_coop) &&
         (x.kind != Signature::Kind::run ||
          (same_operand(x.b, x.b_coop, y.b, y.b_coop) && x.dst == y.dst && (!x.dst || same_view(x.d, y.d))));
}

std::string describe_operand(const View& v, bool coop) {
  return coop ? std::string("cooperative ") + dtype_name(v.dtype) + " input" : describe_view(v);
}

std::string describe(const Signature& g) {
  std::string where = "(" + describe_op(g.op) + ", " + describe_scope(g.scope) + ")";
  switch (g.kind) {
    case Signature::Kind::run:
      return "matmul2d::run " + where + " of the left " + describe_operand(g.a, g.a_coop) + " and the right " +
             describe_operand(g.b, g.b_coop) + " into " +
             (g.dst ? "the " + describe_view(g.d) : std::string("a cooperative tensor"));
    case Signature::Kind::load: return "cooperative_tensor::load " + where + " from the " + describe_view(g.a);
    case Signature::Kind::store: return "cooperative_tensor::store " + where + " to the " + describe_view(g.a);
  }
  return "?";
}

// One instance of a scope operation: the k-th call of every thread of one scope.
struct Instance {
  Signature signature;  // the operation and its operands, identical for every caller
  int expected = 0, arrivals = 0, released = 0;
  // matmul2d::run: the operands as read at the first arrival (float), a: m_eff x K
  // (a[r * K + k]), b: the right operand's columns, n_eff x K (b[c * K + k]), and where
  // they came from (re-read at the last arrival).
  bool is_run = false;
  Matmul op;
  View left, right;
  bool left_coop = false, right_coop = false;  // cooperative inputs: filled by each arrival
  int m_eff = 0, n_eff = 0, K = 0;
  std::vector<float> a, b;
};

using SeqKey = std::tuple<int, int, int>;       // scope kind, scope id, thread index in threadgroup
using InstKey = std::tuple<int, int, uint32_t>;  // scope kind, scope id, call number

struct State : ThreadgroupExtension {
  std::map<SeqKey, uint32_t> seq;
  std::map<InstKey, Instance> inst;
  std::string finish() override {
    if (inst.empty()) return {};
    const Instance& i = inst.begin()->second;
    return "a tensor operation was entered by " + std::to_string(i.arrivals) + " of the " + std::to_string(i.expected) +
           " threads of its execution scope (every thread of the scope must call it, in the same order): " +
           describe(i.signature);
  }
};

State& state() {
  static const char key = 0;
  return static_cast<State&>(threadgroup_extension(&key, []() -> ThreadgroupExtension* { return new State; }));
}

// Operand geometry of a run: rows/K of the left, K/columns of the right.
void left_geometry(const Matmul& op, const View& v, int* rows, int* k) {
  *rows = op.transpose_left ? v.ext0 : v.ext1;
  *k = op.transpose_left ? v.ext1 : v.ext0;
}
void right_geometry(const Matmul& op, const View& v, int* k, int* cols) {
  *k = op.transpose_right ? v.ext0 : v.ext1;
  *cols = op.transpose_right ? v.ext1 : v.ext0;
}
float left_elem(const Matmul& op, const View& v, int r, int kk) {
  return op.transpose_left ? load_elem(v, r, kk) : load_elem(v, kk, r);
}
float right_elem(const Matmul& op, const View& v, int kk, int c) {
  return op.transpose_right ? load_elem(v, kk, c) : load_elem(v, c, kk);
}

void snapshot(Instance& in) {
  const Matmul& op = in.op;
  int rows = op.m, ka = op.k, kb = op.k, cols = op.n;  // a cooperative input is the whole tile
  if (!in.left_coop) left_geometry(op, in.left, &rows, &ka);
  if (!in.right_coop) right_geometry(op, in.right, &kb, &cols);
  auto what = [&] { return "matmul2d::run with " + describe_op(op) + ": "; };
  if (op.k < 0) {
    if (ka != kb)
      fail((what() + "the left operand has K = " + std::to_string(ka) + " and the right K = " + std::to_string(kb) +
            " (with a dynamic k they must be equal)").c_str());
    in.K = ka;
  } else {
    if (ka < op.k || kb < op.k)
      fail((what() + "the operands' K extents (left " + std::to_string(ka) + ", right " + std::to_string(kb) +
            ") are smaller than the descriptor's k; Lily's subset does not rely on edge handling along K")
               .c_str());
    in.K = op.k;
  }
  in.m_eff = std::min(op.m, rows);
  in.n_eff = std::min(op.n, cols);
  // cooperative inputs start as poison: every element comes from some thread's valid slot
  in.a.assign(size_t(in.m_eff) * in.K, poison());
  in.b.assign(size_t(in.K) * in.n_eff, poison());
  if (!in.left_coop)
    for (int r = 0; r < in.m_eff; ++r)
      for (int kk = 0; kk < in.K; ++kk) in.a[size_t(r) * in.K + kk] = left_elem(op, in.left, r, kk);
  if (!in.right_coop)
    for (int c = 0; c < in.n_eff; ++c)
      for (int kk = 0; kk < in.K; ++kk) in.b[size_t(c) * in.K + kk] = right_elem(op, in.right, kk, c);
}

// One cooperative input's valid slots of thread t into its tile (a [m][K] or b [n][K]):
// element (i0, i1) is (outer, kk) when `outer_first`, else (kk, outer).
void scatter(const Matmul& op, Role role, Scope s, int t, const float* coop, bool outer_first, int K,
             std::vector<float>& tile) {
  const Layout l = current_layout();
  for (int i = 0; i < input_capacity(op, role, scope_threads(s)); ++i) {
    const SlotIndex x = slot_index(l, op, role, s, t, i);
    if (!x.valid) continue;
    const int outer = outer_first ? x.i0 : x.i1, kk = outer_first ? x.i1 : x.i0;
    tile[size_t(outer) * K + kk] = coop[i];
  }
}

// An arriving thread's part of the cooperative inputs: its valid slots into the tiles.
void contribute(Instance& in, const Operand& left, const Operand& right, Scope s, int t) {
  const Matmul& op = in.op;
  if (left.coop) scatter(op, Role::left, s, t, left.coop, op.transpose_left, in.K, in.a);
  if (right.coop) scatter(op, Role::right, s, t, right.coop, !op.transpose_right, in.K, in.b);
}

// At the last arrival: the operands must still hold what the first arrival read.
void verify(const Instance& in) {
  const Matmul& op = in.op;
  auto changed = [&](const char* which, int i, int j) {
    fail(("matmul2d::run with " + describe_op(op) + ": the " + which + " operand changed (element " + std::to_string(i) +
          ", " + std::to_string(j) + " of the tile) while the threads of its execution scope were entering the "
          "operation: a thread of the scope wrote it after another had started run() (a missing "
          "threadgroup_barrier before run()?)").c_str());
  };
  for (int r = 0; !in.left_coop && r < in.m_eff; ++r)
    for (int kk = 0; kk < in.K; ++kk)
      if (!same_bits(in.a[size_t(r) * in.K + kk], left_elem(op, in.left, r, kk))) changed("left", r, kk);
  for (int c = 0; !in.right_coop && c < in.n_eff; ++c)
    for (int kk = 0; kk < in.K; ++kk)
      if (!same_bits(in.b[size_t(c) * in.K + kk], right_elem(op, in.right, kk, c))) changed("right", kk, c);
}

float dot(const Instance& in, int r, int c, float acc) {
  const float* a = &in.a[size_t(r) * in.K];
  const float* b = &in.b[size_t(c) * in.K];
  for (int kk = 0; kk < in.K; ++kk) {
    float p = a[kk] * b[kk];
    acc = acc + p;
  }
  return acc;
}

void rendezvous(Scope s, const char* what) {
  if (s.kind == ScopeKind::simdgroup)
    simd_collective(SimdgroupOp::tensor_op, nullptr, 0, 0, [](CollectiveView&) {});
  else if (s.kind == ScopeKind::simdgroups)
    threadgroup_rendezvous(what);
}

int scope_id(Scope s, const ThreadCoords& c) {
  switch (s.kind) {
    case ScopeKind::thread: return int(c.thread_index_in_threadgroup);
    case ScopeKind::simdgroup: return int(c.simdgroup_index_in_threadgroup);
    case ScopeKind::simdgroups: return 0;
  }
  return 0;
}

// Enters the calling thread into the next instance of its scope. first: whether it
// created the instance.
Instance& arrive(Scope s, const Signature& signature, bool* first, InstKey* key) {
  const ThreadCoords& c = coords();
  State& st = state();
  int id = scope_id(s, c);
  uint32_t q = st.seq[SeqKey{int(s.kind), id, int(c.thread_index_in_threadgroup)}]++;
  *key = InstKey{int(s.kind), id, q};
  auto it = st.inst.find(*key);
  *first = it == st.inst.end();
  if (*first) {
    it = st.inst.emplace(*key, Instance{}).first;
    it->second.signature = signature;
    it->second.expected = scope_threads(s);
  } else if (!(it->second.signature == signature)) {
    fail(("divergent tensor operations in one " + describe_scope(s) + " scope: this thread calls " + describe(signature) +
          " where another thread of the scope called " + describe(it->second.signature))
             .c_str());
  }
  it->second.arrivals += 1;
  return it->second;
}

// After the rendezvous: every thread of the scope must have arrived.
void check_complete(const Instance& in) {
  if (in.arrivals != in.expected)
    fail((std::to_string(in.expected - in.arrivals) + " thread(s) of the execution scope returned without calling " +
          describe(in.signature) + " (every thread of the scope must call it)")
             .c_str());
}

void release(const InstKey& key) {
  State& st = state();
  auto it = st.inst.find(key);
  if (it != st.inst.end() && ++it->second.released == it->second.expected) st.inst.erase(it);
}

}  // namespace

void fail(const char* message) { kernel_fail(message); }

Layout current_layout() { return running_dispatch().tensor_layout; }

int scope_index(Scope s) {
  const ThreadCoords& c = coords();
  uint32_t n = c.threads_per_threadgroup.x * c.threads_per_threadgroup.y * c.threads_per_threadgroup.z;
  switch (s.kind) {
    case ScopeKind::thread: return 0;
    case ScopeKind::simdgroup: {
      uint32_t lanes = std::min<uint32_t>(kSimdWidth, n - c.simdgroup_index_in_threadgroup * kSimdWidth);
      if (lanes != uint32_t(kSimdWidth))
        fail(("execution_simdgroup needs full simdgroups of 32 threads; simdgroup " +
              std::to_string(c.simdgroup_index_in_threadgroup) + " of this " + std::to_string(n) + "-thread threadgroup has " +
              std::to_string(lanes))
                 .c_str());
      return int(c.thread_index_in_simdgroup);
    }
    case ScopeKind::simdgroups:
      if (n != uint32_t(32 * s.simdgroups))
        fail((describe_scope(s) + " runs on " + std::to_string(s.simdgroups) + " simdgroups (" +
              std::to_string(32 * s.simdgroups) + " threads) but the threadgroup has " + std::to_string(n) +
              " threads; Metal requires the dispatched simdgroups to match the operation's")
                 .c_str());
      return int(c.thread_index_in_threadgroup);
  }
  return 0;
}

void run(const Matmul& op, Scope s, const Operand& left, const Operand& right, const View* dst, float* coop) {
  // the device offers such a kernel only with bfloat tensor ops (SimDevice::pipeline)
  if ((left.dtype == DType::bf16 || right.dtype == DType::bf16) && !running_kernel().tensor_bfloat)
    fail("matmul2d::run with bfloat operands in a kernel not registered as using them: msl2cpp.py marks the "
         "kernels of a *_tensor.metal file that names a tensor<... bfloat, ...> type");
  int t = scope_index(s);
  int T = scope_threads(s);
  Signature sig;
  sig.kind = Signature::Kind::run;
  sig.op = op;
  sig.scope = s;
  sig.a_coop = left.coop != nullptr;
  sig.b_coop = right.coop != nullptr;
  if (left.view) sig.a = *left.view;
  if (right.view) sig.b = *right.view;
  sig.a.dtype = left.dtype;
  sig.b.dtype = right.dtype;
  sig.dst = dst != nullptr;
  if (dst) sig.d = *dst;
  bool first;
  InstKey key;
  Instance& in = arrive(s, sig, &first, &key);
  if (first) {
    in.is_run = true;
    in.op = op;
    in.left = sig.a;
    in.right = sig.b;
    in.left_coop = sig.a_coop;
    in.right_coop = sig.b_coop;
    snapshot(in);
  }
  contribute(in, left, right, s, t);
  if (in.arrivals == in.expected) {
    if (in.expected > 1) verify(in);
    if (dst) {
      // The destination tensor is written once, by the last thread to arrive.
      int rows = std::min(op.m, dst->ext1), cols = std::min(op.n, dst->ext0);
      if (!op.accumulate) {
        // Apple's header defines every product as C = A B + C with C assumed zeroed, mode
        // multiply included, and does not promise that multiply ignores C: a kernel must
        // zero the destination, and one that does not fails here rather than on a Mac.
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < cols; ++c)
            if (load_elem(*dst, c, r) != 0.0f)
              fail(("matmul2d::run with " + describe_op(op) + " into a tensor whose element (row " + std::to_string(r) +
                    ", column " + std::to_string(c) + ") is not zero: zero the destination first (Apple's header "
                    "assumes C is zero in mode::multiply)").c_str());
      }
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) {
          float v = poison();
          if (r < in.m_eff && c < in.n_eff) v = dot(in, r, c, op.accumulate ? load_elem(*dst, c, r) : 0.0f);
          store_f32(*dst, c, r, v);
        }
    }
  }
  rendezvous(s, "matmul2d::run");
  Instance& done = state().inst.at(key);
  check_complete(done);
  if (coop) {
    const Layout l = current_layout();
    for (int i = 0; i < coop_capacity(op.m, op.n, T); ++i) {
      const SlotIndex x = slot_index(l, op, Role::destination, s, t, i);
      if (!x.valid) continue;
      const int r = x.i1, c = x.i0;
      coop[i] = r < done.m_eff && c < done.n_eff ? dot(done, r, c, op.accumulate ? coop[i] : 0.0f) : poison();
    }
  }
  release(key);
}

namespace {
// A cooperative tensor's load or store: the scope's threads meet on one signature, then
// each moves the elements it holds, move(i, row, column) for its element i.
template <class Move>
void coop_transfer(const Matmul& op, Scope s, Signature::Kind kind, const View& view, const char* what, Move move) {
  int t = scope_index(s);
  int T = scope_threads(s);
  Signature sig;
  sig.kind = kind;
  sig.op = op;
  sig.scope = s;
  sig.a = view;
  bool first;
  InstKey key;
  arrive(s, sig, &first, &key);
  rendezvous(s, what);
  check_complete(state().inst.at(key));
  const Layout l = current_layout();
  for (int i = 0; i < coop_capacity(op.m, op.n, T); ++i) {
    const SlotIndex x = slot_index(l, op, Role::destination, s, t, i);
    if (x.valid) move(i, x.i1, x.i0);
  }
  release(key);
}
}  // namespace

void coop_load(const Matmul& op, Scope s, float* coop, const View& src) {
  coop_transfer(op, s, Signature::Kind::load, src, "cooperative_tensor::load", [&](int i, int r, int c) {
    coop[i] = r < src.ext1 && c < src.ext0 ? load_elem(src, c, r) : poison();
  });
}

void coop_store(const Matmul& op, Scope s, const float* coop, const View& dst) {
  coop_transfer(op, s, Signature::Kind::store, dst, "cooperative_tensor::store", [&](int i, int r, int c) {
    if (r < dst.ext1 && c < dst.ext0) store_f32(dst, c, r, coop[i]);
  });
}

}  // namespace lily::sim::tensor_ops
