"""The simulator modes and native devices the kernel and native-runtime tests run on (the
kernel tests' ``dev`` / ``fwd_dev`` fixtures: tests/kernels/conftest.py).

* ``forward``: dispatch order, with ``verify_writes`` (a byte written outside a dispatch's
  declared write ranges is an error);
* ``reverse``: threadgroups and threads in reverse order, plus ``verify_reads`` (undeclared
  bytes are zeroed and the dispatch re-run: an undeclared read changes the output);
* ``random``: threadgroups and threads in a seeded random order (a missing barrier or a
  race between threadgroups changes the result).

Under AddressSanitizer (``LILY_IN_ASAN``, tools/run_sim_asan.sh) only ``reverse`` runs: the
sanitizer looks for memory errors, which the order does not create, and ``reverse``
exercises the most simulator code (re-runs, zeroing).

Threads: a simulator device runs threadgroups on ``lily._core.sim_default_threads()`` OS
threads unless told otherwise (``$LILY_SIM_THREADS``, else every CPU). Under pytest-xdist the
CPUs are already shared by the workers, so :func:`share_cpus` (tests/conftest.py) gives each
worker's simulators their share (CI: 2 workers on 2 cores, one thread each, today's serial
simulator); a single-process run keeps every CPU. Tests about the parallel simulator name
their thread counts (tests/sim/test_sim_parallel.py).
"""

from __future__ import annotations

import os

import pytest

THREAD_ORDERS = {
    "forward": dict(verify_writes=True),
    "reverse": dict(verify_writes=True, verify_reads=True, thread_order="reverse"),
    "random": dict(verify_writes=True, thread_order="random", seed=1),
}

#: Fixture parameters: the modes to run kernel tests in.
ORDERS = ["reverse"] if os.environ.get("LILY_IN_ASAN") else list(THREAD_ORDERS)


def share_cpus() -> None:
    """Under pytest-xdist, sets ``LILY_SIM_THREADS`` (unless set) to this worker's share of
    the CPUs, at least 1, so the workers' simulators do not oversubscribe them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers and not os.environ.get("LILY_SIM_THREADS"):
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ["LILY_SIM_THREADS"] = str(max(1, cpus // workers))


def _compiled() -> list[str]:
    try:
        from lily.lab.device import devices
        return devices()
    except ImportError:
        return []


#: The native devices every kernel and native-runtime test runs on: the simulator, and the
#: Apple GPU where this build has it (so one pytest on a Mac checks every kernel on the GPU).
NATIVE_DEVICES = [d for d in ("sim", "metal") if d in _compiled()]
METAL = "metal" in NATIVE_DEVICES


def make_dev(param: str):
    """The device of a fixture parameter: a simulator mode of ``THREAD_ORDERS``, or the GPU."""
    if param == "metal":
        from lily import _core
        return _core.metal_device()
    from lily.lab.device import sim_device
    return sim_device(**THREAD_ORDERS[param])

#: Tests skipped under AddressSanitizer (matched against the pytest node id): real-model
#: shapes, long drift runs and statistical tests of kernels whose smaller, ragged cases run
#: there anyway, and tests that only run the compiler. Under ASan the simulator is ~5x
#: slower; these cases would add minutes without exercising other memory-access patterns.
ASAN_SKIP = (
    "test_gdn_decode_drift_512_steps", "test_sample_token_distribution_chi_square",
    "random[real]", "_random[real]", "test_moe_gate_up_swiglu[real]", "test_moe_down[real]",
    "test_norm_gemv[gdn-real]", "test_norm_gemv[attn-real]", "test_drift_several_chunks",
    "test_topk_real_size", "test_time_lm_head_shape", "test_moe_chain_real_shape",
    "test_attn_prefill_prep[reverse-4000", "test_scan_matches_float64[reverse-real",
    "test_scan_matches_float64[reverse-dims-100]", "test_outside_the_subset_does_not_compile",
    "test_threadgroup_storage_with_any_constant_size", "test_threadgroup_size_expression_is_shared",
    "test_fiber_switch",  # builds and runs the fiber layer alone, not instrumented
    # the parallel simulator: the whole runtime (2 min under ASan) and the attention families'
    # bit identity (their kernels run in the kernel tests); the other families and the
    # concurrency tests run
    "test_generation_is_bit_identical_on_two_threads", "bit_identical_on_several_threads[attention",
)


@pytest.fixture(scope="module", params=NATIVE_DEVICES)
def native_device(request) -> str:
    """The name of each native device (``sim``; ``metal`` where built) for Engine.load."""
    return request.param

