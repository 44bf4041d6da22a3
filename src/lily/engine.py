"""The public engine: load a checkpoint, prefill, decode, and generate text.

``Engine`` owns one session (KV cache, conv and recurrent state) on one device. The
reference device is the numpy oracle (:mod:`lily.reference`); native devices
(:mod:`lily.native_backend`) plug in behind the same host contract, :class:`lily.backend.Backend`.
The engine checks its input once, here; it has one generation loop for every device.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from lily.backend import Backend
from lily.chat_output import parse_chat_output, prompt_opens_reasoning
from lily.checkpoint import Checkpoint, ModelConfig, open_checkpoint, read_generation_config, token_ids
from lily.constraints import Constraint
from lily.errors import ContextLengthError, DeviceError, InvalidParameterError, notice
from lily.generation import (THINKING_CLOSE_TEXT, ChatResult, Generation, GenerationResult, StreamEvent,
                             Timings, collect)
from lily.prompt_cache import DEFAULT_MAX_BYTES, PromptCache
from lily.prompt_cache import load as load_cache_file, save as save_cache_file
from lily.reference import ReferenceBackend
from lily.sampling import SamplingParams
from lily.scheduler import Scheduler
from lily.session import Session
from lily.structured import Grammar
from lily.tokenizer import Tokenizer

__all__ = ["DEVICES", "THINKING_CLOSE_TEXT", "ChatResult", "Engine", "GenerationResult", "StreamEvent", "Timings",
           "available_devices", "default_model_path", "model_display_name"]

DEVICES = ("reference", "sim", "metal", "auto")
DEFAULT_MAX_CONTEXT = 32768
#: The limit of a chat reply that sets none (the server's chat and Responses APIs, ``lily
#: chat``, ``lily generate --chat``) unless the checkpoint's generation_config.json sets
#: ``max_new_tokens``: room for Qwen3.6's thinking and an answer, about 40 s at 100 tok/s,
#: bounded so that a model that never ends a reply does not run until the context is full.
CHAT_MAX_TOKENS = 4096
DEMO_MODEL_NAME = "lily-demo-shakespeare"


def default_model_path() -> Path:
    """The embedded demo checkpoint (``lily-demo-shakespeare``) shipped inside the package."""
    return Path(__file__).resolve().parent / "demo_model"


def model_display_name(path: str | Path | None) -> str:
    """The model's name wherever Lily shows one (the ``lily chat`` banner, the server's model
    id unless ``--served-model-name`` replaces it): ``lily-demo-shakespeare`` for the
    embedded demo model (None or its directory), otherwise the checkpoint directory's name
    as given (a symlink keeps its own name), made absolute first so that ``--model .`` still
    names the directory. MLX checkpoints' config.json carries no model name, so the
    directory is the name."""
    if path is None:
        return DEMO_MODEL_NAME
    p = Path(os.path.abspath(Path(path).expanduser()))
    if p.resolve() == default_model_path():
        return DEMO_MODEL_NAME
    return p.name or str(p)


def available_devices() -> list[str]:
    """Devices that can run the model in this installation: ``reference`` always, plus the
    native devices compiled into ``lily._core`` (``sim`` everywhere, ``metal`` on macOS)."""
    try:  # the native core is optional here: the reference device runs without it
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


#: How a Mac build gets the GPU device it lacks (the README's "Running on a Mac").
METAL_BUILD_FIX = ("To build the GPU device: install Xcode, point the developer tools at it "
                   "(`sudo xcode-select -s /Applications/Xcode.app`: the Command Line Tools have no Metal "
                   "compiler) and install its Metal Toolchain (`xcodebuild -downloadComponent MetalToolchain`), "
                   "then reinstall with `pip install -v .` and read the CMake notice about Metal, or make the "
                   "build fail loudly with the reason: `pip install . -Ccmake.define.LILY_METAL=ON`")


#: The environment variable that overrides what ``device="auto"`` resolves to. For tests:
#: ``LILY_AUTO_DEVICE=sim`` makes a Linux run take the native path a Mac takes (``metal``),
#: so a test that silently assumes the default device is the numpy reference fails there.
AUTO_DEVICE_ENV = "LILY_AUTO_DEVICE"


def auto_device(available: Sequence[str] | None = None) -> str:
    """What ``device="auto"`` resolves to: ``$LILY_AUTO_DEVICE`` if set (any device but
    ``auto``), else ``metal`` where this build has it, else ``reference``. The simulator
    verifies kernels and is far too slow to serve, so it is chosen only through the variable.

    Raises :class:`DeviceError` if the variable names an unknown device or one not in this
    build."""
    available = available_devices() if available is None else available
    forced = os.environ.get(AUTO_DEVICE_ENV)
    if forced:
        if forced not in available:
            raise DeviceError(f"{AUTO_DEVICE_ENV}={forced!r} names no device of this build "
                              f"(available: {', '.join(available)})")
        return forced
    return "metal" if "metal" in available else "reference"


def _make_backend(device: str, ck: Checkpoint, max_context: int, options: dict) -> Backend:
    if device not in DEVICES:
        raise DeviceError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    available = available_devices()
    auto = device == "auto"
    if auto:
        forced = bool(os.environ.get(AUTO_DEVICE_ENV))
        device = auto_device(available)
        if device == "reference" and not forced:
            ignored = f"; device options ignored: {', '.join(sorted(options))}" if options else ""
            # on a Mac this is a build without the GPU device: say how to get one
            fix = f". {METAL_BUILD_FIX}" if sys.platform == "darwin" else ""
            notice(f"lily: no Metal GPU in this build; using device='reference' (numpy on the CPU){ignored}{fix}")
    if device == "reference":
        if options and not auto:
            what = "applies" if len(options) == 1 else "apply"
            raise InvalidParameterError(f"device_options ({', '.join(sorted(options))}) {what} only to "
                                        "the native devices (sim, metal); device='reference' takes none")
        return ReferenceBackend(ck, max_context)
    if device not in available:
        hint = f". {METAL_BUILD_FIX}" if device == "metal" and sys.platform == "darwin" else ""
        raise DeviceError(f"device {device!r} is not available in this build "
                          f"(available: {', '.join(available)}){hint}")
    from lily.native_backend import NativeBackend, reject_unknown_options  # needs the native core: loaded on use
    reject_unknown_options(options, NativeBackend.OPTIONS, "device option")
    return NativeBackend(ck, max_context, device, **options)


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
        self.device = backend.name
        self.max_context = max_context
        self.generation_config = generation_config
        self.generation_defaults, gen_eos = _generation_settings(generation_config, path, self.config)
        eos = set(tokenizer.eos_token_ids) | set(self.config.eos_token_ids) | set(gen_eos)
        self.eos_token_ids: frozenset[int] = frozenset(int(e) for e in eos)
        #: Ids a sampler may choose: the embedding's rows past the tokenizer's ids (Qwen3.5/3.6
        #: pad 248,077 ids to 248,320 rows) decode to nothing, so no generation picks them
        #: (:attr:`lily.sampling.SamplingParams.vocab_limit`). Prompts may still hold them.
        self.sample_vocab: int = min(self.config.vocab_size, tokenizer.vocab_size)
        self._held = threading.Condition()  # who holds the session: _holder (None, a Scheduler, a thread id)
        self._depth = 0
        #: The id of ``<|im_start|>``, the token that opens each chat turn (None: the tokenizer
        #: has none): where a conversation's turns begin, for the prompt cache's snapshots
        #: and the CLI's turn handling.
        self.im_start: int | None = tokenizer.token_to_id("<|im_start|>")
        self._session = Session(backend, 0, PromptCache(DEFAULT_MAX_BYTES), self.im_start)
        self._holder = None

    @property
    def backend(self) -> Backend:
        """The device's :class:`lily.backend.Backend` (replacing it empties the session)."""
        return self._session.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self._session = Session(backend, 0, self._session.cache, self.im_start)

    @property
    def session(self) -> Session:
        """The engine's own :class:`lily.session.Session` (sequence 0), which a
        :class:`lily.scheduler.Scheduler` borrows for a row (:meth:`lend_session`)."""
        return self._session

    @property
    def session_free(self) -> bool:
        """Whether no one holds :attr:`session` now (no engine call runs on it, no
        scheduler has borrowed it); a snapshot, not a reservation."""
        return self._holder is None

    def lend_session(self, holder) -> bool:
        """Lend :attr:`session` to ``holder`` (a :class:`lily.scheduler.Scheduler`) if no one
        holds it; never waits.

        Returns
        -------
        bool
            True when lent (until :meth:`return_session`), False when someone holds it.
        """
        with self._held:
            if self._holder is not None:
                return False
            self._holder = holder
            return True

    def return_session(self, holder) -> None:
        """Give back :attr:`session` lent to ``holder`` by :meth:`lend_session` and wake an
        engine call waiting for it; a no-op when ``holder`` does not hold it."""
        with self._held:
            if self._holder is holder:
                self._holder = None
                self._held.notify_all()

    @contextlib.contextmanager
    def _using_session(self):
        """Holds the session for the engine's own call (re-entrant on its thread). While a
        scheduler's row has it, waits for the row to end when the scheduler runs on a thread
        of its own, else raises InvalidParameterError (nothing would end it)."""
        me = threading.get_ident()
        with self._held:
            while self._holder is not None and self._holder != me:
                holder = self._holder
                if not getattr(holder, "running", False) or getattr(holder, "thread_ident", None) == me:
                    raise InvalidParameterError("the engine's session is in use by a Scheduler's row: generate "
                                                "through the scheduler, or drive it until that row ends")
                self._held.wait(0.05)
            self._holder = me
            self._depth += 1
        try:
            yield
        finally:
            with self._held:
                self._depth -= 1
                if self._depth == 0:
                    self._holder = None
                    self._held.notify_all()

    def scheduler(self, *, max_batch: int = 4, max_queue: int = 256, prefill_interleave: int = 1024):
        """A :class:`lily.scheduler.Scheduler`: several generations decoding together on this
        engine (continuous batching; docs/usage.md "Several generations at once"). It
        borrows the engine's session while a row runs on it, opens more sequences as rows
        need them and frees them when closed (use it as a context manager)::

            with engine.scheduler(max_batch=4) as batch:
                results = batch.generate_many(["ROMEO.", "JULIET."], max_tokens=32)

        Raises :class:`InvalidParameterError` for an option out of range."""
        return Scheduler(self, max_batch=max_batch, max_queue=max_queue, prefill_interleave=prefill_interleave)

    @property
    def prompt_cache(self) -> PromptCache | None:
        """The multi-turn prompt cache (:class:`lily.PromptCache`; None: disabled)."""
        return self._session.cache

    @prompt_cache.setter
    def prompt_cache(self, cache: PromptCache | None) -> None:
        self._session.cache = cache

    @property
    def chat_max_tokens(self) -> int:
        """The default limit of a chat reply: the checkpoint's ``max_new_tokens`` (its
        generation_config.json) when it sets one, else :data:`CHAT_MAX_TOKENS`."""
        if self.generation_config.get("max_new_tokens") is not None:
            return self.generation_defaults.max_tokens
        return CHAT_MAX_TOKENS

    @property
    def name(self) -> str:
        """The model's display name (:func:`model_display_name` of :attr:`path`)."""
        return model_display_name(self.path)

    # ------------------------------------------------------------------ construction

    @classmethod
    def load(cls, path: str | Path | None = None, *, device: str = "auto",
             max_context: int | None = None, progress: bool = False,
             device_options: dict | None = None,
             prompt_cache_bytes: int = DEFAULT_MAX_BYTES) -> "Engine":
        """Load a checkpoint directory (default: the embedded demo model).

        Parameters
        ----------
        path : str | Path | None
            An MLX 4-bit ``qwen3_5_moe`` checkpoint directory with tokenizer files.
        device : {"auto", "metal", "reference", "sim"}
            ``auto`` (default): ``metal`` where this build has it (macOS), else ``reference``
            with a one-line notice on stderr (``$LILY_AUTO_DEVICE`` overrides it: see
            :func:`auto_device`). ``sim`` (the Metal kernels on the CPU simulator, for
            verification) only when asked for.
        max_context : int | None
            Context window in tokens (default ``min(32768, max_position_embeddings)``).
        progress : bool
            Show a progress bar while validating and mapping the weights.
        device_options : dict | None
            Native devices only: ``prefill_chunk`` (tokens per prefill chunk; scratch memory
            is sized for one chunk; default 0: automatic, the first of 4096, 2048, 1024, 512,
            capped at ``max_context``, whose memory fits the device), ``gemm_path`` (``"auto"``,
            ``"simdgroup"`` or ``"tensor"``: the prefill GEMM kernels; the attention follows
            them onto tensor ops where the device takes bfloat tensor operands), ``split_threshold``
            (context above which decode attention splits the KV rows across threadgroups,
            default 256), ``split_block`` (rows per split block, default 0: chosen by
            context), ``state_window`` (decode steps per write-back of the Gated DeltaNet
            state, default 16; 1 writes it every step; results are the same bit for bit,
            docs/decode.md), ``command_buffer_rows`` (work per prefill command buffer in
            layer-rows, default 4096: a 4096-row chunk commits one layer at a time; 0: one
            command buffer per chunk; docs/prefill.md "Command buffers"), ``weight_cache`` (``True``: map unaligned checkpoint files
            through an aligned copy written once under :func:`lily.weight_cache.default_dir`;
            a directory to use instead; ``False``: copy them into device memory at each
            load), and ``device_options`` for the simulator (e.g. ``{"order": "random"}``, or
            ``{"threads": 4}``: the OS threads running its threadgroups, default
            ``$LILY_SIM_THREADS`` or every CPU; docs/device-layer.md).
        prompt_cache_bytes : int
            Memory budget of the multi-turn prompt cache (:class:`lily.PromptCache`,
            default 4 GiB); 0 disables it.

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
            from tqdm import tqdm  # only for an interactive load
            # drawn at every step (the steps are few and fast: the default 0.1 s refresh
            # interval left "0/3" showing), the steps named; notices are written above it
            bar = tqdm(total=3, desc=f"loading {model_display_name(path)}", unit="step", leave=False,
                       file=sys.stderr, mininterval=0, miniters=1, postfix="checkpoint")
        ck = open_checkpoint(path)
        if bar:
            bar.set_postfix_str("tokenizer", refresh=False)
            bar.update(1)
        tok = Tokenizer.from_dir(path)
        generation_config = read_generation_config(path)
        _generation_settings(generation_config, path, ck.config)  # its errors before the device is set up
        if bar:
            bar.set_postfix_str(f"device {device}", refresh=False)
            bar.update(1)
        limit = ck.config.max_position_embeddings
        if max_context is None:
            max_context = min(DEFAULT_MAX_CONTEXT, limit)
        if isinstance(max_context, bool) or not isinstance(max_context, int) or not 0 < max_context <= limit:
            raise InvalidParameterError(f"max_context must be an integer in [1, {limit}], got {max_context!r}")
        if isinstance(prompt_cache_bytes, bool) or not isinstance(prompt_cache_bytes, int) or prompt_cache_bytes < 0:
            raise InvalidParameterError(f"prompt_cache_bytes must be a non-negative integer, got {prompt_cache_bytes!r}")
        cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes != 0 else None
        backend = _make_backend(device, ck, max_context, dict(device_options or {}))
        if bar:
            bar.update(1)
            bar.close()
        engine = cls(path, ck, tok, backend, max_context, generation_config)
        engine.prompt_cache = cache
        return engine

    # ------------------------------------------------------------------ low level

    @property
    def position(self) -> int:
        """Tokens in the session so far."""
        return self.backend.position

    @property
    def tokens(self) -> list[int]:
        """The token ids whose effect is in the session state (a copy)."""
        return list(self._session.tokens)

    def reset(self) -> None:
        """Empty the session (KV cache and recurrent state). The prompt cache keeps its
        entries (``engine.prompt_cache.clear()`` drops them)."""
        with self._using_session():
            self._session.reset()

    @property
    def prefill_chunk(self) -> int:
        """Tokens per prefill chunk on this device (the reference: 128; native devices: the
        ``prefill_chunk`` device option, or the runtime's automatic choice when it is 0, the
        default; csrc/runtime/runtime.h kAutoPrefillChunks). Generation checks ``cancel`` between
        chunks, so this is also the cancellation granularity of a prompt."""
        return self.backend.prefill_chunk

    def check_tokens(self, tokens, what: str = "the prompt", after: int = 0) -> np.ndarray:
        """The one input check before anything reaches a backend (the server uses it too):
        ``tokens`` as int64 ``[T]``, T >= 1, every id in ``[0, vocab_size)``, and
        ``after + T <= max_context`` (``after``: the tokens they follow in the session). A
        prompt of exactly ``max_context`` tokens is accepted; its generation ends at once
        with ``finish_reason="length"``.

        Raises :class:`InvalidParameterError` (naming ``what``) or :class:`ContextLengthError`."""
        if tokens is None or isinstance(tokens, (str, bytes)):
            raise InvalidParameterError(f"{what} must be a sequence of integer token ids, got "
                                        f"{type(tokens).__name__}")
        arr = np.asarray(tokens)
        if arr.size == 0:
            raise InvalidParameterError(f"{what} must contain at least one token id")
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise InvalidParameterError(f"{what} must be a 1-D sequence of integer ids, got shape "
                                        f"{arr.shape} dtype {arr.dtype}")
        bad = arr[(arr < 0) | (arr >= self.config.vocab_size)]
        if bad.size:
            raise InvalidParameterError(f"token id {int(bad[0])} is outside the vocabulary "
                                        f"[0, {self.config.vocab_size})")
        if after + arr.size > self.max_context:
            if after:
                n = "1 more token does" if arr.size == 1 else f"{arr.size} more tokens do"
                raise ContextLengthError(f"{n} not fit: {after} tokens are already in the "
                                         f"session and the context window is {self.max_context}")
            raise ContextLengthError(f"{what} is {arr.size} tokens long but the context window "
                                     f"is {self.max_context} tokens")
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
        with self._using_session():
            arr = self.check_tokens(tokens, "the input", self.position)
            out = self.backend.forward(arr, all_logits=all_logits)
            self._session.tokens.extend(arr.tolist())
            return out

    def decode(self, token: int) -> np.ndarray:
        """Feed one token (usually the previously sampled one); returns float32 logits
        ``[vocab_size]`` for the next position. Raises like :meth:`prefill`."""
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
            raise InvalidParameterError(f"token must be an integer token id, got {token!r}")
        return self.prefill([int(token)])

    def snapshot(self):
        """An opaque copy of the session state (tokens, KV cache rows in use, conv and
        recurrent state), for :meth:`restore`. Host memory on the reference device; on the
        native devices a buffer in device memory, copied on the device."""
        with self._using_session():
            return (self.backend.snapshot(), list(self._session.tokens))

    def restore(self, snap) -> None:
        """Return the session to ``snap`` (from :meth:`snapshot` of an engine on the same
        model and device; any number of times). Raises :class:`InvalidParameterError` for
        anything else or a snapshot longer than this engine's context, the session unchanged."""
        try:
            state, toks = snap
        except (TypeError, ValueError):
            raise InvalidParameterError(f"not an Engine snapshot: {type(snap).__name__}") from None
        if len(toks) > self.max_context:
            raise InvalidParameterError(f"the snapshot holds {len(toks)} tokens, more than the "
                                        f"context window of {self.max_context}")
        with self._using_session():
            self.backend.restore(state)
            self._session.tokens = list(toks)

    # ------------------------------------------------------------------ generation

    def resolve_params(self, params: SamplingParams | None, overrides: dict) -> SamplingParams:
        """The :class:`~lily.sampling.SamplingParams` a generation runs with: ``params`` (None:
        :attr:`generation_defaults`) with ``overrides`` (field name -> value) applied, checked
        against the vocabulary (``logit_bias`` ids), and ``vocab_limit`` capped to
        :attr:`sample_vocab` so that no id without a token is sampled.

        Raises
        ------
        InvalidParameterError
            For an override that is not a field or is out of range, or a ``logit_bias`` id
            outside the vocabulary.
        """
        base = params if params is not None else self.generation_defaults
        p = base.replace(**overrides) if overrides else base
        p.check_vocab(self.config.vocab_size)  # logit_bias ids: the one check needing the vocabulary
        if self.sample_vocab < self.config.vocab_size and not 0 < p.vocab_limit <= self.sample_vocab:
            p = p.replace(vocab_limit=self.sample_vocab)  # never an id without a token
        return p

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a raw text prompt (no chat template), or the ids themselves.

        Raises :class:`InvalidParameterError` for an empty prompt, ids that are not integers
        or outside the vocabulary, and :class:`ContextLengthError` for a prompt longer than
        the context window."""
        if prompt is None or isinstance(prompt, bytes):
            raise InvalidParameterError(f"prompt must be a string or a sequence of token ids, got "
                                        f"{type(prompt).__name__}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if len(ids) == 0:
            raise InvalidParameterError("the prompt is empty")
        return self.check_tokens(ids, "the prompt", 0).tolist()

    def prompt_opens_thinking(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the last turn of ``prompt_ids`` leaves a ``<think>`` block open (the chat
        template's generation prompt with thinking on): the text the model writes first is
        then reasoning (:func:`lily.chat_output.prompt_opens_reasoning` on that turn's text)."""
        ids = [int(t) for t in prompt_ids]
        if self.im_start is not None and self.im_start in ids:  # only the last turn matters
            ids = ids[len(ids) - 1 - ids[::-1].index(self.im_start):]
        return prompt_opens_reasoning(self.tokenizer.decode_lenient(ids))

    def prefill_chunked(self, tokens: Sequence[int], *, cancel: threading.Event | None = None,
                        on_logits=None) -> bool:
        """:meth:`prefill` in pieces of :attr:`prefill_chunk` tokens with ``cancel`` checked
        between them (the loop generation uses). ``on_logits(rows)`` receives float32
        ``[piece, vocab_size]`` logits of every position of each piece (teacher-forced
        scoring); without it no logits are computed. Returns False when cancelled. A
        cancel or a failure leaves an empty session. Raises like :meth:`prefill`."""
        with self._using_session():
            ids = self.check_tokens(tokens, "the input", self.position).tolist()
            chunk = self.prefill_chunk
            return self._session.run_pieces((ids[s:s + chunk] for s in range(0, len(ids), chunk)), cancel,
                                            on_logits, snapshot=False)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               cancel: threading.Event | None = None, constraint: Constraint | None = None,
               prompt_cache_key: str | None = None, on_start: Callable[[int], None] | None = None,
               **overrides) -> Iterator[StreamEvent]:
        """Generate from ``prompt``, yielding :class:`StreamEvent` as text becomes safe to show.

        ``params`` defaults to the checkpoint's generation defaults; keyword ``overrides``
        (e.g. ``max_tokens=64, temperature=0.7, stop=["\\n\\n"]``) replace fields. Setting
        ``cancel`` ends the stream promptly (between prefill chunks of
        :attr:`prefill_chunk` tokens or decode steps) with ``finish_reason="cancelled"``;
        closing the generator also stops it. ``constraint``
        (:class:`lily.constraints.Constraint`) restricts the tokens chosen at each step; on
        native devices a constrained request samples on the host (docs/usage.md). A
        :class:`lily.structured.Grammar` is bound to this prompt (its thinking block, if the
        prompt opens one, stays free). ``prompt_cache_key`` (OpenAI's hint naming a conversation) helps the prompt cache
        choose what to evict; reuse is decided by token equality alone. ``on_start(cached)``
        is called on the generating thread once the session is prepared, before any prefill,
        with the number of prompt tokens reused (the final event's ``cached_tokens``): a
        server can report the cache split before the first token.

        ``thinking_budget`` (a :class:`~lily.sampling.SamplingParams` field, so also an
        override) bounds the thinking block: once that many tokens were generated inside
        the block the prompt left open (or the model opened with ``<think>``) without the
        model closing it, the engine appends :data:`THINKING_CLOSE_TEXT`
        (``"\\n</think>\\n\\n"``, ``</think>`` being the tokenizer's special token) to the
        output as if generated, and the model goes on from its live session to write the
        answer (no prompt is computed again). The forced tokens are output tokens: streamed,
        matched against the stop strings, counted in ``completion_tokens`` and
        ``max_tokens``, advanced through the ``constraint``; their logprobs (with
        ``logprobs``) are 0.0 with no alternatives (the engine chose them, not the model).
        The answer is exactly what a fresh generation with the same parameters from the
        prompt, the thinking and the close would produce (the sampler starts again there:
        the same seed, penalties counting from there). Without a thinking block the budget
        has no effect.

        Raises
        ------
        ContextLengthError
            The prompt alone does not fit in the context window.
        InvalidParameterError
            Invalid sampling parameters or prompt ids.
        """
        p = self.resolve_params(params, overrides)
        prompt_ids = self.encode_prompt(prompt)
        if isinstance(constraint, Grammar):
            constraint = constraint.for_prompt(self, prompt_ids)
        return self._generate(prompt_ids, p, cancel, constraint, prompt_cache_key, on_start)

    def generation(self, prompt_ids: list[int], params: SamplingParams, constraint: Constraint | None,
                   cached: int) -> Generation:
        """The output side of a generation of ``prompt_ids`` (:class:`lily.generation.Generation`):
        EOS, stop strings, the constraint's end, at most ``params.max_tokens`` tokens and no
        more than the context holds, the thinking budget; ``cached`` prompt tokens reused."""
        inside = params.thinking_budget is not None and self.prompt_opens_thinking(prompt_ids)
        return Generation(self.tokenizer, self.eos_token_ids, prompt_ids, params, constraint, cached=cached,
                          steps=min(params.max_tokens, self.max_context - len(prompt_ids)), thinking_inside=inside)

    def _generate(self, prompt_ids: list[int], p: SamplingParams, cancel,
                  constraint: Constraint | None, cache_key: str | None = None,
                  on_start: Callable[[int], None] | None = None) -> Iterator[StreamEvent]:
        """The generation loop of the session, the same for every device. All but the last
        prefill chunk of the new tokens run here, ``cancel`` checked between them; the rest
        is the feed of :meth:`Backend.start`, after which the backend returns one token per
        ``next`` (native devices: chosen on the device, with the next step already encoded;
        the host reads ids one step behind, discarding at most one speculative step), which
        :meth:`lily.generation.Generation.push` turns into events until it ends. The prompt
        cache stores the session at the planned positions of the prefill (all inside the
        pieces run here) and at the end of a generation that was not cancelled. A spent
        ``thinking_budget`` finishes the backend, outputs the close and starts it again
        with the close as the feed (the session kept)."""
        with self._using_session():
            yield from self._generate_held(prompt_ids, p, cancel, constraint, cache_key, on_start)

    def _generate_held(self, prompt_ids, p, cancel, constraint, cache_key, on_start) -> Iterator[StreamEvent]:
        backend, session = self.backend, self._session
        new = session.prepare(prompt_ids, cache_key)
        if on_start is not None:
            on_start(len(prompt_ids) - len(new))
        gen = self.generation(prompt_ids, p, constraint, len(prompt_ids) - len(new))
        gpu0 = getattr(backend, "gpu_seconds", None)  # device time measured

        def device_time() -> float | None:
            return None if gpu0 is None else backend.gpu_seconds - gpu0

        chunk = backend.prefill_chunk
        tail = session.feed_start(new, chunk)  # the last chunk is the feed
        if not session.run_pieces(session.pieces(new[:tail], chunk), cancel):
            yield gen.cancelled()
            return
        gen.feed = new[tail:]
        start_pos = backend.position
        failed = False
        try:
            backend.start(np.asarray(gen.feed, dtype=np.int64), gen.steps, prompt_ids, p, constraint)
            while True:
                if cancel is not None and cancel.is_set():
                    yield gen.cancelled()
                    return
                if gen.forced:  # the close of a spent budget: output as if generated
                    yield gen.forced_token()
                    if not gen.done and not gen.forced:  # the close is out: the answer, from the rest of the steps
                        feed = gen.restart_feed()
                        backend.start(np.asarray(feed, dtype=np.int64), gen.steps_left, session.tokens + feed, p,
                                      constraint)
                else:
                    step = backend.next()
                    gen.device_time(device_time())
                    yield gen.push(step)
                if gen.done:
                    return
                if gen.spent:
                    # The budget is spent: stop the device (a speculative step is discarded) and
                    # keep what it computed; the close follows, then the model goes on from the
                    # live session as in a next turn (nothing is computed again).
                    backend.finish()
                    session.tokens.extend(gen.consumed(backend.position - start_pos))
                    start_pos = backend.position
        except GeneratorExit:
            raise
        except BaseException:
            failed = True  # a step that failed part-way leaves no usable session
            raise
        finally:
            try:
                backend.finish()
            finally:
                gen.close(device_time())  # after finish(): prefill chunks it waited for count too
                if failed:
                    self.reset()
                else:
                    session.tokens.extend(gen.consumed(backend.position - start_pos))
                    if gen.finish_reason not in (None, "cancelled"):
                        session.store()  # the end of the generated text: the next turn may extend it

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 cancel: threading.Event | None = None, constraint: Constraint | None = None,
                 prompt_cache_key: str | None = None, **overrides) -> GenerationResult:
        """Like :meth:`stream`, collected into a :class:`GenerationResult`."""
        return collect(self.stream(prompt, params, cancel=cancel, constraint=constraint,
                                         prompt_cache_key=prompt_cache_key, **overrides))

    def stream_chat(self, messages: list[dict], params: SamplingParams | None = None, *,
                    tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                    cancel: threading.Event | None = None, constraint: Constraint | None = None,
                    **overrides) -> Iterator[StreamEvent]:
        """Render ``messages`` with the checkpoint's chat template (generation prompt
        added; the switches as :meth:`lily.tokenizer.Tokenizer.chat_kwargs` completes them) and
        stream the reply. Raises :class:`~lily.errors.TokenizerError` when the template
        rejects the messages, otherwise like :meth:`stream`."""
        prompt = self.chat_prompt(messages, tools, chat_template_kwargs)
        return self.stream(self.tokenizer.encode(prompt), params, cancel=cancel, constraint=constraint,
                           **overrides)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             cancel: threading.Event | None = None, constraint: Constraint | None = None,
             **overrides) -> ChatResult:
        """Like :meth:`stream_chat`, collected into a :class:`ChatResult`: the raw ``text``
        and its ``reasoning``, ``content`` and ``tool_calls``."""
        prompt = self.chat_prompt(messages, tools, chat_template_kwargs)
        r = collect(self.stream(self.tokenizer.encode(prompt), params, cancel=cancel,
                                constraint=constraint, **overrides))
        return self.chat_result(r, prompt, tools)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None) -> str:
        """``messages`` (and ``tools``) rendered with the chat template, the generation
        prompt added and the switches as :meth:`lily.tokenizer.Tokenizer.chat_kwargs` completes
        them: the text :meth:`chat` generates from. Raises :class:`~lily.errors.TokenizerError`
        when the template rejects them."""
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                  **self.tokenizer.chat_kwargs(chat_template_kwargs, tools))

    @staticmethod
    def chat_result(r: GenerationResult, prompt: str, tools: list[dict] | None = None) -> ChatResult:
        """A finished reply to ``prompt`` (:meth:`chat_prompt`'s text) split into reasoning,
        content and tool calls (typed by ``tools``' schemas)."""
        parsed = parse_chat_output(r.text, reasoning=prompt_opens_reasoning(prompt), tools=tools,
                                   parse_tools=bool(tools))
        return ChatResult(**vars(r), reasoning=parsed.reasoning, content=parsed.content,
                          tool_calls=parsed.tool_calls)

    # ------------------------------------------------------------------ prompt cache

    def save_prompt_cache(self, path: str | Path) -> int:
        """Write the prompt cache's entries to ``path`` (one safetensors file carrying the
        model's config, quantization, a weights fingerprint, the device kind and a checksum).
        Returns the number of entries. Raises :class:`InvalidParameterError` when the cache
        is disabled."""
        if self.prompt_cache is None:
            raise InvalidParameterError("the prompt cache is disabled (prompt_cache_bytes=0)")
        return save_cache_file(self.prompt_cache, self, path)

    def load_prompt_cache(self, path: str | Path) -> int:
        """Add the entries of a file written by :meth:`save_prompt_cache` to the prompt cache,
        pinned (never evicted). Returns their number. Raises
        :class:`lily.prompt_cache.PromptCacheError` naming what differs for a file of another
        model, quantization or device kind, a damaged file, or entries beyond the context
        window or the cache budget; nothing is loaded then."""
        if self.prompt_cache is None:
            raise InvalidParameterError("the prompt cache is disabled (prompt_cache_bytes=0)")
        return load_cache_file(self.prompt_cache, self, path)

    def cache_prompt(self, prompt: str | Sequence[int]) -> int:
        """Prefill ``prompt`` (text or ids) into the prompt cache, snapshotting at the same
        positions a generation would (message boundaries, the last token); the session is
        left holding the prompt. Returns the number of tokens computed."""
        ids = self.encode_prompt(prompt)
        with self._using_session():
            session = self._session
            new = session.prepare(ids)
            session.snap_points = [q for q in session.snap_points if q != len(ids) - 1]  # the end is stored
            session.run_pieces(session.pieces(new, self.prefill_chunk), None)
            session.store()
            return len(new)

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
