"""One generation's output side, the same for the engine's loop (one session) and the
scheduler's rows (several at once): tokens come in from a device or the host sampler, safe
text goes out as :class:`StreamEvent` objects, and the generation ends on EOS, a stop
string, the constraint's end or the length limit. It also keeps the request's timings and
the thinking budget (:class:`Generation`).

What runs the model stays with its caller: :meth:`lily.engine.Engine.stream` drives one
session through ``Backend.start`` / ``next`` / ``finish``; :class:`lily.scheduler.Scheduler`
drives rows through the batched calls. Both hand every token to :meth:`Generation.push` and
pass on the event it returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lily.chat_output import ChatMessage, ToolCall
from lily.constraints import Constraint
from lily.sampling import SamplingParams, StopMatcher, TokenLogprob

#: What the engine appends when a thinking budget is spent: the close the model itself
#: writes (Qwen3.5/3.6 put a blank line between ``</think>`` and the answer).
THINKING_CLOSE_TEXT = "\n</think>\n\n"


@dataclass
class Timings:
    """Wall-clock timings of one generation, in seconds and tokens per second; on a native
    device also the device's own execution time of each phase (``gpu_prefill_s``,
    ``gpu_decode_s``: Metal's GPU timestamps of the command buffers, the simulator's
    execution time; None on the reference device). Wall time minus device time is what the
    host added (Python, encoding, waiting). The first decode step runs on the device while
    the host still takes the first token, so ``gpu_decode_s`` may exceed ``decode_s`` by up
    to one step. In a batch (:class:`lily.scheduler.Scheduler`) the device time is that of
    the steps and chunks the request took part in, shared with the other rows."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    gpu_prefill_s: float | None = None
    gpu_decode_s: float | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def decode_gpu_busy(self) -> float | None:
        """Share of the decode's wall time the device was executing, at most 1 (a step may
        start on the device just before the first token reaches the host); None when not
        measured or no decode step ran."""
        if not self.gpu_decode_s or self.decode_s <= 0:
            return None
        return min(1.0, self.gpu_decode_s / self.decode_s)


@dataclass
class StreamEvent:
    """One step of a streamed generation.

    ``text`` is safe to display (complete UTF-8 characters, stop strings withheld);
    ``token_ids`` are the tokens produced in this step (the EOS token is not included).
    The last event has ``finish_reason`` set (``"stop"``, ``"length"`` or ``"cancelled"``)
    and carries ``prompt_tokens``/``completion_tokens``, ``cached_tokens`` (prompt tokens
    whose state was reused rather than computed) and ``timings``.
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: Timings | None = None
    cached_tokens: int = 0


@dataclass
class GenerationResult:
    """A finished generation: ``text``, generated ``token_ids``, ``finish_reason``, usage
    counts (``cached_tokens``: prompt tokens reused from the session or the prompt cache),
    ``timings`` and optional per-token ``logprobs``."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0


@dataclass
class ChatResult(GenerationResult):
    """A finished :meth:`lily.engine.Engine.chat`: a :class:`GenerationResult` (``text`` is
    the raw reply, special tokens included) plus the reply split by
    :func:`lily.chat_output.parse_chat_output`: ``reasoning`` (the thinking block),
    ``content`` (the answer) and ``tool_calls`` (:class:`lily.chat_output.ToolCall`,
    arguments typed by the tools' schemas)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def message(self) -> dict:
        """The assistant message to append to the conversation for the next turn."""
        return ChatMessage(self.reasoning, self.content, list(self.tool_calls)).to_message()


def collect(events) -> GenerationResult:
    """A stream of :class:`StreamEvent` collected into a :class:`GenerationResult`."""
    texts, ids, lps, last = [], [], [], None
    for ev in events:
        texts.append(ev.text)
        ids.extend(ev.token_ids)
        if ev.logprobs:
            lps.extend(ev.logprobs)
        last = ev
    return GenerationResult("".join(texts), ids, last.finish_reason, last.prompt_tokens,
                            last.completion_tokens, last.timings, lps or None, last.cached_tokens)


class ThinkingBudget:
    """Counts the generated tokens inside the first thinking block (open from the prompt, or
    from the model's own ``<think>`` token) and says when the budget is spent. The block is
    known by the tokenizer's ``<think>``/``</think>`` tokens; a tokenizer without them has
    no thinking for a budget to bound."""

    def __init__(self, tokenizer, budget: int, inside: bool):
        self.open_id = tokenizer.token_to_id("<think>")
        self.close_id = tokenizer.token_to_id("</think>")
        self.close_ids = tokenizer.encode(THINKING_CLOSE_TEXT)
        self.budget = budget
        self.state = "before" if not inside else "inside" if self.close_id is not None else "after"
        self.count = 0

    def spent(self, tok: int) -> bool:
        """Record generated token ``tok``; True when it is the budget's last thinking token."""
        if self.state == "before":
            if tok == self.open_id and self.close_id is not None:
                self.state = "inside"
            return False
        if self.state == "after":
            return False
        if tok == self.close_id:
            self.state = "after"
            return False
        self.count += 1
        if self.count >= self.budget:
            self.state = "after"
            return True
        return False


class Generation:
    """The output side of one generation (module doc).

    Parameters
    ----------
    tokenizer : lily.tokenizer.Tokenizer
        For the incremental detokenizer and the thinking block's tokens.
    eos_token_ids : frozenset[int]
        Tokens that end the generation (unless ``params.ignore_eos``).
    prompt_ids : list[int]
        The whole prompt (its length is the event's ``prompt_tokens``).
    params : SamplingParams
        Stop strings, ``max_tokens``, ``logprobs``, ``ignore_eos``, ``thinking_budget``.
    constraint : Constraint | None
        Advanced with every forced token (the sampler advances it with sampled ones); its end
        ends the generation.
    cached : int
        Prompt tokens whose state was reused (the event's ``cached_tokens``); the rest were
        computed (``timings.prefill_tokens``).
    steps : int
        Tokens the generation may produce (``max_tokens`` capped to the room in the context).
    thinking_inside : bool
        The prompt leaves a thinking block open (for ``thinking_budget``).

    The driver sets :attr:`feed` (the tokens fed when the device starts) and reads
    :attr:`outs` (the tokens consumed after the feed: outputs, EOS included, and forced
    ones) to know what the state holds once the device stops (:meth:`consumed`).
    """

    def __init__(self, tokenizer, eos_token_ids, prompt_ids, params: SamplingParams,
                 constraint: Constraint | None, *, cached: int, steps: int, thinking_inside: bool):
        self.eos_token_ids = eos_token_ids
        self.params = params
        self.constraint = constraint
        self.prompt_tokens = len(prompt_ids)
        self.cached = cached
        self.steps = steps
        self.timings = Timings(prefill_tokens=len(prompt_ids) - cached)
        self.detok = tokenizer.detokenizer()
        self.stops = StopMatcher(params.stop)
        self.think = (None if params.thinking_budget is None else
                      ThinkingBudget(tokenizer, params.thinking_budget, thinking_inside))
        self.n_out = 0
        self.feed: list[int] = []
        self.outs: list[int] = []
        self.forced: list[int] = []  # the close of a spent thinking budget, still to output
        self.spent = False  # the budget was spent by the last token: the driver restarts the device
        self.finish_reason: str | None = None
        self.t0 = time.perf_counter()
        self.t1: float | None = None  # when the first token arrived (the end of the prompt)
        self._gpu_prefill: float | None = None
        self._gpu_total: float | None = None

    # -- timings ------------------------------------------------------------------------

    def device_time(self, seconds: float | None) -> None:
        """The device seconds spent on this generation so far (None: not measured); before
        the first token they are the prefill's, after it the rest is the decode's."""
        if seconds is None:
            return
        self._gpu_total = seconds
        if self.t1 is None:
            self._gpu_prefill = seconds
        self._split()

    def _split(self) -> None:
        if self._gpu_total is None:
            return
        if self.t1 is None:
            self.timings.gpu_prefill_s = self._gpu_total
        else:
            self.timings.gpu_prefill_s = self._gpu_prefill or 0.0
            self.timings.gpu_decode_s = self._gpu_total - (self._gpu_prefill or 0.0)

    def first_token(self) -> None:
        """Mark the end of the prompt (the first token arrived): ``timings.prefill_s`` is the
        time to it."""
        if self.t1 is None:
            self.t1 = time.perf_counter()
            self.timings.prefill_s = self.t1 - self.t0

    def close(self, seconds: float | None = None) -> None:
        """Refine the timings once the device has stopped (``seconds``: as :meth:`device_time`)."""
        now = time.perf_counter()
        if self.t1 is None:
            self.timings.prefill_s = now - self.t0
            self.timings.decode_s = 0.0
        else:
            self.timings.decode_s = now - self.t1
        self.device_time(seconds)

    # -- events -------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def _final(self, reason: str, text: str = "", ids=None, lps=None) -> StreamEvent:
        self.finish_reason = reason
        now = time.perf_counter()  # the timings as of the final event; close() refines them
        if self.t1 is None:
            self.timings.prefill_s = now - self.t0
        else:
            self.timings.decode_s = now - self.t1
        self._split()
        return StreamEvent(text, ids or [], lps, reason, self.prompt_tokens, self.n_out, self.timings, self.cached)

    def cancelled(self) -> StreamEvent:
        """The final event of a cancelled generation."""
        return self._final("cancelled")

    def push(self, step) -> StreamEvent:
        """The event for the next step: ``(token, TokenLogprob or None)`` from the device or
        the sampler, or None when the device has no step left (the limit or the context).
        Sets :attr:`finish_reason` on the final event, and :attr:`spent` when the thinking
        budget was spent by this token (the driver stops the device, keeps what it computed
        and outputs :meth:`forced_token` until :attr:`forced` is empty, then starts again
        with :meth:`restart_feed`)."""
        self.first_token()
        if step is None:  # max tokens or the context window reached
            tail_text, _ = self.stops.push(self.detok.flush())
            return self._final("length", tail_text + self.stops.flush())
        tok, lp = step
        if tok in self.eos_token_ids and not self.params.ignore_eos:
            self.outs.append(tok)  # a speculative step may have consumed it
            return self._final("stop", self.stops.flush() + self.detok.flush())
        return self._output(tok, lp)

    def forced_token(self) -> StreamEvent:
        """The next forced token (the close of a spent thinking budget) as if generated: the
        same checks, advanced through the constraint, logprob 0.0 (the engine's choice)."""
        tok = self.forced.pop(0)
        if self.constraint is not None:
            self.constraint.advance(tok)
        return self._output(tok, TokenLogprob(tok, 0.0), forced=True)

    def _output(self, tok: int, lp, forced: bool = False) -> StreamEvent:
        self.outs.append(tok)
        self.n_out += 1
        self.timings.decode_tokens = self.n_out
        lps = [lp] if self.params.logprobs else None
        text, stopped = self.stops.push(self.detok.add(tok))
        if stopped:
            return self._final("stop", text, [tok], lps)
        finished = self.constraint is not None and self.constraint.is_finished()
        if finished or self.n_out >= self.steps:
            tail_text, _ = self.stops.push(self.detok.flush())
            return self._final("stop" if finished else "length", text + tail_text + self.stops.flush(), [tok], lps)
        if not forced and self.think is not None and self.think.spent(tok):
            self.spent = True
            self.forced = list(self.think.close_ids)
        return StreamEvent(text, [tok], lps)

    # -- what the state holds -----------------------------------------------------------

    def consumed(self, n: int) -> list[int]:
        """The first ``n`` tokens of the feed and the outputs since the device started (what
        a device that ran ``n`` steps put in the state), and drops them from both."""
        taken = (self.feed + self.outs)[:n]
        rest = (self.feed + self.outs)[n:]
        self.feed, self.outs = rest, []
        return taken

    def restart_feed(self) -> list[int]:
        """After the forced close is out: the feed the device starts again with (what the
        state does not hold yet, the close included); :attr:`feed` becomes it."""
        self.spent = False
        self.feed, self.outs = self.feed + self.outs, []
        return self.feed

    @property
    def steps_left(self) -> int:
        return self.steps - self.n_out
