"""The import graph keeps its rooms (docs/architecture.md): the engine, the server and the native
backend never import the lab (lily.lab: doctor, bench, estimate, the kernel twins and the test
support), nor name a lab module in a string (which importlib, runpy, pkgutil or exec could
load); the CLI imports a lab module only inside the command that runs it, and only
lily/__main__.py imports the CLI; the lab's own modules stay flat (estimate and bench read the
published figures, not each other); and the host contract (lily.backend) depends on no device."""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys

import lily

# The sources being tested: the checkout's when the tests run from one (an edit there counts
# before it is installed), else the installed package's.
_CHECKOUT = pathlib.Path(__file__).resolve().parents[1] / "src" / "lily"
SRC = _CHECKOUT if (_CHECKOUT / "__init__.py").is_file() else pathlib.Path(lily.__file__).parent


def _loaded(*modules: str, then: str = "") -> set[str]:
    code = (f"import sys\nfor m in {list(modules)!r}: __import__(m)\n{then}\n"
            "import json; print(json.dumps(sorted(m for m in sys.modules if m.startswith('lily'))))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out))


def _lab(modules: set[str]) -> set[str]:
    return {m for m in modules if m == "lily.lab" or m.startswith("lily.lab.")}


def test_engine_server_and_cli_do_not_load_the_lab():
    # build_parser() runs for every command (lily generate, lily serve): it must not load the lab either
    loaded = _loaded("lily", "lily.engine", "lily.cli", "lily.native_backend", "lily.reference", "lily.server",
                     then="import lily.cli; lily.cli.build_parser()")
    assert "lily.engine" in loaded and "lily.server" in loaded and "lily.native_backend" in loaded
    assert not _lab(loaded)


def test_the_lab_commands_do_not_load_the_test_support():
    loaded = _loaded("lily.lab.bench", "lily.lab.agent_bench", "lily.lab.estimate")
    assert not loaded & {"lily.lab.testing", "lily.lab.device", "lily.lab.doctor", "lily.lab.kernels"}


def _absolute(path: pathlib.Path, node: ast.ImportFrom) -> str | None:
    """The module an ``from ... import`` in ``path`` names, relative ones resolved against
    ``path``'s package (``from .lab import x`` in lily/engine.py: lily.lab)."""
    if not node.level:
        return node.module
    package = ["lily", *path.relative_to(SRC).parent.parts]
    base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
    return ".".join(base + ([node.module] if node.module else []))


# What _imports records for an import_module / __import__ call whose module is computed at run
# time (not a literal, or relative to a package that is not one): no test can see where it goes.
COMPUTED = "<computed>"
# The non-lab modules allowed such a call, with the reason (none today).
COMPUTED_IMPORTS_ALLOWED: dict[str, str] = {}


def _arg(call: ast.Call, at: int, name: str):
    """Argument ``name`` of ``call``, given at position ``at`` or by keyword; None if absent."""
    if len(call.args) > at:
        return call.args[at]
    return next((k.value for k in call.keywords if k.arg == name), None)


def _dynamic(path: pathlib.Path, call: ast.Call) -> str | None:
    """The module an ``importlib.import_module(name, package)`` or ``__import__(name, ...,
    level)`` call in ``path`` loads, relative names resolved (against ``package``, or for
    __import__ against ``path``'s own package); COMPUTED when it is not a literal; None when
    the call is not one of them."""
    func = call.func
    fname = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if fname not in ("import_module", "__import__"):
        return None
    name = _arg(call, 0, "name")
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        return COMPUTED
    module = name.value
    if fname == "import_module":
        level = len(module) - len(module.lstrip("."))
        if not level:
            return module
        package = _arg(call, 1, "package")
        if not (isinstance(package, ast.Constant) and isinstance(package.value, str)):
            return COMPUTED
        base = package.value.split(".")
    else:
        level_node = _arg(call, 4, "level")
        if level_node is None:
            return module
        if not (isinstance(level_node, ast.Constant) and isinstance(level_node.value, int)):
            return COMPUTED
        level = level_node.value
        if not level:
            return module
        base = ["lily", *path.relative_to(SRC).parent.parts]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    rest = module.lstrip(".")
    return ".".join(base + ([rest] if rest else []))


def _imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """(lily module, inside a function) for each import in ``path``'s source, import_module /
    __import__ calls included (COMPUTED where their module is not a literal)."""
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            module = _absolute(path, child) if isinstance(child, ast.ImportFrom) else None
            if module and module.startswith("lily"):
                out.extend([(module, in_function)] + [(f"{module}.{a.name}", in_function) for a in child.names])
            elif isinstance(child, ast.Import):
                out.extend((a.name, in_function) for a in child.names if a.name.startswith("lily"))
            elif isinstance(child, ast.Call) and (module := _dynamic(path, child)):
                if module == COMPUTED or module.startswith("lily"):  # importlib.import_module("lily.lab...")
                    out.append((module, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))
    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return out


def test_only_the_cli_imports_the_lab_and_only_in_its_commands():
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("lab/"):
            continue
        imports = _imports(path)
        assert all(m != COMPUTED for m, _ in imports) or rel in COMPUTED_IMPORTS_ALLOWED, \
            f"src/lily/{rel} imports a module whose name is computed at run time"
        lab = [(m, local) for m, local in imports if m == "lily.lab" or m.startswith("lily.lab.")]
        if rel == "cli.py":
            assert lab and all(local for _, local in lab), f"cli.py imports the lab at import time: {lab}"
        else:
            assert not lab, f"src/lily/{rel} imports the lab: {sorted({m for m, _ in lab})}"


# A string naming a lab or CLI module: absolute (lily.lab, lily.lab.doctor:x), relative (.lab,
# ..cli) or the tail a computed name ends with ("lily." + "lab.doctor"; __import__'s level).
NAMES_LAB = re.compile(r"\blily\.lab\b|(?<![\w.])\.+lab\b|^lab(\.|$)")
NAMES_CLI = re.compile(r"\blily\.cli\b|(?<![\w.])\.+cli\b|^cli(\.|$)")


def _strings(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of each string constant in ``path``'s source that is not a docstring
    (f-strings' literal parts included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_engine_code_names_no_lab_module_in_a_string():
    """``im = importlib.import_module; im("lily.lab.doctor")``, ``getattr(importlib,
    "import_module")(...)``, ``pkgutil.resolve_name("lily.lab.doctor:x")``,
    ``runpy.run_module(...)`` and ``exec("from lily.lab import doctor")`` load the lab without an
    import statement: outside the lab and the CLI no string names it."""
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("lab/") or rel == "cli.py":
            continue
        named = [f"{line}: {text!r}" for line, text in _strings(path) if NAMES_LAB.search(text)]
        assert not named, f"src/lily/{rel} names a lab module in a string: {named}"


def test_only_main_imports_the_cli():
    """lily.cli imports the lab inside its commands, so a module importing it (by a statement,
    importlib or a string) would reach the lab: only lily/__main__.py may."""
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel in ("__main__.py", "cli.py"):
            continue
        cli = sorted({m for m, _ in _imports(path) if m == "lily.cli" or m.startswith("lily.cli.")})
        assert not cli, f"src/lily/{rel} imports the CLI: {cli}"
        named = [f"{line}: {text!r}" for line, text in _strings(path) if NAMES_CLI.search(text)]
        assert not named, f"src/lily/{rel} names the CLI module in a string: {named}"


def test_the_lab_is_flat():
    def imported(module):
        return {m for m, _ in _imports(SRC / "lab" / f"{module}.py")}
    assert not imported("estimate") & {"lily.lab.bench", "lily.lab.doctor"}
    assert not imported("bench") & {"lily.lab.doctor", "lily.lab.estimate"}


def _lily_imports(module: str) -> set[str]:
    """The lily modules ``module``'s source imports (at any level, relative ones resolved)."""
    path = SRC.joinpath(*module.split(".")[1:]).with_suffix(".py")
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (name := _absolute(path, node)) and name.startswith("lily"):
            out.add(name)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("lily")}
    return out


def test_host_contract_depends_on_no_device():
    assert _lily_imports("lily.backend") <= {"lily.constraints", "lily.sampling", "lily.errors"}
    assert _lily_imports("lily.constraints") <= {"lily.errors"}
    assert "lily.native_backend" not in _lily_imports("lily.reference")
