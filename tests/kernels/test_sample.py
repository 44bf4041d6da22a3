"""metal/sample.metal (greedy and sampled token selection, docs/kernels.md) on the Metal
simulator against the numpy reference.

Every output buffer starts poisoned (the simulator fills new buffers with NaN), so an
element a kernel forgets to write fails the comparison.

Tolerances (all float32 arithmetic on both sides unless noted):
* sampling: greedy exactly. The sampled path: exactly where the draw is determined
  (top_k = 1, temperature 0); draw by draw against a numpy model of the kernel (Philox u,
  crossing of u * Z in the kernel's order), where float32 (kernel) and float64 (model)
  cumulative masses may disagree only when u lies within 1e-5 of a boundary; and
  statistically (chi-square, alpha 0.001) against lily.sampling's filtered softmax.
  Log-probabilities: atol 1e-4 (float32 log-sum-exp over up to 4000 terms).

Kernel correctness tests run in three simulator modes (fixture ``dev``): forward order,
reverse thread/threadgroup order with undeclared-read detection, random order; all with
out-of-range write detection.
"""

from __future__ import annotations

import math

import numpy as np
from seeding import fresh_rng
from harness import ORDERS, THREAD_ORDERS, bf16_bits, from_bf16, f32  # noqa: F401
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import download, pack_args, upload  # noqa: E402
from lily.sampling import SamplingParams, log_softmax  # noqa: E402
# the layer harnesses and float64 references live with lily doctor's kernel checks (one home)
from lily.lab.kernels import sample as twins  # noqa: E402
from lily.lab.kernels.harness import run  # noqa: E402
from lily.lab.kernels.sample import (  # noqa: E402
    SAMPLER_THREADS, count_buffer, expected_draws, filtered_probs, sample_many, sampler_for, sorted_order, thread_order,
)




# ------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("V", [1, 31, 1000, 248320])
def test_sample_greedy(dev, V):
    rng = fresh_rng(V)
    logits = f32(rng.standard_normal(V) * 3)
    if V > 10:
        logits[[V // 3, V // 2, V - 1]] = logits.max() + 1  # ties -> lowest index
        logits[V // 4] = np.nan                            # NaN never wins
    L, TOK = upload(dev, logits), dev.buffer(4)
    run(dev, "sample_greedy", 1, SAMPLER_THREADS, buffers=[(0, L), (1, TOK)], constants=[(2, pack_args("SampleGreedyArgs", vocab=V))],
        reads=[L], writes=[TOK])
    want = int(np.nanargmax(logits))
    assert download(TOK, np.uint32)[0] == want


def _argmax_case(V, slice_):
    rng = fresh_rng(V, slice_)
    logits = f32(rng.standard_normal(V) * 3)
    if V > 10:
        top = logits.max() + 1
        logits[[V // 3, V // 2, V - 1]] = top  # ties in different slices -> lowest index
        logits[V // 4] = np.nan                 # NaN never wins
    if V > 2 * slice_:
        logits[slice_:2 * slice_] = np.nan      # a slice with no number at all
    return logits


@pytest.mark.parametrize("V,slice_", [(1, 64), (31, 64), (1000, 64), (1000, 4096), (248320, 4096), (5000, 96)])
def test_argmax_two_stage(dev, V, slice_):
    """argmax_partial (one threadgroup per slice) + sample_greedy_combine, as the runtime runs
    the greedy argmax: the token of sample_greedy (largest logit, lowest index among ties,
    NaN never) with ties across slices, a slice of NaN only, and a ragged last slice."""
    logits = _argmax_case(V, slice_)
    token, stages = twins.argmax_two_stage(dev, logits, slice_)
    assert stages == 2
    assert token == int(np.nanargmax(logits))


@pytest.mark.parametrize("V,slice_", [(5000, 96), (20000, 64)])
def test_argmax_two_stage_combine_with_fewer_threads(dev, V, slice_):
    """The runtime gives sample_greedy_combine as many threads as its pipeline allows, down
    to 32 (csrc/runtime/families/sample.h sampler_threads): 32 threads over 53 and 313 partials, several per
    thread, give the same token."""
    logits = _argmax_case(V, slice_)
    token, _ = twins.argmax_two_stage(dev, logits, slice_, combine_threads=32)
    assert token == int(np.nanargmax(logits))


PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)


def _penalty_case(V, seed, fixed=False):
    # fixed: statistical tests keep their inputs, so their false-alarm rate stays alpha per case
    rng = np.random.default_rng(seed) if fixed else fresh_rng(seed)
    logits = f32(rng.standard_normal(V) * 2)
    prompt = rng.choice(V, 5, replace=False)
    generated = rng.choice(V, 8)
    return logits, prompt, generated


def test_sample_token_temperature0_is_penalised_argmax(dev):
    V = 3000
    logits, prompt, generated = _penalty_case(V, 0)
    top = np.argsort(-logits)[:6]
    # leaders within 0.3 of the 4th (positive) logit, so the penalties must change the argmax
    # whatever the fresh draw (an outlier leader could otherwise stay ahead penalised)
    logits[top[:3]] = logits[top[3]] + f32([0.3, 0.2, 0.1])
    generated = np.concatenate([generated, top[:3], top[:3]])   # penalise the leaders
    params = SamplingParams(temperature=0.0, **PENALTIES)
    toks, *_ = sample_many(dev, logits, count_buffer(V, prompt, generated), params, [1], [5])
    want = int(np.argmax(sampler_for(params, prompt, generated).process(logits)))
    assert toks[0] == want and want not in top[:3]


def test_sample_token_top_k1_equals_greedy(dev):
    V = 5000
    logits = f32(fresh_rng(1).standard_normal(V))
    params = SamplingParams(temperature=0.8, top_k=1)
    toks, *_ = sample_many(dev, logits, count_buffer(V), params, list(range(8)), list(range(8)))
    assert (toks == np.argmax(logits)).all()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.02, **PENALTIES),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.1),
])
def test_sample_token_exact_draws_fast_path(dev, params):
    """V = 50 (all tokens are candidates): the token is where the cumulative filtered mass,
    in (probability desc, id asc) order, first exceeds u * Z; u from the numpy Philox model."""
    V = 50
    logits, prompt, generated = _penalty_case(V, 2)
    probs = filtered_probs(params, logits, prompt, generated)
    seeds = [int(s) for s in fresh_rng(3).integers(0, 2**63, 200)]
    positions = list(range(100, 300))
    toks, *_ = sample_many(dev, logits, count_buffer(V, prompt, generated), params, seeds, positions, tg=64)
    assert (probs[toks] > 0).all()
    for tok, (want, near) in zip(toks, expected_draws(probs, sorted_order(probs), seeds, positions)):
        assert tok == want or near  # float32 vs float64 mass can differ only next to a boundary


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=0.995),           # nucleus of ~2900 tokens > 1024
    SamplingParams(temperature=1.0, top_k=2000, min_p=0.5),  # top_k > 1024, no top-p
    SamplingParams(temperature=0.5),                         # no filter at all
])
def test_sample_token_exact_draws_slow_path(dev, params):
    """Filtered sets wider than the 1024 candidates: draws in (thread, element) order."""
    V, tg = 3000, 64
    rng = fresh_rng(11)
    logits = f32(rng.standard_normal(V) * 0.3)
    probs = filtered_probs(params, logits)
    assert (probs > 0).sum() > 1024 or params.min_p > 0
    seeds = list(range(60))
    positions = [5] * 60
    toks, *_ = sample_many(dev, logits, count_buffer(V), params, seeds, positions, tg=tg)
    assert (probs[toks] > 0).all()
    for tok, (want, near) in zip(toks, expected_draws(probs, thread_order(V, tg), seeds, positions)):
        assert tok == want or near


def _chi2_critical(df, z=3.09):  # alpha = 0.001, Wilson-Hilferty
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("tg,N", [(SAMPLER_THREADS, 400), (128, 3000)])
def test_sample_token_distribution_chi_square(fwd_dev, tg, N):
    """N seeds (kSamplerThreads threads as in production; 128 threads for a larger sample at the
    simulator's cost), several elements per thread (V = 3000): the empirical distribution matches
    the filtered softmax of lily.sampling (chi-square, alpha 0.001); tokens outside the
    filtered support never appear."""
    V = 3000
    logits, prompt, generated = _penalty_case(V, 4, fixed=True)
    logits[:40] += 4.0  # a head of ~40 plausible tokens
    params = SamplingParams(temperature=0.8, top_k=30, top_p=0.92, min_p=0.01, **PENALTIES)
    probs = filtered_probs(params, logits, prompt, generated)
    seeds = list(range(1, N + 1))
    toks, *_ = sample_many(fwd_dev, logits, count_buffer(V, prompt, generated), params, seeds, [7] * N, tg=tg)
    assert (probs[toks] > 0).all()
    obs = np.bincount(toks, minlength=V).astype(np.float64)
    exp_ = probs * N
    big = exp_ >= 5
    stat = ((obs[big] - exp_[big]) ** 2 / exp_[big]).sum()
    rest_o, rest_e = obs[~big].sum(), exp_[~big].sum()
    df = int(big.sum()) - 1
    if rest_e >= 5:
        stat += (rest_o - rest_e) ** 2 / rest_e
        df += 1
    assert stat < _chi2_critical(df), (stat, df)


def test_sample_token_reproducible_and_counts(fwd_dev):
    V = 2000
    logits = f32(fresh_rng(5).standard_normal(V))
    params = SamplingParams(temperature=1.0, top_p=0.95)
    a, *_ = sample_many(fwd_dev, logits, count_buffer(V), params, [42, 42, 43, 42], [10, 10, 10, 11])
    assert a[0] == a[1]
    b, *_ = sample_many(fwd_dev, logits, count_buffer(V), params, [42], [10])
    assert b[0] == a[0]
    many, *_ = sample_many(fwd_dev, logits, count_buffer(V), params, list(range(40)), [10] * 40)
    assert len(set(many.tolist())) > 5
    # the per-session count buffer gets +1 at the drawn token
    counts = count_buffer(V, prompt=[3])
    toks, _, _, C, _ = sample_many(fwd_dev, logits, counts, params, [9], [0], update_counts=True)
    want = counts.copy()
    want[toks[0]] += 1
    np.testing.assert_array_equal(download(C, np.uint32), want)


def test_sample_token_logprobs(dev):
    V = 4000
    logits = f32(fresh_rng(6).standard_normal(V) * 4)
    params = SamplingParams(temperature=0.9, top_k=50, top_logprobs=5, logprobs=True)
    toks, lps, ids, *_ = sample_many(dev, logits, count_buffer(V), params, [11, 12], [1, 2], logprobs=True)
    for tok, lp, ii in zip(toks, lps, ids):
        want = sampler_for(params).logprob(logits, int(tok))
        assert abs(lp[0] - want.logprob) < 1e-4
        np.testing.assert_array_equal(ii, [t for t, _ in want.top])
        np.testing.assert_allclose(lp[1:], [v for _, v in want.top], atol=1e-4)


def test_sample_token_real_vocab(fwd_dev):
    """The real vocabulary (248320), Qwen-style settings: the token is in the nucleus and the
    draw is the one the numpy model of the kernel's order predicts."""
    V = 248320
    rng = fresh_rng(8)
    logits = f32(rng.standard_normal(V) * 2)
    logits[rng.choice(V, 30, replace=False)] += 9
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, top_logprobs=3, logprobs=True)
    probs = filtered_probs(params, logits)
    toks, lps, ids, _, dt = sample_many(fwd_dev, logits, count_buffer(V), params, [1, 2, 3], [0, 0, 0],
                                        logprobs=True)
    assert (probs[toks] > 0).all()
    np.testing.assert_array_equal(ids[0], np.argsort(-logits, kind="stable")[:3])
    lsm = log_softmax(logits)
    np.testing.assert_allclose(lps[:, 0], lsm[toks], atol=1e-4)


# ------------------------------------------------------------------------------ logit bias


def _bias_params(rng, logits, n=40, **kw):
    """A random logit_bias of ``n`` entries: random values, +100 on a random token and -100
    on the unbiased leader (a ban). The +100 token is drawn from the finite logits other than
    the leader's: the leader's ban would overwrite it, and NaN + 100 never wins (either made
    the tests' "+100 wins" fail for 1 in V draws)."""
    leader = int(np.nanargmax(logits))
    pool = np.flatnonzero(np.isfinite(logits))
    pool = pool[pool != leader]
    ids = rng.choice(pool, min(n, pool.size), replace=False)
    vals = rng.uniform(-5, 5, ids.size)
    vals[0] = 100.0
    bias = {int(t): float(v) for t, v in zip(ids, vals)}
    bias[leader] = -100.0
    return SamplingParams(logit_bias=bias, **kw)


@pytest.mark.parametrize("V,slice_", [(1000, 64), (5000, 96), (248320, 4096)])
@pytest.mark.parametrize("lift", [True, False])
def test_argmax_two_stage_bias(dev, V, slice_, lift):
    """argmax_partial_bias + sample_greedy_combine: the argmax of logits + bias (float32 sums,
    ties to the lowest index, NaN never wins), the host sampler's greedy token, still two
    stages. lift: +100 on one token wins; else the -100 ban moves the argmax elsewhere."""
    rng = fresh_rng(V, slice_, lift)
    logits = f32(rng.standard_normal(V) * 3)
    logits[V // 4] = np.nan
    params = _bias_params(rng, logits)
    if not lift:
        params = params.replace(logit_bias={t: b for t, b in params.logit_bias if b < 100})
    bias = twins.dense_bias(params, V)
    token, stages = twins.argmax_two_stage(dev, logits, slice_, bias)
    assert stages == 2
    want = int(np.nanargmax(logits + bias))
    host = sampler_for(params).sample(np.where(np.isnan(logits), -np.inf, logits))  # host argmax: NaN would win
    assert token == want == host
    if lift:
        assert bias[want] == 100.0
    else:
        assert bias[int(np.nanargmax(logits))] == -100.0 and want != int(np.nanargmax(logits))


def test_sample_token_bias_temperature0(dev):
    """Greedy with penalties and a bias (sample_token's pass 1): the host sampler's token."""
    V = 3000
    logits, prompt, generated = _penalty_case(V, 20)
    params = _bias_params(fresh_rng(21), logits, temperature=0.0, **PENALTIES)
    toks, *_ = sample_many(dev, logits, count_buffer(V, prompt, generated), params, [1], [5])
    assert toks[0] == sampler_for(params, prompt, generated).sample(logits)
    assert dict(params.logit_bias)[int(toks[0])] == 100.0


@pytest.mark.parametrize("V,tg,params", [
    (50, 64, SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.02, **PENALTIES)),  # fast path
    (3000, 64, SamplingParams(temperature=0.5)),                                              # slow path
    (3000, 32, SamplingParams(temperature=0.5)),  # the fewest threads the runtime gives it (sampler_threads)
])
def test_sample_token_bias_exact_draws(dev, V, tg, params):
    """Draws with a logit bias (moderate values, so several tokens stay plausible) against the
    numpy model of the kernel over lily.sampling's biased, filtered distribution; banned
    tokens are never drawn."""
    rng = fresh_rng(22, V)
    logits, prompt, generated = _penalty_case(V, int(rng.integers(1 << 30)))
    ids = rng.choice(V, 20, replace=False)
    bias = {int(t): float(v) for t, v in zip(ids, rng.uniform(-3, 3, ids.size))}
    banned = [int(t) for t in np.argsort(-logits)[:3]]
    bias.update({t: -100.0 for t in banned})
    params = params.replace(logit_bias=bias)
    probs = filtered_probs(params, logits, prompt, generated)
    seeds = [int(s) for s in rng.integers(0, 2**63, 40)]
    positions = list(range(40))
    toks, *_ = sample_many(dev, logits, count_buffer(V, prompt, generated), params, seeds, positions, tg=tg)
    assert (probs[toks] > 0).all() and not set(toks.tolist()) & set(banned)
    order = sorted_order(probs) if V <= 1024 else thread_order(V, tg)
    for tok, (want, near) in zip(toks, expected_draws(probs, order, seeds, positions)):
        assert tok == want or near


def test_sample_token_bias_logprobs_raw(dev):
    """Log-probabilities stay those of the raw logits (no bias), as the host sampler's."""
    V = 4000
    logits = f32(fresh_rng(23).standard_normal(V) * 4)
    params = _bias_params(fresh_rng(24), logits, temperature=0.9, top_k=50, top_logprobs=5, logprobs=True)
    toks, lps, ids, *_ = sample_many(dev, logits, count_buffer(V), params, [11, 12], [1, 2], logprobs=True)
    assert (np.asarray([dict(params.logit_bias).get(int(t)) for t in toks]) == 100.0).all()
    for tok, lp, ii in zip(toks, lps, ids):
        want = sampler_for(params).logprob(logits, int(tok))
        assert abs(lp[0] - want.logprob) < 1e-4
        np.testing.assert_array_equal(ii, [t for t, _ in want.top])
        np.testing.assert_allclose(lp[1:], [v for _, v in want.top], atol=1e-4)


@pytest.mark.parametrize("V,pad,slice_", [(1000, 24, 64), (5000, 77, 96), (248077, 243, 4096)])
def test_argmax_two_stage_never_picks_past_vocab(dev, V, pad, slice_):
    """Issue 29: the runtime passes the tokenizer's size as ``vocab`` (``vocab_limit``) while
    the logits buffer holds the model's padded rows (248,077 of 248,320 for Qwen3.6): rows
    past ``vocab``, the largest logits of all, are never chosen, with or without a bias (one
    that lifts a padding row too); the token is the argmax of the first ``vocab``."""
    rng = fresh_rng(V, pad)
    logits = f32(rng.standard_normal(V) * 3)
    padded = twins.padded_rows(logits, pad)
    assert twins.argmax_two_stage(dev, padded, slice_, vocab=V)[0] == int(np.argmax(logits))
    bias = np.zeros(V + pad, np.float32)
    bias[int(rng.integers(V))] = 9.0
    bias[V + pad // 2] = 100.0
    got = twins.argmax_two_stage(dev, padded, slice_, bias, vocab=V)[0]
    assert got == int(np.argmax(logits + bias[:V]))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=50, logprobs=True, top_logprobs=5),  # fast path
    SamplingParams(temperature=1.0, top_p=0.999, logprobs=True, top_logprobs=3),  # slow path (> 1024 kept)
])
def test_sample_token_never_draws_or_lists_past_vocab(dev, params):
    """sample_token told ``vocab`` = V over buffers of V + 24 rows whose extra rows dominate:
    the draws are the numpy model's over the first V (fast and slow path), the logprobs and
    alternatives those of the distribution over the first V (no padding row listed)."""
    V, pad, tg = 3000, 24, 64
    rng = fresh_rng(12, params.top_p)
    logits = f32(rng.standard_normal(V) * 0.5)
    probs = filtered_probs(params, logits)
    seeds = [int(s) for s in rng.integers(0, 2**63, 40)]
    positions = list(range(40))
    toks, lps, ids, *_ = sample_many(dev, twins.padded_rows(logits, pad), count_buffer(V + pad), params,
                                     seeds, positions, tg=tg, logprobs=True, vocab=V)
    assert toks.max() < V and ids.max() < V
    order = sorted_order(probs) if params.top_k else thread_order(V, tg)
    for tok, (want, near) in zip(toks, expected_draws(probs, order, seeds, positions)):
        assert tok == want or near
    for tok, lp, ii in zip(toks[:4], lps, ids):
        want = sampler_for(params).logprob(logits, int(tok))
        assert abs(lp[0] - want.logprob) < 1e-4
        np.testing.assert_array_equal(ii, [t for t, _ in want.top])
