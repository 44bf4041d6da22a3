#!/usr/bin/env python3
"""How `lily estimate`'s constants are calibrated, and how far the data pin them (an ESTIMATE's
foundations; docs/performance.md, "An honest estimate"): every table that page quotes.

    tools/estimate_calibration.py decode        the decode calibrations behind low / likely / high
    tools/estimate_calibration.py validate      the decode calibration out of sample
    tools/estimate_calibration.py engines       the tensor rate from MLX-LM's and pplx-garden's prefill
    tools/estimate_calibration.py sensitivity   each constant alone at its ends (4K decode, 4K prefill)
"""

from __future__ import annotations

import argparse

import numpy as np

from lily.lab import calibration, estimate, tensor_rate


def decode() -> None:
    sc = estimate.scenarios(estimate.machine("m5max"))
    print("*** ESTIMATE *** decode calibrations (bandwidth efficiency, stage gap) per scenario machine")
    for end, machines in sc.items():
        for m in machines:
            print(f"{end:6s} {m.occupancy_rule:15s} latency dram {m.latency['dram'] * 1e9:4.0f} ns  "
                  f"loop overlap {m.loop_overlap:3.0f}  efficiency {m.bandwidth_efficiency:.3f}  "
                  f"gap {m.stage_gap * 1e6:5.2f} us")


def validate() -> None:
    print("*** ESTIMATE *** decode calibration out of sample (relative error of the predicted lengths)")
    for run in estimate.RUNS:
        for split, r in calibration.out_of_sample(run=run).items():
            errs = " ".join(f"{L}:{100 * e:+.1f}%" for L, e in r["errors"].items())
            print(f"{run} {split:12s} eff {r['bandwidth_efficiency']:.3f} gap {r['stage_gap_us']:5.2f} us "
                  f"rms {100 * r['rms']:4.1f}% max {100 * r['max_abs']:4.1f}%  {errs}")


def engines() -> None:
    print("*** ESTIMATE *** tensor efficiency of engines measured on an M5 Max (lily.lab.tensor_rate)")
    grid, att = np.arange(0.30, 1.001, 0.05), np.arange(0.20, 1.001, 0.10)
    short = (256, 512, 1024, 2048, 4096, 8192)
    for engine in ("pplx_garden", "mlx_lm"):
        for run in estimate.RUNS:
            for lengths in (None, short):
                r = tensor_rate.fit_engine(engine, run=run, tensor_grid=grid, param_grid=att, lengths=lengths)
                errs = " ".join(f"{x['prompt']}:{100 * (x['modelled_tok_s'] / x['measured_tok_s'] - 1):+.1f}%"
                                for x in r["rows"])
                print(f"{engine:11s} {run} {'<=8K' if lengths else 'all '} GEMMs {r['tensor_efficiency']:.2f} "
                      f"attention {r['attention_efficiency']:.2f} chunk {r['chunk_ms']:5.1f} ms "
                      f"rms {100 * r['rms_relative_error']:4.1f}%  {errs}")


def sensitivity() -> None:
    cfg = estimate.model_config()
    m = estimate.scenarios(estimate.machine("m5max"))["likely"][0]

    def figures(x):
        return 1 / estimate.decode_step(x, cfg, 4096).seconds, 4096 / estimate.prefill(x, cfg, 4096, 4096, {}).seconds

    d, p = figures(m)
    print(f"*** ESTIMATE *** each constant alone at its low / high end (likely: decode {d:.1f}, prefill {p:,.0f} tok/s "
          "at 4K; decode calibration not refit)")
    for name, c in estimate.CONSTANTS.items():
        (dl, pl), (dh, ph) = figures(estimate.with_constants(m, {name: c.low})), figures(estimate.with_constants(m, {name: c.high}))
        print(f"{name:22s} decode {dl:6.1f} / {dh:6.1f}   prefill {pl:7,.0f} / {ph:7,.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("decode", "validate", "engines", "sensitivity"))
    {"decode": decode, "validate": validate, "engines": engines, "sensitivity": sensitivity}[ap.parse_args().what]()


if __name__ == "__main__":
    main()
