"""Machine, OS and toolchain facts for the lab's reports (``lily doctor``, ``lily bench``)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from lily import __version__, _core


def _first_line(cmd: list[str]) -> str | None:
    """The first output line of a command, or None when it is missing or fails."""
    if not shutil.which(cmd[0]):
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = (r.stdout or r.stderr).strip().splitlines()
    return out[0].strip() if r.returncode == 0 and out else None


def _chip() -> str:
    if sys.platform == "darwin":
        return _first_line(["sysctl", "-n", "machdep.cpu.brand_string"]) or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _physical_memory() -> int | None:
    if sys.platform == "darwin":
        v = _first_line(["sysctl", "-n", "hw.memsize"])
        return int(v) if v and v.isdigit() else None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _build(info: dict) -> str:
    std = {201703: "C++17", 202002: "C++20"}.get(info.get("cxx_standard"), f"C++ {info.get('cxx_standard')}")
    return (f"{info.get('compiler')}, {std}, {info.get('platform')}{', debug' if info.get('debug') else ''}; "
            f"devices: {', '.join(info.get('devices', [])) or 'none'}")


def system_info() -> dict:
    """Machine, OS and toolchain facts (strings; None where not found)."""
    info = {
        "lily": __version__,
        "native_build": _build(_core.build_info()),
        "python": platform.python_version(),
        "os": (f"macOS {platform.mac_ver()[0]}" if sys.platform == "darwin" else platform.platform()),
        "arch": platform.machine(),
        "chip": _chip(),
        "memory_bytes": _physical_memory(),
    }
    if sys.platform == "darwin":
        info["xcode"] = _first_line(["xcodebuild", "-version"])
        info["metal_compiler"] = _first_line(["xcrun", "-sdk", "macosx", "metal", "--version"])
        info["sdk"] = _first_line(["xcrun", "--show-sdk-version"])
    return info
