"""``lily estimate``: a performance model of a Lily run on an Apple GPU. An ESTIMATE.

No Mac is needed: the real plan is encoded on a record-only simulator (nothing executes)
and every dispatch comes back with its geometry, declared bytes and the work table's
arithmetic per execution path (csrc/runtime/work.cpp, the one place that knows each
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
from collections import defaultdict
from dataclasses import dataclass, field

from lily.checkpoint import ModelConfig, parse_config
from lily.errors import InvalidParameterError, LilyError

NOTICE = ("ESTIMATE from a performance model of the recorded plan (lily.perf, docs/performance.md), "
          "not a measurement")

#: Context / prompt lengths reported (pplx-garden's table, restated in docs/goals.md).
LENGTHS = tuple(2 ** i for i in range(8, 18))  # 256 .. 131072

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

#: Fraction of the advertised bandwidth a streaming kernel reaches: 122 of 153 GB/s (79%)
#: measured with STREAM-style Metal kernels on an M5 (michaelstinkerings.org, "Apple M5 GPU
#: Roofline Analysis"); applied to every machine.
BANDWIDTH_EFFICIENCY = 0.79
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
#: Seconds per barrier stage (dispatch boundary + pipeline drain), calibrated on
#: pplx-garden's M5 Max decode at 4K (182.8 tok/s = 5.4705 ms per step) with their ~425
#: barrier stages per step (issue 11's review count): the step's bytes (our plan's 1.896 GB
#: at 4K, taken as theirs: same model and quantization) at 614 GB/s x 0.79 take 3.910 ms,
#: leaving 1.561 ms over 425 stages = 3.67 us. Used on every machine (no per-machine figure).
STAGE_GAP = 3.67e-6
#: The published figures the calibration uses (pplx-garden lily/docs/2026-09-02-performance-mlx-0.32.2.md).
CALIBRATION = {"decode_tok_s_4k": 182.8, "stages_per_step": 425, "bytes_per_step_4k": 1.896e9,
               "machine": "m5max"}


@dataclass(frozen=True)
class Machine:
    """An Apple GPU: ``cores``; ``bandwidth`` bytes/s; ``rates`` peak flop/s per execution
    path (absent: the path does not exist there); ``threadgroup_memory`` bytes per
    threadgroup; ``stage_gap`` seconds per barrier stage; ``gpu_family`` (MTLGPUFamilyAppleN);
    ``sources``: where each figure comes from."""

    key: str
    name: str
    cores: int
    bandwidth: float
    rates: dict
    threadgroup_memory: int
    gpu_family: int
    sources: dict
    stage_gap: float = STAGE_GAP

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
    """The plan dispatches a kernel the work table (csrc/runtime/work.cpp) does not know."""


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
        raise UnknownKernelError(f"kernel {rec['kernel']!r} ({rec['label']}) has no entry in the work table "
                                 "(csrc/runtime/work.cpp); every dispatched kernel needs one")
    return w


def _compute_seconds(m: Machine, flops: dict) -> float:
    s = 0.0
    for path, f in flops.items():
        if not f:
            continue
        rate = m.rates.get(path)
        if rate is None:
            raise InvalidParameterError(f"{m.name} has no {path} path (the plan for another GPU family?)")
        s += f / (rate * PATH_EFFICIENCY[path])
    return s


def dispatch_seconds(m: Machine, rec: dict) -> float:
    """Roofline time of one dispatch record at its occupancy (no stage gap)."""
    w = _work(rec)
    occ = occupancy(m, math.prod(rec["groups"]), math.prod(rec["threads"]))
    return max(w["bytes"] / (m.bandwidth * BANDWIDTH_EFFICIENCY), _compute_seconds(m, w["flops"])) / occ


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
        full = max(total_bytes / (m.bandwidth * BANDWIDTH_EFFICIENCY), _compute_seconds(m, flops))
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
    """Prefill's GEMM kernels on ``m``: the tensor-op twins where there are neural accelerators."""
    return "tensor" if m.tensor_ops else "simdgroup"


def decode_step(m: Machine, cfg: ModelConfig, context: int) -> Timing:
    """Estimated time of one decode step at ``context`` tokens already in the cache."""
    from lily.native import count_decode_step
    return time_records(m, count_decode_step(cfg, context)["records"])


_HEAD = ("lm head + sampling",)


def _chunk(m: Machine, cfg: ModelConfig, p0: int, rows: int, head: bool, cache: dict) -> Timing:
    key = (p0, rows, head)
    if key not in cache:
        from lily.native import count_prefill_chunk
        recs = count_prefill_chunk(cfg, rows, p0, gemm_path=gemm_path(m), tensor_attention=m.tensor_attention)["records"]
        cache[key] = time_records(m, recs, () if head else _HEAD)
    return cache[key]


def prefill(m: Machine, cfg: ModelConfig, prompt: int, chunk: int, cache: dict | None = None) -> Timing:
    """Estimated time to the first token of a ``prompt``-token prompt run as ``chunk``-row
    chunks (the last with lm_head). Full chunks are encoded at a geometric sample of start
    positions and interpolated linearly in between (their cost is linear in the start
    position within a code path; docs/performance.md)."""
    cache = {} if cache is None else cache
    total = Timing()
    starts = list(range(0, prompt, chunk))
    full = starts[:-1]  # every chunk but the last is full and has no head
    sampled = _geometric(full, chunk) if full else set()
    samples = sorted({p for p in full if p < 8 * chunk or p in sampled} | set(full[-1:]))
    for p in full:
        if p in samples:
            total.add(_chunk(m, cfg, p, chunk, False, cache))
            continue
        i = bisect.bisect(samples, p)
        lo, hi = samples[i - 1], samples[i]
        a = (p - lo) / (hi - lo)
        total.add(_chunk(m, cfg, lo, chunk, False, cache), 1 - a)
        total.add(_chunk(m, cfg, hi, chunk, False, cache), a)
    last = starts[-1]
    total.add(_chunk(m, cfg, last, prompt - last, True, cache))
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
    ``1 <= n < limit``; a ``"chunk"`` needs ``n >= 1``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidParameterError(f"{name} must be a positive integer, got {n!r}")
    top = {"prompt": limit, "context": limit - 1}.get(kind)
    if top is not None and n > top:
        raise InvalidParameterError(f"{name} {n} is beyond the model's limit: max_position_embeddings is "
                                    f"{limit}, so at most {top}" + (" (a decode step at context c writes "
                                                                    "position c)" if kind == "context" else ""))


def estimate(machine_key: str = "m5max", *, config: ModelConfig | dict | None = None,
             contexts=LENGTHS, prompts=LENGTHS, breakdown_at: int = 4096, chunk: int | None = None,
             model_name: str | None = None) -> dict:
    """The estimate report (JSON-ready): decode tok/s at each of ``contexts``, prefill tok/s
    (prompt tokens / time to first token) at each of ``prompts``, the per-family breakdown of
    one decode step and one prefill at ``breakdown_at``, the model (``model_name``, default
    :data:`DEFAULT_MODEL_NAME`), the machine with its sources, and the calibration.
    ``chunk``: prefill rows per chunk (None or 0: the runtime's automatic choice on a Mac with
    the memory for it, ``RuntimeOptions.AUTO_PREFILL_CHUNKS[0]``; every machine modelled has
    it). The plan reports the prefill scratch that chunk needs (bytes, the runtime's sizing).

    Raises :class:`InvalidParameterError` for an unknown machine, a non-positive length or
    chunk, or a length beyond the model's max_position_embeddings (:func:`check_length`),
    and :class:`UnknownKernelError` if the plan uses a kernel the work table lacks."""
    from lily import _core
    m = machine(machine_key)
    cfg = model_config(config)
    limit = cfg.max_position_embeddings
    for c in contexts:
        check_length("contexts", c, limit, kind="context")
    for p in prompts:
        check_length("prompts", p, limit)
    check_length("breakdown_at", breakdown_at, limit, kind="context")
    chunk = chunk or _core.RuntimeOptions.AUTO_PREFILL_CHUNKS[0]
    check_length("chunk", chunk, limit, kind="chunk")
    from lily.native import _counting_runtime
    scratch = _counting_runtime(cfg, 4, 8, chunk, prefill_chunk=chunk).prefill_scratch_bytes
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
                 "attention_path": "tensor" if m.tensor_attention else "simdgroup"},
        "calibration": {"bandwidth_efficiency": BANDWIDTH_EFFICIENCY, "path_efficiency": PATH_EFFICIENCY,
                        "saturation_threads": SATURATION_THREADS, "stage_gap_us": STAGE_GAP * 1e6,
                        "stage_gap_from": CALIBRATION},
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
              f"stage gap {m['stage_gap_us']:.1f} us; prefill chunk {rep['plan']['prefill_chunk']} "
              f"(scratch {rep['plan']['prefill_scratch_bytes'] / 2**20:,.0f} MiB), "
              f"GEMM path {rep['plan']['gemm_path']}, attention path {rep['plan']['attention_path']}"), "",
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
