#!/usr/bin/env python3
"""Per-kernel split of `lily estimate` (an ESTIMATE, docs/performance.md): one prefill chunk
or one decode step of the real model, each kernel's share of the estimated time (a barrier
stage's time split over its dispatches in proportion to their own roofline times, as
`lily.perf.time_records` splits it over families), its dispatch count and declared bytes.

    tools/estimate_kernels.py prefill [ROWS] [--machine m5max]     (ROWS: 4096)
    tools/estimate_kernels.py decode [CONTEXT] [--machine m5max]   (CONTEXT: 4096)
    tools/estimate_kernels.py decode-options [CONTEXT] [--machine m5max]

decode-options times two changes to the decode step that were costed and not built
(docs/performance.md, "Two ways to the 4K decode target"): the DeltaNet state written back
every W steps instead of every step, and the DeltaNet step in its in_proj's barrier stage.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from lily import perf
from lily.native import count_decode_step, count_prefill_chunk


def by_kernel(m: perf.Machine, records: list) -> tuple[float, int, dict]:
    """(seconds, stages, {kernel: [seconds, dispatches, bytes]}) of ``records`` on ``m``."""
    stages: dict = defaultdict(list)
    for r in records:
        stages[(r["pass"], r["stage"])].append(r)
    per: dict = defaultdict(lambda: [0.0, 0, 0.0])
    total = 0.0
    for recs in stages.values():
        # one stage's time, as perf.time_records computes it
        t = perf.time_records(m, recs).seconds
        each = [perf.dispatch_seconds(m, r) for r in recs]
        total += t
        for r, s in zip(recs, each):
            k = per[r["kernel"]]
            k[0] += t * s / sum(each) if sum(each) else t / len(recs)
            k[1] += 1
            k[2] += r["work"]["bytes"]
    return total, len(stages), per


def deferred_state(records: list, cfg, window: int) -> list:
    """``records`` with each DeltaNet decode step's state traffic as if the state were written
    back every ``window`` steps: the step reads the last written state and replays the pending
    steps' rank-1 updates from a ring of (delta rows, k, g) it appends to; averaged over a window
    (``window`` 1: today's plan)."""
    hv, dv, dk, hk = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim, \
        cfg.linear_num_key_heads
    state = (hv * dv * dk + hv * dv) * 4           # S' and the per-row decay c, fp32
    pending = (hv * dv + hk * dk + hv) * 4          # one step's delta rows, normalised k, g
    # written: 1/window of the state and one ring entry; read: on average (window - 1) / 2 entries
    saved = state * (1 - 1 / window) - (pending * (window + 1) / 2 if window > 1 else 0)
    out = []
    for r in records:
        if r["kernel"].startswith("gdn_decode_step"):
            r = dict(r, work=dict(r["work"], bytes=r["work"]["bytes"] - saved))
        out.append(r)
    return out


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


def decode_options(m: perf.Machine, cfg, context: int) -> list:
    """[(label, tok/s, stages, GB)] of the decode step at ``context`` and its costed variants."""
    base = count_decode_step(cfg, context)["records"]
    variants = [("today", base)]
    variants += [(f"state written every {w} steps", deferred_state(base, cfg, w)) for w in (2, 4, 8, 16)]
    variants.append(("step in in_proj's stage", step_in_projection_stage(base)))
    variants.append(("both (state every 16 steps)", step_in_projection_stage(deferred_state(base, cfg, 16))))
    rows = []
    for label, recs in variants:
        t = perf.time_records(m, recs)
        rows.append((label, 1 / t.seconds, t.stages, t.bytes / 1e9))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("prefill", "decode", "decode-options"))
    ap.add_argument("size", nargs="?", type=int, default=4096, help="chunk rows (prefill) or context (decode)")
    ap.add_argument("--machine", default="m5max")
    a = ap.parse_args()
    m, cfg = perf.machine(a.machine), perf.model_config()
    if a.what == "decode-options":
        print(f"*** ESTIMATE *** {m.name}: decode at {a.size}")
        for label, tps, stages, gb in decode_options(m, cfg, a.size):
            print(f"{label:32s} {tps:7.1f} tok/s  {stages:4d} stages  {gb:6.3f} GB/step")
        return
    if a.what == "prefill":
        records = count_prefill_chunk(cfg, a.size, 0, gemm_path=perf.gemm_path(m))["records"]
    else:
        records = count_decode_step(cfg, a.size)["records"]
    total, stages, per = by_kernel(m, records)
    print(f"*** ESTIMATE *** {m.name}: {a.what} {a.size}: {total * 1e3:.2f} ms, {stages} barrier stages")
    for k, (s, n, b) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        print(f"{k:40s} {s * 1e3:9.3f} ms  {n:4d} dispatches  {b / 1e9:8.3f} GB")


if __name__ == "__main__":
    main()
