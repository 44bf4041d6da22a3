"""The shipped type stubs of lily._core (src/lily/_core.pyi) name exactly the module's real
functions, classes and class members, so they cannot go stale: after changing a binding,
regenerate them with ``python tools/make_core_stub.py``."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import lily
from lily import _core

STUB = Path(lily.__file__).resolve().parent / "_core.pyi"
PLATFORM_ONLY = {"metal_device": "metal"}  # stubbed everywhere, built only with that device


def _stub_names() -> dict[str, set[str] | None]:
    """Top-level stub names -> member names (classes) or None (functions, constants)."""
    out: dict[str, set[str] | None] = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            out[node.name] = members
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = None
    return out


def _public(names) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def test_stub_is_shipped_and_parses():
    assert STUB.is_file(), "lily/_core.pyi is not installed with the package"
    assert _stub_names()


def test_stub_matches_module():
    stub = _stub_names()
    real = {n for n in _public(dir(_core)) if not inspect.ismodule(getattr(_core, n))}
    devices = set(_core.compiled_devices())
    expected_missing = {n for n, dev in PLATFORM_ONLY.items() if dev not in devices}
    assert real - set(stub) == set(), "bound but not in the stub (run tools/make_core_stub.py)"
    assert set(stub) - real == expected_missing, "in the stub but not bound"
    for name, members in stub.items():
        obj = getattr(_core, name, None)
        if members is None or obj is None:
            continue
        got = _public(vars(obj))  # what the class itself defines (methods, properties, FIELDS)
        assert got == _public(members), f"{name}: bound only {sorted(got - members)}, stub only {sorted(members - got)}"
