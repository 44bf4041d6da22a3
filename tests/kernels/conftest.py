"""Fixtures of the kernel tests: the devices each kernel runs on (tests/simdev.py); their
helpers are in tests/harness.py."""

from __future__ import annotations

import pytest
from harness import METAL, ORDERS, TIMES, make_dev


@pytest.fixture(scope="module", params=ORDERS + (["metal"] if METAL else []))
def dev(request):
    """The simulator in each mode of ``ORDERS`` (kernel correctness tests run in all), and the
    Metal GPU where this build has it."""
    return make_dev(request.param)


@pytest.fixture(scope="module", params=["forward"] + (["metal"] if METAL else []))
def fwd_dev(request):
    """One simulator mode only (``forward``), for long drift, statistical and real-size runs;
    and the Metal GPU where this build has it."""
    return make_dev(request.param)


def pytest_terminal_summary(terminalreporter, config):
    """The simulator wall time per kernel (harness.commit), in a verbose run (-v)."""
    if TIMES and config.option.verbose > 0:
        terminalreporter.section("simulator time per kernel (kernel tests)")
        for name, t in sorted(TIMES.items()):
            terminalreporter.write_line(f"  {name:50s} {t * 1000:9.1f} ms")
