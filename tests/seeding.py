"""Fresh random inputs per test run, reproducible on demand.

Each run draws a session seed (or takes ``LILY_TEST_SEED``) and prints it in the pytest
header; ``fresh_rng(*key)`` mixes it with a test's own key, so every run exercises new
inputs while a failure can be replayed with ``LILY_TEST_SEED=<seed> pytest ...``.
"""

from __future__ import annotations

import os
import secrets

import numpy as np

SESSION_SEED = int(os.environ.get("LILY_TEST_SEED") or secrets.randbits(32))


def fresh_rng(*key) -> np.random.Generator:
    """A generator seeded by the session seed and ``key`` (non-negative ints)."""
    return np.random.default_rng([SESSION_SEED, *(abs(int(k)) for k in key)])
