"""The checks ``lily doctor`` walks: one per shipped kernel, registered by the family modules
(:func:`lily.lab.kernels.harness.check`), run on fresh random inputs from a printed seed.

    results = run_checks(device)            # every kernel of device.kernel_names()
    for r in results: print(r.kernel, r.status, r.error)

A result's ``error`` is the worst ratio of |got - exact| to the kernel's tolerance (PASS
when <= 1), or for exact kernels (argmax, routing ids) 0 or 1. Kernels whose name starts
with ``st_`` are the simulator's self-test kernels (metal/selftest*.metal, registered only in
the simulator, never in the shipped metallib), not part of the model; they are not checked
here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from lily.errors import InvalidParameterError
from lily.lab.kernels import (  # noqa: F401 (each family module registers its checks on import)
    attention, attention_prefill, embed, gdn, gdn_prefill, gemm, gemv, moe, moe_prefill, norm, sample,
)
from lily.lab.kernels.harness import CHECKS, TOY, Mismatch, Result, Size

SELFTEST_PREFIX = "st_"

#: Shipped kernels that have no check yet: ``lily doctor`` reports them as NO CHECK.
#: tests/test_doctor.py keeps this list exact, so a new kernel without a check fails a test.
PENDING: frozenset[str] = frozenset()


def shipped_kernels(dev) -> list[str]:
    """The model's kernels in ``dev``'s library (its self-test kernels left out), sorted."""
    return sorted(k for k in dev.kernel_names() if not k.startswith(SELFTEST_PREFIX))


def kernel_seed(seed: int, kernel: str) -> np.random.SeedSequence:
    """The seed of ``kernel``'s inputs: depends on (seed, name) only, not on which other
    kernels run or in what order."""
    return np.random.SeedSequence(seed, spawn_key=tuple(kernel.encode()))


def run_checks(dev, kernels: list[str] | None = None, seed: int | None = None,
               progress: Callable[[Result], None] | None = None, size: Size = TOY) -> list[Result]:
    """Checks ``kernels`` (default: every shipped kernel of ``dev``) once each, at ``size``
    (:data:`~lily.lab.kernels.harness.TOY` or a model size).

    ``seed`` (a non-negative int) fixes the random inputs (default: fresh ones). Each
    kernel's generator comes from (seed, kernel name) alone, so checking a subset draws the
    same inputs for a kernel as checking all of them. Unknown names raise
    InvalidParameterError (a ValueError);
    a kernel without a check gives a NO CHECK result. ``progress`` is called per result.
    """
    names = shipped_kernels(dev)
    if kernels is not None:
        unknown = [k for k in kernels if k not in names]
        if unknown:
            raise InvalidParameterError(f"unknown kernel(s) {', '.join(unknown)}; this library has: "
                                        f"{', '.join(names)}")
        names = list(kernels)
    if seed is None:
        seed = np.random.SeedSequence().entropy
    results = []
    for name in names:
        child = kernel_seed(seed, name)
        fn = CHECKS.get(name)
        t0 = time.perf_counter()
        if fn is None:
            res = Result(name, "NO CHECK", detail="no reference check for this kernel yet")
        else:
            try:
                res = Result(name, "PASS", fn(dev, np.random.default_rng(child), name, size))
            except Mismatch as e:
                res = Result(name, "FAIL", e.error, str(e))
            except Exception as e:  # noqa: BLE001 (a dispatch error is a finding to report, not a crash)
                res = Result(name, "ERROR", None, f"{type(e).__name__}: {e}")
        res.seconds = time.perf_counter() - t0
        results.append(res)
        if progress:
            progress(res)
    return results
