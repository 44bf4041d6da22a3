"""``lily estimate``: a performance model of a Lily run on an Apple GPU. An ESTIMATE.

No Mac is needed: the real plan is encoded on a record-only simulator (nothing executes)
and every dispatch comes back with its geometry, declared bytes and the cost table's
arithmetic per execution path (csrc/runtime/cost.cpp, the one place that knows each
kernel). Each dispatch is then timed against a machine from :data:`MACHINES`:

* occupancy: a dispatch of ``g`` threadgroups of ``t`` threads uses
  ``min(1, g / cores) * min(1, threads per busy core / SATURATION_THREADS)`` of the GPU and
  gets only that share of bandwidth and of every compute rate;
* roofline: its time is the larger of bytes / (bandwidth x BANDWIDTH_EFFICIENCY x occupancy)
  and the sum over paths of flops / (rate x efficiency x occupancy);
* stages: dispatches of one barrier stage run together; a stage lasts as long as its
  slowest dispatch or the whole stage's bytes and flops at full occupancy, whichever is
  longer, and every stage costs the machine's ``stage_gap`` (calibrated, see
  :data:`STAGE_GAP`).

docs/performance.md states the assumptions, the sources of every figure and how far to
trust the result. The model never measures anything; what a Mac measures wins.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from lily import _core
from lily.checkpoint import ModelConfig, load_config, parse_config
from lily.errors import InvalidParameterError, LilyError
from lily.lab.published import (LENGTHS, PPLX_CODE_SOURCE, PPLX_DECODE_STEPS, PPLX_PUBLISHED_M5MAX,
                                PPLX_STAGES_PER_STEP, PPLX_TABLE_SOURCE)
from lily.native_backend import count_decode_window, count_prefill_chunk, counting_runtime, default_state_window

NOTICE = ("ESTIMATE from a performance model of the recorded plan (lily.lab.estimate, docs/performance.md), "
          "not a measurement")

PATHS = ("alu_f32", "alu_f16", "sgmm_f32", "sgmm_f16", "sgmm_bf16", "tensor_f32", "tensor_f16", "tensor_bf16")

#: Qwen3.6-35B-A3B's text config (config.json of mlx-community/Qwen3.6-35B-A3B-4bit).
QWEN36_35B_A3B = {"model_type": "qwen3_5_moe", "text_config": {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6, "full_attention_interval": 4,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25, "type": "default"}}}
#: How the report names the model when no checkpoint is given.
DEFAULT_MODEL_NAME = "Qwen3.6-35B-A3B (built-in config of mlx-community/Qwen3.6-35B-A3B-4bit)"

# ---- calibration (docs/performance.md, "Calibration") -----------------------------------

#: Fraction of the advertised bandwidth a streaming dispatch reaches. Fitted together with
#: :data:`STAGE_GAP` (:func:`calibrate_reference`) to pplx-garden's published M5 Max decode at
#: ten contexts, 256..128K: their step's bytes grow with the context (bf16 KV cache) while
#: its 425 barrier stages do not, so the contexts tell the two apart (loosely: 0.78..0.83 fit
#: within 1.12%). Near the 0.79 (122 of 153 GB/s) STREAM-style Metal kernels reach on an M5
#: (michaelstinkerings.org, "Apple M5 GPU Roofline Analysis"). Applied to every machine.
BANDWIDTH_EFFICIENCY = 0.805
#: Fraction of the peak a path sustains on our kernels. simdgroup_matrix GEMMs: 80-92% of
#: the ALU peak (philipturner/metal-benchmarks), 0.85 taken; fp32-operand tensor ops are
#: taken to run on the same ALUs alike. Half/bfloat tensor ops: no public sustained figure for
#: quantized-weight GEMMs on M5; 0.6 assumed (consistent with pplx-garden's 4K prefill: its
#: 0.716 s hold the ~20.5 TFLOP of GEMMs, 2 x 2.5e9 active parameters x 4096 tokens, which
#: take 0.48 s at 0.6 of the 71.7 TFLOPS bf16 peak; docs/performance.md). Scalar ALU code: our counts are
#: arithmetic only (no address, compare or shuffle instructions), 0.5 assumed.
PATH_EFFICIENCY = {"alu_f32": 0.5, "alu_f16": 0.5, "sgmm_f32": 0.85, "sgmm_f16": 0.85, "sgmm_bf16": 0.85,
                   "tensor_f32": 0.85, "tensor_f16": 0.6, "tensor_bf16": 0.6}
#: Threads a core needs in flight to reach its peak: 8 simdgroups (8 independent
#: instructions per thread hide the 4-cycle FMA latency, michaelstinkerings.org, M5
#: roofline; 256 threads assumed to cover memory latency too).
SATURATION_THREADS = 256
#: Seconds per barrier stage (dispatch boundary + pipeline drain), fitted with
#: :data:`BANDWIDTH_EFFICIENCY` (:func:`calibrate_reference`): this model times pplx-garden's
#: decode step (:func:`reference_decode_step`) dispatch by dispatch, occupancy included, and
#: the gap is what their measured step time leaves over those times, per stage (relative
#: least squares over the ten contexts: 0.9% rms). If their small grids (the DeltaNet step
#: on 32 threadgroups of 128 threads, single-threadgroup norms) ran at full bandwidth instead
#: of at their occupancy, the same fit would give 0.792 and 3.41 us (docs/performance.md).
#: Used on every machine (no per-machine figure).
STAGE_GAP = 2.25e-6
#: What the calibration is fitted to: pplx-garden's published decode table
#: (:data:`lily.lab.published.PPLX_PUBLISHED_M5MAX`), measured on this machine, and their
#: decode step as read in their source (:mod:`lily.lab.published` holds the figures).
CALIBRATION = {"source": PPLX_TABLE_SOURCE, "code": PPLX_CODE_SOURCE, "machine": "m5max",
               "stages_per_step": PPLX_STAGES_PER_STEP, "decode_steps": PPLX_DECODE_STEPS}


@dataclass(frozen=True)
class Machine:
    """An Apple GPU: ``cores``; ``bandwidth`` bytes/s; ``rates`` peak flop/s per execution
    path (absent: the path does not exist there); ``threadgroup_memory`` bytes per
    threadgroup; ``stage_gap`` seconds per barrier stage; ``gpu_family`` (MTLGPUFamilyAppleN);
    ``sources``: where each figure comes from. The calibration (``stage_gap``,
    ``bandwidth_efficiency``, ``path_efficiency``) is the published one unless
    ``fitted_from`` names the measured run it was fitted to (:func:`fit`), which also pins
    the prefill paths that run used (``gemm``, ``attention``: ``"tensor"`` /
    ``"simdgroup"``; None: the fastest the machine has)."""

    key: str
    name: str
    cores: int
    bandwidth: float
    rates: dict
    threadgroup_memory: int
    gpu_family: int
    sources: dict
    stage_gap: float = STAGE_GAP
    bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY
    path_efficiency: dict = field(default_factory=lambda: dict(PATH_EFFICIENCY))
    fitted_from: str | None = None
    gemm: str | None = None
    attention: str | None = None

    @property
    def tensor_ops(self) -> bool:
        """The prefill GEMMs' tensor-op path (half operands)."""
        return "tensor_f16" in self.rates

    @property
    def tensor_attention(self) -> bool:
        """The prefill attention's tensor-op path (bfloat operands; needs the GEMMs' too)."""
        return self.tensor_ops and "tensor_bf16" in self.rates


def _alu(cores: int, ghz: float, lanes: int = 128) -> float:
    """Peak FMA rate: cores x 128 fp32 lanes x 2 flops x clock (philipturner/metal-benchmarks)."""
    return cores * lanes * 2 * ghz * 1e9


def _machine(key, name, cores, gbs, ghz, family, sources, f16_factor=1.0, matrix_per_core_clk=None):
    f32 = _alu(cores, ghz)
    f16 = f32 * f16_factor
    rates = {"alu_f32": f32, "alu_f16": f16, "sgmm_f32": f32, "sgmm_f16": f16, "sgmm_bf16": f16}
    if matrix_per_core_clk:
        na = cores * matrix_per_core_clk * ghz * 1e9
        rates.update(tensor_f32=f32, tensor_f16=na, tensor_bf16=na)
    return Machine(key, name, cores, gbs * 1e9, rates, 32768, family, sources)


_TG = "32 KiB per threadgroup: Apple Metal feature set tables (maxThreadgroupMemoryLength, Apple7+)"
_NO_NA = "no neural accelerators before M5: tensor ops unavailable (Device::supports_tensor_ops)"
_F16_SAME = "fp16/bf16 ALU and simdgroup_matrix at the fp32 rate: philipturner/metal-benchmarks (F16 is not faster)"
_ZAKHAROKO = ("tzakharko.github.io/apple-neural-accelerators-benchmark (A19 measured: SIMD FP32 1880, FP16 3200, "
              "matrix FP16 7500 GFLOPS on 5 cores; ~1024 FP16 matrix flops per core per clock)")

def _m5_sources(cores: int, gbs: int) -> dict:
    return {
        "cores": f"Apple newsroom, 2026-03 'M5 Pro and M5 Max': up to {cores} GPU cores, a Neural Accelerator in each",
        "bandwidth": f"Apple newsroom, 2026-03: {gbs}GB/s",
        "clock": "~1750 MHz: estimate in " + _ZAKHAROKO + " (M5 Max: 18 TFLOPS fp32, 70 TFLOPS fp16 matrix)",
        "f16": "SIMD fp16 1.7x fp32 (A19 measured 3200 / 1880 GFLOPS): " + _ZAKHAROKO,
        "tensor": ("fp16/bf16 tensor ops 1024 flops/core/clock (bf16 assumed equal to fp16; fp32 operands "
                   "assumed to run at the fp32 SIMD rate): " + _ZAKHAROKO),
        "threadgroup_memory": _TG}


#: The machine table. Flop rates are derived: cores x 128 lanes x 2 x clock; the clocks are
#: public estimates (Apple publishes none), named in ``sources``.
MACHINES = {m.key: m for m in (
    _machine("m1max", "M1 Max (32-core GPU)", 32, 400, 1.296, 7, {
        "cores": "Apple newsroom, 2021-10-18 'Introducing M1 Pro and M1 Max': up to 32 GPU cores",
        "bandwidth": "Apple newsroom, 2021-10-18: 400GB/s",
        "clock": "1296 MHz: philipturner/metal-benchmarks GPU table (10.6 TFLOPS fp32; Apple quotes 10.4)",
        "f16": _F16_SAME, "tensor": _NO_NA, "threadgroup_memory": _TG}),
    _machine("m3max", "M3 Max (40-core GPU)", 40, 400, 1.380, 9, {
        "cores": "Apple newsroom, 2023-10-30 'M3, M3 Pro, M3 Max': up to 40 GPU cores",
        "bandwidth": "Apple M3 Max (16-core CPU / 40-core GPU) tech specs: 400GB/s (macmegasite 2024-10-30 compares)",
        "clock": "1380 MHz: metal-benchmarks-derived GPU table (14.13 TFLOPS fp32 at 40 cores)",
        "f16": _F16_SAME, "tensor": _NO_NA, "threadgroup_memory": _TG}),
    _machine("m4max", "M4 Max (40-core GPU)", 40, 546, 1.578, 9, {
        "cores": "Apple newsroom, 2024-10-30 (MacRumors 'Apple announces M4 Max'): up to 40 GPU cores",
        "bandwidth": "Apple newsroom, 2024-10-30: 546GB/s",
        "clock": "~1578 MHz: commonly cited estimate (techboards.net A19/M5 neural accelerator thread)",
        "f16": _F16_SAME, "tensor": _NO_NA, "threadgroup_memory": _TG}),
    _machine("m5pro", "M5 Pro (20-core GPU)", 20, 307, 1.75, 10, _m5_sources(20, 307),
             f16_factor=1.7, matrix_per_core_clk=1024),
    _machine("m5max", "M5 Max (40-core GPU)", 40, 614, 1.75, 10, _m5_sources(40, 614),
             f16_factor=1.7, matrix_per_core_clk=1024),
)}


def machine(key: str) -> Machine:
    """The machine named ``key`` (:data:`MACHINES`); raises :class:`InvalidParameterError`."""
    try:
        return MACHINES[key]
    except KeyError:
        raise InvalidParameterError(f"unknown machine {key!r} (known: {', '.join(MACHINES)})") from None


class UnknownKernelError(LilyError):
    """The plan dispatches a kernel the cost table (csrc/runtime/cost.cpp) does not know."""


# ---- timing -----------------------------------------------------------------------------


def occupancy(m: Machine, groups: int, threads: int) -> float:
    """Share of ``m`` a dispatch of ``groups`` threadgroups of ``threads`` threads can use:
    the cores it reaches times how full it keeps each of them (:data:`SATURATION_THREADS`)."""
    busy = min(groups, m.cores)
    per_core = groups * threads / busy
    return busy / m.cores * min(1.0, per_core / SATURATION_THREADS)


def _work(rec: dict) -> dict:
    w = rec["work"]
    if w is None:
        raise UnknownKernelError(f"kernel {rec['kernel']!r} ({rec['label']}) has no entry in the cost table "
                                 "(csrc/runtime/cost.cpp); every dispatched kernel needs one")
    return w


def _compute_seconds(m: Machine, flops: dict) -> float:
    s = 0.0
    for path, f in flops.items():
        if not f:
            continue
        rate = m.rates.get(path)
        if rate is None:
            raise InvalidParameterError(f"{m.name} has no {path} path (the plan for another GPU family?)")
        s += f / (rate * m.path_efficiency[path])
    return s


def dispatch_seconds(m: Machine, rec: dict) -> float:
    """Roofline time of one dispatch record at its occupancy (no stage gap)."""
    w = _work(rec)
    occ = occupancy(m, math.prod(rec["groups"]), math.prod(rec["threads"]))
    return max(w["bytes"] / (m.bandwidth * m.bandwidth_efficiency), _compute_seconds(m, w["flops"])) / occ


@dataclass
class Timing:
    """Estimated seconds of a list of records, with the per-family split."""

    seconds: float = 0.0
    stages: int = 0
    bytes: float = 0.0
    families: dict = field(default_factory=lambda: defaultdict(float))

    def add(self, other: Timing, times: float = 1.0) -> None:
        self.seconds += other.seconds * times
        self.stages += round(other.stages * times)
        self.bytes += other.bytes * times
        for k, v in other.families.items():
            self.families[k] += v * times


def time_records(m: Machine, records: list, skip_families: tuple = ()) -> Timing:
    """Estimated time of ``records`` (one command buffer's, in order): per barrier stage the
    slowest dispatch or the stage's total work at full occupancy, plus the stage gap. A
    stage's time is split over families in proportion to their dispatches' times."""
    t = Timing()
    stages: dict = defaultdict(list)
    for r in records:
        w = _work(r)
        if w["family"] in skip_families:
            continue
        stages[(r["pass"], r["stage"])].append(r)
    for recs in stages.values():
        each = [dispatch_seconds(m, r) for r in recs]
        total_bytes = sum(_work(r)["bytes"] for r in recs)
        flops: dict = defaultdict(float)
        for r in recs:
            for p, f in _work(r)["flops"].items():
                flops[p] += f
        full = max(total_bytes / (m.bandwidth * m.bandwidth_efficiency), _compute_seconds(m, flops))
        stage = max(max(each), full) + m.stage_gap
        t.seconds += stage
        t.stages += 1
        t.bytes += total_bytes
        weight = sum(each)
        for r, s in zip(recs, each):
            t.families[_work(r)["family"]] += stage * s / weight
    return t


# ---- the plan ----------------------------------------------------------------------------


def model_config(config: ModelConfig | dict | None = None) -> ModelConfig:
    """``config`` as a :class:`ModelConfig` (default: Qwen3.6-35B-A3B)."""
    if isinstance(config, ModelConfig):
        return config
    return parse_config(config or QWEN36_35B_A3B)


def gemm_path(m: Machine) -> str:
    """Prefill's GEMM kernels on ``m``: the tensor-op twins where there are neural accelerators
    (or the path a fitted run used, :attr:`Machine.gemm`)."""
    return m.gemm or ("tensor" if m.tensor_ops else "simdgroup")


def attention_path(m: Machine) -> str:
    """Prefill attention's kernels on ``m``: the tensor-op twins where bfloat tensor ops exist
    (or the path a fitted run used, :attr:`Machine.attention`)."""
    return m.attention or ("tensor" if m.tensor_attention and gemm_path(m) == "tensor" else "simdgroup")


def decode_step(m: Machine, cfg: ModelConfig, context: int) -> Timing:
    """Estimated time of one decode step at ``context`` tokens already in the cache: the mean
    over one write-back window of steps (:func:`lily.native_backend.count_decode_window`), whose
    Gated DeltaNet steps differ in the state traffic."""
    return mean_timing([time_records(m, c["records"]) for c in count_decode_window(cfg, context)])


def mean_timing(timings: list[Timing]) -> Timing:
    """The mean of ``timings`` (seconds, bytes, families); their stage counts must agree."""
    if len({t.stages for t in timings}) != 1:
        raise ValueError(f"mean_timing: the steps have different stage counts {sorted({t.stages for t in timings})}")
    out = Timing(stages=timings[0].stages)
    for t in timings:
        out.seconds += t.seconds / len(timings)
        out.bytes += t.bytes / len(timings)
        for k, v in t.families.items():
            out.families[k] += v / len(timings)
    return out


_HEAD = ("lm head + sampling",)


def _timing_key(m: Machine) -> tuple:
    # everything a dispatch's time depends on
    return (m.cores, m.bandwidth, tuple(sorted(m.rates.items())), m.stage_gap, m.bandwidth_efficiency,
            tuple(sorted(m.path_efficiency.items())))


def _chunk(m: Machine, cfg: ModelConfig, p0: int, rows: int, head: bool, cache: dict, path: str,
           attention: str) -> Timing:
    # the records depend on the plan only, their timing on the machine and its calibration
    rkey = (repr(cfg), p0, rows, path, attention)
    records = cache.setdefault("records", {})
    if rkey not in records:
        records[rkey] = count_prefill_chunk(cfg, rows, p0, gemm_path=path,
                                            tensor_attention=attention == "tensor")["records"]
    timings = cache.setdefault("timings", {})
    tkey = (_timing_key(m), rkey, head)
    if tkey not in timings:
        timings[tkey] = time_records(m, records[rkey], () if head else _HEAD)
    return timings[tkey]


def prefill(m: Machine, cfg: ModelConfig, prompt: int, chunk: int, cache: dict | None = None,
            path: str | None = None, attention: str | None = None) -> Timing:
    """Estimated time to the first token of a ``prompt``-token prompt run as ``chunk``-row
    chunks (the last with lm_head) on GEMM ``path`` and ``attention`` path (defaults
    :func:`gemm_path`, :func:`attention_path`). Full chunks
    are encoded at a geometric sample of start positions and interpolated linearly in
    between (their cost is linear in the start position within a code path;
    docs/performance.md). ``cache`` (a dict) keeps encoded chunks across calls."""
    cache = {} if cache is None else cache
    path = path or gemm_path(m)
    attention = attention or attention_path(m)
    total = Timing()
    starts = list(range(0, prompt, chunk))
    full = starts[:-1]  # every chunk but the last is full and has no head
    sampled = _geometric(full, chunk) if full else set()
    samples = sorted({p for p in full if p < 8 * chunk or p in sampled} | set(full[-1:]))
    for p in full:
        if p in samples:
            total.add(_chunk(m, cfg, p, chunk, False, cache, path, attention))
            continue
        i = bisect.bisect(samples, p)
        lo, hi = samples[i - 1], samples[i]
        a = (p - lo) / (hi - lo)
        total.add(_chunk(m, cfg, lo, chunk, False, cache, path, attention), 1 - a)
        total.add(_chunk(m, cfg, hi, chunk, False, cache, path, attention), a)
    last = starts[-1]
    total.add(_chunk(m, cfg, last, prompt - last, True, cache, path, attention))
    return total


def _geometric(full: list, chunk: int) -> set:
    out, p = set(), chunk
    while p <= full[-1]:
        out.add(p)
        out.add(p + p // 2 - (p + p // 2) % chunk)
        p *= 2
    return out


def check_length(name: str, n, limit: int, *, kind: str = "prompt") -> None:
    """Raises :class:`InvalidParameterError` naming ``name`` unless ``n`` is a usable length for
    a model of ``limit`` positions (max_position_embeddings): a ``"prompt"`` of ``n`` tokens
    needs ``1 <= n <= limit``; a decode step at ``"context"`` ``n`` writes position ``n``, so
    ``1 <= n < limit``; a ``"chunk"`` needs ``1 <= n <= limit`` (a runtime caps its chunk at
    its context, which is at most the model's)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidParameterError(f"{name} must be a positive integer, got {n!r}")
    top = {"prompt": limit, "context": limit - 1, "chunk": limit}.get(kind)
    if top is not None and n > top:
        raise InvalidParameterError(f"{name} {n} is beyond the model's limit: max_position_embeddings is "
                                    f"{limit}, so at most {top}" + (" (a decode step at context c writes "
                                                                    "position c)" if kind == "context" else ""))


def estimate(machine_key: str | Machine = "m5max", *, config: ModelConfig | dict | None = None,
             contexts=LENGTHS, prompts=LENGTHS, breakdown_at: int = 4096, chunk: int | None = None,
             model_name: str | None = None) -> dict:
    """The estimate report (JSON-ready): decode tok/s at each of ``contexts``, prefill tok/s
    (prompt tokens / time to first token) at each of ``prompts``, the per-family breakdown of
    one decode step and one prefill at ``breakdown_at``, the model (``model_name``, default
    :data:`DEFAULT_MODEL_NAME`), the machine with its sources, and the calibration.
    ``machine_key``: a :data:`MACHINES` key, or a :class:`Machine` (e.g. :func:`fit`'s,
    calibrated on a measured run). ``chunk``: prefill rows per chunk (None or 0: the runtime's automatic choice on a Mac with
    the memory for it, ``RuntimeOptions.AUTO_PREFILL_CHUNKS[0]``; every machine modelled has
    it). The plan reports the prefill scratch that chunk needs (bytes, the runtime's sizing).

    Raises :class:`InvalidParameterError` for an unknown machine, a non-positive length or
    chunk, or a length beyond the model's max_position_embeddings (:func:`check_length`),
    and :class:`UnknownKernelError` if the plan uses a kernel the cost table lacks."""
    m = machine_key if isinstance(machine_key, Machine) else machine(machine_key)
    cfg = model_config(config)
    limit = cfg.max_position_embeddings
    for c in contexts:
        check_length("contexts", c, limit, kind="context")
    for p in prompts:
        check_length("prompts", p, limit)
    check_length("breakdown_at", breakdown_at, limit, kind="context")
    chunk = chunk or min(_core.RuntimeOptions.AUTO_PREFILL_CHUNKS[0], limit)  # the runtime caps it so
    check_length("chunk", chunk, limit, kind="chunk")
    # part of the scratch grows with the context up to a bound (docs/prefill.md): size it as a
    # runtime serving the model's full context does, not one of `chunk` positions
    scratch = counting_runtime(cfg, 4, 8, limit, prefill_chunk=chunk).prefill_scratch_bytes
    decode_rows, prefill_rows, cache = [], [], {}
    for c in contexts:
        t = decode_step(m, cfg, c)
        decode_rows.append({"context": c, "tok_s": 1 / t.seconds, "ms_per_token": t.seconds * 1e3,
                            "stages": t.stages, "gb_per_step": t.bytes / 1e9,
                            "raw_bandwidth_ceiling_tok_s": m.bandwidth / t.bytes})
    for p in prompts:
        t = prefill(m, cfg, p, chunk, cache)
        prefill_rows.append({"prompt": p, "tok_s": p / t.seconds, "seconds": t.seconds, "stages": t.stages,
                             "gb_moved": t.bytes / 1e9})

    def split(t: Timing) -> list:
        return [{"family": k, "ms": v * 1e3, "share": v / t.seconds}
                for k, v in sorted(t.families.items(), key=lambda kv: -kv[1])]

    d = decode_step(m, cfg, breakdown_at)
    p = prefill(m, cfg, breakdown_at, chunk, cache)
    return {
        "estimate": True,
        "notice": NOTICE,
        "model": {"name": model_name or DEFAULT_MODEL_NAME, "model_type": cfg.model_type,
                  "layers": cfg.num_hidden_layers, "experts": cfg.num_experts,
                  "max_position_embeddings": limit},
        "machine": {"key": m.key, "name": m.name, "cores": m.cores, "bandwidth_gb_s": m.bandwidth / 1e9,
                    "tflops": {k: v / 1e12 for k, v in m.rates.items()},
                    "threadgroup_memory": m.threadgroup_memory, "stage_gap_us": m.stage_gap * 1e6,
                    "gpu_family": m.gpu_family, "sources": m.sources},
        "plan": {"prefill_chunk": chunk, "prefill_scratch_bytes": scratch, "gemm_path": gemm_path(m),
                 "attention_path": attention_path(m), "state_window": default_state_window()},
        "calibration": {"bandwidth_efficiency": m.bandwidth_efficiency, "path_efficiency": m.path_efficiency,
                        "saturation_threads": SATURATION_THREADS, "stage_gap_us": m.stage_gap * 1e6,
                        "fitted_from": m.fitted_from,
                        "stage_gap_from": CALIBRATION if m.fitted_from is None else m.fitted_from},
        "decode": decode_rows,
        "prefill": prefill_rows,
        "breakdown": {"at": breakdown_at,
                      "decode": {"ms": d.seconds * 1e3, "families": split(d)},
                      "prefill": {"ms": p.seconds * 1e3, "families": split(p)}},
    }


def format_report(rep: dict) -> str:
    """The report as text tables, headed by the notice that it is an estimate."""
    m = rep["machine"]
    lines = [f"*** {rep['notice']} ***",
             f"model: {rep['model']['name']}",
             (f"{m['name']}: {m['cores']} GPU cores, {m['bandwidth_gb_s']:.0f} GB/s, "
              f"stage gap {m['stage_gap_us']:.2f} us; prefill chunk {rep['plan']['prefill_chunk']} "
              f"(scratch {rep['plan']['prefill_scratch_bytes'] / 2**20:,.0f} MiB), "
              f"GEMM path {rep['plan']['gemm_path']}, attention path {rep['plan']['attention_path']}; "
              f"a decode step is the mean of a {rep['plan']['state_window']}-step state write-back window")]
    c = rep["calibration"]
    if c.get("fitted_from"):
        lines.append(f"calibration fitted to {c['fitted_from']}: bandwidth efficiency "
                     f"{c['bandwidth_efficiency']:.3f}, stage gap {c['stage_gap_us']:.2f} us")
    lines += ["",
             f"{'context':>8} {'decode tok/s':>13} {'ms/token':>9} {'stages':>7} {'GB/step':>8} {'raw-BW ceiling':>15}"]
    for r in rep["decode"]:
        lines.append(f"{r['context']:>8} {r['tok_s']:>13.1f} {r['ms_per_token']:>9.3f} {r['stages']:>7} "
                     f"{r['gb_per_step']:>8.3f} {r['raw_bandwidth_ceiling_tok_s']:>15.1f}")
    lines += ["", f"{'prompt':>8} {'prefill tok/s':>14} {'seconds':>9} {'stages':>7} {'GB moved':>9}"]
    for r in rep["prefill"]:
        lines.append(f"{r['prompt']:>8} {r['tok_s']:>14.1f} {r['seconds']:>9.3f} {r['stages']:>7} "
                     f"{r['gb_moved']:>9.1f}")
    b = rep["breakdown"]
    for phase in ("decode", "prefill"):
        what = "one decode step" if phase == "decode" else "prefill"
        lines += ["", f"{what} at {b['at']}: {b[phase]['ms']:.2f} ms by kernel family"]
        for f in b[phase]["families"]:
            lines.append(f"  {f['family']:<28} {f['ms']:>10.3f} ms {100 * f['share']:>6.1f}%")
    lines += ["", f"*** {rep['notice']} ***"]
    return "\n".join(lines)


# ---- calibration on a measured run (docs/performance.md, "Calibrating on a Mac run") ----

#: The paths whose efficiency the prefill fit scales, per GEMM path of the measured run.
MATRIX_PATHS = {"tensor": ("tensor_f16", "tensor_bf16"), "simdgroup": ("sgmm_f32", "sgmm_f16", "sgmm_bf16")}


def machine_for_chip(chip: str | None) -> str | None:
    """The :data:`MACHINES` key of a chip name such as ``"Apple M5 Max"`` (None if none is).
    The table has one GPU configuration per chip (the largest); a binned chip needs
    ``--machine`` naming a table entry and the fit absorbs the difference."""
    hit = re.search(r"\bM(\d)\s+(Pro|Max)\b", chip) if isinstance(chip, str) else None
    key = f"m{hit.group(1)}{hit.group(2).lower()}" if hit else None
    return key if key in MACHINES else None


def _rms(values) -> float:
    v = list(values)
    return math.sqrt(sum(x * x for x in v) / len(v)) if v else 0.0


def _search(cost, lo: float, hi: float, step: float):
    """The argument in [lo, hi] minimising ``cost`` on a grid of ``step``, refined twice by 10x
    around the best point (the costs here are smooth and unimodal in practice)."""
    best = lo
    for _ in range(3):
        n = int(round((hi - lo) / step))
        best = min((lo + i * step for i in range(n + 1)), key=cost)
        lo, hi, step = max(lo, best - step), min(hi, best + step), step / 10
    return best


def _gap_fit(rows: list, default: float) -> tuple[float, float]:
    """(gap, rms relative error) for ``rows`` of (modelled seconds without stage gaps, stages,
    measured seconds): the gap (at least 0) minimising the relative squared error of
    ``seconds + stages x gap``, in closed form; ``default`` when no row has a stage."""
    num = sum(n * (t - t0) / t ** 2 for t0, n, t in rows)
    den = sum(n ** 2 / t ** 2 for t0, n, t in rows)
    gap = max(0.0, num / den) if den else default
    return gap, _rms((t0 + n * gap - t) / t for t0, n, t in rows)


def _plan_dims(cfg: ModelConfig) -> tuple:
    """The dimensions the plan's dispatches depend on."""
    return (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size, cfg.layer_types)


def _usable(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


#: The throughputs a report may hold (tok/s): far outside anything the model runs at, so a
#: figure beyond them is a damaged report, not a fast or slow Mac.
MIN_TPS, MAX_TPS = 1e-3, 1e7


def _bench_lengths(bench: dict, phase: str) -> tuple[list, bool]:
    """(prompt tokens, Lily's tok/s, Lily's wall-clock tok/s) per length of a ``lily bench
    --json`` report for ``phase`` (``"decode"`` / ``"prefill"``), lengths without a positive
    figure left out, and whether the tok/s are per second of device time (the report's
    ``lily_gpu_tps``, used when every length has it) rather than wall time."""
    rows = []
    for i, row in enumerate(bench.get("lengths") or []):
        try:
            L, wall = row["prompt_tokens"], row[f"{phase}_tps"]["lily"]
        except (KeyError, TypeError):
            raise InvalidParameterError(f"lengths[{i}] of the bench report has no prompt_tokens or "
                                        f"{phase}_tps.lily (not a `lily bench --json` file?)") from None
        g = row.get("lily_gpu_tps")
        gpu = g.get(phase) if isinstance(g, dict) else None
        for what, x in (("lily", wall), ("lily_gpu_tps", gpu)):
            if _usable(x) and not MIN_TPS <= x <= MAX_TPS:
                raise InvalidParameterError(f"lengths[{i}] of the bench report: {phase} {what} {x!r} tok/s is not a "
                                            f"measurement of this model (expected {MIN_TPS:g} to {MAX_TPS:g})")
        if isinstance(L, int) and not isinstance(L, bool) and L > 0 and _usable(wall):
            rows.append((L, gpu, float(wall)))
    device = bool(rows) and all(_usable(g) for _, g, _ in rows)
    return [(L, float(g) if device else w, w) for L, g, w in rows], device


def fit(bench: dict, *, machine_key: str | None = None, config: ModelConfig | dict | None = None,
        source: str = "the bench report") -> tuple[Machine, dict]:
    """Fit the model's calibration to a measured ``lily bench --json`` report of Lily on a Mac's
    GPU (either protocol), so its ESTIMATES for other lengths, machines or plans start from
    that machine's numbers instead of the published calibration.

    The plan is the one the run used (the model ``config``, default Qwen3.6-35B-A3B, the
    report's ``prefill_chunk`` and ``gemm_path``) on ``machine_key`` (default: the report's
    chip, :func:`machine_for_chip`). Three constants are fitted, minimising the relative
    error of the modelled against the measured throughput: per second of device time (the
    report's ``lily_gpu_tps``, GPU timestamps of Lily's command buffers) where every length
    has it, else per second of wall time (the host's share then counts as GPU time):

    * from decode (step time at the mean context of the timed steps, prompt + steps / 2):
      the bandwidth efficiency and the stage gap. Bytes per step grow with the context while
      the stages do not, so two or more lengths separate them; with one length only the gap
      is fitted. The gap absorbs whatever per-step cost the stages do not show (on wall time
      also the host's).
    * from prefill (time to the first token), with those two fixed: the efficiency of the
      run's matrix path (:data:`MATRIX_PATHS`), one factor for its operand types.

    Returns the calibrated :class:`Machine` (for :func:`estimate`) and a JSON-ready report:
    ``constants`` (published and fitted), ``time_basis`` per phase (``"device"`` / ``"wall"``),
    per-length ``decode`` / ``prefill`` rows (measured on that basis, wall-clock,
    published-model and fitted-model tok/s), ``rms_relative_error`` of both models, and
    ``notes``. Raises
    :class:`InvalidParameterError` for a report that is not a Metal run of Lily, has no usable
    length, names an unknown chip without ``machine_key``, was measured on a checkpoint here
    whose dimensions are not ``config``'s, or has lengths beyond the model. The calibrated
    machine keeps the run's prefill paths (:attr:`Machine.gemm`, :attr:`Machine.attention`)."""
    if not isinstance(bench, dict) or "lengths" not in bench:
        raise InvalidParameterError(f"{source} is not a `lily bench --json` report (no 'lengths')")
    info = bench.get("machine") if isinstance(bench.get("machine"), dict) else {}
    if info.get("device") != "metal":
        raise InvalidParameterError(f"{source} measured Lily on device={info.get('device')!r}: only a run on "
                                    "the Metal device (a Mac's GPU) measures what the model describes")
    key = machine_key or machine_for_chip(info.get("chip"))
    if key is None:
        raise InvalidParameterError(f"{source}: chip {info.get('chip')!r} is not in the machine table; name the "
                                    f"closest with --machine ({', '.join(MACHINES)})")
    m0 = machine(key)
    cfg = model_config(config)
    limit = cfg.max_position_embeddings
    steps = bench.get("decode_steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < limit:
        raise InvalidParameterError(f"{source}: decode_steps must be a positive integer below the model's limit of "
                                    f"{limit} tokens, got {steps!r}")
    chunk = info.get("prefill_chunk") or _core.RuntimeOptions.AUTO_PREFILL_CHUNKS[0]
    check_length(f"{source}: machine.prefill_chunk", chunk, limit, kind="chunk")
    path = info.get("gemm_path") or gemm_path(m0)
    if not isinstance(path, str) or path not in MATRIX_PATHS or (path == "tensor" and not m0.tensor_ops):
        raise InvalidParameterError(f"{source}: gemm_path {path!r} is not a path of {m0.name}")
    attention = info.get("attention_path") or attention_path(replace(m0, gemm=path))
    if not isinstance(attention, str) or attention not in MATRIX_PATHS or (
            attention == "tensor" and (path != "tensor" or not m0.tensor_attention)):
        raise InvalidParameterError(f"{source}: attention_path {attention!r} is not a path of {m0.name} with "
                                    f"gemm_path {path!r}")
    decode, dev_decode = _bench_lengths(bench, "decode")
    pre, dev_prefill = _bench_lengths(bench, "prefill")
    decode = [r for r in decode if r[0] + steps < limit]
    pre = [r for r in pre if r[0] <= limit]
    if not decode and not pre:
        raise InvalidParameterError(f"{source} has no length with a measured throughput within the model's "
                                    f"limit of {limit} tokens")
    notes = []
    model = bench.get("model")
    if isinstance(model, str) and model:
        if (Path(model) / "config.json").is_file():
            if _plan_dims(load_config(model)[0]) != _plan_dims(cfg):
                raise InvalidParameterError(f"{source} measured {model}, whose dimensions are not those of the model "
                                            f"estimated; pass that checkpoint as --model (Python: fit(config=...))")
        else:
            notes.append(f"the run's model {model} is not on this machine: its dimensions are taken to be the "
                         "estimated model's (--model names another)")

    # decode: step time = T0(efficiency) + stages x gap, the gap solved in closed form, for the
    # plan the run used (its state_window and split_block when the report has them)
    plan = {}
    for key, lowest, top in (("state_window", 1, _core.RuntimeOptions.MAX_STATE_WINDOW), ("split_block", 0, limit)):
        v = info.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not lowest <= v <= top:
            raise InvalidParameterError(f"{source}: machine.{key} must be an integer from {lowest} to {top}, "
                                        f"got {v!r}")
        plan[key] = v
    ctx = {L: L + steps // 2 for L, _, _ in decode}
    recs = {c: [s["records"] for s in count_decode_window(cfg, c, **plan)] for c in set(ctx.values())}

    def step(m: Machine, c: int) -> Timing:  # the mean step of a write-back window at context c
        return mean_timing([time_records(m, r) for r in recs[c]])

    def decode_fit(e: float):
        m = replace(m0, bandwidth_efficiency=e, stage_gap=0.0)
        rows = [(step(m, ctx[L]), 1 / t) for L, t, _ in decode]
        return _gap_fit([(tm.seconds, tm.stages, t) for tm, t in rows], m0.stage_gap)

    eff, gap = m0.bandwidth_efficiency, m0.stage_gap
    if len(set(ctx.values())) >= 2:
        eff = _search(lambda e: decode_fit(e)[1], 0.30, 1.00, 0.01)
        gap = decode_fit(eff)[0]
        step_bytes = [step(m0, c).bytes for c in recs]
        if max(step_bytes) < 1.5 * min(step_bytes):
            notes.append(f"the decode lengths move {min(step_bytes) / 1e9:.2f} to {max(step_bytes) / 1e9:.2f} GB per "
                         "step: too narrow a spread to tell the bandwidth efficiency from the stage gap well "
                         "(measure 64K and 128K contexts too)")
        if eff in (0.30, 1.00):
            notes.append(f"the bandwidth efficiency hit the bound of its search ({eff:.2f}): the measured decode "
                         "does not scale with the bytes per step as the model does")
    elif decode:
        gap = decode_fit(eff)[0]
        notes.append("one decode length: only the stage gap is fitted (the bandwidth efficiency needs two)")
    else:
        notes.append("no decode figures: the decode constants stay as published")
    if decode and gap == 0.0:
        notes.append("the fitted stage gap is 0: the measured decode is faster than the bytes allow at the fitted "
                     "efficiency (check the report's lengths and steps)")
    m1 = replace(m0, bandwidth_efficiency=eff, stage_gap=gap)

    # prefill: one efficiency for the run's matrix path, the decode constants fixed
    paths, cache = MATRIX_PATHS[path], {}

    def with_matrix(x: float) -> Machine:
        return replace(m1, path_efficiency={**m1.path_efficiency, **{p: x for p in paths}})

    def prefill_err(m: Machine) -> list:
        return [(L / prefill(m, cfg, L, chunk, cache, path, attention).seconds - t) / t for L, t, _ in pre]

    x = m1.path_efficiency[paths[0]]
    if pre:
        x = _search(lambda v: _rms(prefill_err(with_matrix(v))), 0.05, 1.00, 0.05)
        if x in (0.05, 1.00):
            notes.append(f"the matrix efficiency hit the bound of its search ({x:.2f})")
    else:
        notes.append("no prefill figures: the matrix path's efficiency stays as published")
    fitted = replace(with_matrix(x), fitted_from=source, gemm=path, attention=attention)

    def rows_for(pairs, rate):
        return [{"prompt_tokens": L, "measured_tok_s": t, "wall_tok_s": w, "published_model_tok_s": rate(m0, L),
                 "fitted_model_tok_s": rate(fitted, L)} for L, t, w in pairs]

    dec_rows = rows_for(decode, lambda m, L: 1 / step(m, ctx[L]).seconds)
    pre_rows = rows_for(pre, lambda m, L: L / prefill(m, cfg, L, chunk, cache, path, attention).seconds)
    for r in dec_rows:
        r["context"] = ctx[r["prompt_tokens"]]

    def rms(rows, which):
        return _rms((r[which] - r["measured_tok_s"]) / r["measured_tok_s"] for r in rows)

    return fitted, {
        "estimate": True, "notice": NOTICE, "source": source, "machine": {"key": fitted.key, "name": fitted.name},
        "chip": info.get("chip"), "plan": {"prefill_chunk": chunk, "gemm_path": path, "attention_path": attention,
                                           "decode_steps": steps, **plan},
        "constants": {
            "bandwidth_efficiency": {"published": m0.bandwidth_efficiency, "fitted": eff},
            "stage_gap_us": {"published": m0.stage_gap * 1e6, "fitted": gap * 1e6},
            "matrix_efficiency": {"paths": list(paths), "published": m0.path_efficiency[paths[0]], "fitted": x}},
        # what measured_tok_s counts: the device time of Lily's command buffers (GPU timestamps,
        # the report's lily_gpu_tps) or, when the report has none, wall-clock time (host included)
        "time_basis": {"decode": "device" if dev_decode else "wall", "prefill": "device" if dev_prefill else "wall"},
        "decode": dec_rows, "prefill": pre_rows,
        "rms_relative_error": {"decode": {"published": rms(dec_rows, "published_model_tok_s"),
                                          "fitted": rms(dec_rows, "fitted_model_tok_s")},
                               "prefill": {"published": rms(pre_rows, "published_model_tok_s"),
                                           "fitted": rms(pre_rows, "fitted_model_tok_s")}},
        "notes": notes,
    }


def format_fit(f: dict) -> str:
    """:func:`fit`'s result as text: the constants, then measured against modelled throughput."""
    c = f["constants"]
    lines = [f"calibration fitted to {f['source']} ({f['chip'] or 'unknown chip'}, modelled as "
             f"{f['machine']['name']}; prefill chunk {f['plan']['prefill_chunk']}, GEMM path {f['plan']['gemm_path']})",
             f"  bandwidth efficiency  {c['bandwidth_efficiency']['published']:.3f} published -> "
             f"{c['bandwidth_efficiency']['fitted']:.3f} fitted",
             f"  stage gap             {c['stage_gap_us']['published']:.2f} us published -> "
             f"{c['stage_gap_us']['fitted']:.2f} us fitted",
             f"  matrix efficiency     {c['matrix_efficiency']['published']:.3f} published -> "
             f"{c['matrix_efficiency']['fitted']:.3f} fitted ({', '.join(c['matrix_efficiency']['paths'])})"]
    for phase in ("decode", "prefill"):
        if not f[phase]:
            continue
        e, basis = f["rms_relative_error"][phase], f["time_basis"][phase]
        lines += ["", f"{phase} tok/s: measured ({'per second of GPU time' if basis == 'device' else 'wall clock'}) "
                      f"vs model (rms relative error {100 * e['published']:.1f}% published, "
                      f"{100 * e['fitted']:.1f}% fitted)",
                  f"{'prompt':>8} {'measured':>10} {'wall':>10} {'published':>10} {'fitted':>10}"]
        for r in f[phase]:
            lines.append(f"{r['prompt_tokens']:>8} {r['measured_tok_s']:>10.1f} {r['wall_tok_s']:>10.1f} "
                         f"{r['published_model_tok_s']:>10.1f} {r['fitted_model_tok_s']:>10.1f}")
    lines += [f"note: {n}" for n in f["notes"]]
    return "\n".join(lines)


# ---- the published calibration (docs/performance.md, "Calibration") ----------------------


def reference_decode_step(length: int, config: ModelConfig | dict | None = None) -> list:
    """pplx-garden's decode step (perplexityai/pplx-garden, lily/src at f263d07) as records
    :func:`time_records` takes, for a step whose attention covers ``length`` positions: one
    record per dispatch with its barrier stage, grid and the bytes it must move (unique bytes:
    their attention re-reads each KV row from every query head's threadgroup below 8K and
    from two below 32K, counted once, as caches are not modelled). Read from their
    model.rs (``encode_decode_step`` and its branches), kernels/*.rs and metal.rs: one command
    buffer per step with one concurrent-dispatch encoder, every dependency level closed by
    ``memoryBarrierWithScope(Buffers)``; 10 stages per DeltaNet layer, 12 per attention layer
    (split attention and its combine, from 257 positions), 5 around them: 425. Weights as
    stored in the MLX checkpoint (4-bit, group 64, bf16 scales and biases; router and shared
    gate 8-bit), fp32 DeltaNet state and logits, bf16 KV cache. Compute is left out: every
    dispatch is bandwidth-bound at this model's rates."""
    c = model_config(config)
    h, vec = c.hidden_size, 2 * c.hidden_size
    recs: list = []
    stage = [0]

    def q(bits: int, n: int, k: int) -> float:  # codes plus bf16 scale and bias per 64
        return n * k * (bits / 8 + 4 / 64)

    def add(name: str, groups: int, threads: int, nbytes: float, end: bool = False) -> None:
        """One dispatch; ``end``: a memory barrier follows it (the next stage depends on it)."""
        recs.append({"kernel": name, "label": name, "pass": 0, "stage": stage[0], "groups": [groups, 1, 1],
                     "threads": [threads, 1, 1], "work": {"family": "reference", "bytes": nbytes, "flops": {}}})
        stage[0] += end

    hk, hv, dk = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim
    conv, dv = (2 * hk + hv) * dk, hv * c.linear_value_head_dim
    nq, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    e, k, mi, si = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size
    add("embedding row", 8, 32, q(4, 1, h) + vec, end=True)
    add("input norm", 1, 256, 3 * vec, end=True)
    for kind in c.layer_types:
        if kind == "linear_attention":
            rows = conv + dv + 2 * hv  # qkv | z | a | b in one matvec, 2 rows per simdgroup
            add("in_proj", rows // 2, 32, q(4, rows, h) + vec + 2 * rows, end=True)
            kd = c.linear_conv_kernel_dim  # window read and written, taps, input and output
            add("conv step", conv // 256, 256, 2 * conv * (2 * (kd - 1) + kd + 2), end=True)
            add("deltanet step", hv, dk, 2 * hv * dk * dk * 4 + 2 * conv + 4 * dv, end=True)
            add("out_proj", h // 2, 32, q(4, h, dv) + 2 * dv + vec)
        else:
            rows = 2 * nq * d + 2 * nkv * d  # q|gate, k, v in one matvec
            add("qkv_proj", rows // 2, 32, q(4, rows, h) + vec + 2 * rows, end=True)
            add("q norm + rope", nq, 256, 8 * nq * d)
            add("k norm + rope + cache", nkv, 256, 4 * nkv * d)
            add("v to cache", nkv * d // 256, 256, 4 * nkv * d, end=True)
            kv = 4 * nkv * length * d
            if length <= 256:  # one threadgroup per query head, no split
                add("attention", nq, 256, kv + 4 * nq * d, end=True)
            else:
                if length >= 32768:  # 128 blocks, a KV head's 8 query heads in one threadgroup
                    splits, groups, threads = 128, nkv * 128, 128
                else:  # 256-position splits, one query head (four from 8K) per threadgroup
                    splits = -(-length // 256)
                    groups, threads = (nkv * 2 if length >= 8192 else nq) * splits, 256
                part = nq * splits * (d + 2) * 4
                add("attention splits", groups, threads, kv + part + 2 * nq * d, end=True)
                add("attention combine", nq, 256, part + 2 * nq * d, end=True)
            add("sigmoid gate", nq * d // 256, 256, 6 * nq * d, end=True)
            add("o_proj", h // 2, 32, q(4, h, nq * d) + 2 * nq * d + vec)
        stage[0] += 1  # after out_proj / o_proj
        add("residual + norm", 1, 256, 5 * vec, end=True)
        add("router", e, 32, q(8, e, h) + vec + 4 * e)
        add("shared gate|up", si, 32, q(4, 2 * si, h) + vec + 4 * si)
        add("shared gate", 1, 32, q(8, 1, h) + vec + 4, end=True)
        add("top-k", 1, 256, 4 * e + 8 * k)
        add("shared swiglu", -(-si // 256), 256, 6 * si, end=True)
        add("experts gate|up", mi * k, 32, k * q(4, 2 * mi, h) + vec + 2 * k * mi)
        add("shared down", h // 2, 32, q(4, h, si) + 2 * si + vec, end=True)
        add("experts down + combine", h // 2, 32, k * q(4, h, mi) + 2 * k * mi + 2 * vec, end=True)
        add("residual + next norm", 1, 256, 5 * vec, end=True)
    add("lm_head", c.vocab_size, 32, q(4, c.vocab_size, h) + vec + 4 * c.vocab_size, end=True)
    add("argmax partials", 64, 256, 4 * c.vocab_size + 512, end=True)
    add("argmax", 1, 256, 516, end=True)
    return recs


def calibrate_reference(occupancy: bool = True) -> dict:
    """The bandwidth efficiency and stage gap fitted to pplx-garden's published M5 Max decode
    (:data:`CALIBRATION`) with this model timing their step (:func:`reference_decode_step`
    at the mean position of each length's timed steps), as :func:`fit` fits a Lily run: the
    gap in closed form per efficiency, the efficiency by the smallest rms relative error.
    ``occupancy=False`` times every dispatch at full occupancy instead (their step's bytes
    at the bandwidth floor), the bound the published figures allow for a larger gap.
    Returns ``bandwidth_efficiency``, ``stage_gap`` (s), ``rms_relative_error`` and
    per-length ``rows`` (measured and modelled tok/s, stages, bytes per step)."""
    m0 = machine(CALIBRATION["machine"])
    steps = CALIBRATION["decode_steps"]
    measured = {L: row[0] for L, row in PPLX_PUBLISHED_M5MAX.items()}
    base = replace(m0, bandwidth_efficiency=1.0, stage_gap=0.0)
    # position L + steps / 2 attends over one more; no flops, so time scales as 1 / efficiency
    steps_at = {L: reference_decode_step(L + steps // 2 + 1) for L in measured}
    one = {L: (time_records(base, r).seconds if occupancy else sum(x["work"]["bytes"] for x in r) / m0.bandwidth,
               len({x["stage"] for x in r}), sum(x["work"]["bytes"] for x in r)) for L, r in steps_at.items()}

    def at(e: float):
        return _gap_fit([(t / e, n, 1 / measured[L]) for L, (t, n, _) in one.items()], 0.0)

    eff = _search(lambda e: at(e)[1], 0.30, 1.00, 0.01)
    gap, err = at(eff)
    rows = [{"context": L, "measured_tok_s": measured[L], "modelled_tok_s": 1 / (t / eff + n * gap), "stages": n,
             "gb_per_step": b / 1e9} for L, (t, n, b) in one.items()]
    return {"bandwidth_efficiency": eff, "stage_gap": gap, "rms_relative_error": err, "rows": rows}
