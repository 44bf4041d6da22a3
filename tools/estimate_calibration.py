#!/usr/bin/env python3
"""How `lily estimate`'s constants are calibrated, and how far the data pin them (an ESTIMATE's
foundations; docs/performance.md, "An honest estimate"): every table that page quotes.

    tools/estimate_calibration.py decode        the scenario machines: decode and prefill refits, exclusions
    tools/estimate_calibration.py validate      the decode and prefill calibrations out of sample
    tools/estimate_calibration.py engines       the tensor rate from MLX-LM's and pplx-garden's prefill
    tools/estimate_calibration.py cross         one engine's fit predicting the other's prefill (design transfer)
    tools/estimate_calibration.py residency     MLX-LM's prefill fit against the threadgroup memory per core
    tools/estimate_calibration.py corners       latency constants moved one at a time off the scenario corners
    tools/estimate_calibration.py sensitivity   each constant alone at its ends (4K decode; 4K, 32K, 128K prefill)
    tools/estimate_calibration.py targets       what issue 27's prefill targets need of the attention, per length
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from lily.lab import calibration, estimate, tensor_rate
from lily.lab.published import PPLX_PUBLISHED_M5MAX

CFG = estimate.model_config()


def _figures(m: estimate.Machine, cache: dict) -> tuple:
    """Decode tok/s at 4K and 128K, prefill tok/s at 4K and 32K on ``m``."""
    return (1 / estimate.decode_step(m, CFG, 4096).seconds, 1 / estimate.decode_step(m, CFG, 131072).seconds,
            4096 / estimate.prefill(m, CFG, 4096, 4096, cache).seconds,
            32768 / estimate.prefill(m, CFG, 32768, 4096, cache).seconds)


def decode() -> None:
    sc = estimate.scenarios(estimate.machine("m5max"))
    print("*** ESTIMATE *** scenario machines: decode refit (efficiency, gap, rms / largest error) and prefill refit "
          "to pplx-garden (GEMMs, attention, per chunk, rms / largest), the efficiencies our plan takes")
    for end in ("likely", "low", "high", "excluded"):
        for m in sc[end]:
            c = m.calibration
            d, p = c["decode"], c["prefill"]
            print(f"{end:8s} {c['rule']:14s} {c['run']} dram {m.latency['dram'] * 1e9:3.0f} ns overlap "
                  f"{m.loop_overlap:1.0f} | eff {d['bandwidth_efficiency']:.3f} gap {d['stage_gap_us']:4.2f} us "
                  f"{100 * d['rms_relative_error']:.2f}/{100 * d['max_relative_error']:.1f}% | GEMMs "
                  f"{p['tensor_efficiency']:.2f} attention {p['attention_efficiency']:.2f} {p['chunk_ms']:4.1f} ms "
                  f"{100 * p['rms_relative_error']:.1f}/{100 * p['max_relative_error']:.1f}% | ours "
                  f"{m.path_efficiency['tensor_bf16']:.3f} / {m.attention_efficiency:.3f}"
                  + (f"  EXCLUDED: {c['excluded']}" if c["excluded"] else ""))


def validate() -> None:
    print("*** ESTIMATE *** decode calibration out of sample (relative error of the predicted lengths)")
    for run in estimate.RUNS:
        for split, r in calibration.out_of_sample(run=run).items():
            errs = " ".join(f"{L}:{100 * e:+.1f}%" for L, e in r["errors"].items())
            print(f"{run} {split:12s} eff {r['bandwidth_efficiency']:.3f} gap {r['stage_gap_us']:5.2f} us "
                  f"rms {100 * r['rms']:4.1f}% max {100 * r['max_abs']:4.1f}%  {errs}")
    print("*** ESTIMATE *** prefill fits out of sample (efficiencies and per-chunk cost fitted on one part, the "
          "other predicted; likely machine)")
    for engine in ("pplx_garden", "mlx_lm"):
        for run in estimate.RUNS:
            for split, r in tensor_rate.held_out(engine, run=run).items():
                errs = " ".join(f"{L}:{100 * e:+.1f}%" for L, e in r["errors"].items())
                print(f"{engine:11s} {run} {split:11s} GEMMs {r['tensor_efficiency']:.2f} attention "
                      f"{r['attention_efficiency']:.2f} chunk {r['chunk_ms']:5.1f} ms (fit {100 * r['fit_rms']:.1f}%) "
                      f"rms {100 * r['rms']:4.1f}% max {100 * r['max_abs']:4.1f}%  {errs}")


def _fit_line(r: dict) -> str:
    errs = " ".join(f"{x['prompt']}:{100 * (x['modelled_tok_s'] / x['measured_tok_s'] - 1):+.1f}%" for x in r["rows"])
    bound = f" (at bound: {', '.join(r['at_bound'])})" if r["at_bound"] else ""
    return (f"GEMMs {r['tensor_efficiency']:.2f} attention {r['attention_efficiency']:.2f} chunk {r['chunk_ms']:5.1f} ms "
            f"rms {100 * r['rms_relative_error']:4.1f}% max {100 * r['max_relative_error']:4.1f}%{bound}  {errs}")


def engines() -> None:
    m = estimate.likely_machine(estimate.machine("m5max"))
    print("*** ESTIMATE *** tensor efficiency of engines measured on an M5 Max (lily.lab.tensor_rate; likely machine)")
    short = (256, 512, 1024, 2048, 4096, 8192)
    for engine in ("pplx_garden", "mlx_lm"):
        for run in estimate.RUNS:
            for lengths in (None, short):
                r = tensor_rate.fit_engine(engine, m, run, lengths=lengths)
                print(f"{engine:11s} {run} {'<=8K' if lengths else 'all '} {_fit_line(r)}")


def cross() -> None:
    print("*** ESTIMATE *** each engine's fitted efficiencies predicting the other's published prefill (only its "
          "per-chunk cost fitted; likely machine)")
    for run in estimate.RUNS:
        r = tensor_rate.cross_engine(run=run)
        for name, p in r["predictions"].items():
            errs = " ".join(f"{L}:{100 * e:+.1f}%" for L, e in p["errors"].items())
            print(f"{run} {name:22s} chunk {p['chunk_ms']:5.1f} ms rms {100 * p['rms']:4.1f}% max "
                  f"{100 * p['max_abs']:4.1f}%  {errs}")
        print(f"{run} spread of the fitted efficiencies: GEMMs {100 * r['spread']['tensor']:.1f}%, attention "
              f"{100 * r['spread']['attention']:.1f}% (margins used: {100 * estimate.GEMM_SPREAD:.0f}%, "
              f"{100 * estimate.ATTENTION_SPREAD:.0f}%)")


def residency() -> None:
    m = estimate.likely_machine(estimate.machine("m5max"))
    print("*** ESTIMATE *** the engines' fits against the threadgroup memory a core holds (likely machine otherwise)")
    for kib in (32, 36, 40, 44, 45, 48, 54, 56, 60, 64):
        x = replace(m, tg_memory_per_core=kib * 1024)
        for run in estimate.RUNS:
            r = tensor_rate.fit_engine("mlx_lm", x, run)
            p = tensor_rate.fit_engine("pplx_garden", x, run)
            bound = f" (at bound: {', '.join(r['at_bound'])})" if r["at_bound"] else ""
            print(f"{kib:3d} KiB {run} MLX-LM GEMMs {r['tensor_efficiency']:.2f} attention "
                  f"{r['attention_efficiency']:.2f} rms {100 * r['rms_relative_error']:4.1f}%{bound} | pplx-garden "
                  f"rms {100 * p['rms_relative_error']:.1f}%")


def corners() -> None:
    """Each latency constant moved alone off each latency point of the scenarios (to its other
    levels), with the other constants at the end's values, the calibrations refit: does any
    figure leave the range the scenarios give?"""
    base = estimate.machine("m5max")
    sc = estimate.scenarios(base)
    cache: dict = {}
    every = [_figures(m, cache) for m in sc["likely"] + sc["low"] + sc["high"]]
    lo, hi = [min(f[i] for f in every) for i in range(4)], [max(f[i] for f in every) for i in range(4)]
    names = ("decode 4K", "decode 128K", "prefill 4K", "prefill 32K")
    print("*** ESTIMATE *** latency constants moved one at a time off the scenarios' latency points (refit; "
          "core_bandwidth rule, 2026-09-02 run); range of the scenarios: "
          + ", ".join(f"{n} {a:,.1f}-{b:,.1f}" for n, a, b in zip(names, lo, hi)))
    outside = 0
    for end in ("low", "high"):
        vals = {k: getattr(c, end) for k, c in estimate.CONSTANTS.items() if k not in estimate.LATENCY_CONSTANTS}
        for n, point in enumerate(estimate.LATENCY_POINTS):
            lat = {k: getattr(estimate.CONSTANTS[k], e) for k, e in point.items()}
            for k in estimate.LATENCY_CONSTANTS:
                for to in sorted({"low", "likely", "high"} - {point[k]}):
                    m = estimate._scenario(base, {**vals, **lat, k: getattr(estimate.CONSTANTS[k], to)},
                                           estimate.LIKELY_RULE, estimate.RUNS[0])
                    if m.calibration["excluded"]:
                        continue
                    f = _figures(m, cache)
                    out = [f"{n} {x:,.1f}" for n, x, a, b in zip(names, f, lo, hi) if not a * 0.999 <= x <= b * 1.001]
                    outside += bool(out)
                    if out:
                        print(f"{end} ends, latency point {n}, {k} -> {to}: outside: {', '.join(out)}")
    print(f"{outside} of the moves leave the range")


def sensitivity() -> None:
    m = estimate.likely_machine(estimate.machine("m5max"))
    cache: dict = {}

    def figures(x):
        return (1 / estimate.decode_step(x, CFG, 4096).seconds,
                *(L / estimate.prefill(x, CFG, L, 4096, cache).seconds for L in (4096, 32768, 131072)))

    d, *p = figures(m)
    print(f"*** ESTIMATE *** each constant alone at its low / high end (likely: decode {d:.1f} at 4K, prefill "
          f"{' / '.join(f'{v:,.0f}' for v in p)} tok/s at 4K / 32K / 128K; calibrations not refit)")
    for name, c in estimate.CONSTANTS.items():
        lo, hi = figures(estimate.with_constants(m, {name: c.low})), figures(estimate.with_constants(m, {name: c.high}))
        pre = "   ".join(f"{L} {a:7,.0f} / {b:7,.0f}" for L, a, b in zip(("4K", "32K", "128K"), lo[1:], hi[1:]))
        print(f"{name:22s} decode {lo[0]:6.1f} / {hi[0]:6.1f}   prefill {pre}")


def _needed(seconds, lo: float, hi: float, goal: float) -> float | None:
    """The smallest efficiency in [lo, hi] (to 0.001) whose prefill takes at most ``goal``
    seconds (``seconds(efficiency)`` falls as the efficiency rises); None if even ``hi`` is
    too slow."""
    if seconds(hi) > goal:
        return None
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if seconds(mid) <= goal else (mid, hi)
    return hi


def target_rows(ratio: float = 1.25) -> list[dict]:
    """Issue 27's prefill targets (the likely figure >= ``ratio`` x MLX-LM's published M5 Max
    rate, the low figure above it) against the attention, per published length: MLX-LM's rate,
    the likely and low tok/s (the low: the slowest scenario machine, as `lily estimate`), the
    attention's share of the likely time, the tensor efficiency the attention would need
    (everything else as estimated) for the likely figure to reach ``ratio`` x MLX-LM
    (``need``) and, on every low scenario machine at once, for the low figure to reach 1.0x
    (``need_low``; ``low_efficiency``: the attention's on the slowest machine today), each None
    where no attention could (or equal to the efficiency it has where the target is met); and,
    the attention kept as estimated, the factor by which everything else would have to run
    faster for the likely target (``rest``: 1.0 where met, None where no such factor exists)."""
    base = estimate.machine("m5max")
    m = estimate.likely_machine(base)
    lows = estimate.scenarios(base)["low"]
    cache: dict = {}

    def secs(x: estimate.Machine, L: int, eff: float | None = None) -> float:
        x = x if eff is None else replace(x, attention_efficiency=eff)
        return estimate.prefill(x, CFG, L, 4096, cache).seconds

    def low_secs(L: int, eff: float) -> float:  # the low figure's time, every low machine's attention at eff
        return max(secs(x, L, eff) for x in lows)

    rows = []
    for L, published in PPLX_PUBLISHED_M5MAX.items():
        mlx = published[3]
        t = estimate.prefill(m, CFG, L, 4096, cache)
        att = t.families["attention"]
        goal = L / (ratio * mlx)
        slowest = max(lows, key=lambda x, n=L: secs(x, n))  # the low figure's machine
        low = L / secs(slowest, L)
        rows.append({
            "prompt": L, "mlx_lm": mlx, "likely": L / t.seconds, "attention_share": att / t.seconds,
            "efficiency": m.attention_efficiency,
            "need": _needed(lambda e, n=L: secs(m, n, e), m.attention_efficiency, 1.0, goal),
            "rest": 1.0 if t.seconds <= goal else ((t.seconds - att) / (goal - att) if goal > att else None),
            "low": low, "low_efficiency": slowest.attention_efficiency,
            "need_low": slowest.attention_efficiency if low >= mlx else
            _needed(lambda e, n=L: low_secs(n, e), slowest.attention_efficiency, 1.0, L / mlx),
        })
    return rows


def targets(ratio: float = 1.25) -> None:
    rows = target_rows(ratio)
    m = estimate.likely_machine(estimate.machine("m5max"))
    transfer = estimate.CONSTANTS["attention_transfer"].likely
    print(f"*** ESTIMATE *** the attention efficiency (of the {m.rates['tensor_bf16'] / 1e12:.1f} TFLOPS tensor peak) "
          f"issue 27's prefill targets need, the rest as estimated; the likely machine's attention "
          f"{rows[0]['efficiency']:.2f} (pplx-garden's fitted {rows[0]['efficiency'] / transfer:.2f} x the design "
          f"transfer {transfer:.2f}: MLX's fitted efficiency); '--' met, '> 1' out of reach")
    print(f"  prompt  MLX-LM tok/s   likely (x)   attention share   needs for x{ratio:.2f}   or the rest   low (x)   "
          "its attention   needs for 1.0x")

    def shown(v, have):
        return "> 1" if v is None else ("--" if v <= have + 1e-3 else f"{v:.3f}")

    for r in rows:
        rest = "--" if r["rest"] == 1.0 else ("none" if r["rest"] is None else f"x{r['rest']:.3f}")
        print(f"{r['prompt']:8d} {r['mlx_lm']:12,.0f} {r['likely']:8,.0f} ({r['likely'] / r['mlx_lm']:4.2f}) "
              f"{100 * r['attention_share']:12.0f}% {shown(r['need'], r['efficiency']):>17s} {rest:>13s} "
              f"{r['low']:8,.0f} ({r['low'] / r['mlx_lm']:4.2f}) {r['low_efficiency']:10.2f} "
              f"{shown(r['need_low'], r['low_efficiency']):>17s}")


def main() -> None:
    commands = {"decode": decode, "validate": validate, "engines": engines, "cross": cross, "residency": residency,
                "corners": corners, "sensitivity": sensitivity, "targets": targets}
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=tuple(commands))
    commands[ap.parse_args().what]()


if __name__ == "__main__":
    main()
