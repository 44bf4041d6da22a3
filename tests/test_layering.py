"""The import graph keeps its rooms (docs/architecture.md): the engine, CLI and server never
import the test support shipped in the package (lily.testing, lily._device), and the host
contract (lily.backend) depends on no device."""

from __future__ import annotations

import ast
import json
import subprocess
import sys


def _loaded(*modules: str) -> set[str]:
    code = (f"import sys\nfor m in {list(modules)!r}: __import__(m)\n"
            "import json; print(json.dumps(sorted(m for m in sys.modules if m.startswith('lily'))))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out))


def test_runtime_modules_do_not_import_test_support():
    loaded = _loaded("lily", "lily.engine", "lily.cli", "lily.native", "lily.bench", "lily.server")
    assert "lily.engine" in loaded and "lily.server" in loaded
    assert not loaded & {"lily.testing", "lily._device"}


def _lily_imports(module: str) -> set[str]:
    """The lily modules ``module``'s source imports (at any level)."""
    import importlib.util
    spec = importlib.util.find_spec(module)
    tree = ast.parse(open(spec.origin, encoding="utf-8").read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lily"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("lily")}
    return out


def test_host_contract_depends_on_no_device():
    assert _lily_imports("lily.backend") <= {"lily.constraints", "lily.sampling", "lily.errors"}
    assert _lily_imports("lily.constraints") <= {"lily.errors"}
    assert "lily.native" not in _lily_imports("lily.reference")
