// The session runtime: lifecycle (weights, buffers, load-time checks), session state and
// snapshots, the decode pipeline (two command buffers and two token slots in flight) and
// the chunked prefill driver. Every dispatch is encoded by the two phases' plans, DecodePlan
// (decode.cpp) and PrefillPlan (prefill.cpp), over the state this file owns.
#include "runtime/runtime.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <tuple>

#include "runtime/encoder.h"
#include "runtime/kernel_args.h"

namespace lily::runtime {

namespace {
std::string gib(uint64_t bytes) {
  char b[32];
  if (bytes >= (1ull << 30)) std::snprintf(b, sizeof b, "%.2f GiB", double(bytes) / double(1ull << 30));
  else std::snprintf(b, sizeof b, "%.1f MiB", double(bytes) / double(1ull << 20));
  return b;
}
// `x` after its validate() (which throws std::invalid_argument naming the field).
template <class T>
T validated(T x) {
  x.validate();
  return x;
}
}  // namespace

// The plans check, as they are built, that kernels exist for the dimensions.
Runtime::Runtime(std::shared_ptr<gpu::Device> device, ModelDims dims, const std::vector<TensorDesc>& tensors,
                 RuntimeOptions options)
    : device_(std::move(device)),
      dims_(validated(std::move(dims))),
      opt_(validated(options)),
      decode_(dims_, opt_),
      prefill_(dims_, opt_, decode_) {
  // Size everything first and refuse what does not fit the device before allocating; the
  // automatic prefill chunk is the largest candidate that fits (the last one is refused with
  // the numbers if none does); an explicit chunk that does not fit is refused naming the
  // largest candidate below it that would.
  MemoryUse weights;
  weights.max_context = opt_.max_context;
  for (const auto& [file, bytes] : WeightTable::file_extents(tensors)) {
    weights.weights += bytes;
    if (bytes > weights.largest_buffer) weights.largest_buffer = bytes, weights.largest_label = "weights " + file;
  }
  const gpu::MemoryLimits limits = device_->memory_limits();
  uint32_t chunk = 0;
  auto size_for = [&](uint32_t want) {
    chunk = std::max<uint32_t>(1, std::min(want, opt_.max_context));
    memory_ = weights;
    sizing_ = true;
    allocate_buffers(chunk);
    sizing_ = false;
    return fits_memory(memory_, limits);
  };
  if (!opt_.prefill_chunk) {
    for (uint32_t c : kAutoPrefillChunks)
      if (size_for(c)) break;
  } else if (!size_for(opt_.prefill_chunk)) {
    const uint32_t asked = chunk;
    std::string hint;
    for (uint32_t c : kAutoPrefillChunks) {
      if (c < asked && size_for(c)) {
        hint = " A smaller prefill_chunk also fits: " + std::to_string(c) + " (its scratch is " +
               gib(memory_.scratch) + "; 0 picks the largest that fits).";
        break;
      }
    }
    size_for(asked);  // the numbers of the chunk asked for
    try {
      check_memory(memory_, limits);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(e.what() + hint);
    }
  }
  check_memory(memory_, limits);
  weights_ = WeightTable(*device_, tensors, options.virtual_weights);
  model_ = ModelWeights::bind(weights_, dims_);
  allocate_buffers(chunk);
  record_only_ = seq_.tokens->contents() == nullptr;
  // The prefill GEMMs: Metal 4 tensor operations where the device has them (Apple10 / M5),
  // each family only once it computed what its twins compute.
  prefill_.select_paths(*device_);
  if (!record_only_) check_tensor_families();
  reset();
  for (;;) {  // a tensor family whose pipeline does not build at a shape the plan dispatches goes back
    try {
      preflight();
      break;
    } catch (const std::invalid_argument& e) {
      if (!drop_failed_family(e.what())) throw;
    }
  }
}

std::vector<std::string> Runtime::tensor_families() const {
  std::vector<std::string> out;
  for (auto f : {PrefillPlan::kGemmFamily, PrefillPlan::kMoeFamily, PrefillPlan::kAttentionFamily})
    if (prefill_.tensor_families() & f) out.push_back(PrefillPlan::family_name(f));
  return out;
}

bool Runtime::drop_failed_family(const std::string& error) {
  // the kernel a load error names, as 'name'
  for (size_t a = error.find('\''); a != std::string::npos; a = error.find('\'', a + 1)) {
    const size_t b = error.find('\'', a + 1);
    if (b == std::string::npos) break;
    const uint32_t family = PrefillPlan::family_of(error.substr(a + 1, b - a - 1));
    if (family & prefill_.tensor_families()) {
      prefill_.set_tensor_families(prefill_.tensor_families() & ~family);
      notices_.push_back(std::string("the Metal 4 tensor-op kernels of ") +
                         PrefillPlan::family_name(PrefillPlan::Family(family)) + " cannot run here (" + error +
                         "): prefill runs that family's simdgroup_matrix kernels");
      return true;
    }
    a = b;
  }
  return false;
}

void Runtime::check_tensor_families() {
  const uint32_t all = prefill_.tensor_families();
  if (!all) return;
  const ModelDims& d = dims_;
  // A short chunk of fixed tokens at position 0 through the first layer (every dense GEMM
  // kernel and the MoE: a DeltaNet layer has them all) and, for the attention, through the
  // first attention layer.
  uint32_t attn_layers = 1;
  while (attn_layers < d.num_hidden_layers && !d.full_attention[attn_layers - 1]) ++attn_layers;
  const uint32_t M = std::min<uint32_t>(16, prefill_scratch_.rows);
  std::vector<uint32_t> ids(M);
  for (uint32_t i = 0; i < M; ++i) ids[i] = uint32_t((uint64_t(i) * 2654435761u + 7) % d.vocab_size);
  const size_t H = d.hidden_size;
  // h after `layers` layers with the families in `mask` on the tensor path, expert tiles of
  // height `tile`; throws what the device throws (a pipeline that does not build, a fault)
  auto run = [&](uint32_t mask, uint32_t tile, uint32_t layers) {
    prefill_.set_tensor_families(mask);
    prefill_.bind(*device_, model_);
    reset();
    std::memcpy(prefill_scratch_.tok[0]->contents(), ids.data(), M * sizeof(uint32_t));
    Chunk chunk{0, 0, M, Logits::none, false};
    chunk.tile_rows = tile;
    chunk.layer_end = layers;  // no head: the residual h is compared
    auto cmd = device_->new_command_buffer();
    prefill_.encode_chunk(*cmd, prefill_scratch_, seq_, decode_scratch_, chunk, nullptr);
    cmd->commit();
    cmd->wait();
    const auto* h = static_cast<const float*>(prefill_scratch_.h->contents());
    return std::vector<float>(h, h + M * H);
  };
  // Rows compared by relative L2 error: each family's twins compute the same fp32 sums on the
  // same bfloat operands in another order (~1e-6), whose bfloat-stored outputs (z, q|gate, the
  // expert hidden and outputs, P in the attention) may then round one bfloat ulp (2^-8) apart
  // in a few elements: ~1e-4 for the GEMMs, more for the attention's softmax weights. A router
  // near-tie may pick another expert for a row, so up to an eighth of the rows may differ
  // more; a wrong kernel changes many.
  auto agree = [&](const std::vector<float>& a, const std::vector<float>& b, uint32_t layers, double bound,
                   std::string* why) {
    uint32_t off = 0;
    double worst = 0;
    for (uint32_t r = 0; r < M; ++r) {
      double e = 0, n = 0;
      for (size_t i = 0; i < H; ++i) {
        const double x = a[r * H + i], y = b[r * H + i];
        e += (x - y) * (x - y);
        n += y * y;
      }
      const double rel = std::sqrt(e / std::max(n, 1e-30));
      if (!(rel <= bound)) ++off;  // NaN counts
      if (!(rel <= worst)) worst = rel;
    }
    char b2[200];
    std::snprintf(b2, sizeof b2, "%u of %u rows of the residual after layer %u differ from the simdgroup_matrix "
                  "kernels' by more than %g relative (worst %.3g)", off, M, layers - 1, bound, worst);
    *why = b2;
    return off * 8 <= M;
  };
  uint32_t keep = 0;
  try {
    const std::vector<float> base = run(0, 64, 1);
    for (auto f : {PrefillPlan::kGemmFamily, PrefillPlan::kMoeFamily, PrefillPlan::kAttentionFamily}) {
      if (!(all & f)) continue;
      std::string why;
      bool ok = true;
      try {
        const uint32_t layers = f == PrefillPlan::kAttentionFamily ? attn_layers : 1;
        for (uint32_t tile : kExpertTileRows) {  // every tile height on the moe family; once for the others
          if (f != PrefillPlan::kMoeFamily && tile != 64) continue;
          // 128: tensor-op tiles only, against the simdgroup path's 64
          const std::vector<float> want = layers == 1 && tile >= 64 ? base : run(0, std::min<uint32_t>(tile, 64), layers);
          if (!agree(run(f, tile, layers), want, layers, f == PrefillPlan::kAttentionFamily ? 2e-2 : 1e-3, &why)) {
            ok = false;
            if (f == PrefillPlan::kMoeFamily) why += " with expert tiles of " + std::to_string(tile) + " rows";
            break;
          }
        }
      } catch (const std::exception& e) {
        ok = false;
        why = e.what();
      }
      if (ok) keep |= f;
      else notices_.push_back(std::string("the Metal 4 tensor-op kernels of ") + PrefillPlan::family_name(f) +
                              " failed their check at load (" + why + "): prefill runs that family's "
                              "simdgroup_matrix kernels");
    }
  } catch (const std::exception&) {  // the simdgroup path itself failed: the load's own checks say why
    keep = all;
  }
  prefill_.set_tensor_families(keep);
}

void Runtime::allocate_buffers(uint32_t chunk) {
  owned_.clear();
  const Alloc alloc{[this](size_t bytes, const char* label, Mem kind) { return scratch(bytes, label, kind); }};
  auto owned_bytes = [&] {
    uint64_t n = 0;
    for (auto& b : owned_) n += b->size();
    return n;
  };
  decode_scratch_ = decode_.allocate(alloc);
  batch_scratch_ = decode_.allocate(alloc, kernels::kBatchMaxRows);
  seq_ = allocate_sequence(alloc);
  const uint64_t before = owned_bytes();
  prefill_scratch_ = prefill_.allocate(chunk, alloc);
  prefill_scratch_.bytes = owned_bytes() - before;
  // what another sequence adds (open_sequence), counted without allocating
  sequence_bytes_ = 0;
  allocate_sequence(Alloc{[this](size_t bytes, const char*, Mem) {
    sequence_bytes_ += std::max<size_t>(bytes, 4);
    return gpu::BufferPtr();
  }});
}

SequenceState Runtime::allocate_sequence(const Alloc& alloc) {
  const auto& d = dims_;
  const size_t f = sizeof(float);
  SequenceState s;
  s.tokens = alloc(2 * sizeof(uint32_t), "token slots");
  s.positions = alloc(2 * sizeof(uint32_t), "positions");
  const size_t kv_bytes = size_t(d.num_key_value_heads) * opt_.max_context * d.head_dim * 2;
  for (auto* layers : {&s.k_cache, &s.v_cache, &s.conv[0], &s.conv[1], &s.state, &s.ring})
    layers->resize(d.num_hidden_layers);
  // one entry at least, as the kernel's binding needs a buffer
  const size_t ring_bytes = std::max(1u, decode_.ring_capacity()) * decode_.ring_entry_bytes();
  for (uint32_t l = 0; l < d.num_hidden_layers; ++l) {
    if (d.full_attention[l]) {
      s.k_cache[l] = alloc(kv_bytes, "k cache", Mem::kv_cache);
      s.v_cache[l] = alloc(kv_bytes, "v cache", Mem::kv_cache);
    } else {
      const size_t conv = size_t(d.linear_conv_kernel_dim - 1) * d.conv_dim() * f;
      s.conv[0][l] = alloc(conv, "conv state A", Mem::state);
      s.conv[1][l] = alloc(conv, "conv state B", Mem::state);
      s.state[l] = alloc(d.gdn_state_floats() * f, "recurrent state", Mem::state);
      s.ring[l] = alloc(ring_bytes, "recurrent state ring", Mem::state);
    }
  }
  s.counts = alloc(size_t(d.vocab_size) * sizeof(uint32_t), "token counts");
  s.bias = alloc(size_t(d.vocab_size) * f, "logit bias");
  s.logprob_out = alloc(2 * SequenceState::kMaxTopLogprobs * f, "logprobs (per slot)");
  s.top_ids = alloc(2 * SequenceState::kMaxTopLogprobs * sizeof(uint32_t), "top logprob ids (per slot)");
  return s;
}

SequenceState& Runtime::sequence(uint32_t seq) {
  return const_cast<SequenceState&>(static_cast<const Runtime*>(this)->sequence(seq));
}

const SequenceState& Runtime::sequence(uint32_t seq) const {
  if (seq == 0) return seq_;
  if (seq > extra_.size() || !extra_[seq - 1])
    throw std::invalid_argument("sequence " + std::to_string(seq) + " is not open");
  return *extra_[seq - 1];
}

uint32_t Runtime::sequence_room() const {
  const uint64_t budget = device_->memory_limits().working_set;
  if (!budget) return UINT32_MAX;
  const uint64_t used = memory_.total() + sequences_bytes();
  return used >= budget ? 0 : uint32_t(std::min<uint64_t>(UINT32_MAX - 1, (budget - used) / sequence_bytes_));
}

uint32_t Runtime::open_sequence() {
  if (record_only_) throw std::invalid_argument("open_sequence: the device is record-only");
  const gpu::MemoryLimits limits = device_->memory_limits();
  const uint64_t after = memory_.total() + sequences_bytes() + sequence_bytes_;
  if (sequence_room() == 0)
    throw std::length_error("open_sequence: another sequence needs " + gib(sequence_bytes_) +
                            " (KV cache at max_context " + std::to_string(opt_.max_context) +
                            ", state, ring, sampler buffers), which would take the runtime to " + gib(after) +
                            ", past this GPU's working set of " + gib(limits.working_set));
  size_t id = 0;
  while (id < extra_.size() && extra_[id]) ++id;
  auto s = std::make_unique<SequenceState>(allocate_sequence(
      Alloc{[this](size_t bytes, const char* label, Mem) {
        gpu::BufferPtr b = device_->new_buffer(std::max<size_t>(bytes, 4));
        b->set_label(label);
        return b;
      }}));
  if (id == extra_.size()) extra_.push_back(nullptr);
  extra_[id] = std::move(s);
  reset(uint32_t(id + 1));
  return uint32_t(id + 1);
}

void Runtime::close_sequence(uint32_t seq) {
  if (seq == 0) throw std::invalid_argument("close_sequence: sequence 0 is the session, not opened");
  sequence(seq);  // throws for one not open
  wait_sequence(seq);
  for (const Inflight& e : inflight_)
    for (const auto& [row, pos] : e.rows)
      if (row.seq == seq) throw std::logic_error("close_sequence: a ticket of this sequence was not taken");
  extra_[seq - 1].reset();
}

uint64_t Runtime::sequences_bytes() const {
  uint64_t n = 0;
  for (const auto& s : extra_)
    if (s) n += sequence_bytes_ + (s->host_logits ? s->host_logits->size() : 0);
  return n;
}

std::vector<uint32_t> Runtime::sequences() const {
  std::vector<uint32_t> out{0};
  for (size_t i = 0; i < extra_.size(); ++i)
    if (extra_[i]) out.push_back(uint32_t(i + 1));
  return out;
}

bool fits_memory(const MemoryUse& use, const gpu::MemoryLimits& limits) {
  return (!limits.working_set || use.total() <= limits.working_set) &&
         (!limits.max_buffer || use.largest_buffer <= limits.max_buffer);
}

void check_memory(const MemoryUse& use, const gpu::MemoryLimits& limits) {
  // KV bytes per token of context: what a smaller max_context saves.
  const uint64_t per_token = use.max_context ? use.kv_cache / use.max_context : 0;
  auto suggest = [&](uint64_t room) -> std::string {
    const uint64_t fits = per_token ? room / per_token / 256 * 256 : 0;
    if (fits < 256) return "";
    return " Try --max-context " + std::to_string(std::min<uint64_t>(fits, use.max_context)) +
           " (max_context=" + std::to_string(std::min<uint64_t>(fits, use.max_context)) + ").";
  };
  const uint64_t total = use.total();
  if (limits.working_set && total > limits.working_set) {
    const uint64_t fixed = total - use.kv_cache;
    std::string msg = "the model needs " + gib(total) + " of GPU memory at max_context " +
                      std::to_string(use.max_context) + " (weights " + gib(use.weights) + ", KV cache " +
                      gib(use.kv_cache) + ", recurrent state " + gib(use.state) + ", scratch " + gib(use.scratch) +
                      "), more than this GPU's recommended working set of " + gib(limits.working_set) + ".";
    if (fixed >= limits.working_set)
      msg += " The weights, state and scratch alone (" + gib(fixed) + ") exceed it" +
             (use.weights + use.state >= limits.working_set ? ": this model does not fit this device." : ".");
    else
      msg += suggest(limits.working_set - fixed);
    throw std::invalid_argument(msg);
  }
  if (limits.max_buffer && use.largest_buffer > limits.max_buffer) {
    std::string msg = "the buffer '" + use.largest_label + "' needs " + gib(use.largest_buffer) +
                      ", more than this GPU's largest buffer of " + gib(limits.max_buffer) + " (maxBufferLength).";
    if (use.largest_label == "k cache" || use.largest_label == "v cache")
      msg += suggest(uint64_t(double(limits.max_buffer) / double(use.largest_buffer) * double(use.kv_cache)));
    throw std::invalid_argument(msg);
  }
}

// A command buffer that keeps a DispatchRecord per dispatch, for load-time checks and
// estimates (a generation step keeps only the scalar counters).
std::unique_ptr<gpu::CommandBuffer> Runtime::logged_command_buffer() {
  auto cmd = device_->new_command_buffer();
  cmd->record_dispatches();
  return cmd;
}

void Runtime::preflight() {
  std::map<std::string, uint32_t> threads;
  auto collect = [&](gpu::CommandBuffer& cmd) {
    for (const gpu::DispatchRecord& r : cmd.counters().log)
      threads[r.kernel] = std::max(threads[r.kernel], uint32_t(r.threads.count()));
  };
  auto at_load = [](const std::exception& e) {
    return std::invalid_argument(std::string("the kernels cannot run on this device (checked at load): ") + e.what());
  };
  try {
    decode_.bind(*device_, model_);
    prefill_.bind(*device_, model_);
    // decode: plain and (when the context reaches it) split attention, each sampler
    for (uint32_t pos : {0u, opt_.max_context - 1}) {
      if (pos && !decode_.uses_split_attention(pos)) continue;
      auto cmd = logged_command_buffer();
      decode_.encode_step(*cmd, decode_scratch_, seq_, 0, pos, pos % opt_.state_window, nullptr);
      collect(*cmd);
    }
    if (opt_.state_window > 1) {
      auto cmd = logged_command_buffer();
      decode_.encode_state_writeback(*cmd, seq_, decode_.ring_capacity());
      collect(*cmd);
    }
    // the batched step (several requests decoding together): each width of the batched
    // kernels (batch_kernel) at the most rows it serves, up to the batch scratch's rows; the
    // record-only rows may share the session's buffers
    for (uint32_t width = 2; width / 2 < batch_scratch_.rows; width *= 2) {
      const uint32_t n = std::min(width, batch_scratch_.rows);
      const std::vector<DecodePlan::Row> rows(n, DecodePlan::Row{&seq_, 0, 0, 0});
      auto cmd = logged_command_buffer();
      decode_.encode_rows(*cmd, batch_scratch_, rows, nullptr);
      collect(*cmd);
    }
    {
      auto cmd = logged_command_buffer();
      gpu::ComputePass& pass = cmd->compute_pass();
      SequenceState probe = seq_;  // the session's buffers with other sampling settings
      probe.sampling = SamplingConfig{};
      probe.sampling.temperature = 1.0f;
      probe.sampling.logprobs = true;
      decode_.encode_sample(pass, decode_scratch_, probe, 0);
      probe.sampling = SamplingConfig{};  // greedy with a logit bias
      probe.sampling.logit_bias = {{0, 0.0f}};
      decode_.encode_sample(pass, decode_scratch_, probe, 0);
      pass.end();
      collect(*cmd);
    }
    // prefill: a full chunk with each expert tile height; a one-row chunk at the end of
    // the context (split attention when the context reaches it)
    for (uint32_t tile : kExpertTileRows) {
      if (!prefill_.expert_tile_available(tile)) continue;
      Chunk chunk = chunk_at(0, 0, prefill_scratch_.rows, Logits::last, true);
      chunk.tile_rows = tile;
      auto cmd = logged_command_buffer();
      prefill_.encode_chunk(*cmd, prefill_scratch_, seq_, decode_scratch_, chunk, nullptr);
      collect(*cmd);
    }
    if (opt_.max_context > 1) {
      auto cmd = logged_command_buffer();
      prefill_.encode_chunk(*cmd, prefill_scratch_, seq_, decode_scratch_,
                            chunk_at(0, opt_.max_context - 1, 1, Logits::last, false), nullptr);
      collect(*cmd);
    }
    {  // every-position logits
      auto cmd = logged_command_buffer();
      prefill_.encode_lm_head_rows(*cmd, prefill_scratch_, 0, prefill_scratch_.logits_rows);
      collect(*cmd);
    }
  } catch (const gpu::UsageError& e) {  // an unknown kernel, a threadgroup over the pipeline's limit
    throw at_load(e);
  } catch (const gpu::Error& e) {  // a pipeline that does not build
    throw at_load(e);
  }
  kernels_.clear();
  for (const auto& [name, n] : threads) {
    const gpu::Pipeline& p = device_->pipeline(name);
    kernels_.push_back(KernelUse{name, n, p.max_threads_per_threadgroup(), p.static_threadgroup_memory()});
  }
}

gpu::BufferPtr Runtime::scratch(size_t bytes, const char* label, Mem kind) {
  bytes = std::max<size_t>(bytes, 4);
  if (sizing_) {
    (kind == Mem::kv_cache ? memory_.kv_cache : kind == Mem::state ? memory_.state : memory_.scratch) += bytes;
    if (bytes > memory_.largest_buffer) memory_.largest_buffer = bytes, memory_.largest_label = label;
    return nullptr;
  }
  gpu::BufferPtr b = device_->new_buffer(bytes);
  b->set_label(label);
  owned_.push_back(b);
  return b;
}

void Runtime::reset(uint32_t id) {
  SequenceState& seq = sequence(id);
  if (id == 0) finish();
  wait_sequence(id);
  seq.position = seq.written = 0;
  if (id == 0 && inflight_.empty()) chunks_done_ = 0;
  if (record_only_) return;
  // The recurrent and conv state start at zero (a recurrent state's c = 0 means S = 0: the
  // kernels need no special case); the KV cache needs no clearing (rows past the position
  // are never read).
  for (uint32_t l = 0; l < dims_.num_hidden_layers; ++l) {
    if (dims_.full_attention[l]) continue;
    for (auto* buf : {seq.conv[0][l].get(), seq.conv[1][l].get(), seq.state[l].get()})
      std::memset(buf->contents(), 0, buf->size());
  }
}

// The session state as runs (buffer, offset, bytes, first run of a part) in snapshot order:
// per attention layer a K part and a V part (rows [0, position) of each KV head of the
// [Hkv, capacity, D] bf16 cache), per GDN layer the current conv state and the recurrent state.
template <typename F>
static void for_each_state_run(const ModelDims& d, uint32_t position, uint32_t capacity, const SequenceState& s,
                               F&& run) {
  const size_t row = size_t(d.head_dim) * 2;
  for (uint32_t l = 0; l < d.num_hidden_layers; ++l) {
    if (d.full_attention[l]) {
      for (gpu::Buffer* cache : {s.k_cache[l].get(), s.v_cache[l].get()})
        for (uint32_t h = 0; h < d.num_key_value_heads; ++h)
          run(*cache, size_t(h) * capacity * row, size_t(position) * row, h == 0);
    } else {
      gpu::Buffer& c = *s.conv[position % 2][l];
      run(c, 0, c.size(), true);
      run(*s.state[l], 0, s.state[l]->size(), true);
    }
  }
}

std::vector<std::vector<uint8_t>> SessionSnapshot::host_parts() const {
  std::vector<std::vector<uint8_t>> out;
  const auto* p = buffer ? static_cast<const uint8_t*>(buffer->contents()) : nullptr;
  size_t at = 0;
  for (uint64_t n : sizes) {
    if (n && !p) throw std::invalid_argument("snapshot: its buffer is not readable by the host");
    out.emplace_back(n ? p + at : nullptr, n ? p + at + n : nullptr);
    at += n;
  }
  return out;
}

SessionSnapshot SessionSnapshot::upload(gpu::Device& device, uint32_t position,
                                        const std::vector<std::pair<const void*, size_t>>& parts) {
  SessionSnapshot s;
  s.position = position;
  for (const auto& part : parts) s.sizes.push_back(part.second);
  if (!s.nbytes()) return s;
  s.buffer = device.new_buffer(s.nbytes());
  auto* dst = static_cast<uint8_t*>(s.buffer->contents());
  if (!dst) throw std::invalid_argument("snapshot: the device is record-only");
  s.buffer->set_label("session snapshot");
  for (const auto& [src, n] : parts) {
    if (n) std::memcpy(dst, src, n);
    dst += n;
  }
  return s;
}

// Encodes the copies between the session state (as for_each_state_run at `position`) and a
// snapshot buffer holding it back to back, in either direction, and runs them.
static void copy_state(gpu::Device& device, const ModelDims& d, uint32_t position, uint32_t capacity,
                       const SequenceState& s, gpu::Buffer& snapshot, bool to_snapshot) {
  std::unique_ptr<gpu::CommandBuffer> cmd = device.new_command_buffer();
  size_t at = 0;
  for_each_state_run(d, position, capacity, s, [&](gpu::Buffer& b, size_t offset, size_t n, bool) {
    if (to_snapshot) cmd->copy(b, offset, snapshot, at, n);
    else cmd->copy(snapshot, at, b, offset, n);
    at += n;
  });
  cmd->commit();
  cmd->wait();
}

SessionSnapshot Runtime::snapshot(uint32_t id) {
  SequenceState& seq = sequence(id);
  if (id == 0) finish();
  wait_sequence(id);
  if (record_only_) throw std::invalid_argument("snapshot: the device is record-only");
  if (seq.position > seq.written) {  // the snapshot holds the state itself, not the ring
    auto cmd = device_->new_command_buffer();
    decode_.encode_state_writeback(*cmd, seq, seq.position - seq.written);
    cmd->commit();
    cmd->wait();  // device time not counted, as the copies' is not
    seq.written = seq.position;
  }
  SessionSnapshot s;
  s.position = seq.position;
  for_each_state_run(dims_, seq.position, opt_.max_context, seq,
                     [&](gpu::Buffer&, size_t, size_t n, bool first) {
                       if (first) s.sizes.push_back(0);
                       s.sizes.back() += n;
                     });
  if (!s.nbytes()) return s;
  s.buffer = device_->new_buffer(s.nbytes());
  s.buffer->set_label("session snapshot");
  copy_state(*device_, dims_, seq.position, opt_.max_context, seq, *s.buffer, true);
  return s;
}

void Runtime::restore(const SessionSnapshot& s, uint32_t id) {
  SequenceState& seq = sequence(id);
  if (id == 0) finish();
  wait_sequence(id);
  if (record_only_) throw std::invalid_argument("restore: the device is record-only");
  if (s.position > opt_.max_context)
    throw std::invalid_argument("restore: the snapshot holds " + std::to_string(s.position) +
                                " tokens, more than the context window of " +
                                std::to_string(opt_.max_context));
  std::vector<uint64_t> sizes;  // checked before anything is written
  for_each_state_run(dims_, s.position, opt_.max_context, seq,
                     [&](gpu::Buffer&, size_t, size_t n, bool first) {
                       if (first) sizes.push_back(0);
                       sizes.back() += n;
                     });
  if (sizes != s.sizes || (s.nbytes() && (!s.buffer || s.buffer->size() < s.nbytes())))
    throw std::invalid_argument("restore: the snapshot comes from a runtime of another model");
  if (s.nbytes()) {
    try {  // a rejected copy is thrown while encoding, before anything runs
      copy_state(*device_, dims_, s.position, opt_.max_context, seq, *s.buffer, false);
    } catch (const gpu::UsageError& e) {
      throw std::invalid_argument(std::string("restore: the snapshot is not in this device's memory (") +
                                  e.what() + ")");
    }
  }
  seq.position = seq.written = s.position;
  if (id == 0 && inflight_.empty()) chunks_done_ = 0;
}

std::vector<uint32_t> Runtime::expert_histogram(uint32_t layer) const {
  if (layer >= dims_.num_hidden_layers) throw std::invalid_argument("expert_histogram: no such layer");
  if (record_only_ || chunks_done_ == 0) return std::vector<uint32_t>(dims_.num_experts, 0);
  const auto* h =
      static_cast<const uint32_t*>(prefill_scratch_.hist[(chunks_done_ - 1) % 2][layer]->contents());
  return std::vector<uint32_t>(h, h + dims_.num_experts);
}

void Runtime::encode_session_step(gpu::CommandBuffer& cmd, SequenceState& seq, int slot, uint32_t position) {
  decode_.encode_step(cmd, decode_scratch_, seq, slot, position, position - seq.written, nullptr);
  if (decode_.ends_window(position)) seq.written = position + 1;
}

Chunk Runtime::chunk_at(int parity, uint32_t p0, uint32_t rows, Logits logits, bool sample) const {
  Chunk c{parity, p0, rows, logits, sample};
  // The newest chunk known to be complete: the previous one when it was waited for, else
  // the one before (creating this chunk's command buffer waited for it: at most two are
  // outstanding). A chunk of another sequence counts alike: the histograms only choose tile
  // heights, which do not change the results (docs/prefill.md "Choosing T").
  bool pending = false;
  for (const Inflight& e : inflight_) pending = pending || (e.chunk && !e.waited);
  const uint64_t back = pending ? 2 : 1;
  if (!record_only_ && back <= chunks_done_) c.measured = int((chunks_done_ - back) % 2);
  return c;
}

void Runtime::write_token(SequenceState& seq, int slot, uint32_t token, uint32_t position) {
  static_cast<uint32_t*>(seq.tokens->contents())[slot] = token;
  static_cast<uint32_t*>(seq.positions->contents())[slot] = position;
}

void Runtime::check_feed(const SequenceState& seq, const std::vector<uint32_t>& tokens, const char* what) const {
  if (record_only_) throw std::invalid_argument(std::string(what) + ": the device is record-only");
  if (tokens.empty()) throw std::invalid_argument(std::string(what) + ": no tokens");
  if (uint64_t(seq.position) + tokens.size() > opt_.max_context)
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(seq.position) +
                                " tokens in context + " + std::to_string(tokens.size()) +
                                " new exceed the context window of " + std::to_string(opt_.max_context));
  for (uint32_t tok : tokens)
    if (tok >= dims_.vocab_size)
      throw std::invalid_argument(std::string(what) + ": token id " + std::to_string(tok) +
                                  " is outside the vocabulary");
}

std::unique_ptr<gpu::CommandBuffer> Runtime::encode_chunk(uint32_t id, SequenceState& seq, const uint32_t* tokens,
                                                          uint32_t M, Logits logits, bool sample) {
  const int parity = int(chunks_done_ % 2);
  // Creating a command buffer waits for the one two back (kMaxInFlight), so the chunk two
  // back, whose token buffer is reused, has completed.
  auto cmd = device_->new_command_buffer();
  std::memcpy(prefill_scratch_.tok[parity]->contents(), tokens, M * sizeof(uint32_t));
  if (sample) static_cast<uint32_t*>(seq.positions->contents())[(seq.position + M - 1) % 2] = seq.position + M - 1;
  // decode steps before this prefill: written back first, the scan reads the state
  if (seq.position > seq.written) decode_.encode_state_writeback(*cmd, seq, seq.position - seq.written);
  Chunk chunk = chunk_at(parity, seq.position, M, logits, sample);
  // The chunk's layers in command buffers of bounded work (layer_groups), each but the last
  // committed as it is encoded: two in flight keep the GPU busy while the host encodes the next.
  const auto groups = prefill_.layer_groups(seq.position, M);
  for (size_t g = 0; g < groups.size(); ++g) {
    if (g) cmd = device_->new_command_buffer();
    std::tie(chunk.layer_begin, chunk.layer_end) = groups[g];
    prefill_.encode_chunk(*cmd, prefill_scratch_, seq, decode_scratch_, chunk, nullptr);
    if (g + 1 < groups.size()) commit(std::move(cmd), {}, {id}, false, true);
  }
  seq.position += M;
  seq.written = seq.position;  // the scan writes the state back (set once both are encoded)
  ++chunks_done_;
  return cmd;
}

void Runtime::keep_logits(gpu::CommandBuffer& cmd, SequenceState& seq, const DecodeScratch& s, uint32_t row) {
  const size_t bytes = size_t(dims_.vocab_size) * sizeof(float);
  if (!seq.host_logits) {
    seq.host_logits = device_->new_buffer(bytes);
    seq.host_logits->set_label("host-sampled logits");
  }
  cmd.copy(*s.logits, s.at(s.logits, row), *seq.host_logits, 0, bytes);
}

uint64_t Runtime::commit(std::unique_ptr<gpu::CommandBuffer> cmd, std::vector<std::pair<StepRow, uint32_t>> rows,
                         std::vector<uint32_t> seqs, bool outputs, bool chunk) {
  cmd->commit();
  Inflight e;
  e.cmd = std::move(cmd);
  e.ticket = outputs ? next_ticket_++ : 0;
  e.rows = std::move(rows);
  e.seqs = std::move(seqs);
  e.chunk = chunk;
  inflight_.push_back(std::move(e));
  // Entries without outputs are dropped once complete (creating a command buffer waited for
  // all but one of those before it): their faults surface here, in commit order.
  while (inflight_.size() > 2 && inflight_.front().ticket == 0) pop_front();
  return inflight_.back().ticket;
}

void Runtime::pop_front() {
  Inflight e = std::move(inflight_.front());
  inflight_.pop_front();  // first: a fault is reported once
  if (!e.waited) wait_timed(*e.cmd);
}

// Commits prefill chunks for tokens[begin, end) of sequence `id` at its position (which
// advances as they are committed); the last chunk gets `last_logits` / `sample`.
uint64_t Runtime::run_chunks(uint32_t id, const std::vector<uint32_t>& tokens, size_t begin, size_t end,
                             Logits last_logits, bool sample, bool ticket) {
  SequenceState& seq = sequence(id);
  uint64_t t = 0;
  for (size_t s = begin; s < end; s += prefill_scratch_.rows) {
    const uint32_t M = uint32_t(std::min<size_t>(prefill_scratch_.rows, end - s));
    const bool last = s + M == end;
    const uint32_t p = seq.position;
    auto cmd = encode_chunk(id, seq, tokens.data() + s, M, last ? last_logits : Logits::none, last && sample);
    const bool keep = last && ticket;
    if (keep && last_logits == Logits::last) keep_logits(*cmd, seq, decode_scratch_, 0);
    StepRow row{id, -1, last_logits == Logits::last};
    t = commit(std::move(cmd), keep ? std::vector<std::pair<StepRow, uint32_t>>{{row, p + M - 1}}
                                    : std::vector<std::pair<StepRow, uint32_t>>{},
               {id}, keep, true);
  }
  return t;
}

void Runtime::wait_timed(gpu::CommandBuffer& cmd) {
  cmd.wait();
  const auto [start, end] = cmd.gpu_interval();
  if (!(start == start && end == end)) return;  // NaN: no device time
  // Waited in commit order; a buffer may start before the previous one ends (the GPU
  // overlaps them): count only the time not counted yet, so the total never exceeds the
  // span the device was busy.
  gpu_seconds_ += std::max(0.0, end - std::max(start, gpu_last_end_));
  gpu_last_end_ = std::max(gpu_last_end_, end);
}

void Runtime::wait_all() {
  for (Inflight& e : inflight_) {
    if (!e.waited) {
      e.waited = true;  // first: a fault is reported once
      wait_timed(*e.cmd);
    }
  }
  while (!inflight_.empty() && inflight_.front().ticket == 0) inflight_.pop_front();
}

void Runtime::wait_sequence(uint32_t id) {
  size_t last = 0;
  for (size_t i = 0; i < inflight_.size(); ++i)
    for (uint32_t s : inflight_[i].seqs)
      if (s == id) last = i + 1;
  for (size_t i = 0; i < last; ++i) {
    if (!inflight_[i].waited) {
      inflight_[i].waited = true;  // first: a fault is reported once
      wait_timed(*inflight_[i].cmd);
    }
  }
  while (!inflight_.empty() && inflight_.front().ticket == 0 && inflight_.front().waited) inflight_.pop_front();
}

std::vector<float> Runtime::forward(const std::vector<uint32_t>& tokens, Logits logits, bool decode_steps,
                                    uint32_t id) {
  SequenceState& seq = sequence(id);
  if (id == 0) finish();  // a generation left open ends here (its steps are part of the session)
  wait_sequence(id);
  check_feed(seq, tokens, "forward");
  const size_t V = dims_.vocab_size, n = tokens.size();
  std::vector<float> out(logits == Logits::all ? n * V : logits == Logits::last ? V : 0);
  if (decode_steps || n == 1) {
    for (size_t i = 0; i < n; ++i) {
      const int slot = seq.position % 2;
      write_token(seq, slot, tokens[i], seq.position);
      auto cmd = device_->new_command_buffer();
      encode_session_step(*cmd, seq, slot, seq.position);
      cmd->commit();
      wait_timed(*cmd);
      ++seq.position;
      if (logits == Logits::all || (logits == Logits::last && i + 1 == n))
        std::memcpy(out.data() + (logits == Logits::all ? i * V : 0), decode_scratch_.logits->contents(),
                    V * sizeof(float));
    }
    return out;
  }
  if (logits != Logits::all) {
    run_chunks(id, tokens, 0, n, logits, false, false);
    wait_all();
    if (logits == Logits::last) std::memcpy(out.data(), decode_scratch_.logits->contents(), V * sizeof(float));
    return out;
  }
  // Every position's logits: after each chunk, lm_head over its normed rows in blocks.
  for (size_t s = 0; s < n; s += prefill_scratch_.rows) {
    const uint32_t M = uint32_t(std::min<size_t>(prefill_scratch_.rows, n - s));
    run_chunks(id, tokens, s, s + M, Logits::all, false, false);
    for (uint32_t r0 = 0; r0 < M; r0 += prefill_scratch_.logits_rows) {
      const uint32_t R = std::min(prefill_scratch_.logits_rows, M - r0);
      auto cmd = device_->new_command_buffer();
      prefill_.encode_lm_head_rows(*cmd, prefill_scratch_, r0, R);
      cmd->commit();
      wait_timed(*cmd);
      std::memcpy(out.data() + (s + r0) * V, prefill_scratch_.logits->contents(),
                  size_t(R) * V * sizeof(float));
    }
    wait_all();
  }
  return out;
}

void Runtime::begin(uint32_t id, const SamplingConfig& cfg, const std::vector<uint32_t>& prompt) {
  SequenceState& seq = sequence(id);
  if (record_only_) throw std::invalid_argument("generate: the device is record-only");
  if (cfg.top_logprobs + 1 > SequenceState::kMaxTopLogprobs)
    throw std::invalid_argument("generate: top_logprobs > 20");
  for (const auto& [t, b] : cfg.logit_bias)
    if (t >= dims_.vocab_size) throw std::invalid_argument("generate: logit_bias token id outside the vocabulary");
  wait_sequence(id);  // its counts and bias may still be read by work in flight
  seq.sampling = cfg;
  auto* counts = static_cast<uint32_t*>(seq.counts->contents());
  std::memset(counts, 0, seq.counts->size());
  for (uint32_t t : prompt)
    if (t < dims_.vocab_size) counts[t] = 0x80000000u;
  if (!cfg.logit_bias.empty()) {  // uploaded once per generation; the kernels read it every step
    auto* bias = static_cast<float*>(seq.bias->contents());
    std::memset(bias, 0, seq.bias->size());
    for (const auto& [t, b] : cfg.logit_bias) bias[t] = b;
  }
}

uint64_t Runtime::submit_chunk(uint32_t id, const std::vector<uint32_t>& tokens, bool sample, bool logits) {
  SequenceState& seq = sequence(id);
  check_feed(seq, tokens, "submit_chunk");
  if (tokens.size() > prefill_scratch_.rows)
    throw std::invalid_argument("submit_chunk: " + std::to_string(tokens.size()) + " tokens, more than the chunk of " +
                                std::to_string(prefill_scratch_.rows));
  return run_chunks(id, tokens, 0, tokens.size(), logits ? Logits::last : Logits::none, sample, sample || logits);
}

uint64_t Runtime::submit_step(const std::vector<StepRow>& rows) {
  if (rows.empty()) throw std::invalid_argument("submit_step: no rows");
  std::vector<uint32_t> seqs;
  for (const StepRow& r : rows) {
    const SequenceState& seq = sequence(r.seq);
    if (std::find(seqs.begin(), seqs.end(), r.seq) != seqs.end())
      throw std::invalid_argument("submit_step: sequence " + std::to_string(r.seq) + " twice");
    if (seq.position >= opt_.max_context)
      throw std::invalid_argument("submit_step: sequence " + std::to_string(r.seq) + " fills the context window");
    if (r.token >= int64_t(dims_.vocab_size))
      throw std::invalid_argument("submit_step: token id " + std::to_string(r.token) + " is outside the vocabulary");
    // its output two steps back must have been taken: the slots are reused
    int untaken = 0;
    for (const Inflight& e : inflight_)
      for (const auto& [row, pos] : e.rows) untaken += row.seq == r.seq;
    if (untaken >= 2)
      throw std::logic_error("submit_step: sequence " + std::to_string(r.seq) + " has two steps not taken");
    seqs.push_back(r.seq);
  }
  auto cmd = device_->new_command_buffer();
  std::vector<std::pair<StepRow, uint32_t>> done;
  std::vector<BatchRow> batch;
  for (const StepRow& r : rows) {
    SequenceState& seq = sequence(r.seq);
    const uint32_t pos = seq.position;
    const int slot = pos % 2;
    if (r.token >= 0) write_token(seq, slot, uint32_t(r.token), pos);
    else static_cast<uint32_t*>(seq.positions->contents())[slot] = pos;  // the token itself comes from the GPU
    batch.push_back(BatchRow{&seq, slot, pos, pos - seq.written, r.logits});
    done.emplace_back(r, pos);
  }
  encode_batch(*cmd, batch, nullptr);
  for (const BatchRow& b : batch) {
    if (decode_.ends_window(b.position)) b.seq->written = b.position + 1;
    ++b.seq->position;
  }
  return commit(std::move(cmd), std::move(done), std::move(seqs), true, false);
}

void Runtime::encode_batch(gpu::CommandBuffer& cmd, const std::vector<BatchRow>& rows, Traffic* traffic) {
  if (rows.size() == 1) {  // the batch-1 step, exactly
    const BatchRow& r = rows[0];
    decode_.encode_step(cmd, decode_scratch_, *r.seq, r.slot, r.position, r.pending, traffic);
    if (r.logits) keep_logits(cmd, *r.seq, decode_scratch_, 0);
    return;
  }
  // up to kBatchMaxRows rows per step of the batched kernels
  for (size_t i = 0; i < rows.size(); i += batch_scratch_.rows) {
    const size_t end = std::min(rows.size(), i + batch_scratch_.rows);
    std::vector<DecodePlan::Row> group;
    for (size_t j = i; j < end; ++j)
      group.push_back({rows[j].seq, rows[j].slot, rows[j].position, rows[j].pending});
    decode_.encode_rows(cmd, batch_scratch_, group, traffic);
    for (size_t j = i; j < end; ++j)
      if (rows[j].logits) keep_logits(cmd, *rows[j].seq, batch_scratch_, uint32_t(j - i));
  }
}

std::vector<RowOutput> Runtime::take(uint64_t ticket, double* gpu_seconds, bool timed) {
  while (!inflight_.empty() && inflight_.front().ticket != ticket) {
    if (inflight_.front().ticket != 0)
      throw std::logic_error("take: ticket " + std::to_string(inflight_.front().ticket) + " was not taken before " +
                             std::to_string(ticket));
    pop_front();
  }
  if (inflight_.empty()) throw std::invalid_argument("take: no ticket " + std::to_string(ticket) + " in flight");
  Inflight e = std::move(inflight_.front());
  inflight_.pop_front();
  if (!e.waited) {
    if (timed) wait_timed(*e.cmd);
    else e.cmd->wait();
  }
  if (gpu_seconds) {
    const auto [start, end] = e.cmd->gpu_interval();
    *gpu_seconds = end - start;
  }
  std::vector<RowOutput> out;
  for (const auto& [row, pos] : e.rows) {
    SequenceState& seq = sequence(row.seq);
    RowOutput o;
    o.seq = row.seq;
    o.position = pos;
    const int slot = pos % 2;
    if (row.logits) {
      const float* l = static_cast<const float*>(seq.host_logits->contents());
      o.logits.assign(l, l + dims_.vocab_size);
    } else {
      o.step.token = static_cast<const uint32_t*>(seq.tokens->contents())[slot ^ 1];
      if (seq.sampling.logprobs) {
        const float* lp =
            static_cast<const float*>(seq.logprob_out->contents()) + slot * SequenceState::kMaxTopLogprobs;
        const uint32_t* ids =
            static_cast<const uint32_t*>(seq.top_ids->contents()) + slot * SequenceState::kMaxTopLogprobs;
        o.step.logprob = lp[0];
        for (uint32_t i = 0; i < seq.sampling.top_logprobs; ++i) o.step.top.emplace_back(ids[i], lp[1 + i]);
      }
    }
    out.push_back(std::move(o));
  }
  return out;
}

void Runtime::start(const std::vector<uint32_t>& feed, const SamplingConfig& cfg, uint32_t max_steps,
                    const std::vector<uint32_t>& prompt) {
  if (generating_) throw std::logic_error("generate: a generation is already running");
  check_feed(seq_, feed, "generate");
  begin(0, cfg, prompt);
  // The feed's last token is the input of "step 0", which samples the first output: a
  // decode step for a single token, else the last prefill chunk (ending with the sampler).
  const size_t n = feed.size();
  uint64_t step0 = 0;
  if (n > 1 && max_steps > 0) {
    const size_t tail = (n - 1) % prefill_scratch_.rows + 1;  // tokens of the last chunk
    run_chunks(0, feed, 0, n - tail, Logits::none, false, false);
    step0 = run_chunks(0, feed, n - tail, n, Logits::none, true, true);
  } else if (n > 1) {
    run_chunks(0, feed, 0, n - 1, Logits::none, false, false);
  }
  // the steps' budget counts the feed's last token as step 0's input
  gen_steps_ = uint32_t(std::min<uint64_t>(max_steps, uint64_t(opt_.max_context) - (seq_.position - (step0 ? 1 : 0))));
  gen_encoded_ = 0;
  gen_tickets_.clear();
  generating_ = true;
  if (step0) {
    gen_tickets_.push_back(step0);
    gen_encoded_ = 1;
  } else if (gen_steps_) {
    gen_tickets_.push_back(submit_step({StepRow{0, int64_t(feed.back()), false}}));
    gen_encoded_ = 1;
  } else {
    write_token(seq_, seq_.position % 2, feed.back(), seq_.position);
  }
}

bool Runtime::next(StepOutput* out) {
  if (!generating_) throw std::logic_error("generate: next() without start()");
  if (gen_tickets_.empty()) return false;
  // Encode step n+1 before waiting on step n, so the device never idles on the host.
  if (gen_encoded_ < gen_steps_ && gen_tickets_.size() < 2) {
    gen_tickets_.push_back(submit_step({StepRow{0, -1, false}}));
    ++gen_encoded_;
  }
  const uint64_t t = gen_tickets_.front();
  gen_tickets_.pop_front();
  *out = take(t).front().step;
  return true;
}

void Runtime::finish() {
  if (generating_) {
    generating_ = false;  // before the waits: a fault leaves no generation open
    auto tickets = std::move(gen_tickets_);
    gen_tickets_.clear();
    for (uint64_t t : tickets) take(t, nullptr, false);  // the speculative step: not counted
  }
  wait_all();
}

std::vector<uint32_t> Runtime::generate_greedy(uint32_t first, uint32_t max_tokens,
                                               const std::set<uint32_t>& stop_ids) {
  std::vector<uint32_t> out;
  if (max_tokens == 0) return out;
  start({first}, SamplingConfig{}, max_tokens, {});
  StepOutput o;
  while (next(&o)) {
    out.push_back(o.token);
    if (stop_ids.count(o.token)) break;
  }
  finish();
  return out;
}

gpu::Counters Runtime::count_chunk(uint32_t position, uint32_t rows, Traffic* traffic) {
  if (rows == 0 || rows > prefill_scratch_.rows || uint64_t(position) + rows > opt_.max_context)
    throw std::invalid_argument("count_chunk: " + std::to_string(rows) + " rows at position " +
                                std::to_string(position) + " do not fit the chunk of " +
                                std::to_string(prefill_scratch_.rows) + " rows or the context window of " +
                                std::to_string(opt_.max_context));
  auto cmd = logged_command_buffer();
  prefill_.encode_chunk(*cmd, prefill_scratch_, seq_, decode_scratch_,
                        chunk_at(0, position, rows, Logits::last, false), traffic);
  gpu::Counters c = cmd->counters();
  cmd->commit();
  cmd->wait();
  return c;
}

gpu::Counters Runtime::count_batch_step(const std::vector<uint32_t>& positions, Traffic* traffic) {
  if (positions.empty()) throw std::invalid_argument("count_batch_step: no rows");
  std::vector<SequenceState> scratch_rows;  // the rows after the first: sequences of their own
  const Alloc alloc{[this](size_t bytes, const char* label, Mem) {
    gpu::BufferPtr b = device_->new_buffer(std::max<size_t>(bytes, 4));
    b->set_label(label);
    return b;
  }};
  for (size_t i = 1; i < positions.size(); ++i) scratch_rows.push_back(allocate_sequence(alloc));
  std::vector<BatchRow> rows;
  for (size_t i = 0; i < positions.size(); ++i) {
    const uint32_t p = positions[i];
    if (p >= opt_.max_context)
      throw std::invalid_argument("count_batch_step: position " + std::to_string(p) +
                                  " is outside the context window of " + std::to_string(opt_.max_context));
    // steady decoding: the steps since the window began are pending
    rows.push_back(BatchRow{i == 0 ? &seq_ : &scratch_rows[i - 1], int(p % 2), p, p % opt_.state_window, false});
  }
  auto cmd = logged_command_buffer();
  encode_batch(*cmd, rows, traffic);
  gpu::Counters c = cmd->counters();
  cmd->commit();
  cmd->wait();
  return c;
}

gpu::Counters Runtime::count_step(uint32_t position, Traffic* traffic) {
  if (position >= opt_.max_context)
    throw std::invalid_argument("count_step: position " + std::to_string(position) +
                                " is outside the context window of " + std::to_string(opt_.max_context));
  auto cmd = logged_command_buffer();
  // steady decoding: the steps since the window began are pending
  decode_.encode_step(*cmd, decode_scratch_, seq_, position % 2, position, position % opt_.state_window,
                      traffic);
  gpu::Counters c = cmd->counters();
  cmd->commit();
  cmd->wait();
  return c;
}

}  // namespace lily::runtime
