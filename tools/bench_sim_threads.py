"""Wall time of the simulator (device ``sim``) by OS-thread count: one prefill chunk and
decode steps of a whole model, the thread counts interleaved round by round so that a shared
machine's load falls on all of them alike (docs/device-layer.md, "Speed").

    python tools/bench_sim_threads.py [MODEL] [--threads 1,2] [--chunk 64] [--steps 4] [--rounds 3]

MODEL: a checkpoint directory (default: the embedded demo model). Each thread count gets its
own engine, loaded once; every round prefills ``--chunk`` random tokens as one chunk from an
empty session, then runs ``--steps`` greedy decode steps. Printed: the median prefill-chunk
and decode-step time per thread count and the median of the per-round ratios to the first
count (a speedup above 1 is faster), and the process's CPU time per prefill chunk and decode
step (its growth with the thread count is the pool's overhead: on a machine whose cores are
busy with other work the wall-clock speedup cannot show, the CPU time still can). These are
timings of the CPU simulator, not of a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def _counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads takes comma-separated counts, not {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--threads takes counts of at least 1, not {text!r}")
    return counts


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}")
    return int(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the demo model)")
    ap.add_argument("--threads", type=_counts, default=[1, 2], help="thread counts, e.g. 1,2,16 (default 1,2)")
    ap.add_argument("--chunk", type=_positive, default=64, help="prefill chunk in tokens (default 64)")
    ap.add_argument("--steps", type=_positive, default=4, help="decode steps per round (default 4)")
    ap.add_argument("--rounds", type=_positive, default=3, help="rounds (default 3)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)

    from lily.engine import Engine
    engines = {}
    for t in args.threads:
        t0 = time.perf_counter()
        engines[t] = Engine.load(args.model, device="sim", max_context=args.chunk + args.steps + 1,
                                 prompt_cache_bytes=0,
                                 device_options={"prefill_chunk": args.chunk, "device_options": {"threads": t}})
        print(f"threads={t}: loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    vocab = engines[args.threads[0]].config.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, args.chunk).tolist()
    prefill = {t: [] for t in args.threads}
    decode = {t: [] for t in args.threads}
    cpu = {t: [[], []] for t in args.threads}  # process CPU seconds: prefill chunks, decode steps
    for r in range(args.rounds):
        for t, e in engines.items():
            e.reset()
            t0, c0 = time.perf_counter(), time.process_time()
            logits = e.prefill(ids)
            prefill[t].append(time.perf_counter() - t0)
            cpu[t][0].append(time.process_time() - c0)
            steps, c0 = [], time.process_time()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                logits = e.decode(int(logits.argmax()))
                steps.append(time.perf_counter() - t0)
            cpu[t][1].append((time.process_time() - c0) / args.steps)
            decode[t].append(statistics.median(steps))
            print(f"round {r + 1} threads={t}: prefill chunk {prefill[t][-1]:.3f} s (cpu {cpu[t][0][-1]:.3f}), "
                  f"decode step {decode[t][-1]:.3f} s (cpu {cpu[t][1][-1]:.3f})", file=sys.stderr)
    base = args.threads[0]
    rows = []
    for t in args.threads:
        rows.append({"threads": t, "prefill_chunk_s": statistics.median(prefill[t]),
                     "decode_step_s": statistics.median(decode[t]),
                     "prefill_speedup": statistics.median(b / x for b, x in zip(prefill[base], prefill[t])),
                     "decode_speedup": statistics.median(b / x for b, x in zip(decode[base], decode[t])),
                     "prefill_cpu_s": statistics.median(cpu[t][0]), "decode_cpu_s": statistics.median(cpu[t][1])})
    name = args.model or "demo model"
    print(f"{name}: prefill chunk of {args.chunk} tokens, decode step (median of {args.rounds} rounds; "
          f"speedup: median per-round ratio to threads={base})")
    print(f"{'threads':>7} {'prefill s':>10} {'speedup':>8} {'cpu s':>7} {'decode s':>9} {'speedup':>8} {'cpu s':>7}")
    for row in rows:
        print(f"{row['threads']:>7} {row['prefill_chunk_s']:>10.3f} {row['prefill_speedup']:>8.2f} "
              f"{row['prefill_cpu_s']:>7.3f} {row['decode_step_s']:>9.3f} {row['decode_speedup']:>8.2f} "
              f"{row['decode_cpu_s']:>7.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": name, "chunk": args.chunk, "steps": args.steps, "rounds": args.rounds,
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
