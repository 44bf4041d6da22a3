// The native runtime of one session: weights mapped as device buffers, session state (KV
// cache, conv and recurrent state) in device buffers, chunked prefill and batch-1 decode.
//
// Decode: the whole step (embedding -> 40 layers -> lm_head -> token selection) is one
// concurrent compute pass with barriers derived from declared ranges; the step's sampler
// writes the next token id into the other token slot, which the next step's embedding reads
// (GPU-resident token hand-off; docs/decode.md).
// Prefill: a prompt runs as chunks of at most `prefill_chunk` tokens, one command buffer
// each, with GEMM kernels, GPU-resident expert routing and the chunk scan of the Gated
// DeltaNet; the last chunk of a generation ends with the sampler writing the first
// generated token into the decode token slot (docs/prefill.md).
// Runtime owns the state, by owner: the session's SequenceState (below) and each phase's
// scratch (DecodeScratch, PrefillScratch); the phases' plans (DecodePlan in decode.h,
// PrefillPlan in prefill.h) encode over it. Runtime keeps the lifecycle and the session:
// buffers, load-time checks, snapshots, the chunk driver and the generation pipeline.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gpu/device.h"
#include "runtime/decode.h"
#include "runtime/encoder.h"
#include "runtime/model.h"
#include "runtime/prefill.h"

namespace lily::runtime {

// Which GEMM kernels prefill uses: simdgroup_matrix (Apple7..9 GPUs, M1..M4) or Metal 4
// tensor operations (Apple10, M5); automatic asks the device.
enum class GemmPath { automatic, simdgroup, tensor };

// What forward() returns.
enum class Logits { none, last, all };

// A session's options, listed once for the struct and its binding (lily._core.RuntimeOptions,
// which lily.native_backend builds from Engine.load's device options). X(type, name, default).
#define LILY_RUNTIME_OPTIONS(X)                                                                \
  X(uint32_t, max_context, 4096)     /* KV-cache rows per attention layer */                   \
  X(uint32_t, split_threshold, 256)  /* context above which decode attention splits the KV */ \
  X(uint32_t, split_block, 0)        /* KV rows per split block; 0: by context (split_rows) */  \
  X(uint32_t, prefill_chunk, 0)      /* tokens per prefill chunk; 0: automatic (kAutoPrefillChunks) */ \
  X(uint32_t, state_window, 16)      /* decode steps per Gated DeltaNet state write-back; 1: every step */ \
  X(uint32_t, command_buffer_rows, 4096) /* work per prefill command buffer, in layer-rows (PrefillPlan::layer_groups); 0: one per chunk */ \
  X(bool, virtual_weights, false)    /* record-only counting: weights need not exist on disk */

// The automatic prefill chunk (prefill_chunk 0): the first of these, capped at max_context,
// whose memory fits the device's working set. Larger chunks read each expert's weights for
// more rows (docs/prefill.md "Chunks"); scratch is sized for one chunk (~0.55 GiB per 2048
// rows at Qwen3.6-35B-A3B's dimensions), so smaller Macs fall back rather than fail.
inline constexpr uint32_t kAutoPrefillChunks[] = {4096, 2048, 1024, 512};

// Heights of the grouped expert GEMMs' tiles (metal/prefill_args.h; moe_gemm_*_t<T>;
// PrefillPlan::moe_tile_rows picks one, expert_tile_available says which a path has).
using kernels::kExpertTileRows;

struct RuntimeOptions {
  LILY_RUNTIME_OPTIONS(LILY_DECLARE_FIELD)
  GemmPath gemm_path = GemmPath::automatic;  // bound as its name (gemm_path_names)

  static constexpr const char* gemm_path_names[3] = {"auto", "simdgroup", "tensor"};
  // The one home of the options' rules: throws std::invalid_argument naming the option.
  static GemmPath parse_gemm_path(const std::string& name) {
    for (int i = 0; i < 3; ++i)
      if (name == gemm_path_names[i]) return GemmPath(i);
    throw std::invalid_argument("gemm_path must be one of auto, simdgroup, tensor, got '" + name + "'");
  }
  // The options that must be positive (the other integers: non-negative); one rule and one
  // message for 0 (validate) and for a negative value (the binding's setter).
  static bool positive(const std::string& name) {
    return name == "max_context" || name == "split_threshold" || name == "state_window";
  }
  static std::string rule(const std::string& name) {
    return positive(name) ? "a positive integer" : "a non-negative integer";
  }
  void validate() const {
#define LILY_CHECK_POSITIVE(type, name, def)                                                    \
  if (positive(#name) && name == type{})                                                        \
    throw std::invalid_argument(std::string(#name) + " must be " + rule(#name) + ", got 0");
    LILY_RUNTIME_OPTIONS(LILY_CHECK_POSITIVE)
#undef LILY_CHECK_POSITIVE
    if (state_window > kMaxStateWindow)
      throw std::invalid_argument("state_window must be at most " + std::to_string(kMaxStateWindow) +
                                  " (decode steps per state write-back: a longer window's ring costs more "
                                  "memory and replay than it saves), got " + std::to_string(state_window));
  }
  // The ring holds state_window - 1 steps of every DeltaNet layer (24.7 KB each for the model).
  static constexpr uint32_t kMaxStateWindow = 64;
};

// Bytes a step actually moves (the routed experts it selects, not the whole stacks that
// are declared for hazard tracking because the ids are only known on the GPU).
struct Traffic {
  uint64_t weight_bytes = 0;  // quantized weights, scales, biases, norms, conv weights
  uint64_t kv_bytes = 0;      // KV-cache rows read and written
  uint64_t state_bytes = 0;   // recurrent + conv state read and written
  uint64_t other_bytes = 0;   // activations between kernels
};

// Token selection on the device (metal/sample.metal). Greedy without logprobs or penalties
// runs the two-stage argmax (argmax_partial, or argmax_partial_bias with a logit bias);
// anything else runs sample_token (logit bias, penalties from the per-session count buffer,
// temperature, top-k, top-p, min-p, a Philox draw keyed by `seed` with the token's position
// as counter, optional log-probabilities of the raw logits).
// lily.sampling.SamplingParams' device-side fields (same names), listed once for the
// struct and its binding (lily._core.SamplingConfig). X(type, name, default).
#define LILY_SAMPLING_CONFIG(X)                                                              \
  X(float, temperature, 0.0f) X(uint32_t, top_k, 0) X(float, top_p, 1.0f) X(float, min_p, 0.0f) \
  X(float, presence_penalty, 0.0f) X(float, frequency_penalty, 0.0f)                         \
  X(float, repetition_penalty, 1.0f) X(uint64_t, seed, 0) X(bool, logprobs, false)           \
  X(uint32_t, top_logprobs, 0) /* 0..20 */                                                 \
  X(uint32_t, vocab_limit, 0) /* ids >= it are never chosen (0: all of vocab_size) */

struct SamplingConfig {
  LILY_SAMPLING_CONFIG(LILY_DECLARE_FIELD)
  // OpenAI's logit_bias as (token id < vocab, bias) pairs: Runtime::start writes them into a
  // dense per-session [V] buffer the samplers add to the raw logits (empty: not read at all).
  std::vector<std::pair<uint32_t, float>> logit_bias;
  // The two-stage argmax serves it (with or without a bias).
  bool greedy_kernel() const {
    return temperature == 0.0f && !logprobs && presence_penalty == 0.0f && frequency_penalty == 0.0f &&
           repetition_penalty == 1.0f;
  }
};

// Device memory of a runtime, in bytes (Runtime::memory_use()).
struct MemoryUse {
  uint64_t weights = 0;   // checkpoint tensors (mapped files or aligned copies)
  uint64_t kv_cache = 0;  // K and V caches of the attention layers at max_context
  uint64_t state = 0;     // Gated DeltaNet conv and recurrent state
  uint64_t scratch = 0;   // activations, decode and prefill scratch
  uint64_t largest_buffer = 0;
  std::string largest_label;
  uint32_t max_context = 0;
  uint64_t total() const { return weights + kv_cache + state + scratch; }
};

// Checks `use` against the device's memory budget. Throws std::invalid_argument with the
// numbers (weights, KV cache, state, scratch, budget) and a max_context that fits when the
// total exceeds limits.working_set or a buffer exceeds limits.max_buffer (0 = no limit).
// The one place the load-time memory decision is made; pure, so it is tested with fake limits.
void check_memory(const MemoryUse& use, const gpu::MemoryLimits& limits);
// Whether `use` is within `limits` (what check_memory refuses otherwise).
bool fits_memory(const MemoryUse& use, const gpu::MemoryLimits& limits);

// A kernel the runtime dispatches (Runtime::kernel_table()): the most threads per
// threadgroup it asks for and what its pipeline allows.
struct KernelUse {
  std::string kernel;
  uint32_t threads = 0;               // largest threadgroup the runtime dispatches
  uint32_t max_threads = 0;           // the pipeline's maxTotalThreadsPerThreadgroup
  uint64_t threadgroup_memory = 0;    // the pipeline's static threadgroup memory (0 on sim)
};

// One generated token as the host reads it (one step behind the device).
struct StepOutput {
  uint32_t token = 0;
  float logprob = 0.0f;                                // when SamplingConfig::logprobs
  std::vector<std::pair<uint32_t, float>> top;         // top_logprobs alternatives
};

// A session's state in device memory: the position, then each attention layer's K and V rows
// below it and each Gated DeltaNet layer's conv and recurrent state, in layer order, as parts
// stored back to back in one buffer of the runtime's device (shared storage: on a Mac an
// MTLBuffer in the GPU's working set, read by the host only to save it).
struct SessionSnapshot {
  uint32_t position = 0;
  gpu::BufferPtr buffer;          // null when every part is empty
  std::vector<uint64_t> sizes;    // bytes of each part
  uint64_t nbytes() const {
    uint64_t n = 0;
    for (uint64_t p : sizes) n += p;
    return n;
  }
  // Each part's bytes, copied to the host (for saving a prompt cache file).
  std::vector<std::vector<uint8_t>> host_parts() const;
  // A snapshot holding `parts` (from host_parts()) in a new buffer of `device`; Runtime::restore
  // checks the sizes. Throws std::invalid_argument on a record-only device.
  static SessionSnapshot upload(gpu::Device& device, uint32_t position,
                                const std::vector<std::pair<const void*, size_t>>& parts);
};

// One sequence's session state on the device: what it carries from one step or chunk to the
// next (KV cache, conv and recurrent state, the ring of updates not yet written back), its
// token slots and its sampler's buffers and settings. Both phases encode over it; the
// phases' scratch (DecodeScratch, PrefillScratch) is shared (docs/decode.md "State by owner").
struct SequenceState {
  static constexpr uint32_t kMaxTopLogprobs = 21;  // chosen token + up to 20 alternatives
  uint32_t position = 0;
  // The recurrent state buffers hold the tokens before `written`; the decode steps at
  // written .. position - 1 are in the ring (written <= position, and never below the last
  // multiple of state_window: a step ending a window writes the state back).
  uint32_t written = 0;
  // per attention layer: K and V caches, bf16 [Hkv, max_context, D]
  std::vector<gpu::BufferPtr> k_cache, v_cache;
  // per Gated DeltaNet layer: two conv states (a step reads the one of its position's parity
  // and writes the other), the recurrent state (S' then c), the ring (GdnRing entries)
  std::vector<gpu::BufferPtr> conv[2], state, ring;
  // token slots [2] and their positions [2] (one per command buffer in flight)
  gpu::BufferPtr tokens, positions;
  // the sampler: token counts [V] (bit 31: seen in the prompt), the logit bias [V] (written
  // by Runtime::start when the request has one), per-slot log-probability outputs
  gpu::BufferPtr counts, bias, logprob_out, top_ids;
  SamplingConfig sampling;
  // [V] logits of a row the host samples (a constrained request): the step or chunk that
  // computes them copies them here, so later work cannot overwrite them before take()
  // reads them. Allocated on first use.
  gpu::BufferPtr host_logits;
};

// One row of a batched decode step (Runtime::submit_step).
struct StepRow {
  uint32_t seq = 0;
  // The step's input: >= 0, a token the host writes into the sequence's token slot; < 0, the
  // one the device left there (the previous step's sampler, or the last prefill chunk's).
  int64_t token = -1;
  // The host samples this row: its logits are kept for take(); the device sampler's choice
  // is not used.
  bool logits = false;
};

// One row's result of a submitted step or sampling chunk (Runtime::take).
struct RowOutput {
  uint32_t seq = 0;
  uint32_t position = 0;      // the position of the step's input token
  StepOutput step;            // the token the device chose (not read for logits rows)
  std::vector<float> logits;  // logits rows: [V]
};

class Runtime {
 public:
  Runtime(std::shared_ptr<gpu::Device> device, ModelDims dims,
                const std::vector<TensorDesc>& tensors, RuntimeOptions options);
  // The plans hold references to the runtime's dims and options.
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // The calls below without a sequence argument work on the session, sequence 0; the others
  // name the sequence (open_sequence), and throw std::invalid_argument for one not open.

  // Empties the sequence: position 0, zero recurrent/conv state.
  void reset(uint32_t seq = 0);
  // The sequence's state, copied on the device into a new device buffer (waits for its work
  // in flight first; the session's generation is finished, as finish()). Memory: the KV rows
  // in use plus the recurrent and conv state, not the whole cache. Throws
  // std::invalid_argument on a record-only device.
  SessionSnapshot snapshot(uint32_t seq = 0);
  // Makes `s` the sequence's state (device copies; `s` is unchanged and can be restored
  // again, into any sequence). Throws std::invalid_argument, leaving the sequence as it was,
  // when `s` does not come from a runtime of the same model and device kind or does not fit
  // the context.
  void restore(const SessionSnapshot& s, uint32_t seq = 0);
  uint32_t position(uint32_t seq = 0) const { return sequence(seq).position; }
  const ModelDims& dims() const { return dims_; }

  // Runs `tokens` through the model at the sequence's position: prefill chunks of at most
  // prefill_chunk tokens (a single token, or every token with `decode_steps`, runs as
  // decode steps instead). Returns float32 logits [n, vocab] (Logits::all), [1, vocab]
  // (last) or nothing. Throws std::invalid_argument (context full, bad token id) before
  // touching the state. Waits for the work in flight (the session's generation is finished).
  std::vector<float> forward(const std::vector<uint32_t>& tokens, Logits logits, bool decode_steps = false,
                             uint32_t seq = 0);

  // ---- Sequences (issue 31; docs/decode.md "Batched decode"). Sequence 0, the session, is
  // allocated at load; open_sequence() adds one (its own KV cache at max_context, conv and
  // recurrent state, ring, token slots and sampler buffers: sequence_bytes()), at position 0.
  // Throws std::length_error when it would take the runtime past the device's working set.
  uint32_t open_sequence();
  // Frees a sequence opened by open_sequence() (waits for its work in flight).
  void close_sequence(uint32_t seq);
  // Device bytes one more sequence allocates.
  uint64_t sequence_bytes() const { return sequence_bytes_; }
  // Device bytes the open sequences other than the session hold.
  uint64_t sequences_bytes() const;
  // How many more sequences fit the device's working set (UINT32_MAX without a limit).
  uint32_t sequence_room() const;
  // The open sequences, the session first.
  std::vector<uint32_t> sequences() const;

  // ---- Batched generation, driven by the host (lily.scheduler: which rows step together,
  // when a prefill chunk runs). Work is committed at once and taken in commit order; the
  // device token hand-off works across steps as in start()/next(): a row whose input is the
  // device's reads the token its previous step's (or prefill chunk's) sampler wrote.
  // The sampler's settings of `seq`'s generation: `cfg`, its token counts from `prompt`
  // (the repetition penalty's prompt set) and its logit bias.
  void begin(uint32_t seq, const SamplingConfig& cfg, const std::vector<uint32_t>& prompt);
  // Commits one prefill chunk of `tokens` (1 .. prefill_chunk()) at the sequence's position,
  // which advances by their number. With `sample` the last row's sampler writes the first
  // generated token into the decode token slot; with `logits` its logits are kept for the
  // host. Returns the ticket whose take() gives them, 0 when neither.
  uint64_t submit_chunk(uint32_t seq, const std::vector<uint32_t>& tokens, bool sample, bool logits);
  // Commits one decode step of `rows` (distinct sequences; each at its position, which
  // advances by one) in one command buffer. A row's output must be taken before that
  // sequence's next step but one is submitted (its token and log-probability slots are
  // reused). Returns the ticket.
  uint64_t submit_step(const std::vector<StepRow>& rows);
  // Waits for the ticket's command buffer (and everything committed before it; tickets are
  // taken in commit order) and returns its rows' outputs; `gpu_seconds` (if given) gets its
  // device time (NaN when unknown). `timed`: add the device time to gpu_seconds().
  std::vector<RowOutput> take(uint64_t ticket, double* gpu_seconds = nullptr, bool timed = true);
  // Waits for every committed command buffer (their outputs stay for take()).
  void wait_all();

  // Greedy generation with the GPU token hand-off: `first` is fed at the current position,
  // each step's argmax becomes the next step's input on the device, two command buffers
  // alternate so step n+1 is encoded while step n runs, and the host reads ids one step
  // behind. Stops after `max_tokens`, at an id in `stop_ids` (included in the result), or
  // when the context is full. The one step encoded ahead of a stop has run by then: its
  // output id is discarded, and the token it consumed (the stop id) is part of the
  // session, so position() advances by the number of steps executed (len or len + 1).
  std::vector<uint32_t> generate_greedy(uint32_t first, uint32_t max_tokens,
                                        const std::set<uint32_t>& stop_ids);

  // The same pipeline, one token at a time, for hosts that decide when to stop (stop
  // strings): start() feeds `feed` (>= 1 tokens not yet in the session) at the current
  // position with `prompt` marking the tokens the repetition penalty sees; next() returns
  // the next generated token (false when max_steps or the context is exhausted) while the
  // following step already runs; finish() waits for the step in flight and commits the
  // session position (every executed step consumed a token: the feed, then the outputs; a
  // speculative step consumes the last returned token and its own output is dropped).
  // A feed of several tokens runs as prefill chunks whose last one ends with the sampler
  // writing the first generated token into the decode token slot: the first decode step is
  // encoded before the host has seen that token (no CPU round trip between the phases).
  void start(const std::vector<uint32_t>& feed, const SamplingConfig& cfg, uint32_t max_steps,
             const std::vector<uint32_t>& prompt);
  bool next(StepOutput* out);
  void finish();

  // Encodes one step at `position` into a fresh command buffer and commits it; on a
  // record-only device nothing executes. The step is counted as in steady decoding, with the
  // position % state_window steps since its window began pending; on a device that executes
  // it runs on the session's state with that ring: reset the session after counting.
  // Returns the device counters and the traffic.
  gpu::Counters count_step(uint32_t position, Traffic* traffic);
  // The same for one prefill chunk of `rows` tokens starting at `position` (last-row logits).
  gpu::Counters count_chunk(uint32_t position, uint32_t rows, Traffic* traffic);
  // The same for one batched step of rows at `positions` (one row each, the session's state
  // for the first, scratch sequences for the others; each with the position % state_window
  // steps of its window pending), as submit_step encodes it.
  gpu::Counters count_batch_step(const std::vector<uint32_t>& positions, Traffic* traffic);

  uint32_t prefill_chunk() const { return prefill_scratch_.rows; }
  // Device seconds (gpu::CommandBuffer::gpu_interval, overlaps counted once) of the work
  // whose results the host has taken since construction: prefill chunks and forward passes
  // once waited for, generation steps once next() returned their token (not the speculative
  // step finish() drops). A total: the engine takes differences at the first token and at
  // the end of a generation.
  double gpu_seconds() const { return gpu_seconds_; }
  // Whether prefill's GEMMs (dense and expert) run the Metal 4 tensor-op kernels.
  bool uses_tensor_ops() const { return prefill_.tensor_ops(); }
  // Whether prefill's attention runs them too (bfloat operands: only with
  // Device::supports_bfloat_tensor_ops()).
  bool uses_tensor_attention() const { return prefill_.tensor_attention(); }
  // The families of tensor-op kernels prefill runs (names: gemm, moe_prefill,
  // attention_prefill), after the load-time check (check_tensor_families).
  std::vector<std::string> tensor_families() const;
  // The layers of a prefill chunk of `rows` rows at `position`, as [begin, end) groups, one
  // command buffer each (PrefillPlan::layer_groups, the command_buffer_rows option).
  std::vector<std::pair<uint32_t, uint32_t>> prefill_command_buffers(uint32_t position, uint32_t rows) const {
    return prefill_.layer_groups(position, rows);
  }
  // One line per family of tensor-op kernels the load-time check took off the tensor path,
  // saying why (the engine prints them); empty when none was.
  const std::vector<std::string>& notices() const { return notices_; }
  // Bytes of the prefill scratch buffers (sized for one chunk; independent of prompt length).
  uint64_t prefill_scratch_bytes() const { return prefill_scratch_.bytes; }
  // Assignments per expert of layer `layer` in the last completed prefill chunk [E].
  std::vector<uint32_t> expert_histogram(uint32_t layer) const;

  uint64_t weight_bytes() const { return weights_.total_bytes(); }
  // What this runtime allocated (checked against the device's budget at construction).
  const MemoryUse& memory_use() const { return memory_; }
  // Every kernel the runtime can dispatch, built and validated at construction (see
  // preflight()), sorted by name.
  const std::vector<KernelUse>& kernel_table() const { return kernels_; }
  uint64_t repacked_bytes() const { return weights_.repacked_bytes(); }

 private:
  // A committed command buffer and what take() reads after it: a step's rows, a sampling
  // chunk's row (ticket 0: a chunk without outputs).
  struct Inflight {
    std::unique_ptr<gpu::CommandBuffer> cmd;
    uint64_t ticket = 0;
    std::vector<std::pair<StepRow, uint32_t>> rows;  // (row, position of its input)
    std::vector<uint32_t> seqs;                       // every sequence it touches
    bool waited = false;
    bool chunk = false;
  };
  SequenceState& sequence(uint32_t seq);
  const SequenceState& sequence(uint32_t seq) const;
  // Waits for every command buffer touching `seq`, leaving their outputs for take().
  void wait_sequence(uint32_t seq);
  // Commits `cmd` as the next in-flight entry (tickets numbered from 1).
  uint64_t commit(std::unique_ptr<gpu::CommandBuffer> cmd, std::vector<std::pair<StepRow, uint32_t>> rows,
                  std::vector<uint32_t> seqs, bool outputs, bool chunk);
  // `seq`'s step at `position` (the ring's pending steps from seq.written), moving seq.written
  // when the step ends a window.
  void encode_session_step(gpu::CommandBuffer& cmd, SequenceState& seq, int slot, uint32_t position);
  // One row of a batched step: its sequence, token slot, position, the ring's pending steps,
  // whether its logits are kept for the host.
  struct BatchRow {
    SequenceState* seq;
    int slot;
    uint32_t position;
    uint32_t pending;
    bool logits;
  };
  // One decode step of `rows` into `cmd` (submit_step, count_batch_step); the caller moves
  // each row's position and written.
  void encode_batch(gpu::CommandBuffer& cmd, const std::vector<BatchRow>& rows, Traffic* traffic);
  // A chunk of `rows` tokens at p0 in the prefill scratch's buffers `parity`, its expert
  // tiles chosen from the newest completed chunk's histograms.
  Chunk chunk_at(int parity, uint32_t p0, uint32_t rows, Logits logits, bool sample) const;
  // Every buffer of the runtime for prefill chunks of `chunk` rows; with sizing_ only
  // counted into memory_.
  void allocate_buffers(uint32_t chunk);
  // One sequence's buffers (SequenceState), at position 0, from `alloc`.
  SequenceState allocate_sequence(const Alloc& alloc);
  // Resolves the pipelines, then encodes, without committing, every dispatch the runtime can
  // issue (decode step and its split path, both samplers, prefill chunks with each expert
  // tile height and the split path, the all-logits lm_head), so a kernel missing from the
  // library or a threadgroup above its pipeline's limit fails at load naming the kernel;
  // fills kernels_.
  void preflight();
  // Each family of tensor-op kernels the plan uses runs once against its simdgroup_matrix
  // twins before anything else (the first layers of a short chunk, every expert tile height,
  // on the model's weights, compared row by row); a family whose kernels fail to build, fault
  // or disagree goes back to its twins, with a notice (notices_). Also a tensor kernel that
  // preflight cannot build at a shape the plan dispatches (drop_failed_family).
  void check_tensor_families();
  // The family of the tensor-op kernel `error` names, taken off the tensor path with a notice;
  // false when it names none on the tensor path (the error is then the load's to raise).
  bool drop_failed_family(const std::string& error);
  std::unique_ptr<gpu::CommandBuffer> logged_command_buffer();
  void check_feed(const SequenceState& seq, const std::vector<uint32_t>& tokens, const char* what) const;
  // Encodes one prefill chunk of sequence `id` (the GDN ring written back first): its layer
  // groups but the last committed (no outputs), the last returned, not committed; advances
  // seq.position and seq.written.
  std::unique_ptr<gpu::CommandBuffer> encode_chunk(uint32_t id, SequenceState& seq, const uint32_t* tokens,
                                                   uint32_t rows, Logits logits, bool sample);
  // Commits prefill chunks for tokens[begin, end) of sequence `id` at its position; the last
  // chunk gets `last_logits` / `sample` and, when `ticket`, returns its ticket (else 0).
  uint64_t run_chunks(uint32_t id, const std::vector<uint32_t>& tokens, size_t begin, size_t end,
                      Logits last_logits, bool sample, bool ticket);
  // Copies the head's logits (row `row` of scratch `s`) into seq.host_logits (allocated on
  // first use) at the end of `cmd`.
  void keep_logits(gpu::CommandBuffer& cmd, SequenceState& seq, const DecodeScratch& s, uint32_t row);
  void write_token(SequenceState& seq, int slot, uint32_t token, uint32_t position);
  gpu::BufferPtr scratch(size_t bytes, const char* label, Mem kind = Mem::scratch);
  // Waits for `cmd` (rethrowing its fault) and adds its device time to gpu_seconds_.
  void wait_timed(gpu::CommandBuffer& cmd);
  // Waits for the front in-flight entry (timed) and drops it; it must have no outputs left.
  void pop_front();

  std::shared_ptr<gpu::Device> device_;
  ModelDims dims_;
  RuntimeOptions opt_;
  // The phases: pipelines and geometry fixed at load, encoding over the weights and the state.
  DecodePlan decode_;
  PrefillPlan prefill_;
  WeightTable weights_;
  ModelWeights model_;  // tensor references into weights_, per layer
  // The state: the session's sequence, the sequences opened since (index - 1: id; null:
  // closed), the phases' scratch.
  SequenceState seq_;
  std::vector<std::unique_ptr<SequenceState>> extra_;
  uint64_t sequence_bytes_ = 0;
  DecodeScratch decode_scratch_;
  DecodeScratch batch_scratch_;  // a batched step's rows (kBatchMaxRows of each buffer)
  PrefillScratch prefill_scratch_;
  std::vector<gpu::BufferPtr> owned_;  // every buffer above but the extra sequences'
  bool record_only_ = false;
  bool sizing_ = false;
  MemoryUse memory_;
  std::vector<KernelUse> kernels_;
  std::vector<std::string> notices_;

  // committed work, oldest first: prefill chunks, steps (start/next and submit_step)
  std::deque<Inflight> inflight_;
  uint64_t next_ticket_ = 1;
  uint64_t chunks_done_ = 0;  // chunks committed since the last reset (parity of the scratch buffers)
  double gpu_seconds_ = 0;     // gpu_seconds()
  double gpu_last_end_ = 0;    // the latest end of a counted command buffer (host-clock seconds)
  // the session's generation in progress (start/next/finish): its tickets not yet taken
  std::deque<uint64_t> gen_tickets_;
  uint32_t gen_steps_ = 0, gen_encoded_ = 0;
  bool generating_ = false;
};

}  // namespace lily::runtime
