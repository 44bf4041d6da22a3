"""Sampling parameters, the host token sampler (the reference device, and constrained
requests on every device: lily.backend.HostGeneration), and stop-string matching on
streamed text.

Order of logit processing (the usual one, as in Hugging Face / vLLM): logit bias,
repetition penalty, presence and frequency penalties, temperature, top-k, top-p, min-p, then
a draw from a seeded ``numpy.random.Generator`` (PCG64). ``temperature == 0`` is greedy
(argmax). Log-probabilities are those of the raw logits (before bias, penalties and
temperature), as vLLM reports them by default.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from lily.errors import ConfigError, InvalidParameterError

#: Most entries a ``logit_bias`` may have. OpenAI's reference names no limit; a bound keeps
#: a request's validation and upload cheap (the device buffer is dense either way).
LOGIT_BIAS_MAX_ENTRIES = 1024
#: Largest magnitude of a bias (OpenAI's range: -100 bans a token, +100 all but forces it).
LOGIT_BIAS_MAX = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Parameters
    ----------
    max_tokens : int
        Maximum number of generated tokens (>= 1).
    temperature : float
        0 for greedy decoding; otherwise logits are divided by it (>= 0, <= 100).
    top_k : int
        Keep the k most likely tokens; 0 disables.
    top_p : float
        Nucleus sampling: keep the smallest set with cumulative probability >= top_p (0 < p <= 1).
    min_p : float
        Drop tokens whose probability is below ``min_p * p_max`` (0 <= min_p <= 1).
    seed : int | None
        Seed of the per-request random generator; None draws a fresh seed.
    stop : tuple[str, ...]
        Stop strings: generation ends before the first occurrence, which is not returned.
    presence_penalty, frequency_penalty : float
        OpenAI-style penalties in [-2, 2] over the generated tokens so far.
    repetition_penalty : float
        Hugging Face-style multiplicative penalty (> 0, 1 disables) over prompt and output.
    logprobs : bool
        Return the log-probability of each chosen token.
    top_logprobs : int
        Also return this many most likely alternatives per position (0..20).
    ignore_eos : bool
        Keep generating past EOS tokens (benchmarks).
    logit_bias : tuple[tuple[int, float], ...]
        OpenAI's ``logit_bias``: token id -> bias in logit units, finite, in [-100, 100],
        added to that token's raw logit before the penalties and temperature (as vLLM and
        llama.cpp do); -100 effectively bans a token, +100 all but forces it. Given as a
        mapping (or (id, bias) pairs); stored as pairs sorted by id, at most
        ``LOGIT_BIAS_MAX_ENTRIES``. Ids must be >= 0 here; the engine checks them against
        the vocabulary (:meth:`check_vocab`). Log-probabilities stay those of the raw logits.
    thinking_budget : int | None
        At most this many generated tokens inside the thinking block (``<think> ... </think>``,
        open from the prompt or opened by the model); then the engine closes the block itself
        and the answer follows (:meth:`lily.engine.Engine.stream`). None: no budget. A limit of
        the generation loop like ``max_tokens`` and ``stop``, not of the samplers.
    vocab_limit : int
        Token ids at or above it are never chosen, and log-probabilities are those of the
        distribution over the ids below it (0: no limit). The engine sets it to the
        tokenizer's size (:attr:`lily.engine.Engine.sample_vocab`) when the model's embedding
        has more rows than the tokenizer has ids (Qwen3.5/3.6: 248,320 rows, 248,077 ids), so
        no sampler, on the host or the device, picks an id that decodes to nothing.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    thinking_budget: int | None = None
    vocab_limit: int = 0

    def __post_init__(self):
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        elif stop is None:
            stop = ()
        elif not isinstance(stop, (list, tuple)):
            raise InvalidParameterError(f"invalid sampling parameter stop={stop!r}: must be a string "
                                        "or a list of strings")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`InvalidParameterError` naming the first invalid field."""
        def bad(name, why):
            raise InvalidParameterError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        def num(name, lo, hi, lo_open=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "must be a finite number")
            if (v <= lo if lo_open else v < lo) or v > hi:
                bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}]")

        def integer(name, lo, hi, note=None):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                bad(name, "must be an integer")
            if v < lo or v > hi:
                bad(name, f"must be an integer in [{lo}, {hi}]" + (f" ({note})" if note else ""))

        int32_max = (1 << 31) - 1  # 2147483647, the largest 32-bit signed integer
        integer("max_tokens", 1, int32_max)
        num("temperature", 0.0, 100.0)
        integer("top_k", 0, int32_max, "0 disables top-k")
        num("top_p", 0.0, 1.0, lo_open=True)
        num("min_p", 0.0, 1.0)
        num("presence_penalty", -2.0, 2.0)
        num("frequency_penalty", -2.0, 2.0)
        num("repetition_penalty", 0.0, 100.0, lo_open=True)
        integer("top_logprobs", 0, 20)
        if self.seed is not None:
            integer("seed", -(1 << 63), (1 << 64) - 1)
        if self.thinking_budget is not None:
            integer("thinking_budget", 1, int32_max, "tokens of thinking; None for no budget")
        integer("vocab_limit", 0, int32_max, "0: no limit")
        # the list is not echoed: a client may send many or long strings
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise InvalidParameterError(f"invalid sampling parameter stop={s!r}"[:80] + f" (stop string {i}): "
                                            "stop strings must be non-empty strings")
        if len(self.stop) > 16:
            raise InvalidParameterError(f"invalid sampling parameter stop=[{len(self.stop)} strings]: "
                                        "at most 16 stop strings")
        self._check_bias()

    def _check_bias(self, vocab: int | None = None) -> None:
        # the map is not echoed (up to LOGIT_BIAS_MAX_ENTRIES entries): the bad entry is
        if len(self.logit_bias) > LOGIT_BIAS_MAX_ENTRIES:
            raise InvalidParameterError(f"invalid sampling parameter logit_bias=[{len(self.logit_bias)} entries]: "
                                        f"at most {LOGIT_BIAS_MAX_ENTRIES} entries")
        hi = (1 << 31) - 1 if vocab is None else vocab - 1
        seen = set()
        for tok, b in self.logit_bias:
            entry = f"invalid sampling parameter logit_bias={{{_short(tok)}: {_short(b)}}}"
            if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
                raise InvalidParameterError(f"{entry}: token ids must be integers")
            if not 0 <= tok <= hi:
                where = "the vocabulary" if vocab is not None else "the token id range"
                raise InvalidParameterError(f"{entry}: token id outside {where} [0, {hi + 1})")
            if tok in seen:
                raise InvalidParameterError(f"{entry}: token id given twice")
            seen.add(tok)
            if not valid_bias(b):
                raise InvalidParameterError(f"{entry}: the bias must be a number in "
                                            f"[{-LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]")

    def check_vocab(self, vocab: int) -> None:
        """Raise :class:`InvalidParameterError` naming the first ``logit_bias`` entry whose
        token id is outside ``[0, vocab)``."""
        self._check_bias(vocab)

    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``logit_bias`` as (ids int64 ``[n]``, biases float32 ``[n]``), sorted by id."""
        ids = np.fromiter((t for t, _ in self.logit_bias), np.int64, len(self.logit_bias))
        vals = np.fromiter((b for _, b in self.logit_bias), np.float32, len(self.logit_bias))
        return ids, vals

    def replace(self, **changes) -> "SamplingParams":
        """A copy with ``changes`` applied (validated). Unknown names raise
        :class:`InvalidParameterError`."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise InvalidParameterError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_generation_config(cls, gen: dict, where: str = "generation_config.json") -> "SamplingParams":
        """Defaults from a checkpoint's ``generation_config.json`` (Hugging Face semantics):
        its temperature, top_k, top_p and min_p when ``do_sample`` is true (or unspecified
        with a temperature given), greedy otherwise; repetition_penalty and max_new_tokens
        in either case. A temperature of 0 with sampling means greedy.

        Raises :class:`ConfigError` naming ``where`` and the key for a value of the wrong
        type or out of range (the same ranges as the parameters themselves).
        """
        def value(key, kind):
            v = gen.get(key)
            if v is None:
                return None
            if kind is bool:
                ok = isinstance(v, bool)
            else:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                ok = ok and (kind is float or float(v).is_integer())
            if not ok:
                what = {bool: "true or false", int: "an integer", float: "a number"}[kind]
                raise ConfigError(f"{where}: {key} must be {what}, got {v!r}")
            return kind(v)

        temperature = value("temperature", float)
        sample = value("do_sample", bool)
        if sample is None:
            sample = temperature is not None
        if temperature is not None and temperature < 0:
            raise ConfigError(f"{where}: temperature must be >= 0, got {temperature!r}")
        kw = {}
        if sample and (temperature is None or temperature > 0):
            kw["temperature"] = 1.0 if temperature is None else temperature
            for key, kind in (("top_k", int), ("top_p", float), ("min_p", float)):
                if (v := value(key, kind)) is not None:
                    kw[key] = v
        if (v := value("repetition_penalty", float)) is not None:
            kw["repetition_penalty"] = v
        if (v := value("max_new_tokens", int)) is not None:
            kw["max_tokens"] = v
        try:
            return cls(**kw)
        except InvalidParameterError as e:
            raise ConfigError(f"{where}: {e}") from None


def valid_bias(b) -> bool:
    """Whether ``b`` is a ``logit_bias`` value: a number (not a bool), finite, with
    ``|b| <= LOGIT_BIAS_MAX``. The range is tested first: ``math.isfinite`` overflows on an
    int beyond float range (such an int is out of range anyway)."""
    return (not isinstance(b, bool) and isinstance(b, (int, float, np.integer, np.floating))
            and abs(b) <= LOGIT_BIAS_MAX and math.isfinite(b))


def _short(v) -> str:
    """``repr(v)`` for an error message, at most 40 characters (an int of thousands of digits
    cannot even be printed in full: Python limits int-to-str conversion)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"<an integer of {v.bit_length()} bits>"
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _bias_pairs(bias) -> tuple:
    """A ``logit_bias`` given as a mapping, (id, bias) pairs or None, as a tuple of pairs
    sorted by id (integral ids as ``int``, biases as ``float``; other values are kept for
    :meth:`SamplingParams.validate` to name)."""
    if bias is None:
        return ()
    if isinstance(bias, Mapping):
        items = list(bias.items())
    elif isinstance(bias, (list, tuple)):
        items = list(bias)
        if not all(isinstance(e, (list, tuple)) and len(e) == 2 for e in items):
            raise InvalidParameterError("invalid sampling parameter logit_bias: must be a mapping of token id "
                                        "to bias (or (id, bias) pairs)")
    else:
        raise InvalidParameterError(f"invalid sampling parameter logit_bias={bias!r}"[:80] + ": must be a mapping "
                                    "of token id to bias")

    def norm(t, b):
        if isinstance(t, np.integer):
            t = int(t)
        if isinstance(b, (int, np.floating, np.integer)) and not isinstance(b, bool):
            try:
                b = float(b)
            except OverflowError:  # an int beyond float range: kept for validate() to name
                pass
        return t, b

    pairs = [norm(t, b) for t, b in items]
    try:
        return tuple(sorted(pairs, key=lambda e: e[0]))
    except TypeError:  # ids of mixed types: validate() names the bad one
        return tuple(pairs)


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated token under the model's distribution (raw logits,
    before penalties and temperature), with the ``top`` alternatives as ``(id, logprob)``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return (x - m - np.log(np.exp(x - m).sum())).astype(np.float32)


class Sampler:
    """Picks tokens from float32 logits ``[vocab]`` according to :class:`SamplingParams`.

    Keeps the per-request state the penalties need (token counts) and the seeded RNG.
    """

    def __init__(self, params: SamplingParams, prompt_tokens: Sequence[int] = ()):
        self.params = params
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self.rng = np.random.Generator(np.random.PCG64(int(seed) % (1 << 128)))
        self._seen = set(int(t) for t in prompt_tokens)
        self._counts: dict[int, int] = {}
        self._bias = params.bias_arrays() if params.logit_bias else None

    def _limited(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with the ids at or above ``vocab_limit`` set to ``-inf`` (a float32
        copy), or ``logits`` itself when the limit does not cut it."""
        n = self.params.vocab_limit
        if not 0 < n < logits.size:
            return logits
        x = np.array(logits, dtype=np.float32)
        x[n:] = -np.inf
        return x

    def process(self, logits: np.ndarray) -> np.ndarray:
        """Logit bias and penalties applied to a float64 copy of ``logits`` (float32
        ``[vocab]``; ids at or above ``vocab_limit`` at ``-inf``); :meth:`probabilities`
        divides by the temperature."""
        p = self.params
        logits = self._limited(logits)
        if self._bias is not None:
            # added in float32, as the device sampler does (the same sums, bit for bit)
            x = np.array(logits, dtype=np.float32)
            ids, vals = self._bias
            x[ids] += vals
            x = x.astype(np.float64)
        else:
            x = np.array(logits, dtype=np.float64)
        if p.repetition_penalty != 1.0 and (self._seen or self._counts):
            ids = np.fromiter(self._seen | set(self._counts), dtype=np.int64)
            v = x[ids]
            x[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if self._counts and (p.presence_penalty or p.frequency_penalty):
            ids = np.fromiter(self._counts, dtype=np.int64)
            cnt = np.fromiter(self._counts.values(), dtype=np.float64)
            x[ids] -= p.presence_penalty + p.frequency_penalty * cnt
        return x

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a sampled (temperature > 0) draw uses: float64 ``[vocab]``
        after penalties, temperature, top-k, top-p and min-p, renormalised."""
        p = self.params
        x = self.process(logits) / p.temperature
        if 0 < p.top_k < x.size:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x = np.where(x >= kth, x, -np.inf)
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            csum = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(csum, p.top_p) + 1)]
            mask = np.zeros_like(probs, dtype=bool)
            mask[keep] = True
            probs = np.where(mask, probs, 0.0)
        if p.min_p > 0.0:
            probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        return probs / probs.sum()

    def sample(self, logits: np.ndarray) -> int:
        """Choose the next token id and record it for the penalties."""
        if self.params.temperature == 0.0:
            tok = int(np.argmax(self.process(logits)))
        else:
            probs = self.probabilities(logits)
            tok = int(self.rng.choice(probs.size, p=probs))
        self._counts[tok] = self._counts.get(tok, 0) + 1
        return tok

    def logprob(self, logits: np.ndarray, token: int) -> TokenLogprob:
        """The :class:`TokenLogprob` of ``token`` under ``logits`` (float32 ``[vocab]``,
        masked to ``-inf`` where a constraint forbids a token: the alternatives listed are
        then only allowed ones). Raw logits: no bias, penalty or temperature; the ids at or
        above ``vocab_limit`` are left out of the distribution (never listed)."""
        lp = log_softmax(self._limited(logits))
        top = ()
        if self.params.top_logprobs:
            n = self.params.top_logprobs
            idx = np.argpartition(-lp, n)[:n]
            idx = idx[np.argsort(-lp[idx], kind="stable")]
            top = tuple((int(i), float(lp[i])) for i in idx if np.isfinite(lp[i]))
        return TokenLogprob(int(token), float(lp[token]), top)


class StopMatcher:
    """Finds stop strings in streamed text while releasing everything that cannot start one.

    ``push(text)`` returns ``(safe_text, stopped)``: ``safe_text`` may be shown now; when
    ``stopped`` is true the text before the first stop string has been returned and the
    stop string itself is dropped. Only the longest tail that is a prefix of some stop
    string is held back.
    """

    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [(buf.find(s), s) for s in self.stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            i = min(i for i, _ in hits)
            self._held = ""
            return buf[:i], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """Release held text at the end of generation (no stop string followed)."""
        out, self._held = self._held, ""
        return out
