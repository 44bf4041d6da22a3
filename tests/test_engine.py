"""The public engine on the reference device: incremental state, generation, sampling,
stop conditions and bad input."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from lily.constraints import AllowedTokens
from lily.engine import Engine
from lily.errors import ContextLengthError, DeviceError, InvalidParameterError
from lily.reference import ReferenceModel
from lily.sampling import Sampler, SamplingParams, StopMatcher


def _prompt(engine, n):
    text = "ROMEO.\nBut soft, what light through yonder window breaks? It is the east. " * 20
    ids = engine.tokenizer.encode(text)
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.parametrize("which", ["demo", "dims"])
def test_prefill_then_decode_equals_one_shot(which, demo_path, request):
    """Prefill in pieces, then token-by-token decode, gives the one-shot logits."""
    path = demo_path if which == "demo" else request.getfixturevalue("dims_checkpoint")
    engine = Engine.load(path, device="reference")
    ids = _prompt(engine, 40)
    full = engine.prefill(ids, all_logits=True)
    engine.reset()
    engine.prefill(ids[:17])
    engine.prefill(ids[17:30])
    steps = [engine.decode(t) for t in ids[30:]]
    np.testing.assert_allclose(np.stack(steps), full[30:], rtol=2e-4, atol=2e-4)
    assert engine.position == 40


def test_gdn_state_drift_over_many_steps(demo_path):
    """512 recurrent steps one at a time match one 512-token prefill (no drift)."""
    engine = Engine.load(demo_path, device="reference")
    ids = (_prompt(engine, 200) * 3)[:512]
    model: ReferenceModel = engine.backend.model
    a, b = model.new_state(1024), model.new_state(1024)
    model.forward(ids, a)
    for t in ids:
        model.forward([t], b)
    for i in a.recurrent:
        np.testing.assert_allclose(b.recurrent[i], a.recurrent[i], rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(b.conv[i], a.conv[i], rtol=1e-5, atol=1e-6)


def test_reference_streams_weights_it_cannot_keep(tiny_checkpoint):
    """With no room to keep dequantized weights (the full-size case: 140 GB as float32) the
    reference dequantizes each use and applies large weights block by block: the same
    logits, with peak memory about one block rather than lm_head's whole float32 copy (127 MB
    for this preset). The experts on several threads give the very same bits as on one."""
    import tracemalloc

    from lily.checkpoint import open_checkpoint
    ck = open_checkpoint(tiny_checkpoint)
    ids = [785, 3974, 13876, 38835]
    kept = ReferenceModel(ck)
    assert kept._cache_experts and ck.dequantized_nbytes <= 3 << 30  # small: everything kept
    want = kept.forward(ids, kept.new_state(16), all_logits=True)
    assert "lm_head" in kept._dense and kept._experts
    streamed = ReferenceModel(ck, cache_bytes=0, block_bytes=4 << 20, threads=3)
    assert not streamed._cache_experts
    tracemalloc.start()
    got = streamed.forward(ids, streamed.new_state(16), all_logits=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert streamed._cache_used == 0 and not streamed._dense and not streamed._experts
    assert peak < 40 << 20, peak  # blocks of 4 MiB and their products; not 127 MB
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    one = ReferenceModel(ck, cache_bytes=0, block_bytes=4 << 20)
    np.testing.assert_array_equal(one.forward(ids, one.new_state(16), all_logits=True), got)
    with pytest.raises(InvalidParameterError, match="threads"):
        ReferenceModel(ck, threads=0)


def test_generate_demo_greedy_is_shakespeare(demo_engine):
    r = demo_engine.generate("ROMEO.\n", max_tokens=32, temperature=0.0)
    assert r.finish_reason == "length" and r.completion_tokens == 32 == len(r.token_ids)
    assert r.prompt_tokens == len(demo_engine.tokenizer.encode("ROMEO.\n"))
    assert r.text == demo_engine.tokenizer.decode(r.token_ids)
    words = r.text.split()
    assert len(words) > 10 and sum(w.isalpha() for w in words) > len(words) // 2
    assert r.timings.decode_tokens_per_s > 0


def test_stream_equals_generate(demo_engine):
    events = list(demo_engine.stream("KING.\n", max_tokens=20, temperature=0.8, seed=7))
    r = demo_engine.generate("KING.\n", max_tokens=20, temperature=0.8, seed=7)
    assert "".join(e.text for e in events) == r.text
    assert [t for e in events for t in e.token_ids] == r.token_ids
    assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])


def test_seed_reproducible_and_varies(demo_engine):
    a = demo_engine.generate("JULIET.\n", max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    b = demo_engine.generate("JULIET.\n", max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    c = demo_engine.generate("JULIET.\n", max_tokens=16, temperature=1.0, top_p=0.95, seed=99)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_spanning_tokens(demo_engine):
    full = demo_engine.generate("ROMEO.\n", max_tokens=24, temperature=0.0).text
    # A stop string that starts inside one token and ends in a later one.
    cut = len(full) // 2
    stop = full[cut - 3: cut + 4]
    r = demo_engine.generate("ROMEO.\n", max_tokens=24, temperature=0.0, stop=[stop])
    assert r.finish_reason == "stop"
    assert r.text == full[: full.index(stop)]
    assert stop not in r.text


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopMatcher(["</end>", "xyz"])
    out = []
    for piece in ["hello <", "/e", "nd", "> tail"]:
        text, stopped = m.push(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "hello " and stopped
    m = StopMatcher(["abc"])
    assert m.push("xxab") == ("xx", False)
    assert m.push("d") == ("abd", False)
    assert m.flush() == ""


def test_eos_ends_generation_and_is_not_printed(demo_engine):
    eos = min(demo_engine.eos_token_ids)
    assert {8166, 8168} <= demo_engine.eos_token_ids  # generation_config + tokenizer config

    class ForceEOS(Sampler):
        calls = 0

        def sample(self, logits):
            ForceEOS.calls += 1
            return eos if ForceEOS.calls > 3 else int(np.argmax(logits))

    import lily.backend as eng  # the host sampling loop
    orig = eng.Sampler
    eng.Sampler = ForceEOS
    try:
        r = demo_engine.generate("ROMEO.\n", max_tokens=50)
    finally:
        eng.Sampler = orig
    assert r.finish_reason == "stop" and r.completion_tokens == 3
    assert "<|im_end|>" not in r.text and "<|endoftext|>" not in r.text


def test_chat_uses_template(demo_engine):
    r = demo_engine.chat([{"role": "user", "content": "Speak, Romeo."}], max_tokens=8,
                         chat_template_kwargs={"enable_thinking": False})
    ids = demo_engine.tokenizer.encode_chat([{"role": "user", "content": "Speak, Romeo."}],
                                            enable_thinking=False)
    assert r.prompt_tokens == len(ids) and r.completion_tokens >= 1


def test_session_reuse_when_prompt_extends(demo_engine):
    demo_engine.reset()
    cache, demo_engine.prompt_cache = demo_engine.prompt_cache, None  # the session alone
    try:
        ids = _prompt(demo_engine, 30)
        demo_engine.generate(ids[:20], max_tokens=1, temperature=0.0)
        assert demo_engine.tokens == ids[:20]
        r = demo_engine.generate(ids, max_tokens=1, temperature=0.0)
        assert r.timings.prefill_tokens == 10  # only the new suffix was prefilled
        assert r.cached_tokens == 20 and r.prompt_tokens == 30
        events = list(demo_engine.stream(ids[:5], max_tokens=1, temperature=0.0))  # not an extension
        assert events[-1].cached_tokens == 0 and events[-1].timings.prefill_tokens == 5
        # on_start tells the reuse before the prefill (and before any event)
        seen = []
        stream = demo_engine.stream(ids[:6], max_tokens=1, temperature=0.0, on_start=seen.append)
        first = next(stream)
        assert seen == [5] and demo_engine.tokens[:5] == ids[:5]
        assert [first, *stream][-1].cached_tokens == 5
    finally:
        demo_engine.prompt_cache = cache
    fresh = Engine.load(demo_engine.path, device="reference")
    assert fresh.generate(ids, max_tokens=4, temperature=0.0).token_ids == \
        demo_engine.generate(ids, max_tokens=4, temperature=0.0).token_ids


def test_snapshot_restore(demo_engine):
    demo_engine.reset()
    demo_engine.prefill(_prompt(demo_engine, 12))
    snap = demo_engine.snapshot()
    a = demo_engine.decode(5)
    demo_engine.decode(6)
    demo_engine.restore(snap)
    np.testing.assert_array_equal(demo_engine.decode(5), a)


def test_cancel_during_prefill_and_decode(demo_engine):
    ev = threading.Event()
    ev.set()
    r = demo_engine.generate("ROMEO.\n", max_tokens=10, cancel=ev)
    assert r.finish_reason == "cancelled" and r.completion_tokens == 0
    ev = threading.Event()
    gen = demo_engine.stream("ROMEO.\n", max_tokens=50, temperature=0.0, cancel=ev)
    got = [next(gen), next(gen)]
    ev.set()
    rest = list(gen)
    assert rest[-1].finish_reason == "cancelled" and len(got) + len(rest) < 10
    # The engine is still usable and deterministic afterwards.
    assert demo_engine.generate("ROMEO.\n", max_tokens=4, temperature=0.0).completion_tokens == 4


def test_prompt_longer_than_context(demo_path):
    engine = Engine.load(demo_path, max_context=16, device="reference")
    with pytest.raises(ContextLengthError, match="context window is 16"):
        engine.generate(_prompt(engine, 17))
    with pytest.raises(ContextLengthError):
        engine.prefill(_prompt(engine, 17))
    assert engine.position == 0
    r = engine.generate(_prompt(engine, 10), max_tokens=100, temperature=0.0, ignore_eos=True)
    assert r.finish_reason == "length" and r.prompt_tokens + r.completion_tokens <= 17
    engine.reset()
    with pytest.raises(ContextLengthError, match="the input is 17 tokens long but the context window is 16"):
        engine.prefill(_prompt(engine, 17))
    # the one rule (Engine.check_tokens, the server's too): a prompt filling the window is
    # accepted and ends at once for length
    r = engine.generate(_prompt(engine, 16), max_tokens=5)
    assert (r.finish_reason, r.prompt_tokens, r.completion_tokens) == ("length", 16, 0)


@pytest.mark.parametrize("kw, field", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"top_logprobs": 50}, "top_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop": 3}, "stop=3: must be a string or a list of strings"),
    ({"seed": "abc"}, "seed"),
    ({"bogus": 1}, "bogus"),
    ({"logit_bias": {10**6: 1.0}}, r"logit_bias=\{1000000: 1.0\}: token id outside the vocabulary \[0, "),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, r"logit_bias=\{'5': 1.0\}: token ids must be integers"),
    ({"logit_bias": {5: 100.5}}, r"logit_bias=\{5: 100.5\}: the bias must be a number in \[-100, 100\]"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias"),
    ({"logit_bias": {t: 1.0 for t in range(1025)}}, r"logit_bias=\[1025 entries\]: at most 1024"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"logit_bias": {5: 10**400}}, r"logit_bias=\{5: <an integer of 1329 bits>\}: the bias must be a number"),
    ({"logit_bias": {10**5000: 1.0}}, r"logit_bias=\{<an integer of 16610 bits>: 1.0\}: token id outside"),
])
def test_invalid_sampling_parameters(demo_engine, kw, field):
    with pytest.raises(InvalidParameterError, match=field):
        demo_engine.generate("ROMEO.\n", **kw)


def test_bad_tokens_and_device(demo_engine, demo_path):
    with pytest.raises(InvalidParameterError, match="outside the vocabulary"):
        demo_engine.prefill([1, 2, 10**6])
    with pytest.raises(InvalidParameterError):
        demo_engine.prefill([])
    with pytest.raises(InvalidParameterError):
        demo_engine.prefill([[1, 2]])
    for call, name in ((lambda: demo_engine.decode(None), "token must be an integer"),
                       (lambda: demo_engine.decode("a"), "token must be an integer"),
                       (lambda: demo_engine.generate(None), "prompt must be a string or a sequence"),
                       (lambda: demo_engine.prefill(None), "the input must be a sequence"),
                       (lambda: demo_engine.check_tokens("abc"), "the prompt must be a sequence")):
        with pytest.raises(InvalidParameterError, match=name):
            call()
    with pytest.raises(DeviceError, match="unknown device"):
        Engine.load(demo_path, device="cuda")
    with pytest.raises(InvalidParameterError, match="max_context"):
        Engine.load(demo_path, max_context=0)


def test_default_device_is_metal_else_reference(demo_path, capfd, monkeypatch):
    """Engine.load's default (auto) is metal where this build has it, else reference with a
    notice (on a Mac, how to build the GPU device, Xcode selected first); the simulator only
    when asked for, or named by $LILY_AUTO_DEVICE (the suite's stand-in for a Mac)."""
    import sys

    from lily.engine import AUTO_DEVICE_ENV, auto_device
    from lily.lab.device import devices
    monkeypatch.delenv(AUTO_DEVICE_ENV, raising=False)
    e = Engine.load(demo_path, max_context=64)
    if "metal" in devices():
        assert e.device == "metal"
    else:
        assert e.device == "reference"
        assert "using device='reference'" in capfd.readouterr().err
        monkeypatch.setattr(sys, "platform", "darwin")
        Engine.load(demo_path, max_context=64)
        err = capfd.readouterr().err
        assert "sudo xcode-select -s /Applications/Xcode.app" in err and "downloadComponent MetalToolchain" in err
    monkeypatch.setenv(AUTO_DEVICE_ENV, "sim")
    assert auto_device() == "sim" and Engine.load(demo_path, max_context=64).device == "sim"
    assert "using device=" not in capfd.readouterr().err
    for bad in ("auto", "cuda"):
        monkeypatch.setenv(AUTO_DEVICE_ENV, bad)
        with pytest.raises(DeviceError, match=f"{AUTO_DEVICE_ENV}='{bad}' names no device"):
            Engine.load(demo_path, max_context=64)


def test_sampler_logit_bias():
    """The bias is added to the raw logit before the penalties and the temperature; greedy
    and sampled draws see it, log-probabilities do not (raw logits, as vLLM reports)."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    assert Sampler(SamplingParams(logit_bias={3: 5.0})).sample(logits) == 3
    assert Sampler(SamplingParams(logit_bias={0: -100.0})).sample(logits) == 1
    for _ in range(50):
        assert Sampler(SamplingParams(temperature=1.0, logit_bias={0: -100, 1: -100})).sample(logits) in (2, 3)
    # bias, then the repetition penalty (a biased negative logit is multiplied), then temperature
    s = Sampler(SamplingParams(temperature=2.0, repetition_penalty=3.0, logit_bias={0: -2.0}), prompt_tokens=[0])
    x = np.array([1.0, 0.5], np.float32)
    assert s.process(x)[0] == pytest.approx(-3.0)
    want = np.exp(np.array([-3.0, 0.5]) / 2.0)
    np.testing.assert_allclose(s.probabilities(x), want / want.sum())
    lp = Sampler(SamplingParams(logit_bias={3: 5.0}, logprobs=True, top_logprobs=2)).logprob(logits, 3)
    assert lp.logprob == pytest.approx(float(np.log(0.05)), abs=1e-6) and [t for t, _ in lp.top] == [0, 1]


def test_sampler_filters():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    for _ in range(50):
        assert Sampler(SamplingParams(temperature=1.0, top_k=1)).sample(logits) == 0
        assert Sampler(SamplingParams(temperature=1.0, top_p=0.7)).sample(logits) in (0, 1)
        assert Sampler(SamplingParams(temperature=1.0, min_p=0.5)).sample(logits) in (0, 1)
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=2.0))
    assert s.sample(np.array([1.0, 0.5])) == 0
    assert s.sample(np.array([1.0, 0.5])) == 1  # token 0 now penalised by 2
    rep = Sampler(SamplingParams(temperature=0.0, repetition_penalty=3.0), prompt_tokens=[0])
    assert rep.sample(np.array([1.0, 0.5])) == 1


def test_logprobs(demo_engine):
    r = demo_engine.generate("ROMEO.\n", max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=3)
    assert len(r.logprobs) == 4
    for lp, tok in zip(r.logprobs, r.token_ids):
        assert lp.token_id == tok and lp.logprob <= 0
        assert lp.top[0][0] == tok and len(lp.top) == 3  # greedy: chosen token is the top one


@pytest.mark.parametrize("gen, match", [
    ({"do_sample": True, "temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ({"do_sample": True, "temperature": -1}, "temperature must be >= 0"),
    ({"max_new_tokens": -3}, "max_tokens=-3"),
    ({"do_sample": True, "temperature": 0.7, "top_k": 2.5}, "top_k must be an integer, got 2.5"),
    ({"do_sample": "yes"}, "do_sample must be true or false"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_generation_config_is_named(tmp_path, demo_path, gen, match):
    import shutil
    from lily.errors import ConfigError
    d = tmp_path / "m"
    shutil.copytree(demo_path, d)
    (d / "generation_config.json").write_text(json.dumps(gen))
    with pytest.raises(ConfigError, match=match) as e:
        Engine.load(d)
    assert "generation_config.json" in str(e.value)


def test_generation_config_defaults(tmp_path, demo_path):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(demo_path, d)
    (d / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.95, "max_new_tokens": 64,
         "eos_token_id": [1, 2]}))
    p = Engine.load(d).generation_defaults
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.7, 20, 0.95, 64)
    (d / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7, "top_k": 20}))
    p = Engine.load(d).generation_defaults
    assert p.temperature == 0.0 and p.top_k == 0


@pytest.mark.parametrize("eos", [["x"], [None], 99999999, {"a": 1}, -1])
def test_bad_generation_config_eos_is_named(tmp_path, demo_path, eos):
    import shutil
    from lily.errors import ConfigError
    d = tmp_path / "m"
    shutil.copytree(demo_path, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id"):
        Engine.load(d)


# ---- the decoding-constraint hook -------------------------------------------------------


class _LateConstraint(AllowedTokens):
    """Unconstrained (None) for the first ``free`` steps, then only ``tokens``."""

    def __init__(self, vocab_size, tokens, length, free):
        super().__init__(vocab_size, tokens, length)
        self.free, self.masks_asked = free, 0

    def allowed(self):
        self.masks_asked += 1
        return None if len(self.generated) < self.free else self.mask


def test_constraint_masks_greedy_sampled_and_logprobs(demo_engine):
    """Every token is from the mask; greedy picks the best allowed token; the logprobs are
    those of the masked distribution; the constraint's end stops the generation."""
    allowed = demo_engine.tokenizer.encode(" the and of to a I")
    assert len(set(allowed)) >= 5
    free = demo_engine.generate("ROMEO.\n", max_tokens=1, temperature=0.0)
    assert free.token_ids[0] not in allowed  # the constraint changes something
    demo_engine.reset()
    logits = demo_engine.prefill(demo_engine.tokenizer.encode("ROMEO.\n"))
    c = AllowedTokens(demo_engine.config.vocab_size, allowed, length=6)
    r = demo_engine.generate("ROMEO.\n", max_tokens=20, temperature=0.0, constraint=c,
                             logprobs=True, top_logprobs=20)
    assert r.finish_reason == "stop" and r.completion_tokens == 6 and c.generated == r.token_ids
    assert set(r.token_ids) <= set(allowed)
    masked = np.where(c.mask, logits.astype(np.float64), -np.inf)
    assert r.token_ids[0] == int(np.argmax(masked))
    want = masked - masked.max() - np.log(np.exp(masked - masked.max()).sum())
    assert r.logprobs[0].logprob == pytest.approx(want[r.token_ids[0]], abs=1e-4)
    top = r.logprobs[0].top
    assert len(top) == len(set(allowed)) and {i for i, _ in top} == set(allowed)  # only allowed ones
    for seed in (1, 2):
        c = AllowedTokens(demo_engine.config.vocab_size, allowed, length=50)
        r = demo_engine.generate("ROMEO.\n", max_tokens=8, temperature=1.5, seed=seed, constraint=c)
        assert r.finish_reason == "length" and set(r.token_ids) <= set(allowed)


def test_constraint_none_means_unconstrained(demo_engine):
    allowed = demo_engine.tokenizer.encode(" the and")
    free = demo_engine.generate("ROMEO.\n", max_tokens=5, temperature=0.0)
    c = _LateConstraint(demo_engine.config.vocab_size, allowed, length=5, free=3)
    r = demo_engine.generate("ROMEO.\n", max_tokens=5, temperature=0.0, constraint=c)
    assert r.token_ids[:3] == free.token_ids[:3] and set(r.token_ids[3:]) <= set(allowed)
    assert c.masks_asked == 5


def test_constraint_bad_mask(demo_engine):
    class Bad(AllowedTokens):
        def allowed(self):
            return self.mask[:10]

    v = demo_engine.config.vocab_size
    with pytest.raises(InvalidParameterError, match="mask must be bool"):
        demo_engine.generate("ROMEO.\n", max_tokens=3, constraint=Bad(v, [1], 3))
    with pytest.raises(InvalidParameterError, match="allows no token"):
        demo_engine.generate("ROMEO.\n", max_tokens=3, constraint=AllowedTokens(v, [], 3))
    assert demo_engine.generate("ROMEO.\n", max_tokens=2, temperature=0.0).completion_tokens == 2


def test_final_event_carries_the_decode_time(demo_engine):
    """Readers stop at the final event (the server logs from it): its timings are filled in
    then, not only when the generator is closed."""
    demo_engine.reset()
    events = demo_engine.stream("ROMEO.", max_tokens=6, temperature=0.0, ignore_eos=True)
    for ev in events:
        if ev.finish_reason is not None:
            break
    assert ev.completion_tokens == 6
    assert ev.timings.prefill_s > 0 and ev.timings.decode_s > 0 and ev.timings.decode_tokens_per_s > 0
    events.close()


def test_prefill_chunked_scores_like_prefill_and_cancels(demo_path):
    """Engine.prefill_chunked (the one chunked-prefill loop, shared with the server's prompt
    scoring): the same logits as one prefill, in prefill_chunk pieces; a cancel empties the
    session."""
    engine = Engine.load(demo_path, max_context=512, device="reference", prompt_cache_bytes=0)
    ids = (_prompt(engine, 60) * 5)[:300]  # three chunks of the reference's 128
    whole = engine.prefill(ids, all_logits=True)
    engine.reset()
    rows = []
    assert engine.prefill_chunked(ids, on_logits=rows.append)
    assert [len(r) for r in rows] == [128, 128, 44] and engine.tokens == ids
    np.testing.assert_allclose(np.concatenate(rows), whole, rtol=1e-4, atol=1e-4)
    engine.reset()
    cancel = threading.Event()
    cancel.set()
    assert not engine.prefill_chunked(ids, cancel=cancel) and engine.position == 0
    with pytest.raises(ContextLengthError):
        engine.prefill_chunked(ids + ids)


def test_load_progress_bar_reaches_its_end_and_notices_keep_their_own_line(capfd):
    """Issue 29: the load's progress bar showed "0/3" to the end (updates within tqdm's
    0.1 s refresh interval were never drawn) and the device notice was printed onto the
    bar's line. Now every step is drawn and notices are written above the bar."""
    Engine.load(device="auto", progress=True)
    err = capfd.readouterr().err
    assert "3/3" in err, err
    if "no Metal GPU" in err:  # a build without the GPU device: the notice has its own line
        line = next(ln for ln in err.split("\n") if "no Metal GPU" in ln)
        assert line.split("\r")[-1].startswith("lily: no Metal GPU"), repr(line)
