#!/usr/bin/env python3
"""Checks Lily's Metal code against Apple's macOS 26 SDK headers, without a Mac
(docs/verification.md, "Apple's headers").

    tools/check_sdk26.py OVERLAY [--sdk12 DIR] [--compile]

OVERLAY is a directory laid out like an SDK root (System/Library/Frameworks/...) holding the
macOS 26 headers to check against: Metal.framework and MetalPerformancePrimitives.framework
headers, complete or just the files Lily needs (read them from a macOS 26 SDK, e.g. the
public alexey-lysiuk/macos-sdk repository's MacOSX26.0.sdk, or `xcrun --show-sdk-path` on
a Mac). Never commit SDK files.

1. Metal API audit: every Metal method, property, constant and function that
   csrc/gpu/metal/metal_device.mm uses, looked up in the overlay's Metal headers (else the
   macOS 12 SDK's, with --sdk12): where it is declared, since which macOS, and whether it
   is deprecated there. A used API that the newest headers deprecate fails the check.
2. Tensor API: the matmul2d_descriptor constructor, fields and modes, the matmul2d template
   and each member the shipped kernels call (run, get_destination_cooperative_tensor,
   get_left_input_cooperative_tensor, get_right_input_cooperative_tensor) as Apple declares
   it (template parameters, parameter types, return type, const `this`), against the
   simulator's stand-in (csrc/gpu/sim/msl/MetalPerformancePrimitives/); then every getter
   and run() call of the kernels against Apple's declaration: the member declared, an element
   type or a tensor type where the parameter takes one, and a cooperative tensor as an operand
   only where Apple's SFINAE condition admits one (MacOSX 26.1's does not: it has no
   cooperative inputs; 26.2's does); the execution scopes against those the header names.
   cooperative_tensor's members and the tensor types are declared by the Metal compiler's own
   <metal_tensor>, which no SDK holds: not checked. Then the operand element types
   metal/*_tensor.metal and *_tensor.h use against the types Apple's header maps (bfloat
   only under __HAVE_BFLOAT__). Each matmul2d run() of the shipped kernels is read as an
   (A, B, C) combination (element types, address spaces) and checked against the operand
   table in Apple's header comment; one the table lacks passes only if the load-time probe
   pipeline that guards it runs the same combination, so that an OS without it falls back
   to the simdgroup_matrix kernels instead of failing: tensor_ops_probe (gemm_tensor.metal)
   runs the GEMMs' form, tensor_ops_probe_bfloat (attention_prefill_tensor.metal) the
   attention's (MacOSX 26.0's table lists half x half only, 26.1's bfloat x bfloat too: run
   the check against each to see which combinations each lists).
3. --compile (needs --sdk12 and a complete Metal.framework in the overlay): assembles the
   overlay on top of the macOS 12 SDK and runs tools/check_objc.sh on the result with
   deprecations as errors.

Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MM = ROOT / "csrc" / "gpu" / "metal" / "metal_device.mm"
SHIM_MPP = ROOT / "csrc" / "gpu" / "sim" / "msl" / "MetalPerformancePrimitives" / "MetalPerformancePrimitives.h"
FRAMEWORKS = Path("System/Library/Frameworks")


def headers(root: Path, framework: str) -> list[Path]:
    base = root / FRAMEWORKS / f"{framework}.framework"
    found = {p.name: p for p in sorted(base.glob("Versions/*/Headers/**/*.h"))}
    found.update({p.name: p for p in sorted(base.glob("Headers/**/*.h"))})
    return list(found.values())


def tensor_sources() -> list[Path]:
    """Lily's Metal 4 tensor-op sources: metal/*_tensor.metal and the headers only they
    include (metal/*_tensor.h)."""
    metal = ROOT / "metal"
    return sorted([*metal.glob("*_tensor.metal"), *metal.glob("*_tensor.h")])


# ---- declarations -------------------------------------------------------------------------

MACOS_RE = re.compile(r"macos\(([\d.]+)(?:\s*,\s*([\d.]+))?\)")


def macro_args(decl: str, name: str) -> list[str]:
    """The argument text of every ``name(...)`` in decl (balanced parentheses)."""
    out = []
    for m in re.finditer(r"\b" + name + r"\s*\(", decl):
        depth, i = 1, m.end()
        while i < len(decl) and depth:
            depth += {"(": 1, ")": -1}.get(decl[i], 0)
            i += 1
        out.append(decl[m.end():i - 1])
    return out


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", " ", text)


def split_top(text: str) -> list[str]:
    """text split at the commas outside parentheses."""
    out, depth, cur = [], 0, []
    for c in text:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if c == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    out.append("".join(cur))
    return out


def declarations(path: Path) -> dict[str, str]:
    """name -> declaration text, for the methods (selector), properties, enum constants and
    functions of one Objective-C header."""
    out: dict[str, str] = {}
    text = strip_comments(path.read_text(encoding="utf-8", errors="replace"))
    # each @property / method starts a statement even right after an @interface line
    text = re.sub(r"(@property\b|@interface\b|@protocol\b|@end\b|\n\s*[-+]\s*\()", r";\1", text)
    for stmt in re.split(r";|\{|\}", text):
        s = " ".join(stmt.split())
        m = re.match(r"^[-+]\s*\([^)]*(?:\([^)]*\)[^)]*)*\)\s*(.*)$", s)
        if m:  # a method: its selector
            body = re.sub(r"\([^()]*(?:\([^()]*\)[^()]*)*\)", " ", m.group(1))
            parts = re.findall(r"(\w+)\s*:", body)
            sel = "".join(p + ":" for p in parts) if parts else body.split()[0]
            out.setdefault(sel, s)
            continue
        m = re.match(r"^@property\b.*?(\w+)\s*(?:API_|NS_|$)", s)
        if m:
            out.setdefault(m.group(1), s)
            continue
        fn = re.search(r"\b(MTL\w+)\s*\((?:void)?[^()]*\)\s*(?:API_|NS_|$)", s)
        if fn and ("MTL_EXTERN" in s or "extern" in s):
            out.setdefault(fn.group(1), s)
    for body in re.findall(r"NS_(?:ENUM|OPTIONS)\s*\([^)]*\)\s*\{([^}]*)\}", text):  # enum constants
        for entry in split_top(body):
            e = " ".join(entry.split())
            m = re.match(r"(MTL\w+)", e)
            if m:
                out.setdefault(m.group(1), e)
    return out


def availability(decl: str) -> tuple[str, str]:
    """(macOS it appeared in or '', deprecation note or '')."""
    since = ""
    for args in macro_args(decl, "API_AVAILABLE"):
        mm = MACOS_RE.search(args)
        if mm:
            since = mm.group(1)
    dep = ""
    for macro in ("API_DEPRECATED", "API_DEPRECATED_WITH_REPLACEMENT"):
        for args in macro_args(decl, macro):
            mm = MACOS_RE.search(args)
            if mm:
                note = re.match(r'\s*("[^"]*")', args)
                dep = f"DEPRECATED in macOS {mm.group(2) or '?'}" + (f" ({note.group(1)})" if note else "")
    return since, dep


# ---- what metal_device.mm uses ------------------------------------------------------------


def newest_sdk_branch(source: str) -> str:
    """source as a macOS 26 SDK compiles it: the `#else` branches of `#if
    defined(MAC_OS_VERSION_x)` / `#ifdef MAC_OS_VERSION_x` / `#if defined(__MAC_x)` blocks
    (the fallbacks for older SDKs, which define no such macro) are dropped."""
    out, stack = [], []  # stack: per open #if, whether lines are dropped inside it
    # MAC_OS_VERSION_x_y (Foundation) and __MAC_x_y (Availability.h), and the macros defined
    # only under such a guard
    sdk_macros = {r"MAC_OS_VERSION_\d+(?:_\d+)*", r"__MAC_\d+(?:_\d+)*"}
    for line in source.splitlines():
        t = line.strip()
        if re.match(r"#\s*if", t):
            guard = any(re.search(r"\b" + m + r"\b", t) for m in sdk_macros) and "!" not in t
            stack.append(["sdk" if guard else "other", False])
        elif (m := re.match(r"#\s*define\s+(\w+)", t)) and stack and stack[-1] == ["sdk", False]:
            sdk_macros.add(m.group(1))
        elif re.match(r"#\s*else", t) and stack:
            stack[-1][1] = stack[-1][0] == "sdk"
        elif re.match(r"#\s*endif", t) and stack:
            stack.pop()
            continue
        if not any(drop for _, drop in stack):
            out.append(line)
    return "\n".join(out)


def _top_level(inner: str) -> str:
    """The top level of a message send's text: each nested (...), [...] or {...} group (a
    cast, a nested send as receiver or argument, a block's body) becomes one `_`, so
    `[(id<P>)b foo]` and `[[x y] foo:a bar:b]` read as `_b foo` and `_ foo:a bar:b`."""
    out, depth = [], 0
    for c in inner:
        if c in "([{":
            depth += 1
            if depth == 1:
                out.append("_")
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            out.append(c)
    return "".join(out)


def used_apis(source: str) -> list[str]:
    """Selectors of the Objective-C messages, property names after '.', and MTL* names, in
    the code a macOS 26 SDK compiles."""
    src = strip_comments(newest_sdk_branch(source))
    src = re.sub(r'@?"(?:\\.|[^"\\])*"', '""', src)
    names: set[str] = set()
    stack: list[int] = []
    for i, ch in enumerate(src):  # message sends: [receiver part: arg part: arg]
        if ch == "[":
            stack.append(i)
        elif ch == "]" and stack:
            start = stack.pop()
            flat_s = _top_level(src[start + 1:i])
            m = re.match(r"\s*[\w.>\-]+\s+(\w+)\s*(:?)", flat_s)
            if not m:
                continue
            if m.group(2):  # selector parts: `name:`, not C++'s `std::`
                parts = re.findall(r"(?<![\w:])(\w+)\s*:(?!:)", flat_s[m.start(1):])
                names.add("".join(p + ":" for p in parts))
            else:
                names.add(m.group(1))
    names.update(re.findall(r"\.\s*([a-z]\w*[A-Z]\w*)\b", src))
    names.update(re.findall(r"\b(MTL[A-Z]\w+)\b", src))
    return sorted(names)


NSOBJECT = {"alloc", "init", "new", "copy"}  # NSObject's, also redeclared (unavailable) by a few Metal classes


def _all_declarations(root: Path) -> dict[str, list[tuple[str, str]]]:
    """name -> [(declaration, header)] over a tree's Metal headers, in header order."""
    out: dict[str, list[tuple[str, str]]] = {}
    for h in headers(root, "Metal"):
        for k, v in declarations(h).items():
            out.setdefault(k, []).append((v, h.name))
    return out


def api_audit(newest: Path, older: Path | None, source: str | None = None) -> bool:
    """Prints where each API metal_device.mm (or `source`) uses is declared and its status;
    False when a declaration in the newest headers deprecates one. Names are matched without
    the receiver's type: the first declaration found rules, and a same-named one elsewhere
    that is deprecated is named in a note. A setter `setX:` is matched to property x."""
    new = _all_declarations(newest)
    old = _all_declarations(older) if older else {}
    ok = True
    rows, notes = [], []
    for name in used_apis(source if source is not None else MM.read_text(encoding="utf-8")):
        if name in NSOBJECT:
            continue
        key = name
        if name not in new and name not in old and (m := re.fullmatch(r"set([A-Z]\w*):", name)):
            key = m.group(1)[0].lower() + m.group(1)[1:]  # the property's implicit setter
        where = "26" if key in new else "12" if key in old else None
        if where is None:
            continue  # Foundation, a type name, or a declaration outside the headers given
        decls = (new if where == "26" else old)[key]
        decl, header = decls[0]
        since, dep = availability(decl)
        if dep and where == "26":
            ok = False
        others = sorted({h for d, h in decls[1:] if availability(d)[1]})
        if others and not dep:
            notes.append(f"  note: {name}: a same-named declaration in {', '.join(others)} is deprecated; "
                         "check which one the receiver uses")
        label = name if key == name else f"{name} (property {key})"
        rows.append((label, f"{header} ({'macOS 26 overlay' if where == '26' else 'macOS 12 SDK'})",
                     since or "-", dep or "ok"))
    if not rows:
        if new or old:  # headers were given, yet none declares what metal_device.mm uses
            print("Metal API audit: FAILED (none of metal_device.mm's APIs is declared in the headers given: "
                  "a wrong --sdk12 or overlay path?)")
            return False
        print("Metal API audit: SKIPPED (no Metal.framework headers in the overlay, and no --sdk12)")
        return ok
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"{'API used by metal_device.mm':<{w0}}  {'declared in':<{w1}}  since  status")
    for r in rows:
        print(f"{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]:<5}  {r[3]}")
    for n in notes:
        print(n)
    return ok


# ---- tensor operations --------------------------------------------------------------------


def _ctor_params(text: str) -> list[tuple[str, str]]:
    """(type, default) of matmul2d_descriptor's constructor parameters."""
    m = re.search(r"constexpr\s+matmul2d_descriptor\s*\((.*?)\)\s*(?:thread\s*)?:", strip_comments(text), re.DOTALL)
    out = []
    for p in m.group(1).split(","):
        p = " ".join(p.split())
        default = p.split("=", 1)[1].strip() if "=" in p else ""
        typ = p.split("=", 1)[0].strip().rsplit(" ", 1)[0].strip()
        out.append((typ, default))
    return out


def _template_head(text: str, cls: str) -> str:
    m = re.search(r"template\s*<([^>]*)>\s*class\s+" + cls + r"\b", strip_comments(text))
    return " ".join(re.sub(r"\b(typename|class)\b", "T", m.group(1)).split()) if m else ""


def _descriptor_fields(text: str) -> list[tuple[str, str]]:
    """(type, name) of matmul2d_descriptor's data members, in order."""
    m = re.search(r"struct\s+matmul2d_descriptor\s*\{(.*?)constexpr\s+matmul2d_descriptor", strip_comments(text), re.DOTALL)
    body = re.sub(r"enum class mode\s*\{[^}]*\};?", " ", m.group(1)) if m else ""
    out = []
    for typ, rest in re.findall(r"\b(int|bool|mode)\s+([\w\s,]+);", body):
        out += [(typ, n.strip()) for n in rest.split(",")]
    return out


COOPERATIVE_MEMBERS = ("get_capacity", "is_valid_element", "get_multidimensional_index", "get_mask", "load", "store")
ELEMENT_TYPES = {"half", "float", "bfloat", "int8_t", "uint8_t", "int16_t", "uint16_t", "int32_t", "uint32_t"}
_ELEM = r"(device|threadgroup|thread)\s+(?:const\s+)?(\w+)"
# The load-time probe pipelines (csrc/gpu/metal/metal_device.mm). Prefill takes its tensor path
# only where both build (csrc/runtime/prefill.cpp: supports_tensor_ops() and
# supports_bfloat_tensor_ops()), so a combination either one runs is guarded: an OS whose
# library lacks it fails that probe and prefill runs the simdgroup_matrix kernels.
PROBES = {"tensor_ops_probe": "the GEMMs' operation",                # gemm_tensor.metal
          "tensor_ops_probe_bfloat": "the prefill attention's operations"}  # attention_prefill_tensor.metal


def _tensor_names(texts: list[str]) -> dict[str, tuple[str, str]]:
    """Type aliases and functions that name a tensor type -> (element type, address space)."""
    out: dict[str, tuple[str, str]] = {}
    for t in texts:
        for m in re.finditer(r"\busing\s+(\w+)\s*=\s*tensor<\s*" + _ELEM, t):
            out[m.group(1)] = (m.group(3), m.group(2))
        for m in re.finditer(r"\busing\s+(\w+)\s*=\s*decltype\s*\(([^;]*)\)\s*;", t):  # a cooperative tensor's type
            if (coop := _cooperative_getter(" ".join(m.group(2).split()))) != ("?", "?"):
                out[m.group(1)] = coop
    for t in texts:  # functions returning such a type (after the aliases are known)
        for m in re.finditer(r"\btensor<\s*" + _ELEM + r"[^;{}()]*>\s+(\w+)\s*\(", t):
            out[m.group(3)] = (m.group(2), m.group(1))
        for m in re.finditer(r"\b(\w+)\s*<[^;{}()<>]*>\s+(\w+)\s*\(", t):
            if m.group(1) in out:
                out[m.group(2)] = out[m.group(1)]
    return out


_KEYWORDS = {"return", "else", "case", "delete", "new", "throw", "goto", "do"}


def _cooperative_getter(expr: str) -> tuple[str, str]:
    """(element type, 'cooperative') when expr is a matmul2d getter call
    `op[.template] get_X_cooperative_tensor<...>()`, else ('?', '?')."""
    m = re.search(r"get_(destination|left_input|right_input)_cooperative_tensor<(.*)>\s*\(\s*\)$", expr)
    if not m:
        return ("?", "?")
    args = [a.strip() for a in split_top(m.group(2).replace("<", "(").replace(">", ")"))]
    i = {"left_input": 0, "right_input": 1, "destination": 2}[m.group(1)]  # <left, right, destination> types
    return (args[i] if len(args) > 2 else "?", "cooperative")


def _operand(text: str, var: str, at: int, names: dict[str, tuple[str, str]], depth: int = 0) -> tuple[str, str]:
    """(element type, address space or 'cooperative') of variable `var` as declared last
    before offset `at` in text; the type parameter's name when a template leaves it open,
    '?' when unknown."""
    decl = None
    for m in re.finditer(r"\bauto\s+" + var + r"\s*=\s*([^;]*);|\b(\w+)\s+" + var + r"\s*[({\[]", text[:at]):
        if m.group(2) not in _KEYWORDS:
            decl = m
    if decl is None or depth > 4:
        return ("?", "?")
    if decl.group(2):  # `Alias var(...)`
        return names.get(decl.group(2), ("?", "?"))
    e = " ".join(decl.group(1).split())
    if m := re.match(r"tensor<\s*" + _ELEM, e):
        return (m.group(2), m.group(1))
    if (coop := _cooperative_getter(e)) != ("?", "?"):
        return coop
    if m := re.match(r"(\w+)\s*\.\s*(?:template\s+)?(?:slice|offset|static_slice)\b", e):
        return _operand(text, m.group(1), decl.start(), names, depth + 1)
    if m := re.match(r"(\w+)\s*[<(]", e):
        return names.get(m.group(1), ("?", "?"))
    return ("?", "?")


def operand_combinations(files: list[Path]) -> list[tuple[tuple[str, ...], str]]:
    """((A, A space, B, B space, C, C space or 'cooperative'), where) of every matmul2d run()
    call in files; `where` is file:line, with a probe kernel (PROBES) marked: "(name)"."""
    texts = {f: strip_comments(f.read_text(encoding="utf-8")) for f in files}
    names = _tensor_names(list(texts.values()))
    out = []
    for f, t in texts.items():
        probes = [(p, m.start(), _function_end(t, m.start())) for p in PROBES
                  if (m := re.search(r"\bkernel\s+void\s+" + p + r"\b", t))]
        for m in re.finditer(r"\b\w+\s*\.\s*run\s*\(", t):
            args = [" ".join(a.split()) for a in split_top(t[m.end():_close(t, m.end() - 1)])]
            # an operand is a variable or an array element (`o[j]`): anything else is unread ('?')
            ops = [_operand(t, v.group(1), m.start(), names) if (v := re.fullmatch(r"(\w+)(?:\s*\[[^\]]*\])?", a))
                   else ("?", "?") for a in args]
            ops = (ops + [("?", "?")] * 3)[:3] if len(ops) != 3 else ops
            where = f"{f.name}:{t.count(chr(10), 0, m.start()) + 1}"
            where += "".join(f" ({p})" for p, a, b in probes if a < m.start() < b)
            out.append((tuple(x for op in ops for x in op), where))
    return out


def probe_of(where: str) -> str | None:
    """The probe kernel an operand_combinations `where` is in, if any."""
    m = re.search(r"\((\w+)\)$", where)
    return m.group(1) if m and m.group(1) in PROBES else None


def _close(text: str, i: int, brackets: str = "()") -> int:
    """Offset of the bracket closing the one at text[i], every pair in `brackets` (openers at
    even places, closers after them) balanced on the way."""
    step = {c: 1 - 2 * (k % 2) for k, c in enumerate(brackets)}
    depth = 0
    for j in range(i, len(text)):
        depth += step.get(text[j], 0)
        if depth == 0:
            return j
    return len(text)


def _function_end(text: str, start: int) -> int:
    """Offset just past the body of the function whose head starts at `start`."""
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return j + 1
    return len(text)


def _combo_text(c: tuple[str, ...]) -> str:
    return f"{c[0]} ({c[1]}) x {c[2]} ({c[3]}) -> {c[4]} ({c[5]})"


# matmul2d's members that Lily's kernels call, with the number of call arguments they pass
# (the getters without a source tensor: Apple's 26.2 header adds overloads that take one)
MEMBERS = {"run": 3, "get_destination_cooperative_tensor": 0, "get_left_input_cooperative_tensor": 0,
           "get_right_input_cooperative_tensor": 0}
_ADDRESS = r"\b(?:thread|device|threadgroup|constant)\b"


def member_declarations(text: str, member: str) -> list[dict]:
    """Every declaration of member function `member` in a header: its template parameters
    (name, default) before the SFINAE one (a default naming enable_if) and the packs, the
    condition that SFINAE parameter states, its function parameters' types (address spaces and
    names dropped), its return type and whether `this` is const."""
    t = strip_comments(text)
    out = []
    for m in re.finditer(r"(?<![\w.:>])" + member + r"\s*\(", t):
        close = _close(t, m.end() - 1)
        tail = re.match(r"\s*((?:thread|const|\s)*)\s*(\{|;)", t[close + 1:])
        head_at = t.rfind("template", 0, m.start())
        if not tail or head_at < 0 or re.search(r"[;}]", t[_close(t, t.index("<", head_at), "<>()") + 1:m.start()]):
            continue  # a call, not a declaration, or not a member template
        lt = t.index("<", head_at)
        gt = _close(t, lt, "<>()")
        params, cond = [], ""
        for p in split_top(t[lt + 1:gt].replace("<", "(").replace(">", ")")):
            p = " ".join(p.split())
            pm = re.match(r"(?:typename|class)\s*(\.\.\.)?\s*(\w+)\s*(?:=\s*(.*))?$", p)
            if not pm or pm.group(1):
                continue  # a pack (RunArgs..., CoopArgs...)
            if pm.group(3) and "enable_if" in pm.group(3):
                cond = pm.group(3)
                continue
            params.append((pm.group(2), (pm.group(3) or "").replace(" ", "")))
        args = []
        for a in split_top(t[m.end():close]):
            a = re.sub(_ADDRESS, " ", " ".join(a.split())).strip()
            if a:
                a = re.sub(r"\w+$", "", a) if re.search(r"(?:[&*]|[\w>]\s)\s*\w+$", a) else a  # the parameter's name
                args.append(" ".join(a.replace("&", " &").split()).replace(" &", "&"))
        ret = " ".join(re.sub(r"\b(?:INLINE|inline|static|constexpr)\b", " ", t[gt + 1:m.start()]).split())
        out.append({"params": params, "cond": cond, "args": args, "ret": ret,
                    "const": "const" in tail.group(1)})
    return out


def _signature(member: str, d: dict) -> str:
    tparams = ", ".join(n + (f" = {v}" if v else "") for n, v in d["params"])
    return f"{member}<{tparams}>({', '.join(d['args'])}){' const' if d['const'] else ''} -> {d['ret']}"


def accepts_cooperative(decl: dict, param: str) -> bool:
    """Whether a declaration's SFINAE condition lets template parameter `param` be a
    cooperative tensor (Apple's: `__is_cooperative_tensor_type_v<param>` among the
    alternatives); a declaration without such a condition accepts it."""
    return not decl["cond"] or bool(re.search(r"cooperative_tensor_type_v\s*\(\s*" + param + r"\s*\)", decl["cond"]))


def _member_calls(files: list[Path]) -> list[tuple[str, list[str], int, str, int]]:
    """(member, template arguments, call argument count, file:line, offset) of every call of a
    MEMBERS getter in files."""
    out = []
    for f in files:
        t = strip_comments(f.read_text(encoding="utf-8"))
        for m in re.finditer(r"\.\s*(?:template\s+)?(" + "|".join(MEMBERS) + r")\s*<", t):
            gt = _close(t, m.end() - 1, "<>()")
            targs = [" ".join(a.split()) for a in split_top(t[m.end():gt].replace("<", "(").replace(">", ")"))]
            call = re.match(r"\s*\(", t[gt + 1:])
            n = len([a for a in split_top(t[gt + 1 + call.end():_close(t, gt + call.end())]) if a.strip()]) if call else 0
            out.append((m.group(1), targs, n, f"{f.name}:{t.count(chr(10), 0, m.start()) + 1}", m.start()))
    return out


def _is_cooperative_arg(arg: str, text: str, at: int, names: dict[str, tuple[str, str]]) -> bool:
    """Whether a getter's template argument names a cooperative tensor type (an alias of one,
    decltype of a variable holding one, or a conditional_t with one among its branches)."""
    for word in re.findall(r"\b\w+\b", arg):
        if names.get(word, ("", ""))[1] == "cooperative":
            return True
    return any(_operand(text, v, at, names)[1] == "cooperative" for v in re.findall(r"decltype\s*\(\s*(\w+)\s*\)", arg))


def member_check(apple: str, ours: str, sources: list[Path]) -> bool:
    """Apple's declaration of each matmul2d member the kernels call against the stand-in's
    (template parameters, `this` const, parameter types, return type), then each call of the
    kernels against Apple's: the member declared, a template argument of the kind each
    parameter takes (an element type for `...ElementType`, a tensor type for
    `...OperandType`), and a cooperative tensor only where Apple's SFINAE condition allows one."""
    ok = True
    texts = {f: strip_comments(f.read_text(encoding="utf-8")) for f in sources}
    names = _tensor_names(list(texts.values()))
    calls, combos = _member_calls(sources), operand_combinations(sources)
    used = {m for m, *_ in calls} | ({"run"} if combos else set())
    decls = {}
    print("  matmul2d members the kernels call (Apple's declaration vs the stand-in's):")
    for member in MEMBERS:
        if member not in used:
            continue
        a = [d for d in member_declarations(apple, member) if len(d["args"]) == MEMBERS[member]]
        s = [d for d in member_declarations(ours, member) if len(d["args"]) == MEMBERS[member]]
        if not a:
            ok = False
            print(f"    {member}: NOT DECLARED by this header (the kernels call it)")
            continue
        decls[member] = a[0]
        if not s:
            ok = False
            print(f"    {member}: not declared by the stand-in")
            continue
        a0, s0 = a[0], s[0]
        diffs = [what for what, x, y in (("template parameters", a0["params"], s0["params"]),
                                          ("parameter types", a0["args"], s0["args"]),
                                          ("const this", a0["const"], s0["const"])) if x != y]
        if s0["ret"] not in ("auto", a0["ret"]):
            diffs.append("return type")
        ok &= not diffs
        print(f"    {_signature(member, a0)}: " + (f"DIFFERENT ({', '.join(diffs)}); stand-in: {_signature(member, s0)}"
                                                   if diffs else "same"))
    # the kernels' getter calls against Apple's declarations
    bad = []
    for member, targs, _n, where, at in calls:
        d = decls.get(member)
        if d is None:
            continue
        text = texts[next(f for f in sources if f.name == where.split(":")[0])]
        required = [n for n, default in d["params"] if not default]
        if not len(required) <= len(targs) <= len(d["params"]):
            bad.append(f"{where}: {member} takes {len(required)}-{len(d['params'])} template arguments, given {len(targs)}")
            continue
        for (pname, _), arg in zip(d["params"], targs):
            element = arg in ELEMENT_TYPES
            if pname.endswith("ElementType") and not element:
                bad.append(f"{where}: {member}'s {pname} must be an element type, given {arg}")
            elif pname.endswith("OperandType") and element:
                bad.append(f"{where}: {member}'s {pname} must be a tensor type, given {arg}")
            elif pname.endswith("OperandType") and _is_cooperative_arg(arg, text, at, names) \
                    and not accepts_cooperative(d, pname):
                bad.append(f"{where}: {member}'s {pname} is a cooperative tensor ({arg}), which this header's "
                           "declaration does not accept")
    if "run" in decls:
        for c, where in combos:
            for i, pname in ((1, "LeftOperandType"), (3, "RightOperandType")):
                if c[i] == "cooperative" and not accepts_cooperative(decls["run"], pname):
                    bad.append(f"{where}: run's {pname} is a cooperative tensor, which this header's run() "
                               "does not accept")
    ok &= not bad
    for b in bad:
        print(f"    CALL DOES NOT FIT: {b}")
    print(f"    the kernels' {len(calls)} getter calls and {len(combos)} run() "
          "calls: " + ("all fit these declarations" if not bad else f"{len(bad)} misfits"))
    return ok


def tensor_check(newest: Path, sources: list[Path] | None = None) -> bool:
    mpp = {h.name: h for h in headers(newest, "MetalPerformancePrimitives")}
    if "MPPTensorOpsMatMul2d.h" not in mpp:
        print("tensor API: SKIPPED (no MetalPerformancePrimitives.framework/.../MPPTensorOpsMatMul2d.h in the overlay)")
        return True
    apple = mpp["MPPTensorOpsMatMul2d.h"].read_text(encoding="utf-8", errors="replace")
    ours = SHIM_MPP.read_text(encoding="utf-8")
    ok = True

    def same(what, a, b, norm=lambda x: x):
        nonlocal ok
        good = norm(a) == norm(b)
        ok &= good
        print(f"  {what}: {'same' if good else 'DIFFERENT'}\n    Apple: {a}\n    shim:  {b}")

    print("tensor API (MPPTensorOpsMatMul2d.h vs the simulator's stand-in):")
    # defaults are spelled differently: dynamic_length_v<int> == int(dynamic_extent) == INT_MAX
    def dyn(ps):
        return [(t, "dynamic" if "dynamic" in d else re.sub(r"^mode::", "", d)) for t, d in ps]
    same("matmul2d_descriptor(...) parameters (type, default)", _ctor_params(apple), _ctor_params(ours), dyn)
    ka, ks = _ctor_params(apple)[2][1], _ctor_params(ours)[2][1]
    if ka != ks:  # both mean "k from the operands", but the sentinel values may differ
        print(f"  note: k's default is spelled {ka} by Apple, {ks} by the stand-in: Lily's kernels pass k "
              "explicitly or as static_cast<int>(dynamic_extent) (selftest_tensor.metal only)")
    same("matmul2d template parameters", _template_head(apple, "matmul2d"), _template_head(ours, "matmul2d"))
    enum = re.search(r"enum class mode\s*\{([^}]*)\}", strip_comments(apple))
    same("descriptor modes", " ".join(enum.group(1).split()) if enum else "",
         " ".join(re.search(r"enum class mode\s*\{([^}]*)\}", ours).group(1).split()), lambda s: s.rstrip(","))
    same("descriptor fields", _descriptor_fields(apple), _descriptor_fields(ours))
    sources = tensor_sources() if sources is None else sources
    selftest = [f for f in sources if f.name.startswith("selftest")]
    shipped = [f for f in sources if f not in selftest]
    ok &= member_check(apple, ours, shipped)
    scopes = set(re.findall(r"metal::(execution_\w+)", apple))  # the scopes the header's comment names
    used_scopes = {m for f in shipped for m in re.findall(r"\bmatmul2d<[^;]*?,\s*(?:metal::)?(execution_\w+)",
                                                                 strip_comments(f.read_text(encoding="utf-8")))}
    if scopes:
        ok &= used_scopes <= scopes
        print(f"  execution scopes the kernels use: {', '.join(sorted(used_scopes))}: "
              + ("all named by the header" if used_scopes <= scopes
                 else f"NOT named by the header: {', '.join(sorted(used_scopes - scopes))}"))
    else:
        print("  execution scopes: the header names none (not checked)")
    # cooperative_tensor's members and the tensor types come from the Metal compiler's own
    # <metal_tensor>, which no SDK holds: only whether the header's comment mentions them
    kernel_text = "".join(strip_comments(f.read_text(encoding="utf-8")) for f in shipped)
    members = sorted({m for m in COOPERATIVE_MEMBERS if re.search(r"\.\s*" + m + r"\s*\(", kernel_text)})
    unmentioned = [m for m in members if not re.search(r"\b" + m + r"\b", apple)]
    print("  not declared in the SDK (the Metal compiler's <metal_tensor>), so not checked: "
          + (f"cooperative_tensor's {', '.join(members)} and operator[], " if members else "")
          + "the tensor, extents, dextents and tensor_inline types"
          + (f"; the header's comment does not mention {', '.join(unmentioned)}" if unmentioned else ""))

    types_h = mpp.get("MPPTensorOpsTypes.h")
    mapped = set()
    bf_gated = False
    if types_h:
        tt = types_h.read_text(encoding="utf-8", errors="replace")
        mapped = set(re.findall(r"__is_same_v<ElementType,\s*(\w+)>", tt))
        bf_gated = bool(re.search(r"#if __HAVE_BFLOAT__\s*else if constexpr \(__is_same_v<ElementType, bfloat>", tt))
    table = {r for r in re.findall(r"^//\s+(\w+)\s+(\w+)\s+(\w+)\s*$", apple, re.MULTILINE)
             if set(r) <= ELEMENT_TYPES}
    used = set()
    for f in sources:
        src = f.read_text(encoding="utf-8")
        used |= set(re.findall(r"tensor<\s*(?:device|threadgroup)\s+(?:const\s+)?(float|half|bfloat)\b", src))
        for a, b in re.findall(r'host_name\("st_tensor_mm_\w+?_(f16|f32|bf16)_(f16|f32|bf16)', src):
            used |= {a, b}
    names = {"f32": "float", "f16": "half", "bf16": "bfloat"}
    used = {names.get(u, u) for u in used}
    print("  operand element types Apple's header maps: "
          + ", ".join(sorted(mapped)) + (" (bfloat only where the compiler defines __HAVE_BFLOAT__)" if bf_gated else ""))
    print(f"  operand element types Lily's *_tensor.metal use: {', '.join(sorted(used))}")
    missing = used - mapped
    if missing:
        ok = False
        print(f"  NOT MAPPED by these headers: {', '.join(sorted(missing))}")
    floating = sorted((a, b, c) for a, b, c in table if a in ("half", "float", "bfloat") or b in ("half", "float", "bfloat"))
    print("  floating operand rows of the header comment's table (A x B -> C): "
          + (", ".join(f"{a} x {b} -> {c}" for a, b, c in floating) or "none"))
    # the (A, B, C) combinations the shipped kernels run, against the table and the probes
    combos = operand_combinations(shipped)
    probed = {p: {c for c, where in combos if probe_of(where) == p} for p in PROBES}
    by_combo: dict[tuple[str, ...], list[str]] = {}
    for c, where in combos:
        if probe_of(where) is None:
            by_combo.setdefault(c, []).append(where)
    print("  operand combinations of the shipped tensor kernels (A x B -> C, address spaces):")
    for c, wheres in sorted(by_combo.items()):
        listed = (c[0], c[2], c[4]) in table
        runs = [p for p in PROBES if c in probed[p]]
        unresolved = "?" in c or not {c[0], c[2], c[4]} <= ELEMENT_TYPES
        status = ("UNRESOLVED (the check cannot read these operands' types)" if unresolved
                  else "in the table" + (f" (also run by {', '.join(runs)})" if runs else "") if listed
                  else f"NOT in the table; {runs[0]} runs it, so on an OS without it prefill's tensor path falls back"
                  if runs else "NOT in the table and NOT run by any probe")
        ok &= not unresolved and (listed or bool(runs))
        print(f"    {_combo_text(c)}: {status} [{', '.join(wheres)}]")
    missing = sorted(c for c in by_combo if not any(c in probed[p] for p in PROBES))
    if missing:  # harmless where the table lists them; tests/test_check_sdk26.py requires none
        print("  note: no probe runs " + "; ".join(_combo_text(c) for c in missing))
    if selftest:  # never shipped: its compile check is skipped, with a notice, if the SDK rejects it
        trip = {(c[0], c[2], c[4]) for c, _ in operand_combinations(selftest)}
        for f in selftest:
            trip |= {(names.get(a), names.get(b), "float") for a, b in
                     re.findall(r'host_name\("st_tensor_mm_\w+?_(f16|f32|bf16)_(f16|f32|bf16)', f.read_text(encoding="utf-8"))}
        extra = sorted(t for t in trip if set(t) <= ELEMENT_TYPES and t not in table)
        print(f"  {', '.join(f.name for f in selftest)} (tests only, never shipped) also runs, not in the table: "
              + (", ".join(f"{a} x {b} -> {c}" for a, b, c in extra) or "none"))
    cp = [h for h in headers(newest, "Metal") if h.name == "MTLComputePipeline.h"]
    coop = any("cooperative_tensor" in f.read_text(encoding="utf-8") for f in sources)
    if cp and coop and re.search(r"CooperativeTensors in which case this must be set", cp[0].read_text(encoding="utf-8")):
        sets = "requiredThreadsPerThreadgroup" in MM.read_text(encoding="utf-8")
        ok &= sets
        print("  MTLComputePipelineDescriptor.requiredThreadsPerThreadgroup (macOS 26) must be set for pipelines "
              "that use cooperative tensors, as *_tensor.metal do: metal_device.mm "
              + ("sets it" if sets else "does NOT set it"))
    undocumented = sorted(u for u in used if not any(u in (a, b) for a, b, _ in table))
    if undocumented:
        print(f"  note: {', '.join(undocumented)} operands are in no row of that table: only Apple's compiler can say "
              f"whether this SDK accepts them (cmake's Metal 4 probe compiles the real *_tensor.metal files)")
    return ok


# ---- assemble and compile -----------------------------------------------------------------


def assemble(overlay: Path, sdk12: Path, dest: Path) -> Path:
    """The macOS 12 SDK (symlinked) with the overlay's files copied over it."""
    root = sdk12 / "root" if (sdk12 / "root" / "System").is_dir() and not (sdk12 / "System").is_dir() else sdk12
    out = dest / "MacOSX.sdk"
    subprocess.run(["cp", "-as", str(root.resolve()), str(out)], check=True)
    for f in overlay.rglob("*"):
        if f.is_file():
            target = out / f.relative_to(overlay)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink() or target.exists():
                target.unlink()
            shutil.copyfile(f, target)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overlay", type=Path, help="directory with the macOS 26 headers (SDK root layout)")
    ap.add_argument("--sdk12", type=Path, default=None, help="macOS 12 SDK root (hexops-graveyard/sdk-macos-12.0)")
    ap.add_argument("--compile", action="store_true", help="also type-check metal_device.mm against the assembled SDK")
    args = ap.parse_args(argv)
    if not (args.overlay / FRAMEWORKS).is_dir():
        print(f"check_sdk26: {args.overlay} has no {FRAMEWORKS} directory", file=sys.stderr)
        return 2
    sdk12 = args.sdk12
    if sdk12 and (sdk12 / "root" / "System").is_dir() and not (sdk12 / "System").is_dir():
        sdk12 = sdk12 / "root"
    ok = api_audit(args.overlay, sdk12)
    print()
    ok &= tensor_check(args.overlay)
    if args.compile:
        if not sdk12:
            print("check_sdk26: --compile needs --sdk12", file=sys.stderr)
            return 2
        if not any(h.name == "Metal.h" for h in headers(args.overlay, "Metal")):
            print("\ncompile: SKIPPED (the overlay's Metal.framework is partial: no Metal.h; a complete macOS 26 "
                  "Metal.framework is needed to compile against it)")
        else:
            with tempfile.TemporaryDirectory() as tmp:
                sdk = assemble(args.overlay, sdk12, Path(tmp))
                env = dict(os.environ, CHECK_OBJC_EXTRA="-Werror=deprecated-declarations")
                r = subprocess.run(["bash", str(ROOT / "tools" / "check_objc.sh"), str(sdk)], env=env, check=False)
                ok &= r.returncode == 0
    print("\ncheck_sdk26: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
