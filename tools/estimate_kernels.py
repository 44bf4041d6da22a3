#!/usr/bin/env python3
"""Per-kernel split of `lily estimate` (an ESTIMATE, docs/performance.md): one prefill chunk
or one decode step of the real model, each kernel's share of the estimated time (a barrier
stage's time split over its dispatches in proportion to their own roofline times, as
`lily.perf.time_records` splits it over families), its dispatch count and declared bytes.

    tools/estimate_kernels.py prefill [ROWS] [--machine m5max]     (ROWS: 4096)
    tools/estimate_kernels.py decode [CONTEXT] [--machine m5max]   (CONTEXT: 4096)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("prefill", "decode"))
    ap.add_argument("size", nargs="?", type=int, default=4096, help="chunk rows (prefill) or context (decode)")
    ap.add_argument("--machine", default="m5max")
    a = ap.parse_args()
    m, cfg = perf.machine(a.machine), perf.model_config()
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
