"""The simulator modes kernel tests run in (one definition for every kernel test module).

* ``forward``: dispatch order, with ``verify_writes`` (a byte written outside a dispatch's
  declared write ranges is an error);
* ``reverse``: threadgroups and threads in reverse order, plus ``verify_reads`` (undeclared
  bytes are zeroed and the dispatch re-run: an undeclared read changes the output);
* ``random``: threadgroups and threads in a seeded random order (a missing barrier or a
  race between threadgroups changes the result).

Under AddressSanitizer (``LILY_IN_ASAN``, tools/run_sim_asan.sh) only ``reverse`` runs: the
sanitizer looks for memory errors, which the order does not create, and ``reverse``
exercises the most simulator code (re-runs, zeroing).
"""

from __future__ import annotations

import os

THREAD_ORDERS = {
    "forward": dict(verify_writes=True),
    "reverse": dict(verify_writes=True, verify_reads=True, thread_order="reverse"),
    "random": dict(verify_writes=True, thread_order="random", seed=1),
}

#: Fixture parameters: the modes to run kernel tests in.
ORDERS = ["reverse"] if os.environ.get("LILY_IN_ASAN") else list(THREAD_ORDERS)
