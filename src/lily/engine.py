"""The public engine: load a checkpoint, prefill, decode, and generate text.

``Engine`` owns one session (KV cache, conv and recurrent state) on one device. The
reference device is the numpy oracle (:mod:`lily.reference`); native devices plug in behind
the same :class:`Backend` protocol.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol, Sequence

import numpy as np

from lily.checkpoint import Checkpoint, ModelConfig, open_checkpoint, read_generation_config, token_ids
from lily.errors import ContextLengthError, DeviceError, InvalidParameterError
from lily.native import check_vocabulary
from lily.reference import ReferenceModel, ReferenceState
from lily.sampling import Sampler, SamplingParams, StopMatcher, TokenLogprob
from lily.tokenizer import Tokenizer

DEVICES = ("reference", "sim", "metal", "auto")
DEFAULT_MAX_CONTEXT = 32768
PREFILL_CHUNK = 128  # tokens per prefill call; cancellation is checked between chunks


def default_model_path() -> Path:
    """The embedded demo checkpoint (``lily-demo-shakespeare``) shipped inside the package."""
    return Path(__file__).resolve().parent / "demo_model"


class Backend(Protocol):
    """What a device provides to the engine: incremental forward with session state."""

    name: str

    def reset(self) -> None: ...
    def forward(self, tokens: np.ndarray, *, all_logits: bool) -> np.ndarray: ...
    def snapshot(self): ...
    def restore(self, snap) -> None: ...
    @property
    def position(self) -> int: ...


class ReferenceBackend:
    """The numpy oracle as a device."""

    name = "reference"

    def __init__(self, ck: Checkpoint, max_context: int, **kw):
        self.model = ReferenceModel(ck, **kw)
        self.max_context = max_context
        self.state: ReferenceState = self.model.new_state(max_context)

    @property
    def position(self) -> int:
        return self.state.position

    def reset(self) -> None:
        self.state = self.model.new_state(self.max_context)

    def forward(self, tokens, *, all_logits: bool) -> np.ndarray:
        return self.model.forward(tokens, self.state, all_logits=all_logits)

    def snapshot(self) -> ReferenceState:
        return self.state.copy()

    def restore(self, snap: ReferenceState) -> None:
        if not isinstance(snap, ReferenceState):
            raise InvalidParameterError(f"not a snapshot of a 'reference' session: {type(snap).__name__}")
        if snap.position > self.max_context:
            raise InvalidParameterError(f"the snapshot holds {snap.position} tokens, more than the "
                                        f"context window of {self.max_context}")
        self.state = snap.copy()


def available_devices() -> list[str]:
    """Devices that can run the model in this installation: ``reference`` always, plus the
    native devices compiled into ``lily._core`` (``sim`` everywhere, ``metal`` on macOS)."""
    try:
        from lily import _core
        native = [d for d in ("metal", "sim") if d in _core.compiled_devices()]
    except ImportError:
        native = []
    return ["reference", *native]


def _generation_settings(generation_config: dict, path: Path, config: ModelConfig):
    """The sampling defaults and EOS ids of ``generation_config.json``; raises ConfigError."""
    where = path / "generation_config.json"
    return (SamplingParams.from_generation_config(generation_config, where=str(where)),
            token_ids(generation_config.get("eos_token_id"), f"{where}: eos_token_id", config.vocab_size))


def _make_backend(device: str, ck: Checkpoint, max_context: int, options: dict) -> Backend:
    if device not in DEVICES:
        raise DeviceError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    available = available_devices()
    auto = device == "auto"
    if auto:
        device = "metal" if "metal" in available else "sim" if "sim" in available else "reference"
        if device != "metal":
            print(f"lily: no Metal device here; using device={device!r}", file=sys.stderr)
    if device == "reference":
        if options and not auto:
            raise InvalidParameterError(f"device_options ({', '.join(sorted(options))}) apply only to "
                                        "the native devices (sim, metal); device='reference' takes none")
        return ReferenceBackend(ck, max_context)
    if device not in available:
        raise DeviceError(f"device {device!r} is not available in this build "
                          f"(available: {', '.join(available)})")
    from lily.native import NativeBackend, reject_unknown_options
    reject_unknown_options(options, NativeBackend.OPTIONS, "device option")
    return NativeBackend(ck, max_context, device, **options)


@dataclass
class Timings:
    """Wall-clock timings of one generation, in seconds and tokens per second."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class StreamEvent:
    """One step of a streamed generation.

    ``text`` is safe to display (complete UTF-8 characters, stop strings withheld);
    ``token_ids`` are the tokens produced in this step (the EOS token is not included).
    The last event has ``finish_reason`` set (``"stop"``, ``"length"`` or ``"cancelled"``)
    and carries ``prompt_tokens``/``completion_tokens`` and ``timings``.
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: Timings | None = None


@dataclass
class GenerationResult:
    """A finished generation: ``text``, generated ``token_ids``, ``finish_reason``, usage
    counts, ``timings`` and optional per-token ``logprobs``."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    logprobs: list[TokenLogprob] | None = None


class Engine:
    """One model, one session, one device.

    Create with :meth:`Engine.load`. Low level: :meth:`prefill` and :meth:`decode` return
    logits and advance the session. High level: :meth:`generate` / :meth:`stream` on a
    prompt (text or token ids) and :meth:`chat` / :meth:`stream_chat` on chat messages.
    Not thread-safe: one generation at a time (the server serialises requests).
    """

    def __init__(self, path: Path, checkpoint: Checkpoint, tokenizer: Tokenizer, backend: Backend,
                 max_context: int, generation_config: dict):
        self.path = path
        self.checkpoint = checkpoint
        self.config: ModelConfig = checkpoint.config
        self.tokenizer = tokenizer
        self.backend = backend
        self.device = backend.name
        self.max_context = max_context
        self.generation_config = generation_config
        self.generation_defaults, gen_eos = _generation_settings(generation_config, path, self.config)
        eos = set(tokenizer.eos_token_ids) | set(self.config.eos_token_ids) | set(gen_eos)
        self.eos_token_ids: frozenset[int] = frozenset(int(e) for e in eos)
        self._tokens: list[int] = []  # tokens whose effect is in the session state

    # ------------------------------------------------------------------ construction

    @classmethod
    def load(cls, path: str | Path | None = None, *, device: str = "reference",
             max_context: int | None = None, progress: bool = False,
             device_options: dict | None = None) -> "Engine":
        """Load a checkpoint directory (default: the embedded demo model).

        Parameters
        ----------
        path : str | Path | None
            An MLX 4-bit ``qwen3_5_moe`` checkpoint directory with tokenizer files.
        device : {"reference", "sim", "metal", "auto"}
        max_context : int | None
            Context window in tokens (default ``min(32768, max_position_embeddings)``).
        progress : bool
            Show a progress bar while validating and mapping the weights.
        device_options : dict | None
            Native devices only: ``prefill_chunk`` (tokens per prefill chunk, default 2048;
            scratch memory is sized for one chunk), ``gemm_path`` (``"auto"``,
            ``"simdgroup"`` or ``"tensor"``: the prefill GEMM kernels), ``split_threshold``
            (context above which decode attention splits the KV rows across threadgroups,
            default 256), ``split_block`` (rows per split block, default 0: chosen by
            context), ``weight_cache`` (``True``: map unaligned checkpoint files
            through an aligned copy written once under :func:`lily.weight_cache.default_dir`;
            a directory to use instead; ``False``: copy them into device memory at each
            load), and ``device_options`` for the simulator (e.g. ``{"order": "random"}``).

        Raises
        ------
        CheckpointError, ConfigError, TokenizerError
            The directory is not a usable checkpoint (message names file/tensor/shape).
        DeviceError
            Unknown or unavailable device.
        InvalidParameterError
            ``max_context`` not a positive integer.
        """
        path = Path(path) if path is not None else default_model_path()
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=3, desc=f"loading {path.name}", unit="step", leave=False)
        ck = open_checkpoint(path)
        if bar:
            bar.update(1)
        tok = Tokenizer.from_dir(path)
        generation_config = read_generation_config(path)
        _generation_settings(generation_config, path, ck.config)  # its errors before the device is set up
        if bar:
            bar.update(1)
        limit = ck.config.max_position_embeddings
        if max_context is None:
            max_context = min(DEFAULT_MAX_CONTEXT, limit)
        if isinstance(max_context, bool) or not isinstance(max_context, int) or not 0 < max_context <= limit:
            raise InvalidParameterError(f"max_context must be an integer in [1, {limit}], got {max_context!r}")
        backend = _make_backend(device, ck, max_context, dict(device_options or {}))
        if bar:
            bar.update(1)
            bar.close()
        return cls(path, ck, tok, backend, max_context, generation_config)

    # ------------------------------------------------------------------ low level

    @property
    def position(self) -> int:
        """Tokens in the session so far."""
        return self.backend.position

    @property
    def tokens(self) -> list[int]:
        """The token ids whose effect is in the session state (a copy)."""
        return list(self._tokens)

    def reset(self) -> None:
        """Empty the session (KV cache and recurrent state)."""
        self.backend.reset()
        self._tokens = []

    def _check_tokens(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.size == 0:
            raise InvalidParameterError("tokens must contain at least one token id")
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise InvalidParameterError(f"tokens must be a 1-D sequence of integer ids, got shape "
                                        f"{arr.shape} dtype {arr.dtype}")
        check_vocabulary(arr, self.config.vocab_size)
        return arr.astype(np.int64)

    def prefill(self, tokens: Sequence[int], *, all_logits: bool = False) -> np.ndarray:
        """Append ``tokens`` to the session and run them through the model.

        Returns float32 logits ``[vocab_size]`` of the last position, or ``[len(tokens),
        vocab_size]`` for every position with ``all_logits=True`` (teacher-forced evaluation).

        Raises
        ------
        ContextLengthError
            The session would exceed ``max_context`` (the session is left unchanged).
        InvalidParameterError
            Empty input, non-integer or out-of-vocabulary ids.
        """
        arr = self._check_tokens(tokens)
        if self.position + arr.size > self.max_context:
            what = "1 more token does" if arr.size == 1 else f"{arr.size} more tokens do"
            raise ContextLengthError(f"{what} not fit: {self.position} tokens are already in the "
                                     f"session and the context window is {self.max_context}")
        out = self.backend.forward(arr, all_logits=all_logits)
        self._tokens.extend(int(t) for t in arr)
        return out

    def decode(self, token: int) -> np.ndarray:
        """Feed one token (usually the previously sampled one); returns float32 logits
        ``[vocab_size]`` for the next position. Raises like :meth:`prefill`."""
        return self.prefill([int(token)])

    def snapshot(self):
        """An opaque copy of the session state (tokens, KV cache rows in use, conv and
        recurrent state), for :meth:`restore`. Host memory, on every device."""
        return (self.backend.snapshot(), list(self._tokens))

    def restore(self, snap) -> None:
        """Return the session to ``snap`` (from :meth:`snapshot` of an engine on the same
        model and device; any number of times). Raises :class:`InvalidParameterError` for
        anything else or a snapshot longer than this engine's context, the session unchanged."""
        try:
            state, toks = snap
        except (TypeError, ValueError):
            raise InvalidParameterError(f"not an Engine snapshot: {type(snap).__name__}") from None
        self.backend.restore(state)
        self._tokens = list(toks)

    # ------------------------------------------------------------------ generation

    def _params(self, params: SamplingParams | None, overrides: dict) -> SamplingParams:
        base = params if params is not None else self.generation_defaults
        return base.replace(**overrides) if overrides else base

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a raw text prompt (no chat template), or the ids themselves."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidParameterError("the prompt is empty")
        return ids

    def _start(self, prompt_ids: list[int]) -> list[int]:
        """Reuse the session when the new prompt extends the tokens already in it."""
        n = len(self._tokens)
        if n and len(prompt_ids) > n and prompt_ids[:n] == self._tokens:
            return prompt_ids[n:]
        self.reset()
        return prompt_ids

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               cancel: threading.Event | None = None, **overrides) -> Iterator[StreamEvent]:
        """Generate from ``prompt``, yielding :class:`StreamEvent` as text becomes safe to show.

        ``params`` defaults to the checkpoint's generation defaults; keyword ``overrides``
        (e.g. ``max_tokens=64, temperature=0.7, stop=["\\n\\n"]``) replace fields. Setting
        ``cancel`` ends the stream promptly (between prefill chunks or decode steps) with
        ``finish_reason="cancelled"``; closing the generator also stops it.

        Raises
        ------
        ContextLengthError
            The prompt alone does not fit in the context window.
        InvalidParameterError
            Invalid sampling parameters.
        """
        p = self._params(params, overrides)
        prompt_ids = self.encode_prompt(prompt)
        if len(prompt_ids) > self.max_context:
            raise ContextLengthError(f"the prompt has {len(prompt_ids)} tokens but the context window "
                                     f"is {self.max_context} tokens")
        return self._generate(prompt_ids, p, cancel)

    def _generate(self, prompt_ids: list[int], p: SamplingParams, cancel) -> Iterator[StreamEvent]:
        timings = Timings()
        sampler = Sampler(p, prompt_ids)
        detok = self.tokenizer.detokenizer()
        stops = StopMatcher(p.stop)
        new = self._start(prompt_ids)
        timings.prefill_tokens = len(new)

        def done(reason: str, text: str = "", ids=None, lps=None) -> StreamEvent:
            return StreamEvent(text, ids or [], lps, reason, len(prompt_ids), n_out, timings)

        n_out = 0
        t0 = time.perf_counter()
        logits = None
        if getattr(self.backend, "pipelined", False):
            yield from self._generate_pipelined(prompt_ids, new, p, cancel, timings, detok, stops)
            return
        try:
            for s in range(0, len(new), PREFILL_CHUNK):
                if cancel is not None and cancel.is_set():
                    self.reset()  # a partial prefill leaves no usable session
                    yield done("cancelled")
                    return
                logits = self.prefill(new[s:s + PREFILL_CHUNK])
        except BaseException:
            self.reset()
            raise
        timings.prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        if len(prompt_ids) >= self.max_context:  # prompt + completion never exceed the context
            yield done("length")
            return
        while True:
            if cancel is not None and cancel.is_set():
                timings.decode_s = time.perf_counter() - t1
                yield done("cancelled")
                return
            tok = sampler.sample(logits)
            lp = [sampler.logprob(logits, tok)] if p.logprobs else None
            if tok in self.eos_token_ids and not p.ignore_eos:
                timings.decode_s = time.perf_counter() - t1
                yield done("stop", stops.flush() + detok.flush())
                return
            n_out += 1
            timings.decode_tokens = n_out
            text, stopped = stops.push(detok.add(tok))
            if stopped:
                timings.decode_s = time.perf_counter() - t1
                yield done("stop", text, [tok], lp)
                return
            if n_out >= p.max_tokens or len(prompt_ids) + n_out >= self.max_context:
                timings.decode_s = time.perf_counter() - t1
                tail, _ = stops.push(detok.flush())
                yield done("length", text + tail + stops.flush(), [tok], lp)
                return
            yield StreamEvent(text, [tok], lp)
            logits = self.decode(tok)

    def _generate_pipelined(self, prompt_ids, new, p: SamplingParams, cancel, timings: Timings,
                            detok, stops: StopMatcher) -> Iterator[StreamEvent]:
        """Native devices: the prompt runs as prefill chunks, the last of which selects the
        first token on the device; the device then generates with the GPU token hand-off
        (token selection on the device, the next step encoded while the current one runs);
        the host reads ids one step behind and stops on EOS, stop strings or max tokens,
        discarding at most one speculative step. ``timings.prefill_s`` is the time to the
        first token."""
        backend = self.backend
        n_out = 0

        def done(reason: str, text: str = "", ids=None, lps=None) -> StreamEvent:
            return StreamEvent(text, ids or [], lps, reason, len(prompt_ids), n_out, timings)

        t0 = time.perf_counter()
        # All but the last chunk are prefilled here (cancellation is checked between chunks);
        # the last one is the feed of the device pipeline, whose final chunk samples the
        # first token on the device and hands it to the first decode step.
        chunk = getattr(backend, "prefill_chunk", PREFILL_CHUNK)
        tail = len(new) - ((len(new) - 1) % chunk + 1)
        try:
            for s in range(0, tail, chunk):
                if cancel is not None and cancel.is_set():
                    self.reset()
                    yield done("cancelled")
                    return
                piece = new[s:s + chunk]
                backend.prefill_only(piece)
                self._tokens.extend(piece)
        except BaseException:
            self.reset()
            raise
        feed = new[tail:]
        start_pos = backend.position
        history = self._tokens + feed
        steps = min(p.max_tokens, self.max_context - len(prompt_ids))  # prompt + completion <= context
        backend.start(feed, steps, history, p)
        outs: list[int] = []
        t1 = None
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    yield done("cancelled")
                    return
                step = backend.next()
                if t1 is None:  # the first token: the prompt is done
                    t1 = time.perf_counter()
                    timings.prefill_s = t1 - t0
                if step is None:  # max tokens or the context window reached
                    tail_text, _ = stops.push(detok.flush())
                    yield done("length", tail_text + stops.flush())
                    return
                tok, lp = step
                if tok in self.eos_token_ids and not p.ignore_eos:
                    yield done("stop", stops.flush() + detok.flush())
                    return
                outs.append(tok)
                n_out += 1
                timings.decode_tokens = n_out
                lps = [lp] if p.logprobs else None
                text, stopped = stops.push(detok.add(tok))
                if stopped:
                    yield done("stop", text, [tok], lps)
                    return
                if n_out >= steps:
                    tail_text, _ = stops.push(detok.flush())
                    yield done("length", text + tail_text + stops.flush(), [tok], lps)
                    return
                yield StreamEvent(text, [tok], lps)
        finally:
            backend.finish()
            now = time.perf_counter()
            if t1 is None:
                t1 = now
                timings.prefill_s = now - t0
            timings.decode_s = now - t1
            consumed = backend.position - start_pos
            self._tokens.extend((feed + outs)[:consumed])

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 cancel: threading.Event | None = None, **overrides) -> GenerationResult:
        """Like :meth:`stream`, collected into a :class:`GenerationResult`."""
        return self._collect(self.stream(prompt, params, cancel=cancel, **overrides))

    def stream_chat(self, messages: list[dict], params: SamplingParams | None = None, *,
                    tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                    cancel: threading.Event | None = None, **overrides) -> Iterator[StreamEvent]:
        """Render ``messages`` with the checkpoint's chat template (generation prompt
        added) and stream the reply. Raises :class:`~lily.errors.TokenizerError` when the
        template rejects the messages, otherwise like :meth:`stream`."""
        ids = self.tokenizer.encode_chat(messages, tools=tools, add_generation_prompt=True,
                                         **(chat_template_kwargs or {}))
        return self.stream(ids, params, cancel=cancel, **overrides)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             cancel: threading.Event | None = None, **overrides) -> GenerationResult:
        """Like :meth:`stream_chat`, collected into a :class:`GenerationResult`."""
        return self._collect(self.stream_chat(messages, params, tools=tools,
                                              chat_template_kwargs=chat_template_kwargs,
                                              cancel=cancel, **overrides))

    @staticmethod
    def _collect(events: Iterator[StreamEvent]) -> GenerationResult:
        texts, ids, lps, last = [], [], [], None
        for ev in events:
            texts.append(ev.text)
            ids.extend(ev.token_ids)
            if ev.logprobs:
                lps.extend(ev.logprobs)
            last = ev
        return GenerationResult("".join(texts), ids, last.finish_reason, last.prompt_tokens,
                                last.completion_tokens, last.timings, lps or None)

    def info(self) -> dict:
        """Facts for ``lily info``: config, tensor count, weight bytes, device, devices."""
        c = self.config
        return {
            "path": str(self.path),
            "model_type": c.model_type,
            "layers": c.num_hidden_layers,
            "full_attention_layers": list(c.full_attention_layers),
            "hidden_size": c.hidden_size,
            "experts": f"{c.num_experts} (top {c.num_experts_per_tok})",
            "vocab_size": c.vocab_size,
            "tensors": len(self.checkpoint.tensors),
            "weight_bytes": self.checkpoint.nbytes,
            "max_context": self.max_context,
            "device": self.device,
            "devices_available": available_devices(),
            "eos_token_ids": sorted(self.eos_token_ids),
        }
