"""Shared fixtures. Checkpoint fixtures live in fixtures_checkpoints.py."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fixtures_checkpoints import (  # noqa: E402,F401
    checkpoint_cache_dir,
    dims_checkpoint,
    tiny_checkpoint,
    tiny_hf_checkpoint,
    tokenizer_dir,
)

from lily.engine import AUTO_DEVICE_ENV, Engine, auto_device, default_model_path  # noqa: E402
from seeding import SESSION_SEED  # noqa: E402
from simdev import ASAN_SKIP, NATIVE_DEVICES, native_device, share_cpus  # noqa: E402,F401


# xdist workers inherit the environment: one session seed for all of them, so the seed the
# header prints replays a failure on any worker
os.environ["LILY_TEST_SEED"] = str(SESSION_SEED)
# the simulator's OS threads: each xdist worker takes its share of the CPUs (tests/simdev.py)
share_cpus()

# device="auto" resolves to the simulator here, as it resolves to the GPU (metal) on a Mac: a
# test that silently assumes the default device is the numpy reference fails on Linux first
# (issue 28). Tests whose point is not the device name theirs. LILY_AUTO_DEVICE=reference
# runs the suite as before.
if "metal" not in NATIVE_DEVICES and "sim" in NATIVE_DEVICES:
    os.environ.setdefault(AUTO_DEVICE_ENV, "sim")

# native engines write aligned weight caches (lily.weight_cache): keep this session's apart
if not os.environ.get("LILY_CACHE_DIR"):
    os.environ["LILY_CACHE_DIR"] = tempfile.mkdtemp(prefix="lily-weight-cache-")
    atexit.register(shutil.rmtree, os.environ["LILY_CACHE_DIR"], True)
# lily estimate keeps its reference fits between runs (lily.lab.estimate.fits_cache_file): one
# cache for the session's workers and the commands they start, none left behind
if not os.environ.get("LILY_ESTIMATE_CACHE"):
    os.environ["LILY_ESTIMATE_CACHE"] = tempfile.mkdtemp(prefix="lily-estimate-cache-")
    atexit.register(shutil.rmtree, os.environ["LILY_ESTIMATE_CACHE"], True)


def pytest_report_header(config):
    return [f"random inputs: LILY_TEST_SEED={SESSION_SEED} (set it to replay this run)",
            f"device='auto' resolves to {auto_device()!r} ({AUTO_DEVICE_ENV}={os.environ.get(AUTO_DEVICE_ENV, '')!r})"]


@pytest.fixture(scope="session")
def demo_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def demo_engine() -> Engine:
    """One reference engine on the embedded demo model, shared by read-mostly tests.
    Tests that use it must leave no assumptions about the session contents."""
    return Engine.load(device="reference")


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("LILY_IN_ASAN"):
        return
    skip = pytest.mark.skip(reason="heavy case, skipped under AddressSanitizer (tests/simdev.py)")
    for item in items:
        if any(p in item.nodeid for p in ASAN_SKIP):
            item.add_marker(skip)
