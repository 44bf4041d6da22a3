"""Writes src/lily/_core.pyi, the type stubs of the native module, from the built module
(nanobind's stubgen) with the FIELDS tuples typed and the macOS-only metal_device, which a
Linux build does not have. Run it after changing a binding
(tests/test_core_stub.py fails until the stub matches the module):

    python tools/make_core_stub.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "lily" / "_core.pyi"
METAL_DEVICE = '''

# Built on macOS only (LILY_HAVE_METAL).
def metal_device(metallib: str = '') -> Device:
    """The system's Metal GPU with lily.metallib (from beside this module by default)."""
'''


def main() -> None:
    subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "lily._core", "-o", str(OUT)], check=True)
    text = OUT.read_text()
    text = text.replace("    FIELDS: tuple = ...", "    FIELDS: tuple[str, ...]")
    # sim_device validates `threads` itself (an int, not a bool), so it is bound untyped
    text = text.replace("threads: object | None = None", "threads: int | None = None")
    # struct -> (size, ((field, "uint" | "float", byte offset, count), ...)); name -> value
    text = text.replace("KERNEL_ARGS: dict = ...", "KERNEL_ARGS: dict[str, tuple[int, tuple[tuple[str, str, int, int], ...]]]")
    text = text.replace("CONSTANTS: dict = ...", "CONSTANTS: dict[str, int | float]")
    text = text.replace("COST_PATHS: tuple = ...", "COST_PATHS: tuple[str, ...]")
    text = text.replace("LATENCY_KINDS: tuple = ...", "LATENCY_KINDS: tuple[str, ...]")
    text = re.sub(r"EXPERT_TILE_ROWS: tuple = \(.*\)", "EXPERT_TILE_ROWS: tuple[int, ...]", text)
    if "def metal_device(" not in text:
        text = text.rstrip("\n") + "\n" + METAL_DEVICE
    OUT.write_text(text)


if __name__ == "__main__":
    main()
