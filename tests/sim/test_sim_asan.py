"""The simulator tests under AddressSanitizer (docs/verification.md): builds lily._core with
-DLILY_SANITIZE=address (tools/run_sim_asan.sh) and runs the simulator and kernel tests (tests/sim/, tests/kernels/) against it.

Needs cmake, a C++ compiler with ASan and nanobind in this environment; skipped otherwise.
The build directory (build/asan) is reused, so later runs only rebuild what changed.
Set LILY_SKIP_ASAN=1 to skip."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "run_sim_asan.sh"


def _missing():
    if os.environ.get("LILY_SKIP_ASAN") or os.environ.get("LILY_IN_ASAN"):
        return "LILY_SKIP_ASAN set (or already running under ASan)"
    if sys.platform != "linux":
        # tools/run_sim_asan.sh preloads the Linux ASan runtime (LD_PRELOAD) into the
        # interpreter; macOS needs DYLD_INSERT_LIBRARIES and an unsigned Python.
        return "the ASan run is Linux-only (tools/run_sim_asan.sh preloads the Linux ASan runtime)"
    if not SCRIPT.exists() or not (ROOT / "CMakeLists.txt").exists():
        return "needs the source tree"
    for tool in ("cmake", "bash"):
        if not shutil.which(tool):
            return f"{tool} not found"
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        return "no C++ compiler"
    if importlib.util.find_spec("nanobind") is None:
        return "nanobind not installed in this environment (pip install nanobind)"
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
def test_simulator_under_address_sanitizer():
    import fcntl

    env = dict(os.environ, PYTHON=sys.executable, LILY_IN_ASAN="1")
    build = ROOT / "build" / "asan"
    build.parent.mkdir(parents=True, exist_ok=True)
    with open(ROOT / "build" / "asan.lock", "w") as lock:  # concurrent test runs share build/asan
        fcntl.flock(lock, fcntl.LOCK_EX)
        r = subprocess.run(["bash", str(SCRIPT), str(build)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    assert "AddressSanitizer" not in r.stderr, tail
    assert " passed" in r.stdout, tail
