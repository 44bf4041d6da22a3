"""Sampling twins (metal/sample.metal): greedy argmax (one and two stages) and the sampler's
draws against a numpy model of the kernel (Philox, filtered probabilities)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from lily import _core
from lily.lab.device import download, pack_args, upload
from lily.lab.kernels.harness import TOY, Mismatch, check, f32, model, run_bound
from lily.sampling import Sampler, SamplingParams

SAMPLER_THREADS = _core.CONSTANTS["kSamplerThreads"]  # the one-threadgroup samplers' threads (sample_args.h)


def philox_u(seed: int, counter: int) -> float:
    """numpy model of the kernel's draw: Philox4x32-10, key = seed (lo, hi words),
    counter = (position, 0, 0, 0); u = (first word >> 8) * 2^-24."""
    M = 0xFFFFFFFF
    c = [counter & M, 0, 0, 0]
    k0, k1 = seed & M, (seed >> 32) & M
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & M, (p0 >> 32) ^ c[3] ^ k1, p0 & M]
        k0, k1 = (k0 + 0x9E3779B9) & M, (k1 + 0xBB67AE85) & M
    return (c[0] >> 8) * 2.0 ** -24


def sampler_for(params: SamplingParams, prompt=(), generated=()):
    s = Sampler(params, prompt)
    for t in generated:
        s._counts[int(t)] = s._counts.get(int(t), 0) + 1
    return s


def count_buffer(V, prompt=(), generated=()):
    c = np.zeros(V, np.uint32)
    for t in prompt:
        c[t] |= 0x80000000
    for t in generated:
        c[t] += 1
    return c


def filtered_probs(params: SamplingParams, logits, prompt=(), generated=()):
    """The distribution lily.sampling.Sampler draws from (its own code path, minus the draw)."""
    return sampler_for(params, prompt, generated).probabilities(logits)


def sample_args(V, p: SamplingParams, seed, *, logprobs=False, update_counts=False):
    return pack_args("SampleArgs", vocab=V, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                     presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                     repetition_penalty=p.repetition_penalty, seed_lo=seed & 0xFFFFFFFF,
                     seed_hi=(seed >> 32) & 0xFFFFFFFF, logprobs=logprobs, top_logprobs=p.top_logprobs,
                     update_counts=update_counts, bias=bool(p.logit_bias))


def dense_bias(params: SamplingParams, V: int) -> np.ndarray:
    """``params.logit_bias`` as the runtime's per-session buffer: float32 ``[V]``, 0 elsewhere."""
    b = np.zeros(V, np.float32)
    ids, vals = params.bias_arrays()
    b[ids] = vals
    return b


def sample_many(dev, logits, counts, params, seeds, positions, tg=SAMPLER_THREADS, logprobs=False, update_counts=False,
                vocab=None):
    """One sample_token dispatch per (seed, position), all in one command buffer, each encoded
    as the decode step encodes it (lily._core.encode_sample_token); with ``params.logit_bias``
    the dense bias buffer is bound and declared read (else the logits are bound, unread).
    ``vocab``: the ``vocab`` argument when it is less than the buffers (the runtime's
    ``vocab_limit``: the rows past it are never chosen)."""
    V = logits.size
    n_args = V if vocab is None else vocab
    n = len(seeds)
    L, C = upload(dev, f32(logits)), upload(dev, counts)
    B = upload(dev, dense_bias(params, V)) if params.logit_bias else None
    POS = upload(dev, np.asarray(positions, np.uint32))
    TOK = dev.buffer(4 * n)
    k = max(params.top_logprobs, 1)
    lp_bytes = 4 * (1 + params.top_logprobs)
    LP, IDS = dev.buffer(lp_bytes * n), dev.buffer(4 * k * n)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    for j, seed in enumerate(seeds):  # the decode step's encoder (csrc/runtime/families/sample.h)
        _core.encode_sample_token(
            p, sample_args(n_args, params, seed, logprobs=logprobs, update_counts=update_counts), L, C, POS, TOK,
            LP, IDS, B, threads=tg, position_at=4 * j, token_at=4 * j,
            logprobs_at=lp_bytes * j, logprobs_bytes=lp_bytes, top_ids_at=4 * k * j, top_ids_bytes=4 * k)
    t = time.perf_counter()
    cb.commit()
    cb.wait()
    dt = time.perf_counter() - t
    toks = download(TOK, np.uint32)
    lps = download(LP, np.float32, (n, 1 + params.top_logprobs))
    ids = download(IDS, np.uint32, (n, k))
    return toks, lps, ids, C, dt


PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.3}


def sorted_order(probs):
    """The fast path's candidate order: probability descending, id ascending."""
    return np.lexsort((np.arange(probs.size), -probs))


def thread_order(V, tg):
    """The slow path's order: thread t's elements t, t + tg, ... one thread after another."""
    return np.concatenate([np.arange(t, V, tg) for t in range(tg)])


def expected_draws(probs, order, seeds, positions):
    """Tokens the numpy model of the kernel draws, and whether u is near a boundary."""
    p = probs[order]
    csum = np.cumsum(p)
    last = int(np.nonzero(p)[0][-1])
    out = []
    for seed, pos in zip(seeds, positions):
        u = philox_u(seed, pos)
        j = min(int(np.searchsorted(csum, u, side="right")), last)
        out.append((int(order[j]), np.min(np.abs(csum - u)) < 1e-5))
    return out


#: Logits per argmax_partial threadgroup at a model size (DecodePlan::kArgmaxSlice).
MODEL_ARGMAX_SLICE = _core.CONSTANTS["kArgmaxSlice"]


@check("sample_greedy")
def _sample_greedy(dev, rng, kernel, size=TOY):
    """Model size: the vocabulary's 248,320 logits."""
    V = size.pick(1000, size.model and model().vocab_size)
    logits = (rng.standard_normal(V) * 3).astype(np.float32)
    logits[[V // 3, V // 2]] = logits.max() + 1  # a tie: the lower index wins
    L, TOK = upload(dev, logits), dev.buffer(4)
    run_bound(dev, kernel, 1, SAMPLER_THREADS, [L, TOK], pack_args("SampleGreedyArgs", vocab=V), reads=[L], writes=[TOK])
    got, want = int(download(TOK, np.uint32)[0]), int(np.argmax(logits))
    if got != want:
        raise Mismatch(f"{kernel}: token {got}, expected {want} (argmax, lowest index on ties)", 1.0)
    return 0.0


PADDING_ROWS = 24


def padded_rows(logits: np.ndarray, n: int = PADDING_ROWS) -> np.ndarray:
    """``logits`` followed by ``n`` rows that beat every one of them (+50): the padding
    past a tokenizer's ids, which a sampler told ``vocab = logits.size`` must never choose."""
    return np.concatenate([logits, np.full(n, np.nanmax(logits) + 50, np.float32)])


def argmax_two_stage(dev, logits: np.ndarray, slice_: int, bias: np.ndarray | None = None,
                     vocab: int | None = None, combine_threads: int | None = None) -> tuple[int, int]:
    """The runtime's greedy argmax on ``dev`` over float32 ``logits`` ``[V]`` (plus float32
    ``bias`` ``[V]`` when given: argmax_partial_bias), encoded as the decode step encodes it
    (lily._core.encode_argmax): argmax_partial (kArgmaxPartialThreads threads per slice of ``slice_`` logits),
    then sample_greedy_combine in one threadgroup of ``combine_threads`` (default: as the
    runtime picks them, csrc/runtime/families/sample.h sampler_threads); over the first
    ``vocab`` logits only when given (the runtime's ``vocab_limit``). Returns (token, barrier
    stages of the command buffer)."""
    V = logits.size if vocab is None else vocab
    parts = -(-V // slice_)
    L, TOK, PART = upload(dev, logits), dev.buffer(4), dev.buffer(8 * parts)
    cb = dev.command_buffer()
    _core.encode_argmax(cb.compute_pass(), L, PART, TOK, V, slice_, None if bias is None else upload(dev, f32(bias)),
                        combine_threads=combine_threads or 0)
    cb.commit()
    cb.wait()
    return int(download(TOK, np.uint32)[0]), cb.counters["barrier_stages"]


@check("argmax_partial", "argmax_partial_bias", "sample_greedy_combine")
def _argmax_two_stage(dev, rng, kernel, size=TOY):
    """The runtime's greedy argmax: partials over slices of 64 logits, then the combine
    (argmax_partial_bias: over logits + a bias that lifts one token and bans the leaders).
    The buffers hold 24 more rows than ``vocab`` says, the largest logits of all (the
    padding past a tokenizer's ids, runtime ``vocab_limit``): never chosen. Model size: the
    vocabulary's 248,320 logits in the runtime's slices of 4096."""
    V, slice_ = size.pick((1000, 64), (size.model and model().vocab_size, MODEL_ARGMAX_SLICE))
    logits = (rng.standard_normal(V) * 3).astype(np.float32)
    logits[[V // 3, V // 2]] = logits.max() + 1  # a tie across slices: the lower index wins
    bias = None
    if kernel == "argmax_partial_bias":
        bias = np.zeros(V + PADDING_ROWS, np.float32)
        bias[[V // 3, V // 2]] = -100.0
        bias[int(rng.integers(V))] += 7.5
    got = argmax_two_stage(dev, padded_rows(logits), slice_, bias, vocab=V)[0]
    want = int(np.argmax(logits if bias is None else logits + bias[:V]))
    if got != want:
        raise Mismatch(f"{kernel}: token {got}, expected {want} (argmax, lowest index on ties)", 1.0)
    return 0.0


@check("sample_token")
def _sample_token(dev, rng, kernel, size=TOY):
    """Draw by draw against the numpy model of the kernel (Philox u, crossing of u * Z in
    probability order) on penalised, filtered logits; a draw may differ only where u lies
    within 1e-5 of a boundary of the cumulative mass (float32 vs float64). Twice: without and
    with a logit bias (a few nudges and a ban on the most likely token, which is never drawn).
    The buffers hold :data:`PADDING_ROWS` more rows than ``vocab`` says, never drawn. Model
    size: the vocabulary's 248,320 logits, 8 draws each, the runtime's kSamplerThreads threads."""
    V = size.pick(50, size.model and model().vocab_size)
    logits = (rng.standard_normal(V) * 2).astype(np.float32)
    prompt, generated = rng.choice(V, 5, replace=False), rng.choice(V, 8)
    base = SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.02, **PENALTIES)
    nudged = rng.choice(V, 4, replace=False)
    bias = {int(t): float(b) for t, b in zip(nudged, rng.uniform(-3, 3, 4))} | {int(np.argmax(logits)): -100.0}
    draws = size.pick(24, 8)
    seeds = [int(s) for s in rng.integers(0, 2**63, draws)]
    positions = list(range(100, 100 + draws))
    for params in (base, replace(base, logit_bias=bias)):
        probs = filtered_probs(params, logits, prompt, generated)
        toks, *_ = sample_many(dev, padded_rows(logits), count_buffer(V + PADDING_ROWS, prompt, generated), params,
                               seeds, positions, tg=size.pick(64, SAMPLER_THREADS), vocab=V)
        bad = [(int(t), w) for t, (w, near) in zip(toks, expected_draws(probs, sorted_order(probs), seeds, positions))
               if t != w and not near]
        what = " with a logit bias" if params.logit_bias else ""
        if bad:
            raise Mismatch(f"{kernel}{what}: {len(bad)} of {len(toks)} draws differ from the numpy model "
                           f"(got, want): {bad[:5]}", float(len(bad)))
    return 0.0
