#!/usr/bin/env python3
"""Per-kernel split of `lily estimate` (an ESTIMATE, docs/performance.md): one prefill chunk
or one decode step of the real model, each kernel's share of the estimated time (a barrier
stage's time split over its dispatches in proportion to their own roofline times, as
`lily.estimate.time_records` splits it over families), its dispatch count and declared bytes.

    tools/estimate_kernels.py prefill [ROWS] [--machine m5max]     (ROWS: 4096)
    tools/estimate_kernels.py decode [CONTEXT] [--machine m5max]   (CONTEXT: 4096)
    tools/estimate_kernels.py decode-options [CONTEXT] [--machine m5max]

A decode step is the mean of one write-back window of steps (the DeltaNet state is written
back every state_window steps; docs/decode.md). decode-options compares the plan with its
state written back every step (state_window 1) and with a change costed and not built, the
DeltaNet step in its in_proj's barrier stage (docs/performance.md, "The 4K decode target").
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from lily.lab import estimate
from lily.native_backend import count_decode_step, count_decode_window, count_prefill_chunk


def by_kernel(m: estimate.Machine, records: list) -> tuple[float, int, dict]:
    """(seconds, stages, {kernel: [seconds, dispatches, bytes]}) of ``records`` on ``m``."""
    stages: dict = defaultdict(list)
    for r in records:
        stages[(r["pass"], r["stage"])].append(r)
    per: dict = defaultdict(lambda: [0.0, 0, 0.0])
    total = 0.0
    for recs in stages.values():
        # one stage's time, as estimate.time_records computes it
        t = estimate.time_records(m, recs).seconds
        each = [estimate.dispatch_seconds(m, r) for r in recs]
        total += t
        for r, s in zip(recs, each):
            k = per[r["kernel"]]
            k[0] += t * s / sum(each) if sum(each) else t / len(recs)
            k[1] += 1
            k[2] += r["work"]["bytes"]
    return total, len(stages), per


def step_in_projection_stage(records: list) -> list:
    """``records`` with each DeltaNet decode step moved into the barrier stage of the in_proj
    before it, as if a completion counter per head let the last in_proj threadgroup of a head
    run its step (tails and the counters' cost not modelled: an upper bound)."""
    out = []
    for r in records:
        if r["kernel"].startswith("gdn_decode_step"):
            r = dict(r, stage=out[-1]["stage"])
        out.append(r)
    return out


def window_records(cfg, context: int) -> list[list]:
    """The records of each step of one state write-back window at ``context`` (the plan's
    mean step; lily.native_backend.count_decode_window)."""
    return [c["records"] for c in count_decode_window(cfg, context)]


def decode_options(m: estimate.Machine, cfg, context: int) -> list:
    """[(label, tok/s, stages, GB)] of the decode step at ``context``: the plan, the plan with
    the DeltaNet state written back every step (state_window 1, as before the window), and
    the costed, unbuilt move of the DeltaNet step into its in_proj's stage."""
    every = count_decode_step(cfg, context, state_window=1)
    window = window_records(cfg, context)
    variants = [(f"today (state written every {len(window)} steps)", window),
                ("state written every step", [every["records"]]),
                ("today + step in in_proj's stage", [step_in_projection_stage(r) for r in window])]
    rows = []
    for label, steps in variants:
        t = estimate.mean_timing([estimate.time_records(m, r) for r in steps])
        rows.append((label, 1 / t.seconds, t.stages, t.bytes / 1e9))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("prefill", "decode", "decode-options"))
    ap.add_argument("size", nargs="?", type=int, default=4096, help="chunk rows (prefill) or context (decode)")
    ap.add_argument("--machine", default="m5max")
    a = ap.parse_args()
    m, cfg = estimate.machine(a.machine), estimate.model_config()
    if a.what == "decode-options":
        print(f"*** ESTIMATE *** {m.name}: decode at {a.size}")
        for label, tps, stages, gb in decode_options(m, cfg, a.size):
            print(f"{label:38s} {tps:7.1f} tok/s  {stages:4d} stages  {gb:6.3f} GB/step")
        return
    if a.what == "prefill":
        steps = [count_prefill_chunk(cfg, a.size, 0, gemm_path=estimate.gemm_path(m))["records"]]
    else:
        steps = window_records(cfg, a.size)  # the mean step of a write-back window
    total, stages, per = 0.0, 0, defaultdict(lambda: [0.0, 0, 0.0])
    for records in steps:
        t, stages, p = by_kernel(m, records)
        total += t / len(steps)
        for k, (sec, n, b) in p.items():
            per[k][0] += sec / len(steps)
            per[k][1] += n / len(steps)
            per[k][2] += b / len(steps)
    print(f"*** ESTIMATE *** {m.name}: {a.what} {a.size}: {total * 1e3:.2f} ms, {stages} barrier stages")
    for k, (s, n, b) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        print(f"{k:40s} {s * 1e3:9.3f} ms  {round(n):4d} dispatches  {b / 1e9:8.3f} GB")


if __name__ == "__main__":
    main()
