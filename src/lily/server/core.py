"""The shared state of Lily's HTTP APIs and their request checks: :class:`ServerState`
(the engine, the generation worker, the server-wide options, sampling parameters, the
chat template, token limits, queueing a generation) and the checks and conversions every
API applies to a request (system messages, tools, the structured-output constraint).

Each API lives in its own module (:mod:`lily.server.openai_api`, :mod:`lily.server.models`)
as a FastAPI router; the handlers reach the :class:`ServerState` through
``request.app.state.lily`` (:func:`state_of`). Errors are raised as
:class:`~lily.server.protocol.APIError` and answered in the shape of the API the request
was sent to (:mod:`lily.server.errors`); a generation reaches the client through
:mod:`lily.server.streaming`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Callable

from fastapi import Request

from lily.errors import ContextLengthError, InvalidParameterError, LilyError, ToolError
from lily.sampling import LOGIT_BIAS_MAX, LOGIT_BIAS_MAX_ENTRIES, Sampler, SamplingParams, valid_bias
from lily.server.errors import dumps, param_of, shutdown_error
from lily.server.protocol import APIError
from lily.scheduler import DEFAULT_INTERLEAVE, DEFAULT_BATCH
from lily.server.worker import Job, Worker
from lily.structured import check_tools as check_tool_list
from lily.structured import grammar_for_request

log = logging.getLogger("lily.server")

INT32_MAX = (1 << 31) - 1
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "seed")
_MIN_LOGPROB = -9999.0


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------


def finite(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


def check_unicode(text: str, param: str) -> None:
    """400 for text with an unpaired surrogate (JSON allows ``"\\ud800"``; it is not Unicode
    text and no tokenizer can encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param} contains an unpaired surrogate (U+{ord(text[exc.start]):04X} at "
                            f"character {exc.start}): not valid Unicode text", param=param,
                       code="invalid_value") from None


class ServerState:
    """What every API handler shares: the engine, the generation worker, the served model's
    name and the server-wide options. One per app, as ``app.state.lily``."""

    def __init__(self, engine, model_name: str, api_key: str | None, max_queue: int,
                 default_max_tokens: int | None, strict_model_name: bool = False,
                 clamp_max_tokens: bool = False, max_batch: int = DEFAULT_BATCH,
                 prefill_interleave: int = DEFAULT_INTERLEAVE, default_reasoning: bool | None = None,
                 strip_billing_header: bool = True):
        self.closing = False
        self.engine = engine
        self.model_name = model_name
        self.strict_model_name = strict_model_name
        self.api_key = api_key
        self.worker = Worker(engine, max_queue, max_batch, prefill_interleave)
        self.created = int(time.time())
        # without a request limit: the server's, else the engine's chat default (a stand-in
        # engine without one: until the context is full)
        self.default_max_tokens = default_max_tokens if default_max_tokens is not None else \
            getattr(engine, "chat_max_tokens", None)
        self.clamp_max_tokens = clamp_max_tokens
        self.default_reasoning = default_reasoning
        self.strip_billing_header = strip_billing_header

    def begin_shutdown(self) -> None:
        """Take no more generations and end the running and queued ones now: their requests
        get a 503 (streams a final error event and ``data: [DONE]``), and the generation
        stops at its next prefill chunk or decode step. Call it on the event loop when the
        server is asked to exit, before waiting for connections to close
        (:func:`lily.server.serve` does)."""
        if self.closing:
            return
        self.closing = True
        jobs = self.worker.jobs()
        if jobs:
            log.info("shutting down: ending %d running or queued generation(s)", len(jobs))
        for job in jobs:
            job.abort(shutdown_error())

    # -- request checks ------------------------------------------------------------------

    def defaults_line(self) -> str:
        """The request defaults in one line (``lily serve``'s start-up log)."""
        cap = "until the context is full" if self.default_max_tokens is None else str(self.default_max_tokens)
        thinking = {None: "on (the chat template's default)", True: "on", False: "off"}[self.default_reasoning]
        sched = self.worker.ensure_scheduler()
        return (f"requests without a limit: max_tokens {cap} (chat, Responses), 16 (completions); reasoning "
                f"{thinking} unless a request says (--default-max-tokens N, --reasoning on|off change them); "
                f"up to {sched.max_batch} requests decode together and {sched.max_queue} more wait, new prompts "
                f"prefilled in chunks of {sched.interleave} tokens beside them "
                f"(--max-batch, --max-queue, --prefill-interleave)")

    def thinking_kwargs(self, requested: bool | None, forced: bool) -> dict:
        """The chat template's ``enable_thinking`` for a request (``{}``: the template's own
        default, on for Qwen3.6). ``requested`` is what the request's own field asks
        (Anthropic's ``thinking``, OpenAI's ``reasoning_effort`` / ``reasoning.effort``,
        ``chat_template_kwargs.enable_thinking``; None: nothing) and wins. Otherwise a
        request that forces the shape of its output (``forced``: a forced tool call or a
        JSON response format) does not think, as Anthropic's API has it for forced tool
        use: its answer is due at once rather than after thinking that may spend the whole
        ``max_tokens``. Otherwise the server's default (``lily serve --reasoning``)."""
        on = requested if requested is not None else False if forced else self.default_reasoning
        return {} if on is None else {"enable_thinking": on}

    def check_model(self, name: str | None, lookup: bool = False) -> None:
        """404 ``model_not_found`` for a model name other than the one served, when the
        server was started with ``strict_model_name`` or the request looks the model up
        (``lookup``); otherwise any name means the one model served (as llama-server)."""
        if name is not None and name != self.model_name and (self.strict_model_name or lookup):
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")

    @staticmethod
    def check_n(n: int | None, best_of: int | None = None) -> None:
        if n is not None and n != 1:
            raise APIError(400, f"n={n} is not supported: only n=1", param="n", code="invalid_value")
        if best_of is not None and best_of != 1:
            raise APIError(400, f"best_of={best_of} is not supported: only 1", param="best_of",
                           code="invalid_value")

    def logit_bias(self, bias) -> dict[int, float]:
        """OpenAI's ``logit_bias`` (a JSON object: token id as a decimal string -> a number in
        [-100, 100]) as :attr:`lily.sampling.SamplingParams.logit_bias`; null and ``{}`` are
        no bias. 400 naming ``logit_bias`` and the bad entry for a key that is not a token id,
        an id outside the vocabulary, a value that is not a number or is out of range, and
        for more than :data:`~lily.sampling.LOGIT_BIAS_MAX_ENTRIES` entries."""
        if bias is None:
            return {}

        def bad(msg: str) -> APIError:
            return APIError(400, f"logit_bias: {msg}", param="logit_bias", code="invalid_value")

        if not isinstance(bias, dict):
            raise bad(f"must be an object mapping token ids to biases, got {type(bias).__name__}")
        if len(bias) > LOGIT_BIAS_MAX_ENTRIES:
            raise bad(f"{len(bias)} entries, at most {LOGIT_BIAS_MAX_ENTRIES}")
        vocab = self.engine.config.vocab_size
        out = {}
        for key, value in bias.items():
            entry = f"{dumps(key)[:40]}: {dumps(value)[:40]}"
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                raise bad(f"invalid entry {entry}: the key must be a token id (a non-negative integer as a string)")
            tok = int(key) if len(key) <= 12 else vocab  # longer: beyond any vocabulary (and int()'s digit limit)
            if tok >= vocab:
                raise bad(f"invalid entry {entry}: the token id is outside the vocabulary [0, {vocab})")
            if not valid_bias(value):
                raise bad(f"invalid entry {entry}: the bias must be a number in "
                          f"[{-LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]")
            if tok in out:  # "5" and "05"
                raise bad(f"invalid entry {entry}: token id {tok} is given twice")
            out[tok] = float(value)
        return out

    def sampling_params(self, req, max_tokens: int | None, logprobs: bool = False, top_logprobs: int = 0,
                        stop: tuple[str, ...] | None = None, max_temperature: float = 2.0,
                        logit_bias: dict[int, float] | None = None):
        """The engine's :class:`~lily.sampling.SamplingParams` for a request: the checkpoint's
        defaults with the request's sampling fields (those of ``_SAMPLING_FIELDS`` that ``req``
        has and sets), its ``stop`` strings (or ``stop``), ``max_tokens`` and ``logit_bias`` (from
        :meth:`logit_bias`). 400 when a value
        is out of range: the API's own range for ``temperature`` (``max_temperature``: 2 in
        OpenAI's reference, 1 in Anthropic's), the engine's for the rest."""
        kw: dict[str, Any] = {}
        for name in _SAMPLING_FIELDS:
            v = getattr(req, name, None)
            if v is not None:
                kw[name] = v
        t = kw.get("temperature")
        if t is not None and not 0 <= t <= max_temperature:
            raise APIError(400, f"invalid sampling parameter temperature={t}: must be in [0, {max_temperature:g}]",
                           param="temperature", code="invalid_value")
        top_k = kw.get("top_k")
        if top_k is not None and not -1 <= top_k <= INT32_MAX:
            raise APIError(400, f"invalid sampling parameter top_k={top_k}: must be -1 or 0 (both disable "
                                f"top-k) or a count in [1, {INT32_MAX}]", param="top_k", code="invalid_value")
        if top_k == -1:  # vLLM's "disabled"
            kw["top_k"] = 0
        req_stop = getattr(req, "stop", None) if stop is None else stop
        if req_stop is not None:
            kw["stop"] = (req_stop,) if isinstance(req_stop, str) else tuple(req_stop)
        if max_tokens is not None:
            kw["max_tokens"] = max_tokens
        kw["logprobs"] = bool(logprobs)
        kw["top_logprobs"] = top_logprobs if logprobs else 0
        if logit_bias:
            kw["logit_bias"] = logit_bias
        try:
            return self.engine.generation_defaults.replace(**kw)
        except (LilyError, ValueError, TypeError) as exc:
            msg = str(exc)
            raise APIError(400, msg, param=param_of(msg), code="invalid_value") from None

    def context_error(self, n_prompt: int, prompt: str, limit: int | None = None,
                      field: str | None = None) -> APIError:
        """400 ``context_length_exceeded`` in OpenAI's words (as vLLM gives them too): the
        window, the prompt's ``n_prompt`` tokens (``prompt``: what the API calls it) and,
        when the request's ``field`` set the ``limit`` that overflowed, that limit (then
        ``param`` is ``field``, else ``prompt``)."""
        head = f"This model's maximum context length is {self.engine.max_context} tokens. However, "
        if limit is None:
            return APIError(400, f"{head}your {prompt} resulted in {n_prompt} tokens. Please reduce the length "
                                 f"of the {prompt}.", param=prompt, code="context_length_exceeded")
        return APIError(400, f"{head}you requested {n_prompt + limit} tokens ({n_prompt} in the {prompt}, {limit} "
                             f"in {field}). Please reduce the length of the {prompt} or {field} (or start the server "
                             f"with --clamp-max-tokens to cap {field} to the room left).", param=field,
                        code="context_length_exceeded")

    def check_prompt_ids(self, ids: list[int], param: str) -> None:
        """The engine's input check (:meth:`lily.engine.Engine.check_tokens`, one rule for
        the library and the server) as API errors: 400 ``invalid_value`` for an empty prompt
        or a token id outside the vocabulary, 400 ``context_length_exceeded`` naming
        ``param`` for a prompt longer than the context window (:meth:`context_error`)."""
        try:
            self.engine.check_tokens(ids, "the prompt")
        except ContextLengthError:
            raise self.context_error(len(ids), param) from None
        except InvalidParameterError as exc:
            raise APIError(400, str(exc), param="prompt", code="invalid_value") from None

    async def render_chat(self, messages: list[dict], tools: list[dict] | None, kwargs: dict,
                          param: str = "messages", fit: bool = True) -> tuple[str, list[int]]:
        """The chat template applied to template-form ``messages`` and OpenAI-form ``tools``
        (off the event loop): ``(prompt text, token ids)``, checked (400 naming ``param`` for
        a conversation without a user message, a template error, an unpaired surrogate, an
        empty prompt or, with ``fit``, one longer than the context window)."""
        messages = merge_system_messages(messages)
        check_has_user_turn(messages, param)
        tok = self.engine.tokenizer

        def render():
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                           **tok.chat_kwargs(kwargs, tools))
            check_unicode(text, param)
            return text, tok.encode(text)

        try:
            prompt_text, ids = await asyncio.to_thread(render)
        except (LilyError, ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from None
        if fit:
            self.check_prompt_ids(ids, param)
        elif not ids:
            raise APIError(400, f"{param} rendered to an empty prompt", param=param, code="invalid_value")
        return prompt_text, ids

    def max_tokens_for(self, n_prompt: int, limit: int | None, *, field: str, prompt: str,
                       default: int | None = None) -> int:
        """The generation's token limit after a prompt of ``n_prompt`` tokens.

        ``limit`` is what the request's ``field`` (``max_tokens``, ``max_output_tokens``,
        ...) asks for: prompt + limit must fit in the context window, or it is a 400
        (:meth:`context_error`; ``prompt`` is what the API calls the prompt), as OpenAI's
        API and vLLM refuse it; with ``--clamp-max-tokens`` it is capped to the room left
        instead (for agent tools that send a fixed limit larger than a local window). A limit outside [1, 2^31 - 1] is returned as is:
        :meth:`sampling_params` refuses it naming those bounds. Without a limit, ``default``
        (else ``--default-max-tokens``, else none) capped to the room left, at least 1 (a
        prompt that fills the window ends at once for length)."""
        room = self.engine.max_context - n_prompt
        if limit is None:
            cap = default if default is not None else self.default_max_tokens
            return max(1, room if cap is None else min(cap, room))
        if 1 <= limit <= INT32_MAX and limit > room:
            if self.clamp_max_tokens:
                return max(1, room)
            raise self.context_error(n_prompt, prompt, limit, field)
        return limit

    # -- generation ------------------------------------------------------------------------

    def submit(self, ids: list[int], params, prompt_logprobs: int | None = None, constraint=None,
               report_start: bool = False, **engine_kw) -> Job:
        """Queue the generation (429 with ``Retry-After`` when the line is full, 503 while
        shutting down). With ``prompt_logprobs`` (the number of alternatives), the job first
        scores the prompt into ``job.prompt_logprobs`` (:func:`prompt_scorer`).
        ``constraint`` (from :func:`request_constraint`) and ``engine_kw`` (e.g.
        ``prompt_cache_key``) go to the scheduler. ``report_start``: the job posts a
        ``"start"`` item once the engine has prepared the session (:func:`job_events` sets
        ``job.cached_tokens`` and wakes a stream), for a stream that reports the cache split
        up front."""
        if self.closing:
            raise shutdown_error()
        job = Job(asyncio.get_running_loop())
        kw = dict(engine_kw)
        if constraint is not None:
            kw["constraint"] = constraint
        if prompt_logprobs is not None:
            kw["score"] = prompt_scorer(job, ids, prompt_logprobs, self.engine.sample_vocab)
            kw.pop("prompt_cache_key", None)
        self.worker.submit(job, ids, params, report_start=report_start, **kw)
        return job

    @staticmethod
    def log_done(kind: str, job: Job, last, started: float, tool_calls: int = 0) -> None:
        """The request's one log line: token counts (prompt tokens reused from the prompt cache
        and computed), finish reason (a reply that ended in ``tool_calls`` calls says so, as
        the API's own finish reason does), queue wait and speeds."""
        if last is None:
            return
        job.logged = True
        t = last.timings
        wait = (job.started - job.submitted) if job.started else 0.0
        busy = t.decode_gpu_busy if t else None
        log.info("%s: %d prompt (%d cached, %d computed) + %d completion tokens, finish=%s, queued %.2fs, "
                 "prefill %.1f tok/s, decode %.1f tok/s%s, total %.2fs", kind, last.prompt_tokens,
                 getattr(last, "cached_tokens", 0), t.prefill_tokens if t else 0, last.completion_tokens,
                 f"tool_calls ({tool_calls})" if tool_calls and last.finish_reason == "stop" else last.finish_reason,
                 wait, t.prefill_tokens_per_s if t else 0.0,
                 t.decode_tokens_per_s if t else 0.0,
                 f" (GPU busy {100 * busy:.0f}%)" if busy is not None else "", time.perf_counter() - started)


_ROLE_WORDS = {"system": "system", "assistant": "assistant", "tool": "tool result"}


def merge_system_messages(messages: list[dict]) -> list[dict]:
    """Template-form ``messages`` with every system message folded into one at the start.

    Qwen's chat template takes one system message, first (``raise_exception('System message
    must be at the beginning.')``), while agent clients send several: Codex puts
    ``instructions`` and ``developer`` input items together, OpenAI's chat clients a system and
    a developer message (both arrive here as role ``system``). Their text is joined in order
    with a blank line, as LiteLLM does for such templates; a conversation with at most one
    system message, first, is returned unchanged (same prompt, same prompt-cache reuse).
    Non-text parts of a system message are refused with a 400 (param ``messages``)."""
    at = [i for i, m in enumerate(messages) if m.get("role") == "system"]
    if at in ([], [0]):
        return messages
    texts = []
    for i in at:
        content = messages[i].get("content")
        if isinstance(content, list):
            if any(not (isinstance(p, dict) and p.get("type") == "text") for p in content):
                raise APIError(400, f"messages.{i}: a system message may hold text only", param="messages",
                               code="invalid_value")
            content = "".join(p.get("text") or "" for p in content)
        if content:
            texts.append(str(content))
    merged = {"role": "system", "content": "\n\n".join(texts)}
    return [merged] + [m for i, m in enumerate(messages) if i not in set(at)]


def check_has_user_turn(messages: list[dict], param: str) -> None:
    """400 naming ``param`` for a conversation without a user message (template-form
    ``messages``): the model answers a user's turn, and the Qwen chat template refuses a
    conversation without one ("No user query found in messages")."""
    if any(m.get("role") == "user" for m in messages):
        return
    roles = list(dict.fromkeys(_ROLE_WORDS.get(m.get("role"), str(m.get("role"))) for m in messages))
    has = f"it has only {' and '.join(roles)} messages" if roles else "it is empty"
    raise APIError(400, f"{param} has no user message: {has}, and the model answers a user's turn",
                   param=param, code="invalid_value")


def cache_key(req) -> str | None:
    """OpenAI's ``prompt_cache_key`` (a hint naming a conversation, given to the engine's
    prompt cache for eviction; reuse is decided by token equality alone), or None."""
    key = (req.model_extra or {}).get("prompt_cache_key")
    return key if isinstance(key, str) else None


def state_of(request: Request) -> ServerState:
    """The app's :class:`ServerState` (a FastAPI dependency)."""
    return request.app.state.lily


def openai_usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None,
                 cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens reused from the prompt cache."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def prompt_scorer(job: Job, ids: list[int], n_top: int, vocab_limit: int = 0) -> Callable:
    """The ``score`` hook of a ``/v1/completions`` request with ``echo`` and ``logprobs``
    (:meth:`lily.scheduler.Scheduler.submit`): the row runs the prompt but its last token from
    an empty session with every position's logits, then generates from there.

    ``job.prompt_logprobs`` gets one entry per prompt token, ``None`` for the first and
    otherwise the :class:`~lily.sampling.TokenLogprob` of ``ids[i]`` under the model's
    distribution after ``ids[:i]`` (raw logits, with ``n_top`` alternatives, as for
    generated tokens, over the ids below ``vocab_limit`` when it is not 0, as the generation's
    sampler); it is complete before the generation's first event."""
    scorer = Sampler(SamplingParams(top_logprobs=n_top, seed=0, vocab_limit=vocab_limit))
    scored: list = [None]
    job.prompt_logprobs = scored

    def score(rows) -> None:  # row j of a piece predicts the token after it
        for row in rows:
            scored.append(scorer.logprob(row, ids[len(scored)]))

    return score


# ----------------------------------------------------------------------------------------
# the structured-output hook
# ----------------------------------------------------------------------------------------


def effort_thinking(effort) -> bool | None:
    """An OpenAI reasoning effort (Chat Completions' ``reasoning_effort``, the Responses
    API's ``reasoning.effort``) as the request's thinking switch for
    :meth:`ServerState.thinking_kwargs`: ``"none"`` asks for no reasoning (False); Qwen3.6 has
    no levels, so every other value asks for it (True); absent (None) asks for nothing."""
    if effort is None:
        return None
    return effort != "none"


def forces_format(response_format) -> bool:
    """Whether a ``response_format`` (chat) or ``text.format`` (Responses) fixes the answer's
    shape (``json_object``, ``json_schema``; ``text`` does not)."""
    return isinstance(response_format, dict) and response_format.get("type", "text") != "text"


def check_tools(tools: list[dict] | None, param: Callable[[int, str], str]) -> None:
    """:func:`lily.structured.check_tools` (tool names and parameters schemas, before anything
    is rendered or queued) as a 400 naming the tool; ``param(i, field)`` spells tool ``i``'s
    field in the request's own form (e.g. ``tools.0.input_schema``)."""
    try:
        check_tool_list(tools, param)
    except ToolError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None


def request_constraint(state: ServerState, *, format: dict | None = None, tool_choice: str | None = None,
                       tools: list[dict] | None = None, param: str = "response_format", parallel: bool = True,
                       tool_param: Callable[[int, str], str] | None = None):
    """The decoding constraint a request asks for, handed to the engine as ``constraint=``
    (``None``: unconstrained). The one place every API's output-format options meet:

    ``format`` is the requested output format in OpenAI's ``response_format`` form
    (``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {...}}``; the Responses API's ``text.format`` is converted to it by the
    caller); ``tool_choice`` is ``"required"`` or a function name when the request forces a
    tool call, with ``tools`` in OpenAI's chat form (``parallel=False``: exactly one call).
    The result is a :class:`lily.structured.Grammar` (checked here: an invalid or
    unenforceable format schema is a 400 naming ``param``; a forced tool whose schema
    cannot be enforced is a 400 naming the tool and ``tool_param(i, "parameters")``, the
    spelling :func:`check_tools` uses); the engine binds it to the prompt (thinking first
    when the prompt leaves a ``<think>`` block open).
    """
    try:
        return grammar_for_request(format=format, tool_choice=tool_choice, tools=tools, parallel=parallel)
    except ToolError as exc:
        if tool_param is not None:
            exc = exc.spelled(tool_param)
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    except InvalidParameterError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_value") from None
