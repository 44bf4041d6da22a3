"""``lily bench``: Lily and MLX-LM side by side in one run, reported as ratios.

The protocol is docs/goals.md's: both engines load the same checkpoint directory (the
same 4-bit bytes), one request at a time, and in every round both engines run each prompt
length, alternating which goes first. MLX-LM runs its direct generation path
(``mlx_lm.generate.generate_step``, what ``mlx_lm.generate`` and ``stream_generate`` wrap),
Lily its public streaming API (``Engine.stream``). Both are timed the same way, from outside,
by when generated tokens arrive:

* prefill throughput = prompt tokens / time to the first generated token (so it includes
  one decode step in both engines);
* decode throughput at that context = tokens after the first / time from the first to the
  last token.

Greedy decoding with EOS ignored, so both generate exactly ``decode_tokens``. Each figure
is the median over the rounds; the ratio is Lily / MLX-LM (above 1: Lily is faster).

The consistency check is teacher-forced (as docs/goals.md's headline table): a conversation
rendered with the checkpoint's chat template, every position's logits from both engines,
top-1 agreement and the perplexity ratio over ``positions`` next-token predictions.

``protocol="pplx"`` follows instead the measurement contract pplx-garden published with
its M5 Max table (perplexityai/pplx-garden, lily/docs/2026-09-02-performance-mlx-0.32.2.md),
so a first Mac run compares directly with it: synthetic prompt ids (:func:`pplx_prompt`),
greedy, an untimed run of the exact shape before each length's timed ones, prefill = prompt
tokens / time to the first token, then exactly 64 timed decode steps (decode throughput =
64 / time from the first to the 65th token), two rounds, median. Unlike theirs, both engines
run in one process (they start a fresh process per arm).

Figures mean something only with ``device="metal"`` against MLX on the same Mac's GPU; on
another machine (the simulator, MLX on the CPU) the run checks the harness, and the report
says so.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np

from lily import __version__
from lily.checkpoint import load_config
from lily.engine import Engine, default_model_path
from lily.errors import InvalidParameterError
from lily.lab.published import LENGTHS, PPLX_DECODE_STEPS, PPLX_PUBLISHED_M5MAX
from lily.lab.system import system_info

PROTOCOLS = ("spec", "pplx")


def pplx_prompt(length: int, vocab_size: int) -> list[int]:
    """pplx-garden's synthetic prompt: the token at position ``i`` is
    ``((i * 2654435761) mod 2**32) mod vocab_size`` (their measurement contract)."""
    return [((i * 2654435761) % (1 << 32)) % vocab_size for i in range(length)]

# The text the prompts are made of (rendered as a chat with the checkpoint's template).
_QUESTION = "Tell me how a small workshop learned to build clocks that never lose a second."
_ANSWER = (
    "In a narrow street behind the harbour there was a workshop where three brothers mended "
    "ship instruments. Every winter the storms brought them compasses full of salt and "
    "chronometers that had stopped in the middle of the night. The eldest brother kept a "
    "ledger of every fault he found, and after many years he noticed that nearly all of them "
    "began with heat: a spring that softened in the sun, a wheel that swelled a hair's width "
    "and rubbed against its neighbour. So the brothers stopped asking how to make each part "
    "stronger and asked instead how to make the whole clock indifferent to the weather. The "
    "youngest cut balance wheels from two metals that grew by different amounts, so that one "
    "undid what the other did. The middle brother sealed the movement in a case lined with "
    "felt and filled with dry air. Their first clock gained a minute a month; the tenth lost "
    "nothing they could measure against the stars. Captains began to queue at the door before "
    "dawn, and the brothers, who had never wanted more than a quiet bench and a good lamp, "
    "took on apprentices and taught them the one rule in the ledger's last page: find out what "
    "really goes wrong before you decide what to make better."
)


class Runner(Protocol):
    """One engine under test: ``label``, ``run(prompt ids, n) -> Sample`` and
    ``logits(ids) -> float32 [len(ids), vocab]``."""

    label: str

    def run(self, prompt: Sequence[int], n: int) -> "Sample": ...

    def logits(self, ids: Sequence[int]) -> np.ndarray: ...


@dataclass
class Sample:
    """One timed request: ``prompt_tokens`` in, ``tokens`` generated; seconds from the request
    to the first generated token (``first_s``) and from the first to the last (``decode_s``);
    for Lily on a native device also the device's execution time of the same two phases
    (``gpu_first_s``, ``gpu_decode_s``: :class:`lily.engine.Timings`), else None."""

    prompt_tokens: int
    tokens: int
    first_s: float
    decode_s: float
    first_tokens: int = 1  # tokens that had arrived at first_s
    gpu_first_s: float | None = None
    gpu_decode_s: float | None = None

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.first_s if self.first_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.tokens - self.first_tokens
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def gpu_prefill_tps(self) -> float | None:
        """Prompt tokens per second of device time (None when not measured)."""
        return self.prompt_tokens / self.gpu_first_s if self.gpu_first_s else None

    @property
    def gpu_decode_tps(self) -> float | None:
        """Decode tokens per second of device time (None when not measured)."""
        n = self.tokens - self.first_tokens
        return n / self.gpu_decode_s if n > 0 and self.gpu_decode_s else None


def _timed(prompt_tokens: int, arrivals: Callable[[], "Sequence[int] | None"]) -> Sample:
    """Times a stream: ``arrivals()`` returns the next batch of token ids, None at the end."""
    t0 = time.perf_counter()
    first = last = None
    count = first_count = 0
    while (batch := arrivals()) is not None:
        if not batch:
            continue
        now = time.perf_counter()
        if first is None:
            first, first_count = now, len(batch)
        count += len(batch)
        last = now
    if first is None:
        raise RuntimeError("the engine generated no tokens")
    return Sample(prompt_tokens, count, first - t0, last - first, first_count)


class LilyRunner:
    """Lily through ``Engine.stream`` (greedy, EOS ignored), with no prompt cache: every
    timed prefill computes the whole prompt, as the peer's does."""

    def __init__(self, path: str | Path | None, device: str, max_context: int,
                 device_options: dict | None = None):
        # the warm-up and earlier rounds run the same prompts: a cache would turn the timed
        # prefill into a one-token lookup
        self.engine = Engine.load(path, device=device, max_context=max_context,
                                  device_options=device_options, prompt_cache_bytes=0)
        self.label = f"lily {__version__} (device={self.engine.device})"

    def run(self, prompt: Sequence[int], n: int) -> Sample:
        self.engine.reset()
        it = self.engine.stream(list(prompt), max_tokens=n, temperature=0.0, ignore_eos=True)
        last = []

        def arrivals():
            ev = next(it, None)
            if ev is None:
                return None
            last[:] = [ev]
            return ev.token_ids
        s = _timed(len(prompt), arrivals)
        t = last[0].timings  # the final event's, refined when the stream closed
        if t.prefill_tokens != len(prompt):
            raise RuntimeError(f"the timed prefill computed {t.prefill_tokens} of the prompt's {len(prompt)} tokens "
                               "(the rest came from a prompt cache): not a prefill measurement")
        s.gpu_first_s, s.gpu_decode_s = t.gpu_prefill_s, t.gpu_decode_s
        return s

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        self.engine.reset()
        out = self.engine.prefill(list(ids), all_logits=True)
        self.engine.reset()
        return out


def mlx_lm_modules():
    """``(mlx.core, mlx_lm, generate_step)``; raises :class:`InvalidParameterError` naming the
    bench extra when MLX-LM is not installed (checked before Lily loads anything: a native
    load may write the aligned weight cache)."""
    try:
        import mlx.core as mx
        import mlx_lm
        from mlx_lm.generate import generate_step
    except ImportError as e:
        raise InvalidParameterError(f"lily bench needs MLX-LM: pip install \".[bench]\" ({e})") from None
    return mx, mlx_lm, generate_step


class MlxLmRunner:
    """MLX-LM's ``generate_step`` (greedy: its default sampler; no EOS check)."""

    def __init__(self, path: str | Path):
        mx, mlx_lm, generate_step = mlx_lm_modules()
        self._mx, self._step = mx, generate_step
        self.model, _ = mlx_lm.load(str(path))
        dev = mx.default_device()
        self.on_gpu = dev.type == mx.DeviceType.gpu
        self.label = f"mlx-lm {mlx_lm.__version__} (mlx {mx.__version__}, {'gpu' if self.on_gpu else 'cpu'})"

    def run(self, prompt: Sequence[int], n: int) -> Sample:
        it = self._step(self._mx.array(list(prompt)), self.model, max_tokens=n)

        def arrivals():
            step = next(it, None)
            return None if step is None else (step[0],)
        return _timed(len(prompt), arrivals)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        mx = self._mx
        return np.array(self.model(mx.array([list(ids)]))[0].astype(mx.float32))


def teacher_forced(logits: np.ndarray, peer: np.ndarray, targets: np.ndarray) -> dict:
    """Top-1 agreement and perplexity ratio of two engines predicting ``targets``.

    ``logits``, ``peer``: float32 ``[n, vocab]``, row ``i`` predicting ``targets[i]``.
    Returns ``top1_agreement`` (fraction of rows with the same argmax), ``ppl`` and
    ``ppl_peer`` (exp of the mean negative log-likelihood of the targets, computed in
    float64) and ``ppl_ratio`` = ``ppl / ppl_peer``.
    """
    targets = np.asarray(targets)

    def nll(lg):
        lg = np.asarray(lg, np.float64)
        m = lg.max(-1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(lg - m).sum(-1))
        return lse - lg[np.arange(len(targets)), targets]
    ppl, ppl_peer = float(np.exp(nll(logits).mean())), float(np.exp(nll(peer).mean()))
    return {"top1_agreement": float((logits.argmax(-1) == peer.argmax(-1)).mean()),
            "ppl": ppl, "ppl_peer": ppl_peer, "ppl_ratio": ppl / ppl_peer}


def text_tokens(tokenizer):
    """``tokens_for(length)``: ``length`` token ids of the bench conversation rendered with the
    chat template (tokenized once), repeated."""
    one = tokenizer.encode_chat([{"role": "user", "content": _QUESTION},
                                 {"role": "assistant", "content": _ANSWER}], add_generation_prompt=False)
    return lambda length: (one * -(-length // len(one)))[:length]


@dataclass
class LengthResult:
    prompt_tokens: int
    lily: list[Sample] = field(default_factory=list)
    peer: list[Sample] = field(default_factory=list)
    first: list[str] = field(default_factory=list)  # which engine ran first, per round

    def median(self, who: str, what: str) -> float:
        return statistics.median(getattr(s, what) for s in getattr(self, who))

    def ratio(self, what: str) -> float:
        p = self.median("peer", what)
        return self.median("lily", what) / p if p > 0 else float("nan")

    def gpu_median(self, what: str) -> float | None:
        """Median of Lily's device-time throughput ``what`` (None unless every sample has it)."""
        v = [getattr(s, what) for s in self.lily]
        return statistics.median(v) if v and None not in v else None


def run_bench(lily: Runner, peer: Runner, tokens_for: Callable[[int], list[int]], *,
              lengths: Sequence[int], decode_tokens: int, rounds: int, exact_warmup: bool = False,
              log: Callable[[str], None] = lambda s: None) -> list[LengthResult]:
    """The timed part of the protocol (module docstring); ``tokens_for(L)`` makes the prompts.
    With ``exact_warmup`` (pplx-garden's contract) each engine first runs every length once
    untimed with the exact prompt and token count, else one short request warms both up."""
    if rounds < 1 or decode_tokens < 2 or not lengths:
        raise InvalidParameterError("rounds >= 1, decode_tokens >= 2 and at least one length are needed")
    if not exact_warmup:
        warm = tokens_for(16)
        lily.run(warm, 2)  # pipelines, kernels and caches warm before anything is timed
        peer.run(warm, 2)
    results = [LengthResult(L) for L in lengths]
    prompts = [tokens_for(L) for L in lengths]
    for r in range(rounds):
        for res, prompt in zip(results, prompts):
            order = (("lily", lily), ("peer", peer)) if r % 2 == 0 else (("peer", peer), ("lily", lily))
            res.first.append(order[0][0])
            for who, runner in order:
                if exact_warmup and r == 0:
                    runner.run(prompt, decode_tokens)
                s = runner.run(prompt, decode_tokens)
                getattr(res, who).append(s)
                log(f"round {r + 1}/{rounds}  {res.prompt_tokens:>6} tokens  {runner.label}: "
                    f"prefill {s.prefill_tps:,.1f} tok/s, decode {s.decode_tps:,.1f} tok/s")
    return results


def consistency(lily: Runner, peer: Runner, tokens: Sequence[int]) -> dict:
    """Teacher-forced agreement over ``len(tokens) - 1`` positions."""
    a, b = lily.logits(tokens), peer.logits(tokens)
    return {"positions": len(tokens) - 1, **teacher_forced(a[:-1], b[:-1], np.asarray(tokens[1:]))}


def report(results: list[LengthResult], lily: Runner, peer: Runner, meta: dict,
           check: dict | None) -> dict:
    """The run as a JSON-ready dict (what ``--json`` writes)."""
    rows = []
    for res in results:
        rows.append({
            "prompt_tokens": res.prompt_tokens,
            "prefill_tps": {"lily": res.median("lily", "prefill_tps"), "mlx_lm": res.median("peer", "prefill_tps"),
                            "ratio": res.ratio("prefill_tps")},
            "decode_tps": {"lily": res.median("lily", "decode_tps"), "mlx_lm": res.median("peer", "decode_tps"),
                           "ratio": res.ratio("decode_tps")},
            # Lily per second of device time (what the GPU took, without the host's share)
            "lily_gpu_tps": {"prefill": res.gpu_median("gpu_prefill_tps"),
                             "decode": res.gpu_median("gpu_decode_tps")},
            "first": ["mlx_lm" if f == "peer" else f for f in res.first],
            "samples": {"lily": [asdict(s) for s in res.lily], "mlx_lm": [asdict(s) for s in res.peer]},
        })
    return {
        **meta, "lily": lily.label, "mlx_lm": peer.label, "lengths": rows,
        # ratios average geometrically: 0.5x and 2x are even, not 1.25x
        "geomean_prefill_ratio": _geomean(r["prefill_tps"]["ratio"] for r in rows),
        "geomean_decode_ratio": _geomean(r["decode_tps"]["ratio"] for r in rows),
        "consistency": check,
    }


def _geomean(values) -> float:
    v = list(values)
    return statistics.geometric_mean(v) if v and all(x > 0 for x in v) else float("nan")


def format_report(rep: dict) -> str:
    out = [f"lily bench: {rep['model']}" + (f" (protocol {rep['protocol']})" if rep.get("protocol") else ""),
           f"  {rep['lily']}  vs  {rep['mlx_lm']}",
           (f"  {rep['rounds']} round{'s' if rep['rounds'] != 1 else ''} (alternating order), median; {rep['generated_tokens']} generated "
            f"tokens per request ({rep['decode_steps']} timed decode steps after the first); "
            "ratio = lily / mlx-lm")]
    if rep.get("notice"):
        out.append(f"  NOTE: {rep['notice']}")
    out.append("")
    out.append(f"{'prompt':>8}  {'prefill tok/s':>28}  {'decode tok/s':>28}")
    out.append(f"{'tokens':>8}  {'lily':>9} {'mlx-lm':>9} {'ratio':>8}  {'lily':>9} {'mlx-lm':>9} {'ratio':>8}")
    for r in rep["lengths"]:
        p, d = r["prefill_tps"], r["decode_tps"]
        out.append(f"{r['prompt_tokens']:>8}  {p['lily']:>9.1f} {p['mlx_lm']:>9.1f} {p['ratio']:>7.2f}x  "
                   f"{d['lily']:>9.1f} {d['mlx_lm']:>9.1f} {d['ratio']:>7.2f}x")
    out.append(f"{'geomean':>8}  {'':>19} {rep['geomean_prefill_ratio']:>7.2f}x  {'':>19} "
               f"{rep['geomean_decode_ratio']:>7.2f}x")
    gpu = [r for r in rep["lengths"] if (r.get("lily_gpu_tps") or {}).get("decode")]
    if gpu:
        out += ["", "lily per second of device time (GPU timestamps; the rest of the wall time is the host's):",
                f"{'prompt':>8}  {'prefill tok/s':>14} {'host share':>10}  {'decode tok/s':>13} {'host share':>10}"]
        for r in gpu:
            g, p, d = r["lily_gpu_tps"], r["prefill_tps"]["lily"], r["decode_tps"]["lily"]
            gp = g["prefill"] or float("nan")
            # at least 0: the first decode step may start on the device before token 0 reaches the host
            out.append(f"{r['prompt_tokens']:>8}  {gp:>14.1f} {max(0.0, 100 * (1 - p / gp)):>9.1f}%  "
                       f"{g['decode']:>13.1f} {max(0.0, 100 * (1 - d / g['decode'])):>9.1f}%")
    c = rep.get("consistency")
    if c:
        out.append("")
        out.append(f"teacher-forced consistency over {c['positions']} positions: same top-1 token at "
                   f"{100 * c['top1_agreement']:.2f}% of positions, perplexity lily / mlx-lm "
                   f"{c['ppl_ratio']:.4f} ({100 * (c['ppl_ratio'] - 1):+.2f}%)")
    return "\n".join(out)


def machine_info(engine=None) -> dict:
    """What the run ran on, for the report: ``chip`` (macOS: machdep.cpu.brand_string, Linux:
    /proc/cpuinfo's model name), ``arch``, ``memory_bytes`` (total RAM), ``os`` (with version);
    with a native ``engine`` also ``gpu_family``, ``tensor_ops`` and ``bfloat_tensor_ops`` of
    its device and the plan it runs: ``prefill_chunk`` (rows, as chosen at load),
    ``gemm_path`` and ``attention_path`` (prefill's GEMMs and attention: "tensor" or "simdgroup"),
    ``state_window`` and ``split_block`` (the runtime options; ``lily estimate --fit`` counts
    the decode step with them).
    The facts come from :func:`lily.lab.system.system_info` (one place)."""
    sysi = system_info()
    info = {k: sysi.get(k) for k in ("chip", "arch", "memory_bytes", "os")}
    dev = getattr(getattr(engine, "backend", None), "device", None)
    if dev is not None and hasattr(dev, "gpu_family"):
        info.update(device=engine.device, device_name=dev.name, gpu_family=dev.gpu_family,
                    tensor_ops=bool(dev.supports_tensor_ops), bfloat_tensor_ops=bool(dev.supports_bfloat_tensor_ops),
                    prefill_chunk=engine.prefill_chunk)
        runtime = getattr(engine.backend, "runtime", None)
        if runtime is not None:
            info["gemm_path"] = "tensor" if runtime.uses_tensor_ops else "simdgroup"
            info["attention_path"] = "tensor" if runtime.uses_tensor_attention else "simdgroup"
        opts = getattr(engine.backend, "options", None)
        if opts is not None:
            info.update(state_window=opts.state_window, split_block=opts.split_block)
    elif engine is not None:
        info["device"] = engine.device
    return info


def bench(path: str | Path | None = None, *, device: str = "auto", lengths: Sequence[int] | None = None,
          decode_tokens: int | None = None, rounds: int | None = None, positions: int | None = None,
          protocol: str = "spec", device_options: dict | None = None,
          log: Callable[[str], None] | None = None) -> dict:
    """Run the whole protocol on one checkpoint (default: the embedded demo model).

    Parameters
    ----------
    lengths : prompt lengths in tokens (default :data:`lily.lab.published.LENGTHS` up to the model's limit;
        with ``protocol="pplx"`` lengths that do not fit the model's limit are dropped and
        listed in the report's ``dropped_lengths``)
    decode_tokens : tokens generated per request (>= 2; default 64). Not accepted with
        ``protocol="pplx"``, which generates the first token and exactly
        :data:`lily.lab.published.PPLX_DECODE_STEPS` more
    rounds : rounds per length, engine order alternating (default 3; pplx: 2, as published)
    positions : teacher-forced positions of the consistency check (0: skip it; default 192,
        pplx: 0)
    protocol : ``"spec"`` (docs/goals.md's protocol: chat-text prompts, one short warm-up) or
        ``"pplx"`` (pplx-garden's published contract: synthetic ids :func:`pplx_prompt`,
        greedy, an exact-shape warm-up per length, prefill = time to the first token, then
        64 timed decode steps)

    Returns the :func:`report` dict. Raises :class:`InvalidParameterError` for invalid
    arguments or when MLX-LM is not installed.
    """
    if protocol not in PROTOCOLS:
        raise InvalidParameterError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    pplx = protocol == "pplx"
    if pplx and decode_tokens is not None:
        raise InvalidParameterError(f"the pplx protocol times exactly {PPLX_DECODE_STEPS} decode steps; "
                                    "decode_tokens cannot be set")
    decode_tokens = PPLX_DECODE_STEPS + 1 if pplx else (64 if decode_tokens is None else decode_tokens)
    rounds = (2 if pplx else 3) if rounds is None else rounds
    positions = (0 if pplx else 192) if positions is None else positions
    if rounds < 1 or decode_tokens < 2:  # before anything loads (run_bench checks the same)
        raise InvalidParameterError(f"rounds must be >= 1 and decode_tokens >= 2, got rounds={rounds}, decode_tokens={decode_tokens}")
    path = Path(path) if path is not None else default_model_path()
    log = log or (lambda s: print(s, file=sys.stderr))
    config = load_config(path)[0]
    limit = config.max_position_embeddings
    clip = pplx or lengths is None
    lengths = list(LENGTHS if lengths is None else lengths)
    if not lengths or any(isinstance(L, bool) or not isinstance(L, int) or L < 1 for L in lengths):
        raise InvalidParameterError(f"lengths must be positive integers, got {lengths!r}")
    dropped = [L for L in lengths if L + decode_tokens > limit] if clip else []
    lengths = [L for L in lengths if L not in dropped]
    if dropped:
        log(f"lily bench: lengths {', '.join(map(str, dropped))} do not fit the model's limit of {limit} tokens "
            "with the generated tokens; dropped")
    if not lengths:
        raise InvalidParameterError(f"no length fits the model's limit of {limit} tokens")
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 0:
        raise InvalidParameterError(f"positions must be an integer >= 0, got {positions!r}")
    max_context = max(max(lengths) + decode_tokens, positions + 1)
    if max_context > limit:
        raise InvalidParameterError(f"the longest request ({max_context} tokens) exceeds the model's "
                                    f"limit of {limit} tokens")
    mlx_lm_modules()  # a missing extra fails here, before Lily's load writes anything
    lily = LilyRunner(path, device, max_context, device_options)
    peer = MlxLmRunner(path)
    if pplx:
        def tokens_for(length):
            return pplx_prompt(length, config.vocab_size)
    else:
        tokens_for = text_tokens(lily.engine.tokenizer)
    notice = None
    if lily.engine.device != "metal" or not peer.on_gpu:
        notice = (f"Lily on device={lily.engine.device}, MLX on the {'GPU' if peer.on_gpu else 'CPU'}: these "
                  "figures test the harness; only device=metal against MLX on the same Mac's GPU measures "
                  "the engines")
        log(f"lily bench: {notice}")
    results = run_bench(lily, peer, tokens_for, lengths=lengths, decode_tokens=decode_tokens,
                        rounds=rounds, exact_warmup=pplx, log=log)
    check = consistency(lily, peer, tokens_for(positions + 1)) if positions else None
    meta = {"model": str(path), "protocol": protocol, "rounds": rounds,
            # per request: the first token (timed with the prefill) and decode_steps timed after it
            "generated_tokens": decode_tokens, "decode_steps": decode_tokens - 1,
            "notice": notice, "machine": machine_info(lily.engine),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if pplx:
        # pplx-garden's published M5 Max table: their engine (also called lily) and MLX-LM
        meta.update(dropped_lengths=dropped,
                    published_m5max={str(L): dict(zip(("pplx_garden_decode", "mlx_lm_decode", "pplx_garden_prefill",
                                                       "mlx_lm_prefill"), v))
                                     for L, v in PPLX_PUBLISHED_M5MAX.items() if L in lengths})
    return report(results, lily, peer, meta, check)
