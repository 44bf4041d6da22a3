#!/usr/bin/env python3
"""The real model's size through the production runtime, end to end (issue 30): a random-weight
MLX 4-bit checkpoint of Qwen3.6-35B-A3B's dimensions on the Metal simulator (`sim`), teacher-
forced against Lily's numpy `reference` at full size. docs/verification.md, "The full-size
run", gives the procedure and the results.

    tools/fullsize_run.py --out RUN [--checkpoint DIR] [--phases LIST] [--time-limit S]

Assumes Lily is installed (``pip install --no-build-isolation --no-deps .``); builds nothing.
Phases (``--phases``, comma-separated, in this order; default all):

* ``checkpoint``  write the checkpoint to ``--checkpoint`` (default RUN/checkpoint) with
  lily.lab.testing.write_mlx_checkpoint (parallel, no bf16 intermediate), or reuse one there;
* ``reference``   the prompt (``--prompt-tokens``, 256 by default) in chunks of ``--chunk`` (64) rows,
  then ``--decode-steps`` (>= 16) single-token steps, on the reference device, every
  position's logits kept (``--reference-threads``, ``--reference-cache-gb``);
* ``sim``         the same tokens on `sim` (simdgroup GEMM path, ``prefill_chunk=--chunk``,
  the simulator's ``threads`` option where the build has it: ``--threads``, default all cores);
* ``sim-tensor``  the same on `sim` as an M5 (apple10) with ``gemm_path="tensor"``: the
  simulator's own cooperative-tensor layout, so the prefill attention takes its
  threadgroup-memory path;
* ``sim-nax``     the same with the simulator's cooperative tensors in the fragment layout of
  M5's tensor ops (``tensor_layout="nax"``): the attention's register path (the phase
  records the path the probe reports);
* ``snapshot``    the `sim` phase's prompt-cache snapshot after the prompt (written by Lily's
  prompt cache file format in another process) restored in a fresh engine: the next
  ``--snapshot-steps`` steps must be bit-identical to the `sim` phase's; then a snapshot
  taken and restored in process, continuing bit-identically again;
* ``report``      per-position relative error and top-1 agreement against the reference (as
  tests/test_native_decode.py computes them), peak memory against the runtime's memory model
  (the one ``lily doctor --model`` prints), each chunk's and step's counted dispatches,
  stages and bytes with their M5 Max ESTIMATE (lily estimate's model) beside the simulator's
  wall time: RUN/report.json and RUN/report.md.

Each phase runs in its own process (its peak memory is its own), saves every chunk's and
step's results and its session state to RUN/<phase>/ as soon as they are done, and resumes
from there when run again: a run can be split over several invocations, e.g. calls of at
most ten minutes on a lent host. ``--time-limit`` (seconds for this invocation) stops a phase
before a unit that would not finish in time (judged by the longest unit so far) and kills a
phase that overruns; rerun the same command to continue.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

PHASES = ("checkpoint", "reference", "sim", "sim-tensor", "sim-nax", "snapshot", "report")
#: the simulator phases: their GEMM path and cooperative-tensor layout (None: the default)
SIM_PHASES = {"sim": ("simdgroup", None), "sim-tensor": ("tensor", None), "sim-nax": ("tensor", "nax")}
# what a run directory is made with: resuming with other values is refused
RUN_SETTINGS = ("checkpoint", "preset", "seed", "prompt_tokens", "chunk", "decode_steps", "snapshot_steps")
REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "tests" / "data" / "qwen3.5-moe-tokenizer"
#: tests/test_native_decode.py's rule: a top-1 is compared where the reference's top-1/top-2
#: margin exceeds this.
CLEAR_MARGIN = 0.05
#: The prompt's text (any text will do: the weights are random); repeated to length.
TEXT = ("ROMEO.\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
        "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief. "
        "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name. ")


# ---------------------------------------------------------------------------- bookkeeping


def _dump(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _load(path: Path, default=None):
    return json.loads(path.read_text()) if path.is_file() else default


class Memory:
    """Peak resident memory of this process, sampled every 0.2 s from /proc/self/status
    (RssAnon: what the process allocated; RssFile: mapped file pages, here the checkpoint's,
    which the OS can drop) with the kernel's own high-water mark (VmHWM, both together)."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")

    def __init__(self):
        self.peak = {k: 0 for k in self.FIELDS}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> dict:
        now = {}
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in self.FIELDS:
                    now[key] = int(value.split()[0]) * 1024
        except OSError:
            now["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        for k, v in now.items():
            self.peak[k] = max(self.peak[k], v)
        return now

    def _run(self):
        while not self._stop.wait(0.2):
            self.sample()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.sample()
        return {f"peak_{k}": v for k, v in self.peak.items()}


class Phase:
    """RUN/<name>/progress.json: the units done (chunks and steps, with their seconds), one
    record per invocation, and the phase's facts."""

    def __init__(self, run: Path, name: str, deadline: float | None):
        self.dir = run / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "progress.json"
        self.data = _load(self.path, {"units": [], "sessions": []})
        self.deadline = deadline
        self.memory = Memory()
        self.started = time.time()
        self.session = {"started": self.started, "units": 0}
        self.data["sessions"].append(self.session)

    @property
    def done(self) -> int:
        return len(self.data["units"])

    def fits(self, kind: str) -> bool:
        """Whether a unit of ``kind`` is expected to end before the deadline (the longest
        one of that kind so far; the first always runs)."""
        if self.deadline is None:
            return True
        past = [u["seconds"] for u in self.data["units"] if u["kind"] == kind]
        return time.time() + (max(past) if past else 0.0) < self.deadline

    def add(self, unit: dict) -> None:
        unit["rss"] = self.memory.sample()
        self.data["units"].append(unit)
        self.session["units"] += 1
        self.save()

    def save(self) -> None:
        self.session["seconds"] = time.time() - self.started
        self.session.update({f"peak_{k}": v for k, v in self.memory.peak.items()})
        _dump(self.path, self.data)

    def finish(self, complete: bool) -> None:
        self.session.update(self.memory.stop())
        self.data["complete"] = complete
        self.save()


def _plan(args) -> list[tuple[str, int, int]]:
    """The units: ``("chunk", first position, rows)`` over the prompt, then ``("step",
    position, 1)`` per decode step."""
    units = [("chunk", p, min(args.chunk, args.prompt_tokens - p)) for p in range(0, args.prompt_tokens, args.chunk)]
    return units + [("step", args.prompt_tokens + j, 1) for j in range(args.decode_steps)]


def _sequence(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(TEXT)
    return ids[:n]


def _timed(fn, *a, **kw):
    """``(fn(*a, **kw), wall seconds, CPU seconds of this process's threads)``: on a shared
    machine the CPU time is the steadier figure, on a dedicated one the wall time."""
    w, c = time.time(), time.process_time()
    out = fn(*a, **kw)
    return out, time.time() - w, time.process_time() - c


def _max_context(args) -> int:
    return args.prompt_tokens + args.decode_steps + 8


# ---------------------------------------------------------------------------- phases


def phase_checkpoint(args, ph: Phase) -> bool:
    from lily.checkpoint import open_checkpoint
    from lily.lab.testing import write_mlx_checkpoint
    ck_dir = Path(args.checkpoint)
    if (ck_dir / "config.json").is_file():
        ck = open_checkpoint(ck_dir)  # validates every tensor's presence, dtype and shape
        ph.data["checkpoint"] = {"path": str(ck_dir), "reused": True, "bytes": ck.nbytes}
        return True
    if ck_dir.exists() and any(ck_dir.iterdir()):  # config.json is written last
        raise SystemExit(f"checkpoint: {ck_dir} holds an incomplete checkpoint (no config.json); delete it")
    t0 = time.time()
    write_mlx_checkpoint(args.preset, ck_dir, seed=args.seed, tokenizer_dir=args.tokenizer_dir,
                         workers=args.workers)
    ck = open_checkpoint(ck_dir)
    unaligned = sum(t.start % 16 != 0 for t in ck.tensors.values())
    ph.data["checkpoint"] = {"path": str(ck_dir), "reused": False, "bytes": ck.nbytes, "seconds": time.time() - t0,
                             "workers": args.workers or os.cpu_count(), "preset": args.preset,
                             "unaligned_tensors": unaligned}
    return True


def _save_logits(ph: Phase, unit, logits: np.ndarray) -> None:
    kind, pos, _ = unit
    np.save(ph.dir / f"logits-{pos:06d}.npy", np.asarray(logits, np.float32).reshape(-1, logits.shape[-1]))


def phase_reference(args, ph: Phase) -> bool:
    from lily.checkpoint import open_checkpoint
    from lily.reference import ReferenceBackend
    from lily.tokenizer import Tokenizer
    t0 = time.time()
    ck = open_checkpoint(args.checkpoint)
    cache = int(args.reference_cache_gb * 2**30)
    be = ReferenceBackend(ck, _max_context(args), cache_bytes=cache, threads=args.reference_threads)
    ph.data["load_seconds"] = time.time() - t0
    ph.data["options"] = {"cache_bytes": cache, "threads": args.reference_threads}
    seq = _sequence(Tokenizer.from_dir(args.checkpoint), args.prompt_tokens + args.decode_steps)
    state = ph.dir / "state.npz"
    if ph.done:
        with np.load(state) as z:
            arrays = {k: z[k] for k in z.files if k != "meta"}
            meta = json.loads(str(z["meta"]))
        be.restore(be.snapshot_from_arrays(arrays, meta))
    routes: dict = {}
    route = be.model.route

    def recording(i, x):  # keep each layer's routing: the report finds where the sim's differs
        probs, top, w = route(i, x)
        routes[i] = (probs, top)
        return probs, top, w

    be.model.route = recording
    k = ck.config.num_experts_per_tok
    for unit in _plan(args)[ph.done:]:
        kind, pos, rows = unit
        if not ph.fits(kind):
            return False
        assert be.position == pos
        routes.clear()
        logits, seconds, cpu = _timed(be.forward, np.asarray(seq[pos:pos + rows]), all_logits=True)
        _save_logits(ph, unit, logits)
        layers = sorted(routes)
        top_p = [np.sort(routes[i][0], axis=-1)[:, ::-1][:, k - 1:k + 1] for i in layers]
        np.savez(ph.dir / f"routing-{pos:06d}.npz",
                 hist=np.stack([np.bincount(routes[i][1].reshape(-1), minlength=ck.config.num_experts) for i in layers]),
                 gap=np.stack([(t[:, 0] - t[:, 1]) / t[:, 0] for t in top_p]))  # [layer, row]: k-th vs next
        arrays, meta = be.snapshot_arrays(be.snapshot())
        tmp = ph.dir / "state.tmp.npz"
        np.savez(tmp, meta=json.dumps(meta), **arrays)
        os.replace(tmp, state)
        ph.add({"kind": kind, "position": pos, "rows": rows, "seconds": seconds, "cpu_seconds": cpu})
    return True


def _sim_engine(args, gemm_path: str, layout: str | None = None):
    from lily import native_backend
    from lily.engine import Engine
    dev = {"gpu_family": "apple10"} if gemm_path == "tensor" else {}
    if layout:
        dev["tensor_layout"] = layout
    if "threads" in native_backend.SIM_OPTIONS:  # the parallel simulator (issue 30)
        dev["threads"] = args.threads
    opts = {"prefill_chunk": args.chunk, "gemm_path": gemm_path, "device_options": dev}
    return Engine.load(args.checkpoint, device="sim", max_context=_max_context(args), device_options=opts,
                       prompt_cache_bytes=1 << 40), dev


def _restore_session(engine, path: Path, seq: list[int]) -> None:
    """Restore the session saved in the prompt cache file ``path`` (its one entry)."""
    engine.prompt_cache.clear()
    engine.load_prompt_cache(path)
    entry = engine.prompt_cache.lookup(seq, len(seq))
    engine.restore((entry.state, [int(t) for t in entry.tokens]))
    engine.prompt_cache.clear()


def _save_session(engine, path: Path) -> int:
    """The session as a prompt cache file (Lily's format: model identity, checksum)."""
    engine.prompt_cache.clear()
    state, tokens = engine.snapshot()
    engine.prompt_cache.insert(tokens, state, pinned=True)
    engine.save_prompt_cache(path)
    engine.prompt_cache.clear()
    return int(state.nbytes)


def _routing(hist: np.ndarray, config, rows: int, tile: int) -> dict:
    """What a chunk's routing (``hist``: assignments per layer and expert) asked of the
    expert GEMMs: per layer the experts hit, the tiles of ``tile`` rows they fill (the grid
    is sized for the worst case) and the share of the tiles' rows that hold a token."""
    hit = [int((h > 0).sum()) for h in hist]
    tiles = [int(np.ceil(h / tile).sum()) for h in hist]
    assigned = rows * config.num_experts_per_tok
    filled = float(np.mean(tiles)) * tile  # 0 where the chunk recorded no expert tiles
    return {"tile_rows": tile, "experts_hit_mean": float(np.mean(hit)), "tiles_mean": float(np.mean(tiles)),
            "row_occupancy": assigned / filled if filled else None}


def _tile_rows(config, rows: int, position: int, gemm_path: str) -> int:
    """The expert tile height the plan of such a chunk uses (its first layer's GEMM kernel,
    ``moe_gemm_gate_up_q4_t<rows>[_tensor]``; a chunk of <= 64 rows always takes 16)."""
    from lily.native_backend import count_prefill_chunk
    recs = count_prefill_chunk(config, rows, position, gemm_path=gemm_path)["records"]
    name = next(r["kernel"] for r in recs if r["kernel"].startswith("moe_gemm_gate_up"))
    return int(re.search(r"_t(\d+)", name).group(1))


def phase_sim(args, ph: Phase, gemm_path: str = "simdgroup", layout: str | None = None) -> bool:
    from lily import native_backend
    from lily.lab.kernels.attention_prefill import tensor_attention_path
    t0 = time.time()
    engine, dev = _sim_engine(args, gemm_path, layout)
    rt = engine.backend.runtime
    ph.data["load_seconds"] = time.time() - t0
    attention = "simdgroup"
    if rt.uses_tensor_ops:  # the probe on a device like the phase's (its layout), single-threaded
        probe = native_backend.make_device("sim", **{k: v for k, v in dev.items() if k != "threads"})
        attention = tensor_attention_path(probe)["path"]
    ph.data["options"] = {"gemm_path": gemm_path, "prefill_chunk": rt.prefill_chunk, "device_options": dev,
                          "uses_tensor_ops": rt.uses_tensor_ops, "state_window": engine.backend.options.state_window,
                          "attention_path": attention}
    ph.data["memory_model"] = dict(rt.memory_use)  # the runtime's sizing at load (lily doctor's formula)
    ph.data["weights_mapped"] = rt.repacked_bytes == 0
    seq = _sequence(engine.tokenizer, args.prompt_tokens + args.decode_steps)
    session = ph.dir / "session.lilycache"
    if ph.done:
        _restore_session(engine, session, seq)
    for unit in _plan(args)[ph.done:]:
        kind, pos, rows = unit
        if not ph.fits(kind):
            return False
        assert engine.position == pos, (engine.position, pos)
        if kind == "chunk":
            logits, seconds, cpu = _timed(engine.prefill, seq[pos:pos + rows], all_logits=True)
        else:
            logits, seconds, cpu = _timed(engine.decode, seq[pos])
        _save_logits(ph, unit, logits)
        extra = {}
        if kind == "chunk":
            hist = np.stack([np.asarray(rt.expert_histogram(i)) for i in range(engine.config.num_hidden_layers)])
            np.savez(ph.dir / f"routing-{pos:06d}.npz", hist=hist)
            extra["routing"] = _routing(hist, engine.config, rows, _tile_rows(engine.config, rows, pos, gemm_path))
        if pos + rows == args.prompt_tokens:  # the snapshot phase starts from here
            extra["snapshot_bytes"] = _save_session(engine, ph.dir / "after-prompt.lilycache")
        _save_session(engine, session)
        ph.add({"kind": kind, "position": pos, "rows": rows, "seconds": seconds, "cpu_seconds": cpu, **extra})
    return True


def phase_snapshot(args, ph: Phase) -> bool:
    sim = Path(args.out) / "sim"
    steps = min(args.snapshot_steps, args.decode_steps)
    chunks = sum(kind == "chunk" for kind, _, _ in _plan(args))
    if not (sim / "after-prompt.lilycache").is_file() or \
            len(_load(sim / "progress.json", {"units": []})["units"]) < chunks + steps:
        raise SystemExit(f"snapshot: run the sim phase first (its prompt and {steps} decode steps)")
    t0 = time.time()
    engine, _ = _sim_engine(args, "simdgroup")
    ph.data["load_seconds"] = time.time() - t0
    seq = _sequence(engine.tokenizer, args.prompt_tokens + args.decode_steps)
    P = args.prompt_tokens
    t = time.time()
    _restore_session(engine, sim / "after-prompt.lilycache", seq[:P])
    restore_seconds = time.time() - t
    got = [engine.decode(seq[P + j]) for j in range(steps)]
    want = [np.load(sim / f"logits-{P + j:06d}.npy")[0] for j in range(steps)]
    across = [bool(np.array_equal(g, w)) for g, w in zip(got, want)]
    # in process: snapshot here, two steps (any tokens), restore, the same two steps again
    snap = engine.snapshot()
    a = [engine.decode(seq[j]) for j in range(2)]
    engine.restore(snap)
    b = [engine.decode(seq[j]) for j in range(2)]
    within = [bool(np.array_equal(x, y)) for x, y in zip(a, b)]
    from lily.prompt_cache import native_snapshot_bytes
    ph.data["result"] = {"steps_after_restore": steps, "bit_identical_across_processes": across,
                         "bit_identical_in_process": within, "restore_seconds": restore_seconds,
                         "snapshot_bytes": int(snap[0].nbytes),
                         "snapshot_bytes_formula": native_snapshot_bytes(engine.config, P + steps)}
    return all(across) and all(within)


# ---------------------------------------------------------------------------- report


def _compare(run: Path, phase: str, plan) -> dict | None:
    """Per-position relative error (||native - reference|| / ||reference||) and top-1
    agreement of ``phase`` against the reference, over the units both have done."""
    ref_done = len(_load(run / "reference" / "progress.json", {"units": []})["units"])
    got_done = len(_load(run / phase / "progress.json", {"units": []})["units"])
    n = min(ref_done, got_done)
    if not n:
        return None
    rows = []
    for kind, pos, _ in plan[:n]:
        r = np.load(run / "reference" / f"logits-{pos:06d}.npy")
        g = np.load(run / phase / f"logits-{pos:06d}.npy")
        err = np.linalg.norm(g - r, axis=-1) / np.linalg.norm(r, axis=-1)
        top2 = np.sort(r, axis=-1)[:, -2:]
        for i in range(r.shape[0]):
            rows.append({"position": pos + i, "kind": kind, "rel_err": float(err[i]),
                         "top1_equal": bool(g[i].argmax() == r[i].argmax()),
                         "margin": float(top2[i, 1] - top2[i, 0])})
    err = np.array([x["rel_err"] for x in rows])
    eq = np.array([x["top1_equal"] for x in rows])
    clear = np.array([x["margin"] > CLEAR_MARGIN for x in rows])

    def part(mask) -> dict:
        if not mask.any():
            return {}
        return {"positions": int(mask.sum()), "rel_err_max": float(err[mask].max()),
                "rel_err_median": float(np.median(err[mask])), "rel_err_p90": float(np.quantile(err[mask], 0.9)),
                "top1_agreement": float(eq[mask].mean()), "top1_agreement_clear": float(eq[mask & clear].mean())
                if (mask & clear).any() else None, "clear_positions": int((mask & clear).sum())}

    kinds = np.array([x["kind"] for x in rows])
    return {"all": part(np.ones(len(rows), bool)), "prefill": part(kinds == "chunk"), "decode": part(kinds == "step"),
            "routing": _routing_agreement(run, phase, [u for u in plan[:n] if u[0] == "chunk"]), "per_position": rows}


def _routing_agreement(run: Path, phase: str, chunks) -> list[dict]:
    """Per prefill chunk: the first layer whose expert assignments (the runtime's histogram)
    differ from the reference's, and the reference's smallest relative gap there between a
    row's k-th and next router probability. A near-tie (a gap of ~1e-3) lets the rounding of
    either side pick the other expert; from there on the two runs see different activations
    and their logits differ by ~1e-1 (random weights route almost uniformly)."""
    out = []
    for _, pos, rows in chunks:
        ref, got = run / "reference" / f"routing-{pos:06d}.npz", run / phase / f"routing-{pos:06d}.npz"
        if not (ref.is_file() and got.is_file()):
            continue
        with np.load(ref) as r, np.load(got) as g:
            diff = [i for i in range(len(r["hist"])) if not np.array_equal(r["hist"][i], g["hist"][i])]
            first = diff[0] if diff else None
            out.append({"position": pos, "rows": rows, "layers_differing": len(diff), "first_layer": first,
                        "reference_gap_there": None if first is None else float(r["gap"][first].min()),
                        "reference_gap_min_before": float(r["gap"][:first].min()) if first else
                        (float(r["gap"].min()) if first is None else None)})
    return out


def _counted(args, config, plan, phase: str) -> list[dict]:
    """Each unit's record-only counters (the plan lily estimate times) and its M5 Max ESTIMATE."""
    from lily.lab.estimate import machine, scenarios, time_records
    from lily.native_backend import count_decode_step, count_prefill_chunk
    m = scenarios(machine("m5max"))["likely"][0]  # lily estimate's likely M5 Max
    out = []
    for kind, pos, rows in plan:
        if kind == "chunk":
            c = count_prefill_chunk(config, rows, pos, gemm_path=SIM_PHASES[phase][0])
        else:
            c = count_decode_step(config, pos)
        t = time_records(m, c["records"])
        out.append({"kind": kind, "position": pos, "rows": rows, "dispatches": c["dispatches"],
                    "barrier_stages": c["barrier_stages"],
                    "bytes_moved": c["weight_bytes"] + c["kv_bytes"] + c["state_bytes"] + c["activation_bytes"],
                    "weight_bytes": c["weight_bytes"], "m5max_estimate_ms": t.seconds * 1e3})
    return out


def phase_report(args, ph: Phase) -> bool:
    from lily.checkpoint import open_checkpoint
    from lily.lab.doctor import model_memory
    from lily.lab.estimate import estimate
    run = Path(args.out)
    plan = _plan(args)
    ck = open_checkpoint(args.checkpoint)
    rep: dict = {"settings": {k: v for k, v in vars(args).items() if k not in ("worker", "deadline")},
                 "checkpoint": _load(run / "checkpoint" / "progress.json", {}).get("checkpoint"),
                 "host": {"cpus": os.cpu_count(), "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                          "python": sys.version.split()[0]},
                 "phases": {}}
    mem = model_memory(args.checkpoint, _max_context(args))
    rep["memory_model_doctor"] = {k: mem[k] for k in ("weights", "kv_cache", "scratch", "total", "prefill_chunk")}
    est = estimate("m5max", config=ck.config, contexts=[args.prompt_tokens], prompts=[args.prompt_tokens],
                   breakdown_at=args.prompt_tokens, chunk=args.chunk)
    pre, dec = est["prefill"][0], est["decode"][0]  # times: {"low", "likely", "high"}
    rep["estimate"] = {"prefill_seconds": pre["seconds"], "prefill_stages": pre["stages"], "prefill_gb": pre["gb_moved"],
                       "decode_ms": dec["ms_per_token"], "decode_stages": dec["stages"], "decode_gb": dec["gb_per_step"]}
    for name in (p for p in PHASES if p not in ("checkpoint", "report")):
        prog = _load(run / name / "progress.json")
        if prog is None:
            continue
        units = prog["units"]
        entry = {k: prog.get(k) for k in ("load_seconds", "options", "memory_model", "weights_mapped", "result",
                                          "complete")}
        entry["units_done"] = len(units)
        entry["peak"] = {k: max(s.get(k, 0) for s in prog["sessions"])
                         for k in ("peak_VmHWM", "peak_RssAnon", "peak_RssFile")}
        if name in SIM_PHASES:
            counted = _counted(args, ck.config, plan[:len(units)], name)
            for u, c in zip(units, counted):
                u["counted"] = c
            entry["agreement"] = _compare(run, name, plan)
        entry["units"] = units
        rep["phases"][name] = entry
    a, b = (rep["phases"].get(n) for n in ("sim-tensor", "sim-nax"))
    if a and b:  # the attention's two tensor-op paths: the same logits, bit for bit, on the simulator
        units = plan[:min(a["units_done"], b["units_done"])]
        same = [bool(np.array_equal(np.load(run / "sim-tensor" / f"logits-{pos:06d}.npy"),
                                    np.load(run / "sim-nax" / f"logits-{pos:06d}.npy"))) for _, pos, _ in units]
        rep["attention_paths_bit_identical"] = {"units": len(same), "identical": sum(same)}
    _dump(run / "report.json", rep)
    (run / "report.md").write_text(_markdown(rep))
    return True


def _gb(n) -> str:
    return "-" if not n else f"{n / 1e9:.2f}"


def _secs(units, kind: str) -> tuple[list, list]:
    sel = [u for u in units if u["kind"] == kind]
    return [u["seconds"] for u in sel], [u.get("cpu_seconds", 0.0) for u in sel]


def _markdown(rep: dict) -> str:
    s = rep["settings"]
    ck = rep.get("checkpoint") or {"path": s["checkpoint"]}
    written = f"written in {ck['seconds']:.0f} s by {ck['workers']} processes" if ck.get("seconds") else "not written here"
    lines = [f"# Full-size run: {s['preset']} preset, {s['prompt_tokens']}-token prompt in chunks of {s['chunk']}, "
             f"{s['decode_steps']} decode steps", "",
             f"Host: {rep['host']['cpus']} CPUs, {rep['host']['memory_bytes'] / 2**30:.0f} GiB. Checkpoint "
             f"{ck.get('path')}: {_gb(ck.get('bytes'))} GB, {written}.", "",
             "Wall seconds (CPU seconds of the process's threads in brackets).", "",
             "| phase | load s | prefill s: total (per chunk) | decode s/step | peak RSS GB (anon + file) "
             "| runtime memory model GB |", "|---|---|---|---|---|---|"]
    for name, e in rep["phases"].items():
        if name == "snapshot":
            continue
        (cw, cc), (sw, sc) = _secs(e["units"], "chunk"), _secs(e["units"], "step")
        model = (e.get("memory_model") or {}).get("total")
        pk = e["peak"]
        lines.append(f"| {name} | {e.get('load_seconds') or 0:.1f} | {sum(cw):.1f} [{sum(cc):.1f}] "
                     f"({', '.join(f'{x:.1f}' for x in cw)}) | {np.mean(sw) if sw else 0:.2f} "
                     f"[{np.mean(sc) if sc else 0:.2f}] | {_gb(pk['peak_VmHWM'])} ({_gb(pk['peak_RssAnon'])} + "
                     f"{_gb(pk['peak_RssFile'])}) | {_gb(model)} |")
    m = rep["memory_model_doctor"]
    lines += ["", f"lily doctor --model at this context (automatic chunk {m['prefill_chunk']}): weights "
              f"{_gb(m['weights'])} GB + KV/state {_gb(m['kv_cache'])} + scratch {_gb(m['scratch'])} = "
              f"{_gb(m['total'])} GB. The file pages are the checkpoint's, mapped (the OS can drop them).",
              "", "| phase | positions | rel. error max / median / p90 | top-1 agreement (where the margin > "
              f"{CLEAR_MARGIN}) |", "|---|---|---|---|"]
    for name, e in rep["phases"].items():
        a = e.get("agreement")
        for part in ("prefill", "decode"):
            x = (a or {}).get(part)
            if x:
                clear = x["top1_agreement_clear"]
                lines.append(f"| {name} {part} | {x['positions']} | {x['rel_err_max']:.2e} / "
                             f"{x['rel_err_median']:.2e} / {x['rel_err_p90']:.2e} | {x['top1_agreement']:.3f} "
                             f"({'-' if clear is None else f'{clear:.3f}'} of {x['clear_positions']}) |")
    paths = [f"{name}: GEMM path {o['gemm_path']}, prefill attention {o.get('attention_path', 'not recorded')}"
             for name, e in rep["phases"].items() if (o := e.get("options") or {}).get("gemm_path")]
    if paths:
        lines += ["", "Paths: " + "; ".join(paths) + "."]
    same = rep.get("attention_paths_bit_identical")
    if same:
        lines += ["", f"sim-tensor and sim-nax (the attention's threadgroup-memory and register paths): "
                  f"{same['identical']} of {same['units']} chunks' and steps' logits bit-identical."]
    for name, e in rep["phases"].items():
        routing = (e.get("agreement") or {}).get("routing")
        if routing:
            same = sum(r["first_layer"] is None for r in routing)
            flips = [f"{r['position']}: layer {r['first_layer']} (gap {r['reference_gap_there']:.1e})"
                     for r in routing if r["first_layer"] is not None]
            lines.append(f"\n{name}: {same} of {len(routing)} chunks routed exactly as the reference in every layer"
                         + ("; first difference (reference's k-th/next relative router gap there) at chunk "
                            + ", ".join(flips) if flips else "") + ".")
    e = rep["estimate"]
    pre = "/".join(f"{e['prefill_seconds'][k] * 1e3:.1f}" for k in ("low", "likely", "high"))
    dec = "/".join(f"{e['decode_ms'][k]:.2f}" for k in ("low", "likely", "high"))
    lines += ["", f"lily estimate (m5max, an ESTIMATE, low/likely/high): this prompt {pre} ms "
              f"({e['prefill_stages']} stages, {e['prefill_gb']:.2f} GB), a decode step at "
              f"{s['prompt_tokens']} {dec} ms ({e['decode_stages']} stages, {e['decode_gb']:.3f} GB; "
              "the mean of a write-back window). Per unit below: the likely machine.", "",
              "| phase | unit | position | rows | sim s [CPU s] | dispatches | stages | GB counted "
              "| M5 Max ms (ESTIMATE) | experts hit / tiles / rows used |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in rep["phases"].items():
        for u in e["units"]:
            c = u.get("counted")
            if not c:
                continue
            r = u.get("routing")
            occ = "-" if not r or r["row_occupancy"] is None else f"{r['row_occupancy']:.0%}"
            rr = f"{r['experts_hit_mean']:.0f} / {r['tiles_mean']:.0f} / {occ}" if r else ""
            lines.append(f"| {name} | {u['kind']} | {u['position']} | {u['rows']} | {u['seconds']:.2f} "
                         f"[{u.get('cpu_seconds', 0):.2f}] | {c['dispatches']} | {c['barrier_stages']} | "
                         f"{c['bytes_moved'] / 1e9:.3f} | {c['m5max_estimate_ms']:.2f} | {rr} |")
    snap = rep["phases"].get("snapshot", {}).get("result")
    if snap:
        across, within = snap["bit_identical_across_processes"], snap["bit_identical_in_process"]
        lines += ["", f"Snapshot after the prompt ({snap['snapshot_bytes'] / 1e6:.1f} MB; the prompt cache's formula "
                  f"{snap['snapshot_bytes_formula'] / 1e6:.1f} MB) restored from its file in another process: "
                  f"{sum(across)} of {len(across)} steps bit-identical to the sim phase's; snapshot and restore in "
                  f"process: {sum(within)} of {len(within)}."]
    return "\n".join(lines) + "\n"


RUNNERS = {"checkpoint": phase_checkpoint, "reference": phase_reference, "snapshot": phase_snapshot,
           "report": phase_report, **{name: (lambda a, p, g=g, lay=lay: phase_sim(a, p, g, lay))
                                      for name, (g, lay) in SIM_PHASES.items()}}


# ---------------------------------------------------------------------------- driver


def _arguments(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="run directory (results, resumable state)")
    ap.add_argument("--checkpoint", help="checkpoint directory, written if absent (default: RUN/checkpoint)")
    ap.add_argument("--preset", default="full", help="lily.lab.testing preset to write (default full; dims for a quick run)")
    ap.add_argument("--tokenizer-dir", default=str(TOKENIZER_DIR))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=None, help="checkpoint writer processes (default: all cores)")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64, help="prefill_chunk (rows per prefill chunk)")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--snapshot-steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="the simulator's threads (default: all cores)")
    ap.add_argument("--reference-threads", type=int, default=os.cpu_count(),
                    help="threads of the reference's routed experts (default: all cores)")
    ap.add_argument("--reference-cache-gb", type=float, default=None,
                    help="dequantized weights the reference keeps (default: 3 GiB, 12 GiB on hosts of >= 64 GiB)")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds for this invocation (phases resume)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.checkpoint = args.checkpoint or str(Path(args.out) / "checkpoint")
    if args.reference_cache_gb is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        args.reference_cache_gb = 12.0 if total >= 64 * 2**30 else 3.0
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = [p for p in phases if p not in PHASES]
    if bad:
        ap.error(f"unknown phase(s) {', '.join(bad)}; choose from {', '.join(PHASES)}")
    if min(args.prompt_tokens, args.chunk, args.decode_steps + 1, args.threads, args.reference_threads) < 1:
        ap.error("--prompt-tokens, --chunk, --threads and --reference-threads must be >= 1, --decode-steps >= 0")
    args.phases = [p for p in PHASES if p in phases]
    return args


def worker(args) -> int:
    ph = Phase(Path(args.out), args.worker, args.deadline)
    ok = False
    try:
        ok = bool(RUNNERS[args.worker](args, ph))
    finally:
        ph.finish(ok)
    return 0 if ok else 3


def main(argv=None) -> int:
    args = _arguments(argv)
    if args.worker:
        return worker(args)
    run = Path(args.out)
    run.mkdir(parents=True, exist_ok=True)
    # A run resumes only what the same settings made: saved units of other ones would be mixed in.
    made = {k: getattr(args, k) for k in RUN_SETTINGS}
    earlier = _load(run / "settings.json")
    if earlier is not None and earlier != made:
        diff = ", ".join(f"--{k.replace('_', '-')} {earlier.get(k)!r} (now {made[k]!r})"
                         for k in RUN_SETTINGS if earlier.get(k) != made[k])
        print(f"fullsize_run: error: {run} was made with {diff}: use another --out or delete it", file=sys.stderr)
        return 2
    (run / "settings.json").write_text(json.dumps(made))
    deadline = time.time() + args.time_limit if args.time_limit else None
    base = [a for a in (argv if argv is not None else sys.argv[1:])]
    status = 0
    for phase in [p for p in args.phases if p != "report"]:
        prog = _load(run / phase / "progress.json")
        if prog and prog.get("complete"):
            print(f"{phase}: done before (delete {run / phase} to redo)", flush=True)
            continue
        if deadline is not None and time.time() >= deadline:
            print(f"{phase}: not started (time limit); rerun to continue", flush=True)
            status = 3
            break
        t = time.time()
        cmd = [sys.executable, __file__, *base, "--worker", phase] + (["--deadline", str(deadline)] if deadline else [])
        env = dict(os.environ)
        if phase == "reference":  # its threads are the experts'; an idle BLAS pool would spin beside them
            for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                env.setdefault(var, "1")
        try:
            rc = subprocess.run(cmd, env=env,
                                timeout=None if deadline is None else max(1.0, deadline - time.time() + 15)).returncode
        except subprocess.TimeoutExpired:
            rc = -9
        prog = _load(run / phase / "progress.json", {})
        print(f"{phase}: {'complete' if prog.get('complete') else 'incomplete'} after {time.time() - t:.0f} s "
              f"({len(prog.get('units', []))} units saved; exit {rc})", flush=True)
        if not prog.get("complete"):
            status = rc if rc not in (0, 3, -9) else 3
            break
    if "report" in args.phases:  # of whatever is done, also when a phase stopped for time
        rc = subprocess.run([sys.executable, __file__, *base, "--worker", "report"]).returncode
        if rc == 0:
            print((run / "report.md").read_text(), flush=True)
        status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main())
