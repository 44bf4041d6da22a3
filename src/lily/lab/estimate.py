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
import hashlib
import json
import math
import os
import re
import tempfile
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from lily import _core
from lily.checkpoint import ModelConfig, load_config, parse_config
from lily.errors import InvalidParameterError, LilyError
from lily.lab.published import (LENGTHS, PPLX_CODE_SOURCE, PPLX_DECODE_STEPS, PPLX_PUBLISHED_M5MAX,
                                PPLX_STAGES_PER_STEP, PPLX_TABLE_SOURCE)
from lily.native_backend import (count_batch_window, count_decode_window, count_prefill_chunk, counting_runtime,
                                 default_state_window)

NOTICE = ("ESTIMATE from a performance model of the recorded plan (lily.lab.estimate, docs/performance.md), "
          "not a measurement")

PATHS = _core.COST_PATHS  # the cost table's execution paths (csrc/runtime/cost.h Path)

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

#: Fraction of the advertised bandwidth a streaming dispatch reaches: the likely calibration,
#: fitted together with :data:`STAGE_GAP` (lily.lab.calibration.calibrate_reference) to
#: pplx-garden's published M5 Max decode at ten contexts, 256..128K, their step timed with the
#: likely latency chains under the likely small-grid rule (1.4% rms): their step's bytes grow
#: with the context (bf16 KV cache) while its 425 barrier stages do not, so the contexts tell
#: the two apart, loosely (the other decompositions the data allow are refit for the low and
#: high figures: :func:`scenarios`). Without latency chains the same fit gives 0.792, what
#: STREAM-style Metal kernels reach on an M5 (0.79, 122 of 153 GB/s: michaelstinkerings.org,
#: "Apple M5 GPU Roofline Analysis"); the chains their kernels wait on take part of what was
#: bandwidth. Applied to every machine.
BANDWIDTH_EFFICIENCY = 0.8424
#: Fraction of the peak a path sustains on our kernels (the likely values; ranges in
#: :data:`CONSTANTS`). simdgroup_matrix GEMMs: 80-92% of the ALU peak
#: (philipturner/metal-benchmarks), 0.85 taken; fp32-operand tensor ops are taken to run on the
#: same ALUs alike. Half and bfloat tensor ops (the GEMMs; our prefill GEMMs are bfloat, the
#: engine restatements' half): the likely scenario machine's fit to pplx-garden's published
#: prefill through its kernels' structure (lily.lab.tensor_rate.fit_engine; every scenario
#: machine refits it: :func:`scenarios`), relative to the 71.7 TFLOPS peak (an extrapolation:
#: :data:`MACHINES`' sources), so an effective ~45 TFLOPS; docs/performance.md, "The tensor
#: rate from designs measured on M5". The attention's tensor ops take
#: :data:`ATTENTION_EFFICIENCY`. Scalar ALU code: our counts are arithmetic only (no address,
#: compare or shuffle instructions), 0.5 assumed.
PATH_EFFICIENCY = {"alu_f32": 0.5, "alu_f16": 0.5, "sgmm_f32": 0.85, "sgmm_f16": 0.85, "sgmm_bf16": 0.85,
                   "tensor_f32": 0.85, "tensor_f16": 0.64, "tensor_bf16": 0.64}
#: The tensor paths whose efficiency is fitted (the GEMMs' at :data:`PATH_EFFICIENCY`'s, the
#: attention family's at :data:`ATTENTION_EFFICIENCY`).
TENSOR_PATHS = ("tensor_f16", "tensor_bf16")
#: Fraction of the tensor-op peak the attention's products sustain: the half/bfloat tensor ops
#: of the records of the family "attention" take it instead of :data:`PATH_EFFICIENCY`'s. A
#: tensor efficiency belongs to a kernel's structure (a flash attention's products between its
#: softmax and barriers), not to the operand type, which is bfloat for our GEMMs and attention
#: alike. The likely scenario machine's fit to pplx-garden's flash attention (every scenario
#: machine refits it).
ATTENTION_EFFICIENCY = 0.4
#: Threads a core needs in flight to reach its peak: 8 simdgroups (8 independent
#: instructions per thread hide the 4-cycle FMA latency, michaelstinkerings.org, M5
#: roofline; 256 threads assumed to cover memory latency too).
SATURATION_THREADS = 256
#: Seconds per barrier stage (dispatch boundary + pipeline drain), fitted with
#: :data:`BANDWIDTH_EFFICIENCY`: this model times pplx-garden's decode step
#: (lily.lab.calibration.reference_decode_step) dispatch by dispatch, occupancy and latency
#: chains included, and the gap is what their measured step time leaves over those times, per
#: stage (relative least squares over the ten contexts). Without chains: 2.72 us; under the
#: ``share`` rule 2.15 us, under ``full`` 3.26 us (docs/performance.md). Used on every machine
#: (no per-machine figure).
STAGE_GAP = 2.609e-6
#: The kinds of dependent latency the cost table counts per dispatch (csrc/runtime/cost.h
#: ``Lat``), in its order: a load from DRAM, a load of data the stage before wrote, a
#: threadgroup-memory load, a threadgroup barrier with its exchange, a simdgroup reduction, a
#: dependent ALU step (docs/performance.md, "Latency chains").
LATENCY_KINDS = _core.LATENCY_KINDS
#: Seconds per dependent event of the memory and barrier kinds (the likely values; the ranges
#: are in :data:`CONSTANTS`). Loads: an M1 GPU's pointer chase (Chips and Cheese, "iGPU Cache
#: Setups Compared, Including M1", 2022-05-21, as tabulated in azhirnov/cpu-gpu-arch
#: gpu/Apple-M1.md): L1 43 ns, L2 76 ns, system level cache 266 ns, DRAM 311 ns; taken alike
#: in ns on M5 (no M5 figure is public). ``mem`` (a small vector the previous stage wrote,
#: evicted from the GPU's L2 by the weights streamed since) is taken at the SLC's 266 ns.
#: Threadgroup memory at the L1's 43 ns; a barrier as one exchange through it (write, sync,
#: read) at twice that (assumed).
LATENCY_SECONDS = {"dram": 311e-9, "mem": 266e-9, "local": 43e-9, "barrier": 86e-9}
#: Cycles per dependent event of the instruction kinds, at the machine's clock
#: (philipturner/metal-benchmarks, A14/M1: simd_sum of fp32 27.55 cycles adjusted latency
#: (25.95-29.25 raw), fp32 FADD/FMUL/FFMA and compare-select 4 cycles).
LATENCY_CYCLES = {"reduce": 27.55, "alu": 4.0}
#: Iterations of a run-time-count loop whose loads overlap (Work::loop): how far the compiler
#: unrolls it and issues the next iterations' loads ahead. Apple GPUs issue in order, so 1 is
#: a loop that waits for every iteration's loads; 4 assumed likely (the published decode fits
#: best from 4 up and rules out 1: docs/performance.md, "Latency chains").
LOOP_OVERLAP = 4.0
#: Threads and threadgroup memory a core holds at once, which bound how many threadgroups can
#: hide each other's latency (philipturner/metal-benchmarks, Apple 7/8: 384-3072 threads
#: depending on registers, ~60 KB of threadgroup memory per core). On M5 (Apple 10, dynamic
#: caching) no figure is public; MLX-LM's published prefill bounds it from below: its
#: restatement (lily.lab.tensor_rate) describes the measured curve within 3% only when a core
#: holds five of its 9 KiB GEMM tiles (45 KiB; 5.5-18% rms below). The likely and low
#: figures take that bound, the high figure 64 KiB, until ``lily bench --kernels`` measures
#: it. Issue 27's kernels need at most 13 KiB a threadgroup (the prefill GEMMs' 9 KiB weight
#: tile, as MLX's; the tensor-op attention's 13 KiB; decode attention's 12 KiB), so each runs
#: three to five per core at 45 KiB and the range moves no likely figure by a step
#: (docs/performance.md, "Residency"; :func:`residency` lists them).
THREADS_PER_CORE = 2048
TG_MEMORY_PER_CORE = 45 * 1024
#: How a dispatch that cannot fill the GPU shares its bandwidth (docs/performance.md,
#: "Small grids"): ``share``, the cores it reaches times how full it keeps them;
#: ``core_bandwidth``, each core it reaches draws up to CORE_BYTES_PER_CYCLE per clock (the
#: bandwidth saturates from ~11 cores on an M5 Max); ``full``, every dispatch at full
#: occupancy (the bound the calibration data allow).
OCCUPANCY_RULES = ("share", "core_bandwidth", "full")
#: The likely figure's small-grid rule: ``core_bandwidth`` describes the published decode best
#: (1.36% rms, tied with ``full``; ``share`` 1.46%) and gives the middle figure of the three,
#: so the likely figure is neither the most nor the least favourable reading of the data.
LIKELY_RULE = "core_bandwidth"
#: Lily's host and command-buffer cost per prefill chunk beyond its stage gaps (seconds; the
#: likely value, range in :data:`CONSTANTS`): the engine fits need ~9 ms a chunk for
#: pplx-garden's prefill and 0-8 ms for MLX-LM's (lily.lab.tensor_rate); Lily's chunk driver
#: keeps two chunks' command buffers in flight (runtime.cpp run_chunks), which may hide it all.
CHUNK_OVERHEAD = 5e-3
#: Bytes per clock one core's path to the GPU's memory system carries
#: (philipturner/metal-benchmarks, "On-GPU Data BW/Cycle ~32 B", Apple 7/8).
CORE_BYTES_PER_CYCLE = 32
#: What the calibration is fitted to: pplx-garden's published decode table
#: (:data:`lily.lab.published.PPLX_PUBLISHED_M5MAX`), measured on this machine, and their decode step
#: as read in their source (perplexityai/pplx-garden, lily/ at commit f263d07).
CALIBRATION = {"source": PPLX_TABLE_SOURCE, "code": PPLX_CODE_SOURCE, "machine": "m5max",
               "stages_per_step": PPLX_STAGES_PER_STEP, "decode_steps": PPLX_DECODE_STEPS}


@dataclass(frozen=True)
class Machine:
    """An Apple GPU: ``cores``; ``bandwidth`` bytes/s; ``rates`` peak flop/s per execution
    path (absent: the path does not exist there); ``threadgroup_memory`` bytes per
    threadgroup; ``stage_gap`` seconds per barrier stage; ``gpu_family`` (MTLGPUFamilyAppleN);
    ``sources``: where each figure comes from; ``clock`` Hz. The calibration (``stage_gap``,
    ``bandwidth_efficiency``, ``path_efficiency``) is the published one unless
    ``fitted_from`` names the measured run it was fitted to (:func:`fit`), which also pins
    the prefill paths that run used (``gemm``, ``attention``: ``"tensor"`` /
    ``"simdgroup"``; None: the fastest the machine has). The latency model: ``latency``
    seconds per dependent event of each kind (:data:`LATENCY_KINDS`), ``loop_overlap``,
    ``threads_per_core`` and ``tg_memory_per_core`` (residency), ``saturation_threads`` and
    ``occupancy_rule`` (:data:`OCCUPANCY_RULES`); ``chunk_overhead`` seconds per prefill chunk
    beyond its stages (host, command buffer); their defaults are the likely values.
    ``measured``: the :data:`CONSTANTS` a Mac run fitted (held, not ranged, by
    :func:`scenarios`). ``calibration``: what a scenario machine was fitted to and how well
    (:func:`scenarios`; empty otherwise)."""

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
    attention_efficiency: float = ATTENTION_EFFICIENCY
    fitted_from: str | None = None
    gemm: str | None = None
    attention: str | None = None
    clock: float = 1.0e9
    latency: dict = field(default_factory=dict)
    loop_overlap: float = LOOP_OVERLAP
    threads_per_core: int = THREADS_PER_CORE
    tg_memory_per_core: int = TG_MEMORY_PER_CORE
    saturation_threads: float = SATURATION_THREADS
    occupancy_rule: str = LIKELY_RULE
    measured: tuple = ()
    chunk_overhead: float = CHUNK_OVERHEAD
    calibration: dict = field(default_factory=dict, compare=False)

    @property
    def tensor_ops(self) -> bool:
        """The prefill tensor-op path (bfloat operands: the GEMMs' and the attention's)."""
        return "tensor_bf16" in self.rates

    @property
    def tensor_attention(self) -> bool:
        """The prefill attention's tensor-op path (it follows the GEMMs')."""
        return self.tensor_ops


def _alu(cores: int, ghz: float, lanes: int = 128) -> float:
    """Peak FMA rate: cores x 128 fp32 lanes x 2 flops x clock (philipturner/metal-benchmarks)."""
    return cores * lanes * 2 * ghz * 1e9


def latency_at(clock: float, seconds: dict | None = None, cycles: dict | None = None) -> dict:
    """Seconds per dependent event of each kind (:data:`LATENCY_KINDS`) on a GPU clocked at
    ``clock`` Hz: ``seconds`` for the memory and barrier kinds, ``cycles`` for the
    instruction kinds (defaults :data:`LATENCY_SECONDS`, :data:`LATENCY_CYCLES`)."""
    out = dict(LATENCY_SECONDS if seconds is None else seconds)
    out.update({k: c / clock for k, c in (LATENCY_CYCLES if cycles is None else cycles).items()})
    return out


def _machine(key, name, cores, gbs, ghz, family, sources, f16_factor=1.0, matrix_per_core_clk=None):
    f32 = _alu(cores, ghz)
    f16 = f32 * f16_factor
    rates = {"alu_f32": f32, "alu_f16": f16, "sgmm_f32": f32, "sgmm_f16": f16, "sgmm_bf16": f16}
    if matrix_per_core_clk:
        na = cores * matrix_per_core_clk * ghz * 1e9
        rates.update(tensor_f32=f32, tensor_f16=na, tensor_bf16=na)
    return Machine(key, name, cores, gbs * 1e9, rates, 32768, family, sources, clock=ghz * 1e9,
                   latency=latency_at(ghz * 1e9))


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
    # the smallest Mac Lily supports (its worst case: docs/prefill.md "Command buffers"); the
    # real model does not fit its 16 GB at most, but an M1's GPU time bounds every other Mac's
    _machine("m1", "M1 (8-core GPU)", 8, 68.25, 1.278, 7, {
        "cores": "Apple newsroom, 2020-11-10 'Apple unleashes M1': an 8-core GPU (a 7-core one in some models)",
        "bandwidth": "68.25 GB/s: LPDDR4X-4266 on a 128-bit bus (AnandTech's M1 review, 2020-11-17)",
        "clock": "1278 MHz: philipturner/metal-benchmarks GPU table (2.6 TFLOPS fp32, as Apple quotes)",
        "f16": _F16_SAME, "tensor": _NO_NA, "threadgroup_memory": _TG}),
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
    """Share of ``m``'s compute a dispatch of ``groups`` threadgroups of ``threads`` threads
    can use: the cores it reaches times how full it keeps each of them
    (``m.saturation_threads``). Its share of the bandwidth follows ``m.occupancy_rule``."""
    busy = min(groups, m.cores)
    per_core = groups * threads / busy
    return busy / m.cores * min(1.0, per_core / m.saturation_threads)


def _work(rec: dict) -> dict:
    w = rec["work"]
    if w is None:
        raise UnknownKernelError(f"kernel {rec['kernel']!r} ({rec['label']}) has no entry in the cost table "
                                 "(csrc/runtime/cost.cpp); every dispatched kernel needs one")
    return w


@dataclass
class _Plan:
    """One command buffer's records as arrays (what :func:`time_records` needs of them)."""

    stage: np.ndarray     # dense barrier-stage index per record
    stages: int
    bytes: np.ndarray
    flops: np.ndarray     # [records, PATHS]
    groups: np.ndarray
    threads: np.ndarray
    tg_memory: np.ndarray
    chain: np.ndarray     # [records, LATENCY_KINDS]
    lead: np.ndarray
    loop: np.ndarray
    family: np.ndarray    # index into families
    families: list
    attention: np.ndarray | None = None  # records of the attention family (their tensor paths' efficiency)
    starts: np.ndarray | None = None  # first record of each stage, when each stage's records are contiguous


_PLANS: OrderedDict = OrderedDict()  # id(records) -> (records, skip, plan), the most recent kept


def make_plan(records: list, skip_families: tuple = ()) -> _Plan:
    """One command buffer's dispatch records (the runtime's record dicts: kernel, label, pass,
    stage, groups, threads, work) as the arrays the timing model reads (:func:`dispatch_times`,
    :func:`time_records`), leaving out the records whose work family is in
    ``skip_families``. The plan of the most recently planned ``records`` object is kept and
    returned again for the same object.

    Raises
    ------
    UnknownKernelError
        For a record whose kernel has no entry in the cost table (csrc/runtime/cost.cpp).
    """
    key = (id(records), skip_families)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is records:
        _PLANS.move_to_end(key)
        return hit[1]
    rows = [(r, _work(r)) for r in records]
    rows = [(r, w) for r, w in rows if w["family"] not in skip_families]
    stage_ids: dict = {}
    families: list = []

    def kinds(w, which):
        d = w.get(which) or {}
        return [d.get(k, 0.0) for k in LATENCY_KINDS] if d else [0.0] * len(LATENCY_KINDS)

    plan = _Plan(
        stage=np.array([stage_ids.setdefault((r["pass"], r["stage"]), len(stage_ids)) for r, _ in rows], dtype=np.int64),
        stages=0, bytes=np.array([w["bytes"] for _, w in rows], dtype=float),
        flops=np.array([[w["flops"].get(p, 0.0) for p in PATHS] for _, w in rows], dtype=float).reshape(-1, len(PATHS)),
        groups=np.array([math.prod(r["groups"]) for r, _ in rows], dtype=float),
        threads=np.array([math.prod(r["threads"]) for r, _ in rows], dtype=float),
        tg_memory=np.array([r.get("threadgroup_memory") or 0 for r, _ in rows], dtype=float),
        chain=np.array([kinds(w, "chain") for _, w in rows], dtype=float).reshape(-1, len(LATENCY_KINDS)),
        lead=np.array([kinds(w, "lead") for _, w in rows], dtype=float).reshape(-1, len(LATENCY_KINDS)),
        loop=np.array([kinds(w, "loop") for _, w in rows], dtype=float).reshape(-1, len(LATENCY_KINDS)),
        family=np.array([families.index(w["family"]) if w["family"] in families
                         else families.append(w["family"]) or len(families) - 1 for _, w in rows], dtype=np.int64),
        families=families)
    plan.stages = len(stage_ids)
    plan.attention = np.array([f == "attention" for f in families], dtype=bool)[plan.family] if rows else \
        np.zeros(0, dtype=bool)
    if plan.stages and np.all(np.diff(plan.stage) >= 0):
        plan.starts = np.flatnonzero(np.r_[True, np.diff(plan.stage) > 0])
    _PLANS[key] = (records, plan)
    while len(_PLANS) > 512:
        _PLANS.popitem(last=False)
    return plan


def _compute(m: Machine, flops: np.ndarray, attention: np.ndarray | None = None,
             without: str | None = None) -> np.ndarray:
    """Seconds of arithmetic per record at full occupancy (the paths add: a threadgroup runs
    its dequantization, staging and products one after another). ``attention``: the records
    of the attention family, whose :data:`TENSOR_PATHS` run at
    :attr:`Machine.attention_efficiency`; ``without``: ``"gemms"`` or ``"attention"``, that
    part's :data:`TENSOR_PATHS` work left out (:func:`dispatch_times`)."""
    used = flops.sum(axis=0) > 0
    missing = [p for p, u in zip(PATHS, used) if u and p not in m.rates]
    if missing:
        raise InvalidParameterError(f"{m.name} has no {missing[0]} path (the plan for another GPU family?)")
    tensor = [PATHS.index(p) for p in TENSOR_PATHS]
    per = np.array([1.0 / (m.rates[p] * m.path_efficiency[p]) if p in m.rates else 0.0 for p in PATHS])
    per_att = per.copy()
    per_att[tensor] = [1.0 / (m.rates[p] * m.attention_efficiency) if p in m.rates else 0.0 for p in TENSOR_PATHS]
    if without == "gemms":
        per[tensor] = 0.0
    elif without == "attention":
        per_att[tensor] = 0.0
    if attention is None or not attention.any():
        return flops @ per
    return np.where(attention, flops @ per_att, flops @ per)


def _dispatch_times(m: Machine, plan: _Plan, effs=None, comp=None) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                             np.ndarray]:
    """(time of each dispatch, its lead latency, its bytes time and its compute time at full
    occupancy): the roofline at its occupancy, then the latency chains (docs/performance.md,
    "Latency chains"): a dispatch takes at least its throughput time plus its prologue (all its
    first threadgroups wait at once), and at least as many rounds of one threadgroup's chain
    and own work as a core must run one after another (its threadgroups beyond what the core
    holds at once). ``effs``: bandwidth efficiencies to evaluate at once (the arrays then have
    a column per efficiency); default ``m``'s. ``comp``: compute seconds per record at full
    occupancy [records, columns] instead of ``m``'s (:func:`dispatch_times`)."""
    e = np.atleast_1d(np.asarray(m.bandwidth_efficiency if effs is None else effs, dtype=float))
    mem = plan.bytes[:, None] / (m.bandwidth * e[None, :])
    comp = _compute(m, plan.flops, plan.attention)[:, None] if comp is None else comp
    g = np.maximum(plan.groups, 1.0)
    busy = np.minimum(g, m.cores)
    fill = np.minimum(1.0, g * plan.threads / busy / m.saturation_threads)
    occ = busy / m.cores * fill
    if m.occupancy_rule == "full":
        occ = occ_bw = np.ones_like(occ)
    elif m.occupancy_rule == "core_bandwidth":
        occ_bw = np.minimum(1.0, busy * CORE_BYTES_PER_CYCLE * m.clock / m.bandwidth) * fill
    elif m.occupancy_rule == "share":
        occ_bw = occ
    else:
        raise InvalidParameterError(f"unknown occupancy rule {m.occupancy_rule!r} (known: {', '.join(OCCUPANCY_RULES)})")
    thr = np.maximum(mem / occ_bw[:, None], comp / occ[:, None])
    lat = np.array([m.latency.get(k, 0.0) for k in LATENCY_KINDS])
    loop_lat = lat / max(m.loop_overlap, 1.0)
    lead = (plan.lead @ lat)[:, None]
    chain = (plan.chain @ lat + plan.loop @ loop_lat)[:, None]
    per_core = np.ceil(g / m.cores)[:, None]
    by_threads = np.floor(m.threads_per_core / np.maximum(plan.threads, 1.0))
    by_memory = np.where(plan.tg_memory > 0, np.floor(m.tg_memory_per_core / np.maximum(plan.tg_memory, 1.0)), np.inf)
    slots = np.maximum(1.0, np.minimum(by_threads, by_memory))[:, None]
    waves = np.ceil(per_core / slots)
    t = np.maximum(thr + lead, waves * (chain + thr / per_core))
    return t, lead, mem, comp


def dispatch_times(m: Machine, plan: _Plan, part: str | None = None, values=None) -> np.ndarray:
    """Seconds of each dispatch of ``plan`` (:func:`make_plan`) on ``m`` [records, 1], or with the
    tensor efficiency of ``part`` (``"gemms"``: the :data:`TENSOR_PATHS` work outside the
    attention family; ``"attention"``: the attention family's) at each of ``values`` [records,
    len(values)] (the engine fits of lily.lab.tensor_rate search an efficiency over a grid at
    once)."""
    if part is None:
        return _dispatch_times(m, plan)[0]
    if part not in ("gemms", "attention"):
        raise InvalidParameterError(f"unknown part {part!r} (known: gemms, attention)")
    values = np.atleast_1d(np.asarray(values, dtype=float))
    att = plan.attention if plan.attention is not None else np.zeros(len(plan.bytes), dtype=bool)
    mine = (att if part == "attention" else ~att)[:, None]
    comp = _compute(m, plan.flops, att, without=part)[:, None] + sum(
        np.where(mine, plan.flops[:, PATHS.index(p), None], 0.0) / (m.rates.get(p, math.inf) * values[None, :])
        for p in TENSOR_PATHS)
    return _dispatch_times(m, plan, comp=comp)[0]


def dispatch_seconds(m: Machine, rec: dict) -> float:
    """Time of one dispatch record on ``m`` (no stage gap): the roofline at its occupancy and
    its latency chains (:func:`time_records`)."""
    return float(_dispatch_times(m, make_plan([rec]))[0][0, 0])


def _stages(m: Machine, plan: _Plan, effs=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each stage's time without the gap [stages, effs], each dispatch's time [records,
    effs], the sum of its stage's dispatch times [records, effs]) (:func:`time_records`)."""
    each, lead, mem, comp = _dispatch_times(m, plan, effs)
    comp, lead = np.broadcast_to(comp, each.shape), np.broadcast_to(lead, each.shape)
    if plan.starts is not None:  # records grouped by stage (every plan the runtime records)
        at = plan.starts
        slowest, weight = np.maximum.reduceat(each, at), np.add.reduceat(each, at)
        total_mem, total_comp = np.add.reduceat(mem, at), np.add.reduceat(comp, at)
        first = np.minimum.reduceat(lead, at)
    else:
        shape = (plan.stages, each.shape[1])
        slowest, total_mem, total_comp, weight = (np.zeros(shape) for _ in range(4))
        np.maximum.at(slowest, plan.stage, each)
        np.add.at(total_mem, plan.stage, mem)
        np.add.at(total_comp, plan.stage, comp)
        np.add.at(weight, plan.stage, each)
        first = np.full(shape, np.inf)
        np.minimum.at(first, plan.stage, lead)
    return np.maximum(slowest, np.maximum(total_mem, total_comp) + first), each, weight[plan.stage]


def step_seconds(m: Machine, records: list, effs) -> np.ndarray:
    """Seconds of ``records`` without stage gaps at each bandwidth efficiency of ``effs`` (the
    decode fits search the efficiency and solve the gap in closed form)."""
    plan = make_plan(records)
    return _stages(m, plan, effs)[0].sum(axis=0) if plan.stages else np.zeros(len(np.atleast_1d(effs)))


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
    slowest dispatch (:func:`dispatch_seconds`) or the stage's total work at full occupancy
    plus the shortest prologue of its dispatches, whichever is longer, plus the stage gap. A
    stage's time is split over families in proportion to their dispatches' times."""
    plan = make_plan(records, skip_families)
    t = Timing(stages=plan.stages)
    if not plan.stages:
        return t
    stage, each, w = _stages(m, plan)
    stage, each, w = stage[:, 0] + m.stage_gap, each[:, 0], w[:, 0]
    t.seconds = float(stage.sum())
    t.bytes = float(plan.bytes.sum())
    count = np.bincount(plan.stage, minlength=plan.stages)
    share = np.where(w > 0, stage[plan.stage] * each / np.where(w > 0, w, 1.0), stage[plan.stage] / count[plan.stage])
    per_family = np.zeros(len(plan.families))
    np.add.at(per_family, plan.family, share)
    for name, v in zip(plan.families, per_family):
        t.families[name] += float(v)
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


_WINDOWS: OrderedDict = OrderedDict()


def decode_records(cfg: ModelConfig, context: int) -> list:
    """The records of each step of one write-back window at ``context``
    (:func:`lily.native_backend.count_decode_window`), kept for the next call (the estimate times the
    same steps on many machines)."""
    key = (repr(cfg), context, default_state_window())
    if key not in _WINDOWS:
        _WINDOWS[key] = [c["records"] for c in count_decode_window(cfg, context)]
        while len(_WINDOWS) > 64:
            _WINDOWS.popitem(last=False)
    return _WINDOWS[key]


#: Where :func:`declared_threadgroup_memory` looks: decode windows at these contexts (the
#: direct and the split attention) and prefill chunks of these (rows, start position) (the
#: expert tile heights each chunk size picks, the attention unsplit and split).
TG_MEMORY_DECODE_CONTEXTS = (0, 4096, 131072)
TG_MEMORY_PREFILL_CHUNKS = ((64, 0), (256, 0), (1024, 0), (4096, 0), (4096, 4096), (4096, 126976))


def declared_threadgroup_memory(cfg: ModelConfig | dict | None = None) -> dict[str, int]:
    """Threadgroup memory per kernel of the model's plan as the kernels declare it and the
    estimate's residency (threadgroups per core) takes it, in bytes: the largest over the
    kernel's dispatches in the decode windows and prefill chunks of
    :data:`TG_MEMORY_DECODE_CONTEXTS` / :data:`TG_MEMORY_PREFILL_CHUNKS`, the chunks on both
    GEMM / attention paths (the runtime binds no dynamic threadgroup memory, so this is what a
    GPU compiler's static allocation should be; ``lily doctor`` compares the two). Kernels the
    plan dispatches only elsewhere are not listed. ``cfg``: as :func:`model_config`."""
    cfg = model_config(cfg)
    records = [r for c in TG_MEMORY_DECODE_CONTEXTS for step in decode_records(cfg, c) for r in step]
    for rows, p0 in TG_MEMORY_PREFILL_CHUNKS:
        for path in ("tensor", "simdgroup"):
            records += count_prefill_chunk(cfg, rows, p0, gemm_path=path, tensor_attention=path == "tensor")["records"]
    out: dict[str, int] = {}
    for r in records:
        out[r["kernel"]] = max(out.get(r["kernel"], 0), int(r.get("threadgroup_memory") or 0))
    return out


def decode_step(m: Machine, cfg: ModelConfig, context: int) -> Timing:
    """Estimated time of one decode step at ``context`` tokens already in the cache: the mean
    over one write-back window of steps (:func:`decode_records`), whose Gated DeltaNet steps
    differ in the state traffic."""
    return mean_timing([time_records(m, r) for r in decode_records(cfg, context)])


def batch_records(cfg: ModelConfig, context: int, rows: int) -> list:
    """The records of each step of one write-back window of a batched step of ``rows``
    sequences at ``context`` (:func:`lily.native_backend.count_batch_window`), kept as
    :func:`decode_records` keeps its own."""
    if rows == 1:
        return decode_records(cfg, context)
    key = (repr(cfg), context, default_state_window(), rows)
    if key not in _WINDOWS:
        _WINDOWS[key] = [c["records"] for c in count_batch_window(cfg, context, rows)]
        while len(_WINDOWS) > 64:
            _WINDOWS.popitem(last=False)
    return _WINDOWS[key]


def batch_step(m: Machine, cfg: ModelConfig, context: int, rows: int) -> Timing:
    """Estimated time of one batched decode step of ``rows`` sequences at ``context``
    (continuous batching, docs/decode.md "Batched decode"): the mean over a write-back window."""
    return mean_timing([time_records(m, r) for r in batch_records(cfg, context, rows)])


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
            tuple(sorted(m.path_efficiency.items())), m.attention_efficiency, m.clock, tuple(sorted(m.latency.items())),
            m.loop_overlap,
            m.threads_per_core, m.tg_memory_per_core, m.saturation_threads, m.occupancy_rule)


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


#: The breakdown's name for the per-chunk host cost (:attr:`Machine.chunk_overhead`).
CHUNK_FAMILY = "host, per chunk"


def prefill(m: Machine, cfg: ModelConfig, prompt: int, chunk: int, cache: dict | None = None,
            path: str | None = None, attention: str | None = None) -> Timing:
    """Estimated time to the first token of a ``prompt``-token prompt run as ``chunk``-row
    chunks (the last with lm_head) on GEMM ``path`` and ``attention`` path (defaults
    :func:`gemm_path`, :func:`attention_path`), plus ``m.chunk_overhead`` per chunk. Full chunks
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
    total.seconds += len(starts) * m.chunk_overhead
    total.families[CHUNK_FAMILY] += len(starts) * m.chunk_overhead
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


# ---- an honest estimate: low / likely / high (docs/performance.md, "Low, likely, high") ----


@dataclass(frozen=True)
class Constant:
    """A constant the data do not pin, with the range the estimate's figures take it over:
    ``likely`` (the likely figure's value), ``low`` and ``high`` (the values the low, slow,
    and the high, fast, figures take), ``unit`` and ``source`` of the range."""

    name: str
    likely: float
    low: float
    high: float
    unit: str
    source: str


_LAT = "Chips and Cheese 2022-05-21 (M1 GPU pointer chase; azhirnov/cpu-gpu-arch gpu/Apple-M1.md)"
#: The design-transfer margins: how far a tensor efficiency fitted through pplx-garden's kernels
#: may miss on ours, sized by how far it misses on MLX-LM's (lily.lab.tensor_rate.cross_engine on
#: the likely scenario machine: |MLX-LM's fit / pplx-garden's - 1| for the GEMMs and for the
#: attention's products; docs/performance.md, "Out of sample: across engines").
GEMM_SPREAD = 0.05
ATTENTION_SPREAD = 0.48
#: Where our tensor-op prefill attention lies among the measured designs, as a multiple of
#: pplx-garden's fitted attention efficiency (the likely ``attention_transfer``). Where the
#: GPU's tensor ops hold the fragment layout MLX's NAX kernels rely on (checked in-kernel;
#: the simulator's "nax" layout), the kernel (metal/attention_prefill_tensor.metal) has the
#: structure of MLX's attention_nax_dsplit (simdgroup-scope 16-row products, the head dim split
#: over a pair of simdgroups whose partial scores meet in threadgroup memory, two threadgroup
#: barriers per 32 keys, Q, O, the scores and P in registers, both simdgroups running the
#: softmax; fitted 0.59 on MLX-LM's run): likely MLX's, 1 + ATTENTION_SPREAD. The high end
#: is that give or take the spread of two engines' GEMMs of like structure (GEMM_SPREAD); the
#: low end stays as far below pplx-garden's as before (1 - ATTENTION_SPREAD), which also
#: covers the fallback where the layout differs (scores and P through threadgroup memory, as
#: pplx-garden's flash attention, fitted 0.40). A Mac run's `lily bench --kernels` measures it.
ATTENTION_TRANSFER = 1 + ATTENTION_SPREAD
#: The constants the data do not pin and their ranges. The decode calibration (bandwidth
#: efficiency, stage gap) and the tensor efficiencies of the GEMMs and of the attention are not
#: among them: every scenario machine refits them to pplx-garden's published decode and prefill
#: (:func:`scenarios`), and the transfer margins carry the prefill fit to our kernels.
CONSTANTS = {c.name: c for c in (
    Constant("gemm_transfer", 1.0, 1 - GEMM_SPREAD, 1 + GEMM_SPREAD, "x the fitted GEMM tensor efficiency",
             "design transfer: our GEMMs at the efficiency fitted to pplx-garden's (the design nearest ours), "
             "give or take the spread between pplx-garden's and MLX-LM's fits (lily.lab.tensor_rate.cross_engine)"),
    Constant("attention_transfer", ATTENTION_TRANSFER, 1 - ATTENTION_SPREAD, ATTENTION_TRANSFER * (1 + GEMM_SPREAD),
             "x the fitted attention tensor efficiency",
             "design transfer: our prefill attention has MLX's attention_nax_dsplit structure (simdgroup-scope "
             "products, the head dim split over simdgroup pairs, two barriers per 32 keys, scores and P in registers "
             "where the GPU's tensor ops hold the fragment layout MLX's kernels rely on): MLX's fitted efficiency "
             "(lily.lab.tensor_rate.cross_engine), the high end that plus the GEMMs' cross-engine spread, the low "
             "end the attention spread below pplx-garden's (also the fallback through threadgroup memory where "
             "the layout differs)"),
    Constant("chunk_overhead", CHUNK_OVERHEAD, 10e-3, 0.0, "s per prefill chunk",
             "host and command-buffer cost per chunk beyond the stage gaps: pplx-garden's prefill fit needs ~9 ms, "
             "MLX-LM's 0-8 ms; Lily keeps two chunks in flight (runtime.cpp run_chunks), which may hide it: "
             "0-10 ms, the middle likely"),
    Constant("simdgroup_efficiency", 0.85, 0.80, 0.92, "of the ALU peak",
             "simdgroup_matrix GEMMs sustain 80-92% of the ALU peak (philipturner/metal-benchmarks)"),
    Constant("alu_efficiency", 0.5, 0.35, 0.65, "of the ALU peak",
             "assumed: our counts are arithmetic only (no address, compare or shuffle instructions); +-30%"),
    Constant("saturation_threads", SATURATION_THREADS, 512, 128, "threads per core",
             "8 simdgroups hide the 4-cycle FMA latency (michaelstinkerings.org, M5 roofline); 4 to 16 assumed"),
    Constant("threads_per_core", THREADS_PER_CORE, 1024, 3072, "threads",
             "384-3072 threads per core, by registers (philipturner/metal-benchmarks, Apple 7/8)"),
    Constant("tg_memory_per_core", TG_MEMORY_PER_CORE, 45 * 1024, 64 * 1024, "bytes",
             "unknown on M5: MLX-LM's published prefill needs 45 KiB or more (five of its 9 KiB GEMM tiles; "
             "lily.lab.tensor_rate), ~60 KB on Apple 7/8 (philipturner/metal-benchmarks): the likely and low figures "
             "take 45 KiB, the high 64 KiB, until lily bench --kernels measures it; our 9-13 KiB threadgroups run "
             "3-5 per core at 45 KiB, 5-7 at 64 KiB"),
    Constant("latency_dram", LATENCY_SECONDS["dram"], 400e-9, 266e-9, "s",
             _LAT + ": DRAM 311 ns; 266 ns if the system level cache holds it; 400 ns assumed under load"),
    Constant("latency_mem", LATENCY_SECONDS["mem"], 311e-9, 76e-9, "s",
             _LAT + ": system level cache 266 ns; L2 76 ns; DRAM 311 ns"),
    Constant("latency_local", LATENCY_SECONDS["local"], 60e-9, 20e-9, "s", _LAT + ": L1 43 ns; 20-60 ns assumed"),
    Constant("latency_barrier", LATENCY_SECONDS["barrier"], 170e-9, 43e-9, "s",
             "assumed: one threadgroup-memory exchange (2 x 43 ns); 1x to 4x"),
    Constant("latency_reduce", LATENCY_CYCLES["reduce"], 29.25, 25.95, "cycles",
             "philipturner/metal-benchmarks: simd_sum fp32 25.95-29.25 cycles (A14/M1)"),
    Constant("latency_alu", LATENCY_CYCLES["alu"], 6.0, 3.0, "cycles",
             "philipturner/metal-benchmarks: dependent FADD/FMUL 3-4, FFMA32 up to 6 cycles"),
    Constant("loop_overlap", LOOP_OVERLAP, 2.0, 8.0, "iterations",
             "assumed; the published decode rules out 1 (their combine's loops: rms error 1.8-3.3% against "
             "0.9-1.5% from 2 up; docs/performance.md)"),
)}
#: The constants of our plan alone: pplx-garden's step and prefill, which the scenario machines
#: are fitted to, do not depend on them.
LILY_CONSTANTS = ("gemm_transfer", "attention_transfer", "chunk_overhead")
#: Constants :func:`with_constants` sets that are fitted, not ranged (a Mac run's kernel timings
#: measure them: :data:`KERNEL_CONSTANTS`).
FITTED_CONSTANTS = ("tensor_efficiency", "attention_efficiency")
#: The constants the decode calibration is refit with and whose effect on a figure may go
#: either way through the refit: the scenarios take them at the :data:`LATENCY_POINTS`, with
#: each end of the others, not each at one end.
LATENCY_CONSTANTS = ("latency_dram", "latency_mem", "latency_local", "latency_barrier", "latency_reduce",
                     "latency_alu", "loop_overlap")
#: The latency constants in three groups that move the figures differently through the decode
#: refit: those our kernels wait on most (a prefill GEMM's k loop: DRAM loads and barriers),
#: the load of the stage before's output (pplx-garden's decode step waits on it most: its
#: refit turns implausible when it is slow), and the loop overlap (decode attention's rows).
LATENCY_GROUPS = (("latency_dram", "latency_local", "latency_barrier", "latency_reduce", "latency_alu"),
                  ("latency_mem",), ("loop_overlap",))
#: The points the latency constants take in the low and high scenarios (which end of its range
#: each group takes): all at their low ends, all likely, all at their high ends (where a
#: corner's refit is implausible the figure's extreme may lie between), and the splits with the
#: first group at one end and the others not all with it (where the extremes lie when the
#: refit absorbs the reference step's latencies; tools/estimate_calibration.py corners moves
#: each constant alone off every point).
LATENCY_POINTS = tuple(
    {k: end for group, end in zip(LATENCY_GROUPS, ends) for k in group}
    for ends in (("low",) * 3, ("likely",) * 3, ("high",) * 3,
                 ("low", "high", "high"), ("low", "high", "low"), ("low", "low", "high"),
                 ("high", "low", "low"), ("high", "low", "high"), ("high", "high", "low")))
#: The published runs the calibrations are fitted to (lily.lab.calibration.PUBLISHED_RUNS).
RUNS = ("2026-09-02", "2026-09-01")
#: The largest bandwidth efficiency a decode refit may take and still describe a plausible
#: GPU: STREAM-style Metal kernels reach 0.79 on an M5 (michaelstinkerings.org) and the latency
#: chains priced in the reference step lift the fitted figure by ~0.05 (0.792 -> 0.842 likely);
#: a refit beyond 0.90 credits the memory system with more than any measured kernel shows, so
#: its machine is excluded from the low and high figures (listed, with the reason).
PLAUSIBLE_BANDWIDTH_EFFICIENCY = 0.90


def _fitted(m: Machine, name: str) -> float:
    """The tensor efficiency ``name`` a scenario machine was fitted to (before the design
    transfer), else ``m``'s."""
    fit = (m.calibration or {}).get("prefill") or {}
    return fit.get(name, m.path_efficiency["tensor_bf16"] if name == "tensor_efficiency" else m.attention_efficiency)


def with_constants(m: Machine, values: dict) -> Machine:
    """``m`` with the :data:`CONSTANTS` (or :data:`FITTED_CONSTANTS`) named in ``values`` set
    (the others as in ``m``); a transfer margin multiplies the efficiency ``m`` was fitted to."""
    eff = dict(m.path_efficiency)
    kw: dict = {}
    lat_s = {k: m.latency[k] for k in LATENCY_SECONDS}
    cyc = {k: m.latency[k] * m.clock for k in LATENCY_CYCLES}
    for name, v in values.items():
        if name not in CONSTANTS and name not in FITTED_CONSTANTS:
            raise InvalidParameterError(f"unknown constant {name!r} (known: {', '.join((*CONSTANTS, *FITTED_CONSTANTS))})")
        if name == "tensor_efficiency":
            eff.update(tensor_f16=v, tensor_bf16=v)
        elif name == "attention_efficiency":
            kw["attention_efficiency"] = v
        elif name == "gemm_transfer":
            g = _fitted(m, "tensor_efficiency") * v
            eff.update(tensor_f16=g, tensor_bf16=g)
        elif name == "attention_transfer":
            kw["attention_efficiency"] = _fitted(m, "attention_efficiency") * v
        elif name == "simdgroup_efficiency":
            eff.update(sgmm_f32=v, sgmm_f16=v, sgmm_bf16=v, tensor_f32=v)
        elif name == "alu_efficiency":
            eff.update(alu_f32=v, alu_f16=v)
        elif name.startswith("latency_"):
            kind = name[len("latency_"):]
            (cyc if kind in LATENCY_CYCLES else lat_s)[kind] = v
        else:
            kw[name] = v
    return replace(m, path_efficiency=eff, latency=latency_at(m.clock, lat_s, cyc), **kw)


_SCENARIOS: dict = {}
_CALIBRATIONS: dict = {}  # json [constants, rule, run] -> the reference fits (_reference_fit)
_FITS_STATE = {"loaded": False, "dirty": False}


def fits_cache_file() -> Path:
    """Where the reference fits (:func:`_reference_fit`) are kept between runs:
    ``$LILY_ESTIMATE_CACHE``, else ``$XDG_CACHE_HOME/lily/estimate``, else
    ``~/.cache/lily/estimate``; one file per version of everything they depend on (the sources
    of the model, the restatements and the published tables, numpy's version), so an edit to
    any of them starts afresh."""
    from lily import checkpoint
    from lily.lab import calibration, published, tensor_rate
    root = os.environ.get("LILY_ESTIMATE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / (
        "lily/estimate")
    h = hashlib.sha256(np.__version__.encode())
    for mod in (checkpoint, calibration, published, tensor_rate):
        h.update(Path(mod.__file__).read_bytes())
    h.update(Path(__file__).read_bytes())
    return Path(root) / f"reference-fits-{h.hexdigest()[:20]}.json"


def _load_fits() -> None:
    if _FITS_STATE["loaded"]:
        return
    _FITS_STATE["loaded"] = True
    try:
        _CALIBRATIONS.update({k: v for k, v in json.loads(fits_cache_file().read_text()).items()
                              if k not in _CALIBRATIONS})
    except (OSError, ValueError):
        pass  # no cache yet (or a damaged one): the fits are computed


def _save_fits() -> None:
    """Writes the reference fits when new ones were computed (atomically; an unwritable cache
    directory only costs the next run the time)."""
    if not _FITS_STATE["dirty"]:
        return
    _FITS_STATE["dirty"] = False
    path = fits_cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(_CALIBRATIONS, f)
        os.replace(f.name, path)
    except OSError:
        pass


def _reference_fit(values: dict, rule: str, run: str) -> dict:
    """The calibrations of the machine the published runs measured (:data:`CALIBRATION`) with
    the constants ``values`` and small-grid ``rule``, fitted to pplx-garden's published ``run``:
    the bandwidth efficiency and stage gap to its decode (lily.lab.calibration.calibrate_reference),
    then, with those, the tensor efficiencies of the GEMMs and the attention and a cost per chunk
    to its prefill (lily.lab.tensor_rate.fit_engine), each with its rms and largest relative
    error of the time over the ten lengths."""
    _load_fits()
    key = json.dumps([sorted(values.items()), rule, run])
    if key not in _CALIBRATIONS:
        _FITS_STATE["dirty"] = True
        from lily.lab.calibration import calibrate_reference  # (they import this module)
        from lily.lab.tensor_rate import fit_engine
        ref = with_constants(replace(machine(CALIBRATION["machine"]), occupancy_rule=rule), values)
        dec = calibrate_reference(ref, run)
        ref = replace(ref, bandwidth_efficiency=dec["bandwidth_efficiency"], stage_gap=dec["stage_gap"])
        pre = fit_engine("pplx_garden", ref, run)
        _CALIBRATIONS[key] = {
            "rule": rule, "run": run,
            "decode": {"bandwidth_efficiency": dec["bandwidth_efficiency"], "stage_gap_us": dec["stage_gap"] * 1e6,
                       "rms_relative_error": dec["rms_relative_error"],
                       "max_relative_error": max(abs(r["measured_tok_s"] / r["modelled_tok_s"] - 1) for r in dec["rows"])},
            "prefill": {"engine": "pplx_garden", "tensor_efficiency": pre["tensor_efficiency"],
                        "attention_efficiency": pre["attention_efficiency"], "chunk_ms": pre["chunk_ms"],
                        "rms_relative_error": pre["rms_relative_error"],
                        "max_relative_error": pre["max_relative_error"], "at_bound": pre["at_bound"]}}
    return _CALIBRATIONS[key]


def _implausible(cal: dict) -> str | None:
    """Why a scenario machine's refits describe no plausible GPU (None if they do)."""
    why = []
    dec, pre = cal.get("decode"), cal.get("prefill")
    if dec and dec["bandwidth_efficiency"] > PLAUSIBLE_BANDWIDTH_EFFICIENCY:
        why.append(f"decode refit at bandwidth efficiency {dec['bandwidth_efficiency']:.3f} > "
                   f"{PLAUSIBLE_BANDWIDTH_EFFICIENCY}")
    if pre and pre.get("at_bound"):
        why.append(f"prefill refit at the bound of its search ({', '.join(pre['at_bound'])})")
    return "; ".join(why) or None


def _scenario(m: Machine, values: dict, rule: str, run: str) -> Machine:
    """``m`` with the :data:`CONSTANTS` ``values`` (those ``m`` measured held), small-grid
    ``rule``, and its calibrations refit to the published ``run`` (:func:`scenarios`)."""
    keep = set(m.measured)
    ref_values = {k: v for k, v in values.items() if k not in LILY_CONSTANTS}
    lily = {k: values[k] for k in LILY_CONSTANTS}
    c = with_constants(replace(m, occupancy_rule=rule), {k: v for k, v in ref_values.items() if k not in keep})
    if m.fitted_from is not None:  # the Mac run's own calibration, held
        cal: dict = {"rule": rule, "fitted_from": m.fitted_from}
        g, a = m.path_efficiency["tensor_bf16"], m.attention_efficiency
    else:
        cal = _reference_fit(ref_values, rule, run)
        c = replace(c, bandwidth_efficiency=cal["decode"]["bandwidth_efficiency"],
                    stage_gap=cal["decode"]["stage_gap_us"] * 1e-6)
        g, a = cal["prefill"]["tensor_efficiency"], cal["prefill"]["attention_efficiency"]
    eff, att = dict(c.path_efficiency), c.attention_efficiency
    if "tensor_efficiency" not in keep:
        eff.update(dict.fromkeys(TENSOR_PATHS, g * lily["gemm_transfer"]))
    if "attention_efficiency" not in keep:
        att = a * lily["attention_transfer"]
    cal = {**cal, "transfer": {"gemm": lily["gemm_transfer"], "attention": lily["attention_transfer"]}}
    cal["excluded"] = _implausible(cal)
    return replace(c, path_efficiency=eff, attention_efficiency=att, chunk_overhead=lily["chunk_overhead"],
                   calibration=cal)


_LIKELY: dict = {}


def _scenario_key(m: Machine) -> tuple:
    return _timing_key(m) + (m.key, m.fitted_from, m.gemm, m.attention, m.chunk_overhead, tuple(m.measured))


def likely_machine(m: Machine) -> Machine:
    """The likely scenario machine of ``m`` (:func:`scenarios`' ``"likely"``) alone: every
    constant likely, :data:`LIKELY_RULE`, the calibrations fitted to the primary published run."""
    key = _scenario_key(m)
    if key not in _LIKELY:
        _LIKELY[key] = _scenario(m, {k: c.likely for k, c in CONSTANTS.items()}, LIKELY_RULE, RUNS[0])
        _save_fits()
    return _LIKELY[key]


def scenarios(m: Machine) -> dict:
    """The machines the estimate's figures are taken over (docs/performance.md, "Low, likely,
    high"). ``"likely"``, one machine: every constant at its likely value, the small-grid rule
    :data:`LIKELY_RULE` (:func:`likely_machine`). ``"low"`` and ``"high"``: every
    :data:`CONSTANTS` entry at its low (high) end, except the latency constants, which take each
    of the :data:`LATENCY_POINTS`, each with every small-grid rule (:data:`OCCUPANCY_RULES`)
    and each published run (:data:`RUNS`): 54 machines. Each machine's calibrations are refit with its own constants to the published run
    (:func:`_reference_fit`, on the M5 Max where the runs were measured; then applied to ``m``):
    the decode's bandwidth efficiency and stage gap, and the prefill's tensor efficiencies, which
    our plan takes times the design-transfer margins (``gemm_transfer``, ``attention_transfer``),
    so no constant's end is counted twice and every machine describes the published data it was
    fitted to (``Machine.calibration``). A machine whose refits are implausible
    (:func:`_implausible`) is moved to ``"excluded"`` (kept when every machine of its end is).
    A figure's low (high) value is the smallest (largest) over the low and high machines and
    the likely one. ``m``: the base machine; one fitted to a Mac run (:func:`fit`) keeps its
    fitted decode constants and matrix efficiency in every machine, and the constants a
    kernel-timing run measured (they are measured, not ranged: :attr:`Machine.measured`)."""
    key = _scenario_key(m)
    if key in _SCENARIOS:
        return _SCENARIOS[key]
    out = {"likely": [likely_machine(m)], "excluded": []}
    for end in ("low", "high"):
        base = {k: getattr(c, end) for k, c in CONSTANTS.items() if k not in LATENCY_CONSTANTS}
        every = [_scenario(m, {**base, **{k: getattr(CONSTANTS[k], end) for k, end in point.items()}}, rule, run)
                 for point in LATENCY_POINTS for rule in OCCUPANCY_RULES
                 for run in (RUNS if m.fitted_from is None else RUNS[:1])]  # a fitted machine refits nothing
        plausible = [x for x in every if not x.calibration["excluded"]]
        out[end] = plausible or every
        out["excluded"] += [x for x in every if all(x is not y for y in out[end])]
    _save_fits()
    _SCENARIOS[key] = out
    return out


def per_core(m: Machine, rec: dict) -> int:
    """How many threadgroups of the dispatch ``rec`` a core of ``m`` holds at once: by its
    threads and by its threadgroup memory (the slots of :func:`_dispatch_times`)."""
    threads = math.prod(rec["threads"])
    n = m.threads_per_core // max(threads, 1)
    if rec.get("threadgroup_memory", 0) > 0:
        n = min(n, m.tg_memory_per_core // rec["threadgroup_memory"])
    return max(1, n)


def residency(m: Machine, prefill_records: list, decode_records_: list, other: Machine | None = None) -> list:
    """Per kernel with threadgroup memory in a prefill chunk and a decode step: its
    ``bytes`` per threadgroup and the threadgroups a core of ``m`` holds (``likely``) and of
    ``other`` (``high``: the range's other end of :attr:`Machine.tg_memory_per_core`), largest
    first (docs/performance.md, "Residency")."""
    seen: dict = {}
    for phase, recs in (("prefill", prefill_records), ("decode", decode_records_)):
        for r in recs:
            b = r.get("threadgroup_memory", 0)
            if b > 0 and (phase, r["kernel"]) not in seen:
                row = {"phase": phase, "kernel": r["kernel"], "bytes": b, "per_core": {"likely": per_core(m, r)}}
                if other is not None:
                    row["per_core"]["high"] = per_core(other, r)
                seen[(phase, r["kernel"])] = row
    return sorted(seen.values(), key=lambda r: (-r["bytes"], r["kernel"]))


def spread(values: dict) -> dict:
    """``{"low", "likely", "high"}`` of a figure from its value per scenario machine
    (``{"likely": [v], "low": [...], "high": [...]}``): the likely one, and the smallest and the
    largest of every machine's, the likely one included."""
    likely = values["likely"][0]
    every = [likely, *values["low"], *values["high"]]
    return {"low": min(every), "likely": likely, "high": max(every)}


def _published_ratios(m: Machine) -> dict:
    """The published M5 Max figures a ratio is taken against, per length: ``mlx_lm`` and
    ``pplx_garden``, each (decode, prefill) tok/s (pplx-garden's 2026-09-02 table; none for
    another machine: those figures were measured on an M5 Max)."""
    if m.key != "m5max":
        return {}
    return {L: {"mlx_lm": (v[1], v[3]), "pplx_garden": (v[0], v[2])} for L, v in PPLX_PUBLISHED_M5MAX.items()}


def estimate(machine_key: str | Machine = "m5max", *, config: ModelConfig | dict | None = None,
             contexts=LENGTHS, prompts=LENGTHS, breakdown_at: int = 4096, chunk: int | None = None,
             model_name: str | None = None, batches=(1, 2, 4, 8)) -> dict:
    """The estimate report (JSON-ready): decode tok/s at each of ``contexts``, prefill tok/s
    (prompt tokens / time to first token) at each of ``prompts``, each as ``{"low", "likely",
    "high"}`` over the machines of :func:`scenarios` (docs/performance.md, "Low, likely,
    high"), with the ratios to MLX-LM's and pplx-garden's published M5 Max figures at their
    lengths (``vs_mlx_lm``, ``vs_pplx_garden``; the M5 Max only) and, unless the machine was
    fitted to a Mac run, the likely figure with the high end's threadgroup memory per core
    (``likely_tok_s_high_memory``, docs/performance.md, "Residency"); ``residency``, the
    threadgroups per core of each kernel with threadgroup memory (:func:`residency`); the
    per-family breakdown of
    one decode step and one prefill at ``breakdown_at`` (each family's likely ``ms`` and
    ``share`` of the likely total, and ``ms_range``: its low / likely / high over the scenario
    machines, each family's extremes on their own); the model (``model_name``,
    default :data:`DEFAULT_MODEL_NAME`), the machine with its sources, the calibration and the
    ranges of the constants (:data:`CONSTANTS`); and for each row count of ``batches`` a
    batched step at ``breakdown_at`` (``batched``: aggregate and per-request tok/s, low / likely
    / high, the step's stages and GB, GB per generated token). ``machine_key``: a :data:`MACHINES` key, or a
    :class:`Machine` (e.g. :func:`fit`'s, calibrated on a measured run). ``chunk``: prefill rows
    per chunk (None or 0: the runtime's automatic choice on a Mac with the memory for it,
    ``RuntimeOptions.AUTO_PREFILL_CHUNKS[0]``; every machine modelled has it). The plan reports
    the prefill scratch that chunk needs (bytes, the runtime's sizing).

    Raises :class:`InvalidParameterError` for an unknown machine, a non-positive length or
    chunk, or a length beyond the model's max_position_embeddings (:func:`check_length`),
    and :class:`UnknownKernelError` if the plan uses a kernel the cost table lacks."""
    base = machine_key if isinstance(machine_key, Machine) else machine(machine_key)
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
    sc = scenarios(base)
    m = sc["likely"][0]
    pub = _published_ratios(m)
    cache: dict = {}

    def over(f) -> dict:  # f(machine) per scenario machine
        return {end: [f(x) for x in sc[end]] for end in ("likely", "low", "high")}

    def ratios(row: dict, tps: dict, length: int, phase: int) -> None:
        for who, figures in pub.get(length, {}).items():
            row[f"vs_{who}"] = {k: v / figures[phase] for k, v in tps.items()}

    # the threadgroup memory a core holds is unknown on M5 (docs/performance.md, "Residency"):
    # the likely machine at the range's other end is reported beside it
    other = (None if m.fitted_from is not None or "tg_memory_per_core" in m.measured
             else replace(m, tg_memory_per_core=CONSTANTS["tg_memory_per_core"].high))
    decode_rows, prefill_rows = [], []
    for c in contexts:
        t = decode_step(m, cfg, c)
        secs = spread(over(lambda x, c=c: decode_step(x, cfg, c).seconds))
        row = {"context": c, "tok_s": {k: 1 / secs[j] for k, j in (("low", "high"), ("likely", "likely"),
                                                                   ("high", "low"))},
               "ms_per_token": {k: v * 1e3 for k, v in secs.items()},
               "stages": t.stages, "gb_per_step": t.bytes / 1e9,
               "raw_bandwidth_ceiling_tok_s": m.bandwidth / t.bytes}
        if other is not None:
            row["likely_tok_s_high_memory"] = 1 / decode_step(other, cfg, c).seconds
        ratios(row, row["tok_s"], c, 0)
        decode_rows.append(row)
    for p in prompts:
        t = prefill(m, cfg, p, chunk, cache)
        secs = spread(over(lambda x, p=p: prefill(x, cfg, p, chunk, cache).seconds))
        row = {"prompt": p, "tok_s": {k: p / secs[j] for k, j in (("low", "high"), ("likely", "likely"),
                                                                 ("high", "low"))},
               "seconds": secs, "stages": t.stages, "gb_moved": t.bytes / 1e9}
        if other is not None:
            row["likely_tok_s_high_memory"] = p / prefill(other, cfg, p, chunk, cache).seconds
        ratios(row, row["tok_s"], p, 1)
        prefill_rows.append(row)

    def split(t: Timing, each: dict) -> list:
        # each: the family times of every scenario machine; a family's low and high are its own
        # extremes over them (one family's may come from another machine than the next one's)
        return [{"family": k, "ms": v * 1e3, "share": v / t.seconds,
                 "ms_range": {e: x * 1e3 for e, x in spread({end: [f.get(k, 0.0) for f in fs]
                                                             for end, fs in each.items()}).items()}}
                for k, v in sorted(t.families.items(), key=lambda kv: -kv[1])]

    batch_rows = []
    for b in batches:
        t = batch_step(m, cfg, breakdown_at, b)
        secs = spread(over(lambda x, b=b: batch_step(x, cfg, breakdown_at, b).seconds))
        batch_rows.append({
            "rows": b, "context": breakdown_at,
            "aggregate_tok_s": {k: b / secs[j] for k, j in (("low", "high"), ("likely", "likely"), ("high", "low"))},
            "per_request_tok_s": {k: 1 / secs[j] for k, j in (("low", "high"), ("likely", "likely"), ("high", "low"))},
            "ms_per_step": {k: v * 1e3 for k, v in secs.items()}, "stages": t.stages,
            "gb_per_step": t.bytes / 1e9, "gb_per_token": t.bytes / b / 1e9})
    d = decode_step(m, cfg, breakdown_at)
    p = prefill(m, cfg, breakdown_at, chunk, cache)
    chunk_recs = count_prefill_chunk(cfg, min(chunk, breakdown_at), 0, gemm_path=gemm_path(m),
                                     tensor_attention=attention_path(m) == "tensor")["records"]
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
        "residency": residency(m, chunk_recs, decode_records(cfg, breakdown_at)[0], other),
        "calibration": {"bandwidth_efficiency": m.bandwidth_efficiency, "path_efficiency": m.path_efficiency,
                        "attention_efficiency": m.attention_efficiency,
                        "effective_tflops": ({"gemms": m.rates["tensor_bf16"] * m.path_efficiency["tensor_bf16"] / 1e12,
                                              "attention": m.rates["tensor_bf16"] * m.attention_efficiency / 1e12}
                                             if m.tensor_ops else {}),
                        "saturation_threads": m.saturation_threads, "stage_gap_us": m.stage_gap * 1e6,
                        "latency_s": m.latency, "loop_overlap": m.loop_overlap, "occupancy_rule": m.occupancy_rule,
                        "chunk_overhead_s": m.chunk_overhead, "tg_memory_per_core": m.tg_memory_per_core,
                        "fitted_from": m.fitted_from, "fit": m.calibration,
                        "stage_gap_from": CALIBRATION if m.fitted_from is None else m.fitted_from,
                        "decompositions": {end: [{"bandwidth_efficiency": x.bandwidth_efficiency,
                                                  "stage_gap_us": x.stage_gap * 1e6, "occupancy_rule": x.occupancy_rule,
                                                  "tensor_efficiency": x.path_efficiency["tensor_bf16"],
                                                  "attention_efficiency": x.attention_efficiency,
                                                  "fit": x.calibration}
                                                 for x in machines] for end, machines in sc.items()}},
        "ranges": {k: {"likely": c.likely, "low": c.low, "high": c.high, "unit": c.unit, "source": c.source}
                   for k, c in CONSTANTS.items()},
        "decode": decode_rows,
        "prefill": prefill_rows,
        "batched": batch_rows,
        "breakdown": {"at": breakdown_at,
                      "decode": {"ms": d.seconds * 1e3,
                                 "families": split(d, over(lambda x: dict(decode_step(x, cfg, breakdown_at).families)))},
                      "prefill": {"ms": p.seconds * 1e3, "families": split(p, over(
                          lambda x: dict(prefill(x, cfg, breakdown_at, chunk, cache).families)))}},
    }


def _lmh(f: dict, fmt: str = ".1f") -> str:
    return f"{f['low']:{fmt}} / {f['likely']:{fmt}} / {f['high']:{fmt}}"


def format_report(rep: dict) -> str:
    """The report as text tables, headed by the notice that it is an estimate; every
    throughput and ratio as low / likely / high."""
    m = rep["machine"]
    lines = [f"*** {rep['notice']} ***",
             f"model: {rep['model']['name']}",
             (f"{m['name']}: {m['cores']} GPU cores, {m['bandwidth_gb_s']:.0f} GB/s, "
              f"stage gap {m['stage_gap_us']:.2f} us; prefill chunk {rep['plan']['prefill_chunk']} "
              f"(scratch {rep['plan']['prefill_scratch_bytes'] / 2**20:,.0f} MiB), "
              f"GEMM path {rep['plan']['gemm_path']}, attention path {rep['plan']['attention_path']}; "
              f"a decode step is the mean of a {rep['plan']['state_window']}-step state write-back window"),
             "every figure low / likely / high: the likely constants, and the extremes over their stated "
             "ranges and the decode calibrations the published data allow (docs/performance.md)"]
    c = rep["calibration"]
    lines.append(f"calibration{' fitted to ' + c['fitted_from'] if c.get('fitted_from') else ''} (likely): "
                 f"bandwidth efficiency {c['bandwidth_efficiency']:.3f}, stage gap {c['stage_gap_us']:.2f} us "
                 f"({c['occupancy_rule']} small-grid rule)")
    if c["effective_tflops"]:
        eff = c["path_efficiency"]
        fit = (c.get("fit") or {}).get("prefill")
        lines.append(f"tensor efficiency {eff['tensor_bf16']:.2f} (GEMMs) / {c['attention_efficiency']:.2f} (attention) "
                     f"of {m['tflops']['tensor_bf16']:.1f} TFLOPS: {c['effective_tflops']['gemms']:.1f} / "
                     f"{c['effective_tflops']['attention']:.1f} TFLOPS effective"
                     + (f", from the fit to pplx-garden's published prefill ({100 * fit['rms_relative_error']:.1f}% rms) "
                        "times the design transfers"
                        if fit else ""))
        if fit and rep["plan"]["attention_path"] == "tensor":
            lines.append("  the attention's assumes its scores and P in registers (the GPU's tensor ops holding the "
                         "fragment layout MLX's kernels rely on: `lily doctor` reports it); the threadgroup-memory "
                         "fallback lies within the low end")
    dec = c["decompositions"]
    if dec.get("excluded"):
        lines.append(f"scenario machines: {len(dec['low'])} low, {len(dec['high'])} high; {len(dec['excluded'])} "
                     "excluded as implausible (--json: calibration.decompositions.excluded)")
    def other_end(phase: str, key: str, fmt: str) -> str:
        return ", ".join(f"{format(r['likely_tok_s_high_memory'], fmt)} at {r[key] // 1024}K" for r in rep[phase]
                         if "likely_tok_s_high_memory" in r and r[key] in (4096, 32768, 131072))

    if rep.get("residency"):
        # threadgroups per core at the likely and the high end of the threadgroup memory
        # (docs/performance.md, "Residency")
        groups: dict = {}
        for r in rep["residency"]:
            groups.setdefault((r["phase"], r["bytes"], tuple(r["per_core"].values())), []).append(r["kernel"])
        held = "; ".join(f"{ph} {ks[0] if len(ks) == 1 else f'{ks[0]} and {len(ks) - 1} more'} {b / 1024:.1f} KiB: "
                         f"{' / '.join(map(str, n))}" for (ph, b, n), ks in groups.items())
        hi = CONSTANTS["tg_memory_per_core"].high // 1024
        lines.append(f"residency (threadgroups per core at {c['tg_memory_per_core'] // 1024}"
                     + (f" / {hi} KiB of threadgroup memory, unknown on M5): " if any(
                         "likely_tok_s_high_memory" in r for r in rep["decode"] + rep["prefill"]) else " KiB): ")
                     + held)
    if any("likely_tok_s_high_memory" in r for r in rep["decode"] + rep["prefill"]):
        lines.append(f"  the likely estimate at {hi} KiB: decode {other_end('decode', 'context', '.1f') or '-'}, "
                     f"prefill {other_end('prefill', 'prompt', ',.0f') or '-'} tok/s")
    vs = [w for w in ("mlx_lm", "pplx_garden") if any(f"vs_{w}" in r for r in rep["decode"] + rep["prefill"])]
    head = "".join(f" {'vs ' + w.replace('_', '-'):>20}" for w in vs)
    lines += ["", f"{'context':>8} {'decode tok/s':>23} {'ms/token':>9} {'stages':>7} {'GB/step':>8} "
                  f"{'raw-BW ceiling':>15}{head}"]
    for r in rep["decode"]:
        ratio = "".join(f" {_lmh(r[f'vs_{w}'], '.2f') if f'vs_{w}' in r else '':>20}" for w in vs)
        lines.append(f"{r['context']:>8} {_lmh(r['tok_s']):>23} {r['ms_per_token']['likely']:>9.3f} {r['stages']:>7} "
                     f"{r['gb_per_step']:>8.3f} {r['raw_bandwidth_ceiling_tok_s']:>15.1f}{ratio}")
    lines += ["", f"{'prompt':>8} {'prefill tok/s':>26} {'seconds':>9} {'stages':>7} {'GB moved':>9}{head}"]
    for r in rep["prefill"]:
        ratio = "".join(f" {_lmh(r[f'vs_{w}'], '.2f') if f'vs_{w}' in r else '':>20}" for w in vs)
        lines.append(f"{r['prompt']:>8} {_lmh(r['tok_s'], ',.0f'):>26} {r['seconds']['likely']:>9.3f} "
                     f"{r['stages']:>7} {r['gb_moved']:>9.1f}{ratio}")
    if rep.get("batched"):
        at = rep["batched"][0]["context"]
        lines += ["", f"{'rows':>8} {'aggregate tok/s':>23} {'per request tok/s':>23} {'ms/step':>8} {'stages':>7} "
                      f"{'GB/step':>8} {'GB/token':>9}   (batched decode at {at}: several requests per step)"]
        for r in rep["batched"]:
            lines.append(f"{r['rows']:>8} {_lmh(r['aggregate_tok_s']):>23} {_lmh(r['per_request_tok_s']):>23} "
                         f"{r['ms_per_step']['likely']:>8.3f} {r['stages']:>7} {r['gb_per_step']:>8.3f} "
                         f"{r['gb_per_token']:>9.3f}")
    b = rep["breakdown"]
    for phase in ("decode", "prefill"):
        what = "one decode step" if phase == "decode" else "prefill"
        lines += ["", f"{what} at {b['at']}: {b[phase]['ms']:.2f} ms by kernel family (likely; the share of the "
                      f"likely total; low / high ms: each family's own extremes over the scenario machines)"]
        for f in b[phase]["families"]:
            lines.append(f"  {f['family']:<28} {f['ms']:>10.3f} ms {100 * f['share']:>6.1f}%   "
                         f"{f['ms_range']['low']:.3f} / {f['ms_range']['high']:.3f}")
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


def fit_decode(m: Machine, rows: list, lo: float = 0.30, hi: float = 1.00) -> tuple[float, float, float]:
    """(bandwidth efficiency, stage gap in seconds, rms relative error) of the decode model of
    ``m`` fitted to ``rows`` of (record lists of the steps whose mean is one measured step,
    measured seconds per step): the gap in closed form (relative least squares) at each
    efficiency of a grid from ``lo`` to ``hi`` by 0.01, refined twice by 10x around the best;
    the efficiency by the smallest rms relative error. ``m``'s own efficiency and gap are not
    used."""
    stages = np.array([make_plan(steps[0]).stages for steps, _ in rows], dtype=float)
    measured = np.array([t for _, t in rows], dtype=float)

    def errors(effs):
        base = np.array([np.mean([step_seconds(m, r, effs) for r in steps], axis=0) for steps, _ in rows])
        t = measured[:, None]
        n = stages[:, None]
        den = (n ** 2 / t ** 2).sum(axis=0)
        gap = np.maximum(0.0, (n * (t - base) / t ** 2).sum(axis=0) / den) if den.all() else np.zeros(base.shape[1])
        err = np.sqrt((((base + n * gap - t) / t) ** 2).mean(axis=0))
        return gap, err

    step = 0.01
    for _ in range(3):
        effs = np.arange(lo, hi + step / 2, step)
        gap, err = errors(effs)
        best = int(np.argmin(err))
        eff = float(effs[best])
        lo, hi, step = max(lo, eff - step), min(hi, eff + step), step / 10
    gap, err = errors(np.array([eff]))
    return eff, float(gap[0]), float(err[0])


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


def _metal_run(report: dict, source: str, verb: str, machine_key: str | None) -> tuple[dict, str]:
    """(the report's ``machine`` info, the machine table's key) of a report measured on a Mac's
    GPU; raises :class:`InvalidParameterError` for another device or a chip the table lacks
    without ``machine_key``."""
    info = report.get("machine") if isinstance(report.get("machine"), dict) else {}
    if info.get("device") != "metal":
        raise InvalidParameterError(f"{source} {verb} on device={info.get('device')!r}: only a run on "
                                    "the Metal device (a Mac's GPU) measures what the model describes")
    key = machine_key or machine_for_chip(info.get("chip"))
    if key is None:
        raise InvalidParameterError(f"{source}: chip {info.get('chip')!r} is not in the machine table; name the "
                                    f"closest with --machine ({', '.join(MACHINES)})")
    return info, key


def fit(bench: dict, *, machine_key: str | None = None, config: ModelConfig | dict | None = None,
        source: str = "the bench report", base: Machine | None = None, fixed=()) -> tuple[Machine, dict]:
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
    ``notes``. ``base``: the machine to start from (default the table's for the chip), e.g.
    :func:`fit_kernels`'s; ``fixed``: the constants it measured (:data:`KERNEL_CONSTANTS`
    names), which this fit then leaves alone (the stage gap is always fitted). Raises
    :class:`InvalidParameterError` for a report that is not a Metal run of Lily, has no usable
    length, names an unknown chip without ``machine_key``, was measured on a checkpoint here
    whose dimensions are not ``config``'s, or has lengths beyond the model. The calibrated
    machine keeps the run's prefill paths (:attr:`Machine.gemm`, :attr:`Machine.attention`)."""
    if not isinstance(bench, dict) or "lengths" not in bench:
        raise InvalidParameterError(f"{source} is not a `lily bench --json` report (no 'lengths')")
    info, key = _metal_run(bench, source, "measured Lily", machine_key)
    m0 = base or machine(key)
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
    if decode and "bandwidth_efficiency" in fixed:
        gap = decode_fit(eff)[0]
        notes.append("the bandwidth efficiency is the kernel timings': only the stage gap is fitted")
    elif len(set(ctx.values())) >= 2:
        eff, gap, _ = fit_decode(m0, [(recs[ctx[L]], 1 / t) for L, t, _ in decode])
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

    def with_matrix(x: float) -> Machine:  # the attention's tensor ops scaled with the GEMMs'
        att = x if path == "tensor" else m1.attention_efficiency
        return replace(m1, path_efficiency={**m1.path_efficiency, **{p: x for p in paths}}, attention_efficiency=att)

    def prefill_err(m: Machine) -> list:
        return [(L / prefill(m, cfg, L, chunk, cache, path, attention).seconds - t) / t for L, t, _ in pre]

    x = m1.path_efficiency[paths[0]]
    if pre and ("tensor_efficiency" if path == "tensor" else "simdgroup_efficiency") in fixed:
        notes.append("the matrix efficiency is the kernel timings': not fitted to the prefill")
    elif pre:
        x = _search(lambda v: _rms(prefill_err(with_matrix(v))), 0.05, 1.00, 0.05)
        if x in (0.05, 1.00):
            notes.append(f"the matrix efficiency hit the bound of its search ({x:.2f})")
    else:
        notes.append("no prefill figures: the matrix path's efficiency stays as published")
    matrix = {"tensor": ("tensor_efficiency", "attention_efficiency"), "simdgroup": ("simdgroup_efficiency",)}[path]
    fitted = replace(with_matrix(x), fitted_from=source, gemm=path, attention=attention,
                     measured=tuple(dict.fromkeys((*m0.measured, *(matrix if pre else ())))))

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


# ---- calibration on per-kernel timings: `lily bench --kernels` ----------------------------

#: What a `lily bench --kernels` report says it is (its ``kind``).
KERNELS_KIND = "lily bench --kernels"
#: The constants a kernel-timing report can identify, each with the range searched (a constant
#: is fitted only where some timed kernel's modelled time depends on it; which cases do:
#: docs/performance.md, "Calibrating on a Mac run"). The latencies on a log scale
#: (:data:`KERNEL_LOG_SCALE`). Not here: the threadgroup memory per core (the cases' times
#: step with it, which this search does not fit; a Mac run bounds it through the fractions of
#: peak of the simdgroup GEMMs) and the latencies no case exposes (local, reduce, ALU).
KERNEL_CONSTANTS = {"bandwidth_efficiency": (0.30, 1.00), "tensor_efficiency": (0.05, 1.00),
                    "attention_efficiency": (0.05, 1.00), "simdgroup_efficiency": (0.05, 1.00),
                    "alu_efficiency": (0.05, 1.00), "latency_dram": (3e-8, 3e-6), "latency_mem": (1e-8, 3e-6),
                    "latency_barrier": (5e-9, 1e-6)}
#: The constants of :data:`KERNEL_CONSTANTS` searched on a log scale.
KERNEL_LOG_SCALE = ("latency_dram", "latency_mem", "latency_barrier")


def _with(m: Machine, name: str, v: float) -> Machine:
    return replace(m, bandwidth_efficiency=v) if name == "bandwidth_efficiency" else with_constants(m, {name: v})


def _value(m: Machine, name: str) -> float:
    if name == "bandwidth_efficiency":
        return m.bandwidth_efficiency
    if name.startswith("latency_"):
        return m.latency[name[len("latency_"):]]
    return {"tensor_efficiency": m.path_efficiency["tensor_bf16"], "attention_efficiency": m.attention_efficiency,
            "simdgroup_efficiency": m.path_efficiency["sgmm_f16"], "alu_efficiency": m.path_efficiency["alu_f32"]}[name]


def fit_kernels(report: dict, *, machine_key: str | None = None, source: str = "the kernel report") -> tuple[
        Machine, dict]:
    """Fit the constants a ``lily bench --kernels`` report identifies (:data:`KERNEL_CONSTANTS`):
    each hot kernel timed alone at the model's shapes on a Mac's GPU, one case per command
    buffer (its GPU time), against the model of the case's dispatches (the records the bench
    priced with the cost table; a stage gap between stages when a case has two) plus a fitted
    overhead per command buffer. A constant is identified when the modelled time of some timed
    kernel moves by more than 2% with it (on the bench's cases: bandwidth, the decode cases;
    tensor rates, the tensor path's GEMMs and attention; simdgroup_matrix, that path's GEMMs,
    tail tiles and attention; ALU, the scan and the GEMMs' dequantisation; the DRAM, device
    memory and barrier latencies, the simdgroup path's 16/32-row tail tiles, which hold few
    threadgroups per core); the identified ones are fitted together (coordinate search with a
    line search along each round's step, relative least squares), the others keep the likely
    values. Returns the calibrated :class:`Machine` and a JSON-ready report:
    ``constants`` (likely, fitted or None, the kernels identifying each), ``overhead_us``, per
    kernel ``rows`` (measured, likely-model and fitted-model seconds), ``rms_relative_error``
    and ``notes``. Raises :class:`InvalidParameterError` for a report that is not a Metal run
    of `lily bench --kernels`, names an unknown chip without ``machine_key``, or has no
    usable timing."""
    if not isinstance(report, dict) or report.get("kind") != KERNELS_KIND:
        raise InvalidParameterError(f"{source} is not a `{KERNELS_KIND} --json` report (no kind {KERNELS_KIND!r})")
    info, key = _metal_run(report, source, "timed the kernels", machine_key)
    rows = []
    for i, k in enumerate(report.get("kernels") or []):
        recs, t = (k.get("records"), k.get("median_s")) if isinstance(k, dict) else (None, None)
        if (not isinstance(recs, list) or not recs or not all(isinstance(r, dict) and isinstance(r.get("work"), dict)
                                                              for r in recs) or not _usable(t)):
            raise InvalidParameterError(f"{source}: kernels[{i}] has no priced records or no positive median_s")
        rows.append((k.get("case") or k.get("kernel"), recs, float(t)))
    if not rows:
        raise InvalidParameterError(f"{source} has no timed kernel")
    m0 = likely_machine(machine(key))
    measured = np.array([t for _, _, t in rows])

    def times(m: Machine) -> np.ndarray:  # one command buffer per case: its stages, a gap between them
        t = [time_records(replace(m, stage_gap=0.0), recs) for _, recs, _ in rows]
        return np.array([x.seconds + (x.stages - 1) * m.stage_gap for x in t])

    def err(m: Machine) -> tuple[float, float]:  # (overhead, rms relative error), the overhead in closed form
        t0 = times(m)
        c = max(0.0, float(((measured - t0) / measured ** 2).sum() / (1 / measured ** 2).sum()))
        return c, float(np.sqrt((((t0 + c - measured) / measured) ** 2).mean()))

    base = times(m0)
    identified = {}
    for name in KERNEL_CONSTANTS:
        v = _value(m0, name)
        moved = np.abs(times(_with(m0, name, v * (1.5 if name in KERNEL_LOG_SCALE else 0.8))) / base - 1)
        if moved.max() > 0.02:
            identified[name] = [rows[i][0] for i in np.flatnonzero(moved > 0.02)]

    def coords(x: Machine) -> np.ndarray:  # the search's coordinates: latencies on a log scale
        return np.array([math.log10(_value(x, n)) if n in KERNEL_LOG_SCALE else _value(x, n) for n in identified])

    def at(u) -> Machine:
        x = m0
        for n, v in zip(identified, u):
            lo, hi = KERNEL_CONSTANTS[n]
            x = _with(x, n, min(max(10.0 ** v if n in KERNEL_LOG_SCALE else v, lo), hi))
        return x

    m = m0
    for _ in range(12):  # coordinate search, each round followed by a line search along its step
        before, u0 = err(m)[1], coords(m)
        for name in identified:
            lo, hi = KERNEL_CONSTANTS[name]
            if name in KERNEL_LOG_SCALE:
                x = _search(lambda u, n=name, mm=m: err(_with(mm, n, 10.0 ** u))[1], math.log10(lo), math.log10(hi), 0.1)
                m = _with(m, name, 10.0 ** x)
            else:
                m = _with(m, name, _search(lambda u, n=name, mm=m: err(_with(mm, n, u))[1], lo, hi, 0.05))
        d = coords(m) - u0
        if d.any():  # the valley's direction: constants that trade off move together
            t = _search(lambda t, u0=u0, d=d: err(at(u0 + t * d))[1], 0.0, 8.0, 0.25)
            if err(at(u0 + t * d))[1] < err(m)[1]:
                m = at(u0 + t * d)
        if err(m)[1] > 0.98 * before or err(m)[1] < 1e-4:
            break
    overhead, rms = err(m)
    notes = [f"{name} hit the bound of its search" for name in identified
             if any(math.isclose(_value(m, name), b, rel_tol=1e-6) for b in KERNEL_CONSTANTS[name])]
    notes += [f"no timed kernel depends on {name}: it stays likely" for name in KERNEL_CONSTANTS if name not in identified]
    fitted = replace(m, fitted_from=source, measured=tuple(identified))
    return fitted, {
        "estimate": True, "notice": NOTICE, "source": source, "machine": {"key": key, "name": fitted.name},
        "chip": info.get("chip"),
        "constants": {name: {"likely": _value(m0, name), "fitted": _value(m, name) if name in identified else None,
                             "identified_by": identified.get(name, [])} for name in KERNEL_CONSTANTS},
        "overhead_us": overhead * 1e6,
        "rows": [{"case": c, "kernels": [r.get("kernel") for r in recs], "measured_s": t,
                  "likely_model_s": float(b + err(m0)[0]), "fitted_model_s": float(f + overhead)}
                 for (c, recs, t), b, f in zip(rows, base, times(m))],
        "rms_relative_error": {"likely": err(m0)[1], "fitted": rms},
        "notes": notes}


def format_fit_kernels(f: dict) -> str:
    """:func:`fit_kernels`'s result as text: the constants, then each kernel's time."""
    lines = [f"kernel calibration fitted to {f['source']} ({f['chip'] or 'unknown chip'}, modelled as "
             f"{f['machine']['name']}): overhead per command buffer {f['overhead_us']:.1f} us, rms relative error "
             f"{100 * f['rms_relative_error']['likely']:.1f}% likely -> {100 * f['rms_relative_error']['fitted']:.1f}% "
             "fitted"]
    for name, c in f["constants"].items():
        got = "not identified" if c["fitted"] is None else f"{c['fitted']:.4g} fitted ({', '.join(c['identified_by'])})"
        lines.append(f"  {name:22s} {c['likely']:.4g} likely -> {got}")
    lines += ["", f"{'kernel':44s} {'measured us':>12} {'likely':>10} {'fitted':>10}"]
    for r in f["rows"]:
        lines.append(f"{r['case']:44s} {1e6 * r['measured_s']:>12.1f} {1e6 * r['likely_model_s']:>10.1f} "
                     f"{1e6 * r['fitted_model_s']:>10.1f}")
    lines += [f"note: {n}" for n in f["notes"]]
    return "\n".join(lines)


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
