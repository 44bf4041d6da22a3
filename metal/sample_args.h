// Argument structs of the sampling kernels (metal/sample.metal). Each is bound as
// `constant T& args [[buffer(n)]]` (setBytes); the host fills the same layout (all fields 4
// bytes: uint / float, no padding). Host-side facts (grids, threadgroups, buffer ranges) are
// in docs/kernels.md, "Attention, Gated DeltaNet, sampling". The LILY_ARGS_<T> field lists:
// decode_args.h.
#ifndef LILY_SAMPLE_ARGS_H
#define LILY_SAMPLE_ARGS_H

// sample_greedy: argmax of fp32 logits.
struct SampleGreedyArgs {
  uint vocab;         // V: number of logits
};
#define LILY_ARGS_SampleGreedyArgs(F) F(vocab)
// Threads of the one-threadgroup samplers (sample_greedy, sample_greedy_combine,
// sample_token) at most: their limit, and the runtime's choice when the pipeline allows it
// (sampler_threads, csrc/runtime/families/sample.h).
constant constexpr uint kSamplerThreads = 1024;

// argmax_partial (stage 1 of the multi-threadgroup greedy argmax): threadgroup j scans
// logits [j*slice, min((j+1)*slice, vocab)); sample_greedy_combine (stage 2) reduces the
// `count` partials. argmax_partial_bias takes the same arguments, and both run
// kArgmaxPartialThreads threads a threadgroup.
constant constexpr uint kArgmaxPartialThreads = 256;
struct ArgmaxArgs {
  uint vocab;         // V (stage 1); number of partials (stage 2)
  uint slice;         // logits per threadgroup (stage 1; unused by stage 2)
};
#define LILY_ARGS_ArgmaxArgs(F) F(vocab) F(slice)

// sample_token: logit bias, penalties, temperature, top-k, top-p, min-p and a seeded draw.
struct SampleArgs {
  uint vocab;               // V: number of logits
  float temperature;        // 0: greedy (argmax of the penalised logits); > 0 divides the logits
  uint top_k;               // 0 disables; else keep the k largest
  float top_p;              // (0, 1]; 1 disables
  float min_p;              // [0, 1]; 0 disables; keep p >= min_p * p_max
  float presence_penalty;   // subtracted once from tokens generated at least once
  float frequency_penalty;  // subtracted per generated occurrence
  float repetition_penalty; // 1 disables; logits of seen tokens (prompt or output): x > 0 ? x / r : x * r
  uint seed_lo;             // low 32 bits of the 64-bit seed (Philox key word 0)
  uint seed_hi;             // high 32 bits of the seed (Philox key word 1)
  uint logprobs;            // 1: write the chosen token's log-probability (raw logits) to logprob_out[0]
  uint top_logprobs;        // 0..20: also write the n most likely raw-logit alternatives (ids, logprobs)
  uint update_counts;       // 1: counts[token] += 1 after the draw (the per-session count buffer)
  uint bias;                // 1: add the per-session logit bias buffer [V] to the logits first
};
#define LILY_ARGS_SampleArgs(F) \
  F(vocab) F(temperature) F(top_k) F(top_p) F(min_p) F(presence_penalty) F(frequency_penalty) \
  F(repetition_penalty) F(seed_lo) F(seed_hi) F(logprobs) F(top_logprobs) F(update_counts) F(bias)

#define LILY_SAMPLE_ARG_STRUCTS(S) S(SampleGreedyArgs) S(ArgmaxArgs) S(SampleArgs)
#define LILY_SAMPLE_CONSTANTS(C) C(kArgmaxPartialThreads) C(kSamplerThreads)

#endif  // LILY_SAMPLE_ARGS_H
