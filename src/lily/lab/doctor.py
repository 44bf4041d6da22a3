"""``lily doctor``: what this machine has, whether Lily's GPU code loads, whether every
shipped kernel computes what its numpy reference computes (lily.lab.kernels), first at small
shapes, then at the model's own (hidden 2048, 256 experts top-8, vocabulary 248,320, head
dims 256 and 128, a 4096-row prefill chunk, contexts past the attention split), and whether a
whole generation does: the embedded demo model teacher-forced on the device against the
numpy reference, then a prefill and 16 sampled decode steps (:func:`end_to_end`).
``--quick`` runs the small shapes only.

On a Mac it checks the ``metal`` device (the real GPU); elsewhere the ``sim`` device (the
Metal simulator). The report ends with a short block meant to be pasted into a bug report.
"""

from __future__ import annotations

import difflib
import json
import re
import secrets
import sys
import time
from pathlib import Path

from lily import _core, native_backend  # by module: tests swap its make_device
from lily.checkpoint import open_checkpoint
from lily.engine import DEFAULT_MAX_CONTEXT, METAL_BUILD_FIX, default_model_path
from lily.errors import DeviceError, InvalidParameterError
from lily.lab import estimate
from lily.lab.kernels.attention_prefill import tensor_attention_path
from lily.lab.kernels.harness import TOY, Result, Size
from lily.lab.kernels.registry import run_checks, shipped_kernels
from lily.lab.system import system_info

#: Rows of the model-size prefill checks on the simulator by default: the model's 4096-row
#: chunk takes hours there (its GEMMs run at ~0.1-1 GMAC/s on the CPU), and the rows only
#: scale the grids; a GPU runs 4096 (``--rows`` sets it).
SIM_MODEL_ROWS = 256

#: Native vs reference logits on the demo model, relative L2 error per position: the bf16 KV
#: cache and the prefill GEMMs' half operands give ~1e-4..1e-3, so E2E_INSIDE of the positions
#: must be within E2E_REL_TOL; a router near-tie may pick another expert under that rounding
#: (and move the later positions a little), so none may exceed 10 E2E_REL_TOL: the bounds of
#: tests/test_native_prefill.py (its docstring derives them). A broken kernel is off by O(1).
E2E_REL_TOL, E2E_INSIDE = 5e-3, 0.75
#: A position's argmax must agree where the reference's top-2 margin exceeds E2E_MARGIN (at a
#: position within E2E_REL_TOL), or 10 E2E_MARGIN (anywhere).
E2E_MARGIN = 0.05
#: Sampled decode steps of the end-to-end check, their settings, and the bounds: a sampled
#: token's log-probability (raw logits, as reported) within E2E_LOGPROB_TOL nats of the
#: reference's teacher-forced one (logits off by up to 5e-2 relative move it by ~0.1 on the demo
#: model; a broken kernel by nats), and the token among the reference's top E2E_TOP_K + 5
#: (top-k sampling; 5 of slack for the near-ties at the boundary).
E2E_STEPS, E2E_TEMPERATURE, E2E_TOP_K, E2E_LOGPROB_TOL = 16, 0.8, 20, 0.25
E2E_TEXT = ("ROMEO.\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
            "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief. ") * 2


def compare_teacher_forced(native, ref, ids) -> dict:
    """Both engines' logits at every position of ``ids`` (one prefill each, teacher forced) on
    fresh sessions: ``rel_err`` (the worst position's relative L2 error), ``inside`` (the share
    of positions within E2E_REL_TOL), ``clear`` (positions whose reference top-2 margin is clear,
    E2E_MARGIN) and ``argmax_equal`` (how many of those have the same argmax), ``ok`` against
    the bounds above. The comparison of tests/test_native_decode.py and test_native_prefill.py;
    the engines' sessions are left after ``ids``."""
    import numpy as np
    native.reset()
    ref.reset()
    nl = np.asarray(native.prefill(ids, all_logits=True), np.float64)
    rl = np.asarray(ref.prefill(ids, all_logits=True), np.float64)
    err = np.linalg.norm(nl - rl, axis=-1) / np.linalg.norm(rl, axis=-1)
    inside = err < E2E_REL_TOL
    top2 = np.sort(rl, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > np.where(inside, E2E_MARGIN, 10 * E2E_MARGIN)
    same = int((nl.argmax(-1) == rl.argmax(-1))[clear].sum())
    ok = (np.isfinite(nl).all() and inside.mean() >= E2E_INSIDE and err.max() < 10 * E2E_REL_TOL
          and same == int(clear.sum()))
    return {"positions": len(ids), "rel_err": float(err.max()), "inside": float(inside.mean()),
            "clear": int(clear.sum()), "argmax_equal": same, "ok": bool(ok)}


def check_sampled_steps(native, ref, prompt_ids, seed: int) -> dict:
    """A prefill of ``prompt_ids`` and E2E_STEPS sampled decode steps on ``native`` (on the
    device: its sampler, the token hand-off between steps), each sampled token then scored by
    the reference teacher-forced: ``logprob_err`` (the worst |native - reference| log-probability
    of a sampled token) and ``worst_rank`` (its worst rank in the reference's logits), ``ok``
    within E2E_LOGPROB_TOL and E2E_TOP_K + 5."""
    import numpy as np
    native.reset()
    r = native.generate(prompt_ids, max_tokens=E2E_STEPS, temperature=E2E_TEMPERATURE, top_k=E2E_TOP_K,
                        seed=seed, logprobs=True, ignore_eos=True)
    toks = list(r.token_ids)
    ref.reset()
    rl = np.asarray(ref.prefill(list(prompt_ids) + toks[:-1], all_logits=True), np.float64)[len(prompt_ids) - 1:]
    lse = rl.max(-1) + np.log(np.exp(rl - rl.max(-1, keepdims=True)).sum(-1))
    want = rl[np.arange(len(toks)), toks] - lse
    got = np.array([lp.logprob for lp in r.logprobs], np.float64)
    ranks = [int((row > row[t]).sum()) for row, t in zip(rl, toks)]
    err = float(np.abs(got - want).max()) if toks else float("inf")
    return {"steps": len(toks), "seed": seed, "logprob_err": err, "worst_rank": max(ranks, default=-1),
            "ok": len(toks) == E2E_STEPS and err <= E2E_LOGPROB_TOL and max(ranks) < E2E_TOP_K + 5}


def end_to_end(name: str, seed: int, positions: int = 64) -> list[Result]:
    """The embedded demo model on native device ``name`` (the simulator as an M5, so prefill
    takes the tensor-op path as its kernel checks do) against the numpy reference: the
    teacher-forced comparison over ``positions`` tokens of E2E_TEXT in prefill chunks of 16
    (several chunks, their boundaries inside the text), then a prefill and E2E_STEPS sampled
    decode steps (:func:`check_sampled_steps`). One :class:`Result` each; ERROR when the engine
    does not load or run."""
    from lily.engine import Engine
    options = {"prefill_chunk": 16}
    if name == "sim":
        options["device_options"] = {"gpu_family": "apple10"}
    out = []
    t0 = time.perf_counter()
    try:
        native = Engine.load(device=name, max_context=256, device_options=options)
        ref = Engine.load(device="reference", max_context=256)
        ids = ref.tokenizer.encode(E2E_TEXT)[:positions]
        tf = compare_teacher_forced(native, ref, ids)
        out.append(Result("teacher-forced", "PASS" if tf["ok"] else "FAIL", tf["rel_err"] / (10 * E2E_REL_TOL),
                          f"{tf['positions']} positions in prefill chunks of 16: logits within "
                          f"{tf['rel_err']:.2g} of the reference's (bound {10 * E2E_REL_TOL:g}), "
                          f"{tf['inside']:.0%} within {E2E_REL_TOL:g} (bound {E2E_INSIDE:.0%}), argmax equal "
                          f"at {tf['argmax_equal']} of {tf['clear']} positions with a clear margin"))
    except Exception as e:  # noqa: BLE001 (an engine that does not load is a finding to report)
        out.append(Result("teacher-forced", "ERROR", None, f"{type(e).__name__}: {e}"))
        out[-1].seconds = time.perf_counter() - t0
        return out
    out[-1].seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        st = check_sampled_steps(native, ref, ids[:32], seed)
        out.append(Result("prefill + sampled decode", "PASS" if st["ok"] else "FAIL",
                          st["logprob_err"] / E2E_LOGPROB_TOL,
                          f"{st['steps']} of {E2E_STEPS} steps sampled on the device (temperature "
                          f"{E2E_TEMPERATURE}, top-k {E2E_TOP_K}, seed {seed}): log-probabilities within "
                          f"{st['logprob_err']:.2g} of the reference's (bound {E2E_LOGPROB_TOL:g}), every token "
                          f"at rank <= {st['worst_rank']} of the reference's logits (bound {E2E_TOP_K + 4})"))
    except Exception as e:  # noqa: BLE001
        out.append(Result("prefill + sampled decode", "ERROR", None, f"{type(e).__name__}: {e}"))
    out[-1].seconds = time.perf_counter() - t0
    return out


def open_device(name: str):
    """(device, error): the native device ``name`` ('auto': metal when compiled in, else sim)."""
    compiled = list(_core.compiled_devices())
    if name == "auto":
        name = "metal" if "metal" in compiled else "sim"
    # the simulator as an M5 (apple10), so the Metal 4 tensor-op kernels are checked too
    options = {"gpu_family": "apple10", "verify_writes": True} if name == "sim" else {}
    try:
        return name, native_backend.make_device(name, **options), None
    except DeviceError as e:
        return name, None, str(e)
    except RuntimeError as e:  # the metallib or the GPU could not be opened
        return name, None, f"{type(e).__name__}: {e}"


def model_memory(model: str | None, max_context: int | None, budget: int | None = None) -> dict:
    """The memory a native session of a checkpoint (the embedded demo model by default) needs
    at ``max_context`` (default: Engine.load's), in bytes, as the runtime sizes it at load
    (:func:`lily.native_backend.memory_plan`): ``weights``, ``kv_cache`` (KV rows and Gated DeltaNet
    state), ``scratch`` (activations and one prefill chunk), ``total``, the ``prefill_chunk``
    the automatic choice takes under ``budget`` bytes (None: no limit), and ``fits`` (False
    when even the smallest chunk does not fit; ``refusal`` then holds the runtime's message).
    Raises InvalidParameterError for a ``max_context`` that Engine.load refuses (not an
    integer in [1, max_position_embeddings]), CheckpointError for a path that is not a
    checkpoint, DeviceError when this build has no simulator to size it with.
    """
    path = Path(model) if model else default_model_path()
    ck = open_checkpoint(path)
    limit = ck.config.max_position_embeddings
    ctx = min(DEFAULT_MAX_CONTEXT, limit) if max_context is None else max_context  # Engine.load's default
    if isinstance(ctx, bool) or not isinstance(ctx, int) or not 0 < ctx <= limit:
        raise InvalidParameterError(f"max_context must be an integer in [1, {limit}] for {path.name}, got {ctx!r}")
    if "sim" not in _core.compiled_devices():
        raise DeviceError("sizing the session needs the simulator, which this build left out (LILY_SIM=OFF)")
    refusal = None
    try:
        plan = native_backend.memory_plan(ck, ctx, budget or 0)
    except DeviceError as e:
        refusal, plan = str(e), native_backend.memory_plan(ck, ctx, 0)
    return {"path": str(path), "name": path.name, "weights": plan["weights"], "max_context": ctx,
            "kv_cache": plan["kv_cache"] + plan["state"], "scratch": plan["scratch"],
            "prefill_chunk": plan["prefill_chunk"], "total": plan["total"], "fits": refusal is None,
            **({"refusal": refusal} if refusal else {})}


def _pipeline(dev, kernel: str) -> dict:
    """Whether kernel's pipeline builds, and its limits (Device.pipeline_info: thread limit,
    SIMD width, static threadgroup memory in bytes: 0 on the simulator)."""
    try:
        return {**dev.pipeline_info(kernel), "kernel": kernel, "built": True}
    except Exception as e:  # noqa: BLE001 (a pipeline the GPU rejects is a line in the report)
        return {"kernel": kernel, "built": False, "error": f"{type(e).__name__}: {e}"}


#: Bytes by which a compiler's static threadgroup allocation may exceed the sum a kernel
#: declares and still count as that sum (alignment of its arrays).
TG_MEMORY_SLACK = 64


def threadgroup_memory_check(pipes: list[dict], declared: dict[str, int]) -> dict:
    """The GPU compiler's static threadgroup memory (``pipes``: :func:`_pipeline` rows; None on
    the simulator) against what the estimate's residency takes for each kernel of the model's
    plan (``declared``: :func:`lily.lab.estimate.declared_threadgroup_memory`), in bytes.
    ``status``: "match" (every declared kernel within :data:`TG_MEMORY_SLACK` above its
    figure), "differs" (``differs`` lists {kernel, declared, compiled}) or "not measured"
    (no declared kernel to compare); ``kernels``: how many were compared; ``undeclared``: {kernel:
    compiled bytes} of plan kernels whose cost entry declares none but whose pipeline
    allocates some. (:func:`run` adds "unknown", with ``error``, when counting the plan fails.)"""
    compared, differs, undeclared = 0, [], {}
    for p in pipes:
        got = p.get("static_threadgroup_memory")
        if not p.get("built") or got is None or p["kernel"] not in declared:
            continue
        want = declared[p["kernel"]]
        if want == 0:
            if got:
                undeclared[p["kernel"]] = got
            continue
        compared += 1
        if not want <= got <= want + TG_MEMORY_SLACK:
            differs.append({"kernel": p["kernel"], "declared": want, "compiled": got})
    status = "not measured" if not compared else ("differs" if differs else "match")
    return {"status": status, "kernels": compared, "differs": differs, "undeclared": undeclared}


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.2f} GiB"


def run(device: str = "auto", kernels: list[str] | None = None, model: str | None = None,
        max_context: int | None = None, seed: int | None = None, as_json: bool = False,
        out=None, quick: bool = False, rows: int | None = None) -> int:
    """Runs every check and prints the report (text, or one JSON object with ``as_json``):
    the kernels at small shapes, then (unless ``quick``) at the model's own with prefill chunks
    of ``rows`` rows (default 4096, the model's chunk; :data:`SIM_MODEL_ROWS` on the simulator)
    and the end-to-end check (:func:`end_to_end`; not with ``kernels``).
    Returns 0 when everything that ran passed and the model fits in memory, 1 otherwise.
    Without ``seed`` one is drawn and shown, so a failure can be rerun with ``--seed``.
    Raises InvalidParameterError for an unknown kernel name or a ``max_context`` out of range."""
    out = out or sys.stdout
    t0 = time.perf_counter()
    say = (lambda *a: None) if as_json else (lambda *a: print(*a, file=out, flush=True))
    report: dict = {"system": system_info()}
    sysi = report["system"]
    name, dev, err = open_device(device)
    if dev is not None and kernels:  # a typo in --kernels is an error before any output
        shipped = shipped_kernels(dev)
        unknown = sorted(set(kernels) - set(shipped))
        if unknown:
            close = sorted({m for k in unknown for m in difflib.get_close_matches(k, shipped, n=3)})
            hint = (f"; did you mean {', '.join(close)}?" if close
                    else " (`lily doctor --json` lists every kernel of the library under \"pipelines\")")
            raise InvalidParameterError(f"unknown kernel(s) {', '.join(unknown)}{hint}")
    limits = dict(dev.memory_limits) if dev is not None else {}  # 0 = no limit known (the simulator's)
    budget = limits.get("working_set") or sysi["memory_bytes"]
    try:  # a max_context out of range is an error before any output, like a typo in --kernels
        mem = model_memory(model, max_context, budget)
    except InvalidParameterError:
        raise
    except Exception as e:  # noqa: BLE001 (a bad checkpoint is a line in the report and a failure)
        mem = {"error": f"{type(e).__name__}: {e}"}
    if seed is None:
        seed = secrets.randbelow(2**31)
    report["seed"] = seed
    say("Lily doctor")
    for key in ("lily", "native_build", "python", "os", "arch", "chip", "xcode", "metal_compiler", "sdk"):
        if key in sysi:
            say(f"  {key:<15} {sysi[key] if sysi[key] is not None else 'not found'}")
    say(f"  {'memory':<15} {_gib(sysi['memory_bytes'])}")
    say(f"  {'seed':<15} {seed} (rerun the same inputs with --seed {seed})")

    report["device"] = {"name": name, "error": err}
    say("\ndevice")
    if dev is None:
        say(f"  {name}: FAILED to open: {err}")
    else:
        names = shipped_kernels(dev)
        if name == "sim" and "metal" not in _core_devices():
            say("  (no Metal GPU in this build: the kernels run on the Metal simulator, on the CPU; this checks\n"
                "   the package, not a GPU)")
            if sys.platform == "darwin":
                say("  " + METAL_BUILD_FIX)
        report["device"].update({"description": dev.name, "gpu_family": dev.gpu_family,
                                 "kernels": len(names), "tensor_ops": dev.supports_tensor_ops,
                                 "tensor_ops_status": dev.tensor_ops_status,
                                 "bfloat_tensor_ops": dev.supports_bfloat_tensor_ops,
                                 "bfloat_tensor_ops_status": dev.bfloat_tensor_ops_status})
        where = "lily.metallib loaded" if name == "metal" else "kernels compiled into the simulator"
        say(f"  {'device':<15} {_device_line(name, dev)}")
        say(f"  {'library':<15} {where}: {len(names)} kernels")
        loaded = "Metal 4 tensor library loaded" if name == "metal" else "the simulator as an M5"
        say(f"  {'tensor ops':<15} " + (f"yes ({loaded})" if dev.supports_tensor_ops else f"no: {dev.tensor_ops_status}"))
        if dev.supports_tensor_ops:  # prefill's tensor kernels take bfloat operands (nothing is clipped)
            say(f"  {'tensor bfloat':<15} " + ("yes (the prefill GEMMs and attention use tensor ops)"
                                               if dev.supports_bfloat_tensor_ops else
                                               f"no: {dev.bfloat_tensor_ops_status}; the prefill GEMMs and "
                                               "attention run simdgroup_matrix"))
        try:  # the design the tensor-op attention takes on this GPU (attn_layout_probe_d256_tensor)
            attn = tensor_attention_path(dev)
        except Exception as e:  # noqa: BLE001 (a probe that fails is a line in the report)
            attn = {"path": "unknown", "detail": f"the layout probe failed: {type(e).__name__}: {e}", "mismatch": None}
        report["device"]["tensor_attention_path"] = attn
        why = (" (the simulator's default cooperative-tensor layout, deliberately not M5's)"
               if name == "sim" and attn["path"] == "threadgroup memory" else "")
        say(f"  {'prefill attn':<15} {attn['detail']}{why}")
        pipes = [_pipeline(dev, k) for k in names]  # building each one shows what the GPU compiler rejects
        if name == "sim":  # the simulator does not measure threadgroup memory: unknown, not 0
            for p in pipes:
                if p["built"]:
                    p["static_threadgroup_memory"] = None
        report["pipelines"] = pipes
        if name == "sim":  # the simulator measures no allocation
            tg = threadgroup_memory_check([], {})
        else:
            try:
                tg = threadgroup_memory_check(pipes, estimate.declared_threadgroup_memory())
            except Exception as e:  # noqa: BLE001 (the comparison is information, not a check that fails)
                tg = {"status": "unknown", "error": f"{type(e).__name__}: {e}"}
        report["device"]["threadgroup_memory"] = tg
        if tg["status"] == "not measured":
            say(f"  {'tg memory':<15} " + ("not measured on the simulator (the compiler's allocation is a GPU's)"
                                           if name == "sim" else "not compared: no pipeline of the model's plan built"))
        elif tg["status"] == "unknown":
            say(f"  {'tg memory':<15} not compared: counting the model's plan failed: {_short(tg['error'])}")
        elif tg["status"] == "match":
            say(f"  {'tg memory':<15} as the estimate takes it, for the {tg['kernels']} kernels of Qwen3.6-35B-A3B's plan "
                "that declare some" + (f"; {len(tg['undeclared'])} it counts none for allocate some (JSON undeclared)"
                                       if tg["undeclared"] else ""))
        else:
            say(f"  {'tg memory':<15} differs from the estimate's residency for {len(tg['differs'])} of "
                f"{tg['kernels']} kernels: " + "; ".join(f"{d['kernel']} {d['declared']} B declared, "
                                                           f"{d['compiled']} B compiled" for d in tg["differs"]))
        bad = [p["kernel"] for p in pipes if not p["built"]]
        say(f"  {'pipelines':<15} {len(names) - len(bad)} of {len(names)} built")
        for p in pipes:
            if not p["built"]:
                say(f"  {'':<15} FAILED {p['kernel']}: {_short(p.get('error', 'not in the library'))}")
        say(f"  {'':<15} {'kernel':<34} {'max threads':>11} {'simd width':>10} {'tg memory':>10}")
        for p in pipes:
            if p["built"]:
                say(f"  {'':<15} {p['kernel']:<34} {p['max_threads_per_threadgroup']:>11} "
                    f"{p['thread_execution_width']:>10} {_or_dash(p['static_threadgroup_memory']):>10}")
        report["device"]["memory_limits"] = limits
        if limits.get("working_set"):
            say(f"  {'GPU memory':<15} working set {_gib(limits['working_set'])}, largest buffer "
                f"{_gib(limits.get('max_buffer') or None)}")

    report["model"] = mem
    say("\nmodel")
    if "error" in mem:
        say(f"  FAILED: {mem['error']}")
    else:
        mem["budget"] = budget
        mem["budget_kind"] = "GPU working set" if limits.get("working_set") else "memory"
        say(f"  {'checkpoint':<15} {mem['path']}")
        say(f"  {'weights':<15} {_gib(mem['weights'])}")
        say(f"  {'kv cache':<15} {_gib(mem['kv_cache'])} at max_context {mem['max_context']} (KV + state)")
        say(f"  {'scratch':<15} {_gib(mem['scratch'])} (activations and one prefill chunk of "
            f"{mem['prefill_chunk']} rows, the automatic choice)")
        say(f"  {'total':<15} {_gib(mem['total'])} of {_gib(budget)} {mem['budget_kind']}"
            + ("" if mem["fits"] else f"  TOO LARGE: {mem['refusal']}"))
        say(f"  {'':<15} (as the runtime sizes it at load)")

    def show(r):
        err_s = "" if r.error is None else f"error {r.error:.3g}"
        say(f"  {r.status:<8} {r.kernel:<34} {err_s:<16} {r.seconds:6.2f} s"
            + (f"\n           {r.detail}" if r.status in ("FAIL", "ERROR") else ""))

    results, model_results, e2e = [], [], []
    size = Size(model=True, rows=rows or (SIM_MODEL_ROWS if name == "sim" else 4096))
    if dev is not None:
        say(f"\nkernels on {name} (random inputs from seed {seed}; error = worst |got - exact| / tolerance)")
        results = run_checks(dev, kernels, seed=seed, progress=show, size=TOY)
        if not quick:
            if not kernels:  # first: seconds, where the model's shapes take minutes (hours on the simulator)
                say(f"\nend to end (the embedded demo model on {name} against the numpy reference)")
                e2e = end_to_end(name, seed)
                for r in e2e:
                    say(f"  {r.status:<8} {r.kernel:<26} {r.seconds:6.2f} s\n           {r.detail}")
            say(f"\nkernels at the model's shapes (hidden 2048, 256 experts top-8, vocabulary 248,320, head dims 256 "
                f"and 128, prefill chunks of {size.rows} rows, contexts to 8192)"
                + ("; on the simulator this takes an hour or more (--quick skips it), and the model's chunk of "
                   "4096 rows (--rows 4096) hours" if name == "sim" else ""))
            model_results = run_checks(dev, kernels, seed=seed, progress=show, size=size)
    report["kernels"] = [r.as_dict() for r in results]
    if not quick:
        report["model_shapes"] = {"rows": size.rows, "kernels": [r.as_dict() for r in model_results]}
        report["end_to_end"] = [r.as_dict() for r in e2e]
    counts: dict = {}
    for r in results + model_results:
        counts[r.status] = counts.get(r.status, 0) + 1
    e2e_bad = [r for r in e2e if r.status != "PASS"]
    failed = bool(err) or "error" in mem or not mem.get("fits", True) or bool(counts.get("FAIL") or counts.get("ERROR")) or any(
        not p["built"] for p in report.get("pipelines", [])) or bool(e2e_bad)
    report["summary"] = {"ok": not failed, "counts": counts, "seconds": round(time.perf_counter() - t0, 1)}
    if as_json:
        print(json.dumps(report, indent=2, default=str), file=out)
        return 1 if failed else 0

    say("\n--- paste this into a bug report ---")
    say(f"lily {sysi['lily']} | {sysi['os']} {sysi['arch']} | {sysi['chip']} | python {sysi['python']}")
    if "xcode" in sysi:
        say(f"xcode: {sysi['xcode']} | metal: {sysi['metal_compiler']} | sdk: {sysi['sdk']}")
    say(f"build: {sysi['native_build']}")
    if dev is None:
        say(f"device {name}: FAILED to open: {err}")
    else:
        say(f"device {_device_line(name, dev)} | tensor ops: "
            f"{'yes' if dev.supports_tensor_ops else dev.tensor_ops_status}"
            + (f" | tensor bfloat: {dev.bfloat_tensor_ops_status}"
               if dev.supports_tensor_ops and not dev.supports_bfloat_tensor_ops else "")
            + f" | prefill attention: {report['device']['tensor_attention_path']['detail']}")
    if "error" in mem:
        say(f"memory: FAILED: {_short(mem['error'])}")
    else:
        say(f"memory: {mem['name']} weights {_gib(mem['weights'])} + KV/state {_gib(mem['kv_cache'])} "
            f"(max_context {mem['max_context']}) + scratch {_gib(mem['scratch'])} (prefill chunk "
            f"{mem['prefill_chunk']}) = {_gib(mem['total'])} of {_gib(mem['budget'])} "
            f"{mem['budget_kind']}: {'fits' if mem['fits'] else 'TOO LARGE'}")
    say(f"seed: {seed}")
    pipes = report.get("pipelines", [])
    if pipes:
        failed_p = [p["kernel"] for p in pipes if not p["built"]]
        say(f"pipelines: {len(pipes) - len(failed_p)} of {len(pipes)} built"
            + (f"; FAILED: {', '.join(failed_p)}" if failed_p else ""))
        tg = report["device"].get("threadgroup_memory", {})
        if tg.get("status") == "differs":
            say("tg memory differs: " + ", ".join(f"{d['kernel']} {d['declared']}/{d['compiled']}"
                                                  for d in tg["differs"]))
    say("kernels: " + (", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "not run (no device)")
        + ("" if quick else f" (small shapes and the model's, chunks of {size.rows} rows)"))
    for label, rs in (("", results), ("model shapes: ", model_results)):
        for r in rs:
            if r.status in ("FAIL", "ERROR"):
                say(f"  {r.status} {label}{r.kernel}: {_short(r.detail)}")
    if e2e:
        say("end to end: " + "; ".join(f"{r.kernel} {r.status}" for r in e2e))
        for r in e2e_bad:
            say(f"  {r.status} {r.kernel}: {_short(r.detail)}")
    say("--- end ---")
    return 1 if failed else 0


def _core_devices() -> list[str]:
    """The native devices this build has (a function: tests stand in another build)."""
    return list(_core.compiled_devices())


def _device_line(name: str, dev) -> str:
    """'sim (apple10): simulator, no GPU tested' or 'metal: Apple M4 Pro (apple9)'."""
    if name == "sim":
        return f"sim ({dev.gpu_family}): simulator, no GPU tested"
    return f"{name}: {dev.name} ({dev.gpu_family})"


def _or_dash(v) -> str:
    return "-" if v is None else str(v)


def _short(text: str, limit: int = 200) -> str:
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= limit else text[:limit - 3] + "..."
