#!/usr/bin/env python3
"""Source transform: Metal Shading Language (metal/*.metal, metal/*.h) -> C++ for the simulator.

Run by CMake at build time:  msl2cpp.py OUT_DIR FILE...

What it rewrites (everything else passes through unchanged, so any MSL construct the
<metal_stdlib> shim does not provide is a C++ compile error, never silent misbehaviour):

* ``#include <metal_*>`` lines are dropped (the shim is included once up front), except
  the Metal 4 tensor headers ``<metal_tensor>`` and
  ``<MetalPerformancePrimitives/MetalPerformancePrimitives.h>``, which are moved in front of
  the file's namespace (their shims are csrc/gpu/sim/msl/metal_tensor and
  .../MetalPerformancePrimitives/MetalPerformancePrimitives.h). They are allowed only in
  ``metal/*_tensor.metal`` files (compiled with -std=metal4.0 into lily_tensor.metallib on
  macOS), whose kernels are registered as tensor-op kernels, with bfloat operands when the
  file (or a ``*_tensor.h`` header it includes) declares a ``tensor<... bfloat, ...>`` or a
  bfloat cooperative input (the simulator checks at run time that no other kernel runs a
  bfloat tensor operation);
* address-space qualifiers ``device``/``constant``/``thread`` are dropped (``constant`` at
  the start of a declaration becomes ``const``); ``threadgroup`` is dropped in pointer and
  reference types, casts and template arguments, and a ``threadgroup T name[...];``
  statement in a function body (any constant expressions as array sizes) becomes a
  reference to storage shared by the threadgroup (``lily::sim::tg_var``); any other use of
  ``threadgroup`` is an error naming file:line, never a silent per-thread variable;
* ``kernel`` functions lose the keyword and their parameter attributes (``[[buffer(n)]]``,
  ``[[thread_position_in_grid]]``, ...); the attributes are recorded in a table;
* ``template [[host_name("x")]] [[kernel]] decltype(f<T>) f<T>;`` becomes a static
  registration of ``f<T>`` under the name ``x``; non-template kernels register under their
  own name;
* swizzles ``v.xy``/``v.rgba`` become ``v.template swz<0,1>()``; half literals ``1.5h``
  become ``half(1.5f)``.

Line numbers are preserved and ``#line`` points compile errors at the .metal source.
"""
import os
import re
import sys

TOKEN_RE = re.compile(
    r"""
    (?P<comment>/\*.*?\*/|//[^\n]*)
  | (?P<pp>^[ \t]*\#(?:\\\n|[^\n])*)
  | (?P<string>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
  | (?P<number>\.?\d(?:[eEpP][+-]|[\w.])*)
  | (?P<ident>[A-Za-z_]\w*)
  | (?P<ws>\s+)
  | (?P<punct>->|::|.)
    """,
    re.VERBOSE | re.DOTALL | re.MULTILINE,
)

POSITION_ATTRS = {
    "thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
    "threads_per_threadgroup", "dispatch_threads_per_threadgroup", "threads_per_grid",
    "threadgroups_per_grid", "thread_index_in_threadgroup", "simdgroup_index_in_threadgroup",
    "thread_index_in_simdgroup", "simdgroups_per_threadgroup", "threads_per_simdgroup",
}
# Grid-position attributes: scalar or vector, one component count per kernel (MSL spec,
# kernel function input attributes).
GRID_ATTRS = {
    "thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
    "threads_per_threadgroup", "dispatch_threads_per_threadgroup", "threads_per_grid",
    "threadgroups_per_grid",
}
# Index attributes: a uint or ushort scalar (MSL spec, kernel function input attributes).
SCALAR_ATTRS = {"thread_index_in_threadgroup", "simdgroup_index_in_threadgroup", "thread_index_in_simdgroup",
                "simdgroups_per_threadgroup", "threads_per_simdgroup"}
# Scalar and vector value types: `T* p = ...;` with one of them starts a pointer declaration.
VALUE_TYPES = {f"{b}{n}" for b in ("float", "half", "bfloat", "int", "uint", "short", "ushort", "char", "uchar",
                                   "bool", "long", "ulong") for n in ("", "2", "3", "4")} | {"unsigned", "signed"}
ADDRESS_SPACES = ("device", "constant", "threadgroup", "thread")
SWIZZLE_RE = re.compile(r"^(?:[xyzw]{2,4}|[rgba]{2,4})$")
SWIZZLE_INDEX = {"x": 0, "y": 1, "z": 2, "w": 3, "r": 0, "g": 1, "b": 2, "a": 3}


# Metal 4 tensor-operation headers the shim provides (hoisted out of the kernel namespace).
TENSOR_INCLUDES = ("metal_tensor", "MetalPerformancePrimitives/MetalPerformancePrimitives.h")
TENSOR_SUFFIX = "_tensor.metal"
# Headers with tensor code (included only by *_tensor.metal files, which name the tensor
# headers themselves so that the shim's are hoisted out of the kernel namespace).
TENSOR_HEADER_SUFFIX = "_tensor.h"


class TransformError(Exception):
    pass


class Tok:
    __slots__ = ("kind", "text", "line", "orig")

    def __init__(self, kind, text, line):
        self.kind, self.text, self.line = kind, text, line
        self.orig = text  # the source text (rewrites change .text only)

    def __repr__(self):
        return f"Tok({self.kind},{self.text!r})"


def lex(src):
    toks, line, pos = [], 1, 0
    while pos < len(src):
        m = TOKEN_RE.match(src, pos)
        kind = m.lastgroup
        text = m.group(kind)
        toks.append(Tok(kind, text, line))
        line += text.count("\n")
        pos = m.end()
    return toks


def significant(tok):
    return tok.kind not in ("ws", "comment")



def declares_bfloat_tensor(toks):
    """Whether tokens name a tensor type of bfloat elements (`tensor` `<` [address space]
    [const] `bfloat`) or ask for a cooperative input of bfloat operands
    (`get_left_input_cooperative_tensor` / `get_right_input_cooperative_tensor` `<` with a
    bfloat among its first two arguments)."""
    sig = [t.text for t in toks if significant(t)]
    inputs = ("get_left_input_cooperative_tensor", "get_right_input_cooperative_tensor")
    for i, t in enumerate(sig):
        if t == "tensor" and i + 1 < len(sig) and sig[i + 1] == "<":
            rest = [x for x in sig[i + 2:i + 5] if x not in ADDRESS_SPACES and x != "const"]
            if rest and rest[0] == "bfloat":
                return True
        if t in inputs and i + 1 < len(sig) and sig[i + 1] == "<" and "bfloat" in sig[i + 2:i + 5]:
            return True
    return False

class Transformer:
    def __init__(self, path, is_header):
        self.path = path
        self.name = os.path.basename(path)
        self.is_header = is_header
        self.tensor_file = path.endswith(TENSOR_SUFFIX) or path.endswith(TENSOR_HEADER_SUFFIX)
        self.hoisted = []  # tensor headers to include before the file's namespace
        self.toks = lex(open(path, encoding="utf-8").read())
        self.tensor_bfloat = self.tensor_file and not is_header and (
            declares_bfloat_tensor(self.toks) or any(declares_bfloat_tensor(lex(open(h, encoding="utf-8").read()))
                                                     for h in self.tensor_headers()))
        self.counter = 0
        self.kernels = {}  # name -> dict(template=bool, nparams=int)
        self.kernel_parens = set()  # index of the ')' closing each kernel's parameter list
        self.in_kernel = False  # inside a kernel's body (threadgroup storage is allowed there only)

    def tensor_headers(self):
        """The tensor headers (`#include "x_tensor.h"`, beside the file) the file includes."""
        out = []
        for t in self.toks:
            m = re.match(r'^\s*#\s*include\s*"(\w+' + re.escape(TENSOR_HEADER_SUFFIX) + ')"', t.text)
            if m and os.path.exists(os.path.join(os.path.dirname(self.path), m.group(1))):
                out.append(os.path.join(os.path.dirname(self.path), m.group(1)))
        return out

    def err(self, tok, msg):
        raise TransformError(f"{self.path}:{tok.line}: error: {msg}")

    # index helpers over self.toks
    def next_sig(self, i):
        i += 1
        while i < len(self.toks) and not significant(self.toks[i]):
            i += 1
        return i

    def prev_sig(self, i):
        i -= 1
        while i >= 0 and not significant(self.toks[i]):
            i -= 1
        return i

    def tok(self, i):
        return self.toks[i] if 0 <= i < len(self.toks) else Tok("eof", "", 0)

    def match_close(self, i, open_="(", close=")"):
        depth = 0
        for j in range(i, len(self.toks)):
            t = self.toks[j].text if self.toks[j].kind == "punct" else None
            if t == open_:
                depth += 1
            elif t == close:
                depth -= 1
                if depth == 0:
                    return j
        self.err(self.toks[i], f"unbalanced '{open_}'")

    def is_attr_start(self, i):
        return self.tok(i).text == "[" and self.tok(self.next_sig(i)).text == "["

    def parse_attr(self, i):
        """At '[' '[' ... ']' ']': returns (list of (name, argtext), index of last ']')."""
        j = self.next_sig(i)
        k = j
        depth = 0
        while True:
            k += 1
            if k >= len(self.toks):
                self.err(self.toks[i], "unterminated attribute")
            t = self.toks[k]
            if t.kind == "punct" and t.text in "([{":
                depth += 1
            elif t.kind == "punct" and t.text in ")}":
                depth -= 1
            elif t.kind == "punct" and t.text == "]" and depth == 0:
                break
        end = self.next_sig(k)
        if self.tok(end).text != "]":
            self.err(self.toks[i], "malformed attribute")
        body = "".join(t.text for t in self.toks[j + 1:k] if t.kind != "comment").strip()
        attrs = []
        for part in split_top(body, ","):
            part = part.strip()
            m = re.match(r"^([A-Za-z_]\w*)\s*(?:\((.*)\))?$", part, re.DOTALL)
            if not m:
                self.err(self.toks[i], f"cannot parse attribute [[{body}]]")
            attrs.append((m.group(1), (m.group(2) or "").strip()))
        return attrs, end

    def blank(self, a, b):
        """Replace tokens a..b inclusive by their newlines only."""
        for k in range(a, b + 1):
            self.toks[k].text = "\n" * self.toks[k].text.count("\n")
            self.toks[k].kind = "ws"

    def decl_start(self, i):
        """Index of the first token of the declaration containing token i."""
        j = i
        while True:
            p = self.prev_sig(j)
            if p < 0:
                return j
            t = self.toks[p]
            if t.kind in ("pp", "gen") or (t.kind == "punct" and t.text in (";", "{", "}")):
                return j
            j = p

    def run(self):
        toks = self.toks
        scopes = ["ns"]  # kind of each enclosing brace: ns, type, code, init (see brace_kind)
        i = 0
        while i < len(toks):
            t = toks[i]
            if t.kind == "pp":
                inc = re.match(r"^\s*#\s*include\s*<([\w/.]+)>", t.text)
                if inc and (inc.group(1) in TENSOR_INCLUDES or inc.group(1).startswith("MetalPerformancePrimitives/")):
                    name = inc.group(1)
                    if name not in TENSOR_INCLUDES:
                        self.err(t, f"<{name}> is not supported by the simulator (of the Metal Performance "
                                    f"Primitives only <MetalPerformancePrimitives/MetalPerformancePrimitives.h> "
                                    f"with matmul2d; see docs/device-layer.md)")
                    if not self.tensor_file:
                        self.err(t, f"<{name}>: Metal 4 tensor operations belong in metal/*{TENSOR_SUFFIX} "
                                    f"files (compiled with -std=metal4.0 into lily_tensor.metallib on macOS)")
                    if name not in self.hoisted:
                        self.hoisted.append(name)
                    t.text = "\n" * t.text.count("\n")
                elif re.match(r"^\s*#\s*include\s*<metal_\w+>", t.text):
                    t.text = ""
                elif re.match(r'^\s*#\s*include\s*"\w+' + re.escape(TENSOR_HEADER_SUFFIX) + '"', t.text) \
                        and not self.tensor_file:
                    self.err(t, f"{t.text.strip()}: tensor-operation headers (*{TENSOR_HEADER_SUFFIX}) belong in "
                                f"metal/*{TENSOR_SUFFIX} files")
                elif re.match(r"^\s*#\s*define\b", t.text) and re.search(r"\bthreadgroup\b", t.text):
                    self.err(t, "'threadgroup' inside a macro: the transform cannot classify it; "
                                "write the declaration out")
                i += 1
                continue
            if t.kind == "number":
                txt = t.text
                if re.match(r"^(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?[hH]$", txt):
                    core = txt[:-1]
                    if not re.search(r"[.eE]", core):
                        core += ".0"
                    t.text = f"half({core}f)"
                i += 1
                continue
            if t.kind == "punct":
                if t.text == "{":
                    kind = self.brace_kind(i, scopes[-1])
                    if kind == "code" and scopes[-1] != "code":
                        self.function_body(i)
                    scopes.append(kind)
                elif t.text == "}":
                    if len(scopes) == 1:
                        self.err(t, "unbalanced '}'")
                    scopes.pop()
                    if scopes[-1] != "code":
                        self.in_kernel = False
                elif t.text in (".", "->"):
                    n = i + 1
                    if n < len(toks) and toks[n].kind == "ident" and SWIZZLE_RE.match(toks[n].text):
                        idx = ",".join(str(SWIZZLE_INDEX[c]) for c in toks[n].text)
                        toks[n].text = f"template swz<{idx}>()"
                        i = n + 1
                        continue
                elif t.text == "[" and self.is_attr_start(i):
                    attrs, end = self.parse_attr(i)
                    names = [a for a, _ in attrs]
                    if "kernel" in names:
                        self.kernel_def(i, end, attrs)
                    elif "max_total_threads_per_threadgroup" in names:
                        # `[[max_total_threads_per_threadgroup(N)]] kernel void f(...)`
                        k = self.next_sig(end)
                        if self.tok(k).text != "kernel":
                            self.err(t, "[[max_total_threads_per_threadgroup]] must precede `kernel`")
                        self.kernel_def(i, k, attrs)
                        i = k + 1
                        continue
                    i = end + 1
                    continue
                i += 1
                continue
            if t.kind == "ident":
                if scopes[-1] == "code" and t.text in VALUE_TYPES:
                    self.check_local_pointer(i)
                if t.text == "static" and scopes[-1] != "code":
                    self.check_program_scope_variable(i)
                elif t.text == "constexpr" and scopes[-1] == "ns":
                    p = self.prev_sig(i)
                    if p < 0 or toks[p].kind == "pp" or toks[p].text in (";", "{", "}"):
                        self.check_program_scope_variable(i)
                if t.text in ("device", "thread"):
                    t.text = ""
                elif t.text == "constant":
                    p = self.prev_sig(i)
                    starts = p < 0 or toks[p].kind == "pp" or toks[p].text in (";", "{", "}")
                    t.text = "const" if starts else ""
                elif t.text == "threadgroup":
                    i = self.threadgroup(i, scopes[-1])
                    continue
                elif t.text == "kernel":
                    self.kernel_def(i, i, [])
                elif t.text == "template" and self.is_attr_start(self.next_sig(i)):
                    i = self.instantiation(i)
                    continue
            i += 1
        out = "".join(t.text for t in toks)
        if not self.is_header:
            regs = []
            for name, k in self.kernels.items():
                if not k["template"]:
                    regs.append(self.registration(name, name, k["line"]))
            if regs:
                out += "\n" + "\n".join(regs) + "\n"
        return out

    # --- scopes -------------------------------------------------------------------------
    def brace_kind(self, i, outer):
        """Kind of the block opened by the '{' at i: 'code' (a function body or a block in
        one), 'type' (struct/class/union/enum body), 'ns' (namespace, extern "C") or 'init'
        (a braced initializer)."""
        toks = self.toks
        if outer == "init":
            return "init"
        p = self.prev_sig(i)
        pt = self.tok(p)
        if (pt.kind == "punct" and pt.text in ("=", ",", "(", "[", "?")) or pt.text == "return":
            return "init"
        if outer == "code":
            if pt.kind == "punct" and pt.text in (")", ";", "{", "}", ":"):
                return "code"
            if pt.kind == "ident" and pt.text in ("else", "do", "try", "mutable", "noexcept", "const"):
                return "code"
            return "init"  # T x{...}, T{...}, vec<float, 2>{...}
        start = self.decl_start(i)
        prefix = [t for t in toks[start:i] if significant(t)]
        words = [t.text for t in prefix]
        if "namespace" in words or (words and words[0] == "extern"):
            return "ns"
        angle = 0
        for n, t in enumerate(prefix):  # struct/class/union/enum outside template parameter lists
            if t.kind == "punct" and t.text == "<":
                angle += 1
            elif t.kind == "punct" and t.text == ">":
                angle -= 1
            elif (angle == 0 and t.kind == "ident" and t.text in ("struct", "class", "union", "enum")
                  and "(" not in words[:n]):
                return "type"
        if "(" in words and (pt.text == ")" or pt.text in ("const", "noexcept", "override", "final", "volatile")
                             or "->" in words):
            return "code"
        return "init"

    # --- threadgroup ----------------------------------------------------------------------
    #   threadgroup T name[N]...;     (a statement in a function body)  ->  shared storage
    #   threadgroup T* p / T& r / (*p)[N], casts, template arguments     ->  keyword dropped
    #   anything else                                                    ->  error, file:line
    CV = ("const", "volatile")
    ELABORATED = ("typename", "struct", "class", "union", "enum")
    BUILTIN_WORDS = ("unsigned", "signed", "short", "long", "int", "char", "float", "double", "bool", "void")
    NOT_TYPES = ("return", "case", "else", "do", "sizeof", "alignof", "static_cast", "reinterpret_cast",
                 "const_cast", "static", "constexpr", "extern", "inline", "operator", "new", "delete",
                 "threadgroup", "device", "constant", "thread")

    def match_angle(self, i):
        """Index of the '>' closing the template argument list opened at the '<' at i
        (angle brackets inside (), [] and {} do not count)."""
        toks = self.toks
        angle = nest = 0
        for j in range(i, len(toks)):
            t = toks[j]
            if t.kind != "punct":
                continue
            if t.text in "([{":
                nest += 1
            elif t.text in ")]}":
                nest -= 1
                if nest < 0:
                    break
            elif nest == 0 and t.text == "<":
                angle += 1
            elif nest == 0 and t.text == ">":
                angle -= 1
                if angle == 0:
                    return j
            elif nest == 0 and t.text == ";":
                break
        self.err(toks[i], "unbalanced '<' in a threadgroup type")

    def match_group(self, i):
        """Index of the bracket closing the (, [ or { at i (other brackets nest inside)."""
        toks = self.toks
        depth = 0
        for j in range(i, len(toks)):
            t = toks[j]
            if t.kind != "punct":
                continue
            if t.text in "([{":
                depth += 1
            elif t.text in ")]}":
                depth -= 1
                if depth == 0:
                    return j
        self.err(toks[i], f"unbalanced '{toks[i].text}'")

    def parse_type(self, k, where):
        """Parses a type specifier sequence (cv-qualifiers, possibly qualified names,
        template-ids, decltype(...), multi-word builtins such as `unsigned int`) starting at
        token k. Returns the index of the first token after it."""
        seen = last_builtin = False
        while True:
            t = self.tok(k)
            if t.kind == "ident" and (t.text in self.CV or t.text in self.ELABORATED):
                k = self.next_sig(k)
                continue
            if t.kind == "ident" and t.text == "decltype":
                if seen:
                    break
                po = self.next_sig(k)
                if self.tok(po).text != "(":
                    self.err(t, "cannot parse decltype in a threadgroup type")
                k = self.next_sig(self.match_group(po))
                seen, last_builtin = True, False
                continue
            if (t.kind == "ident" and t.text not in self.NOT_TYPES) or (t.kind == "punct" and t.text == "::"):
                if seen and not (t.kind == "ident" and last_builtin and t.text in self.BUILTIN_WORDS):
                    break  # the declarator's name
                if t.text == "::":
                    k = self.next_sig(k)
                while True:
                    tn = self.tok(k)
                    if tn.kind != "ident":
                        self.err(where, f"cannot parse the type after 'threadgroup' (at '{tn.text}')")
                    name = tn.text
                    k = self.next_sig(k)
                    if self.tok(k).text == "<":
                        k = self.next_sig(self.match_angle(k))
                    if self.tok(k).text == "::":
                        k = self.next_sig(k)
                        if self.tok(k).text == "template":
                            k = self.next_sig(k)
                        continue
                    break
                seen, last_builtin = True, name in self.BUILTIN_WORDS
                continue
            break
        if not seen:
            self.err(where, f"cannot parse the type after 'threadgroup' (at '{self.tok(k).text}')")
        return k

    def skip_ptr_ops(self, k):
        """Skips pointer/reference operators (with cv-qualifiers after '*'); returns
        (index after them, whether there were any)."""
        ptr = False
        while True:
            t = self.tok(k)
            if t.kind == "punct" and t.text in ("*", "&"):
                ptr = True
            elif not (ptr and t.kind == "ident" and (t.text in self.CV or t.text == "__restrict")):
                return k, ptr
            k = self.next_sig(k)

    def is_ptr_declarator(self, k):
        """Is the declarator at k a pointer/reference (`*p`, `&r`, `(*p)[N]`)?"""
        k, ptr = self.skip_ptr_ops(k)
        if ptr:
            return True
        if self.tok(k).text == "(":
            _, ptr = self.skip_ptr_ops(self.next_sig(k))
            return ptr
        return False

    def threadgroup(self, i, scope):
        """Classifies the `threadgroup` keyword at i; returns the index to continue at."""
        toks = self.toks
        tg = toks[i]
        p = self.prev_sig(i)
        at_stmt = p < 0 or toks[p].kind in ("pp", "gen") or (toks[p].kind == "punct" and toks[p].text in (";", "{", "}"))
        q = p  # `const threadgroup T* p`: qualifiers before the keyword
        while q >= 0 and toks[q].kind == "ident" and toks[q].text in self.CV:
            q = self.prev_sig(q)
        type_start = self.next_sig(i)
        k = self.parse_type(type_start, tg)
        nt = self.tok(k)
        self.check_atomic_type(tg, type_start, k)
        if self.is_ptr_declarator(k):
            # a pointer or reference into threadgroup memory: a plain C++ pointer here
            if at_stmt:
                self.check_pointer_statement(i, k)
            tg.text = ""
            return i + 1
        if not at_stmt:
            if nt.kind == "punct" and nt.text in (")", ">", ","):
                tg.text = ""  # an abstract type: a cast, sizeof, a template argument
                return i + 1
            if (nt.kind == "ident" and scope != "code" and self.tok(self.next_sig(k)).text == "["
                    and self.tok(q).text in ("(", ",")):
                tg.text = ""  # an array parameter `threadgroup T x[N]` is a pointer
                return i + 1
            what = f"'{nt.text}'" if nt.kind == "ident" else "this use"
            self.err(tg, f"cannot classify the threadgroup declaration of {what}: threadgroup storage "
                         f"is declared as its own statement `threadgroup T name[N];` in a function body "
                         f"(pointers and references into threadgroup memory may appear anywhere)")
        # a statement `threadgroup T name[N]...;`
        if nt.kind != "ident":
            self.err(tg, f"cannot classify the threadgroup declaration (unexpected '{nt.text}' after the type)")
        name_idx = k
        k = self.next_sig(k)
        while self.tok(k).text == "[":
            close = self.match_group(k)
            if close == self.next_sig(k):
                self.err(tg, f"threadgroup variable '{toks[name_idx].text}' needs an array size")
            k = self.next_sig(close)
        end = self.tok(k)
        if end.text in ("=", "{", "("):
            self.err(tg, "threadgroup variables cannot have initializers")
        if end.text == ",":
            self.err(tg, "declare one threadgroup variable per statement")
        if end.text != ";":
            self.err(tg, f"cannot classify the threadgroup declaration of '{toks[name_idx].text}' "
                         f"(unexpected '{end.text}')")
        if scope != "code":
            self.err(tg, f"threadgroup variable '{toks[name_idx].text}' declared outside a function body")
        if not self.in_kernel:
            self.err(tg, f"threadgroup variable '{toks[name_idx].text}' declared outside a kernel function "
                         f"(Apple's compiler allows threadgroup storage in kernel bodies only: declare it in the "
                         f"kernel and pass a threadgroup pointer)")
        name = toks[name_idx].text
        type_txt = self.text(type_start, name_idx)
        ext_txt = self.text(self.next_sig(name_idx), k)
        n = self.counter
        self.counter += 1
        nl = sum(toks[m].text.count("\n") for m in range(i, k))
        self.blank(i, k - 1)
        # An alias, not tg_var<T[N]>: a '>' in the size would end a template argument list.
        full = f"{type_txt} {ext_txt}" if ext_txt else type_txt
        tg.text = (f"using __lily_tgt_{n} = {full}; static char __lily_tgk_{n}; "
                   f"auto& {name} = ::lily::sim::tg_var<__lily_tgt_{n}>(&__lily_tgk_{n})" + "\n" * nl)
        tg.kind = "gen"
        return k

    def check_local_pointer(self, i):
        """`float* p = ...;` as a statement in a function body: MSL makes p a thread-space
        pointer, which a device or threadgroup address does not convert to (Apple's compiler
        rejects it; C++ would not notice). The address space must be written."""
        toks = self.toks
        p = self.prev_sig(i)
        while p >= 0 and toks[p].kind == "ident" and toks[p].text in self.CV:
            p = self.prev_sig(p)
        if not (p < 0 or toks[p].kind in ("pp", "gen") or toks[p].text in (";", "{", "}", "(")):
            return
        if toks[p].text == "(" and self.tok(self.prev_sig(p)).text != "for":
            return  # a cast or a parameter, not a declaration
        k = self.next_sig(i)
        while self.tok(k).kind == "ident" and self.tok(k).text in self.CV:
            k = self.next_sig(k)
        if self.tok(k).text != "*":
            return
        k = self.next_sig(k)
        while self.tok(k).kind == "ident" and self.tok(k).text in self.CV + ("__restrict",):
            k = self.next_sig(k)
        if self.tok(k).kind == "ident" and self.tok(self.next_sig(k)).text in ("=", ";", ","):
            self.err(toks[i], f"pointer '{self.tok(k).text}' declared without an address space: in MSL it points to "
                              f"thread memory (write device, constant, threadgroup or thread)")

    def check_program_scope_variable(self, i):
        """A variable declared at namespace scope, or a static data member, from the
        `static` / `constexpr` at i: MSL gives such variables program-scope storage, which
        must be in the constant address space (Apple's compiler rejects `static constexpr
        uint N = 4;` in a struct; C++ would not notice). Functions are left alone."""
        words = []
        k = i
        while k < len(self.toks) and self.toks[k].text not in ("=", ";", "(", "{"):
            words.append(self.toks[k].text)
            k = self.next_sig(k)
        if self.tok(k).text in ("=", ";") and "constant" not in words:
            self.err(self.toks[i], f"'{' '.join(words)}' is a program-scope variable outside the constant address "
                                   f"space: in MSL write `constant` (e.g. `static constant constexpr`)")

    def check_atomic_type(self, tg, a, b):
        """Float atomics exist in device memory only (MSL spec 6.15.1)."""
        words = [t.text for t in self.toks[a:b] if significant(t)]
        if "atomic_float" in words or (words[:3] == ["atomic", "<", "float"]):
            self.err(tg, "atomic<float> in threadgroup memory: Metal supports float atomics in device memory only")

    def function_body(self, brace):
        """At the '{' opening a function body: its pointer and reference parameters need an
        address space (Apple's compiler rejects `float* p`); notes whether it is a kernel."""
        toks = self.toks
        j = self.prev_sig(brace)
        while self.tok(j).kind == "ident" and self.tok(j).text in ("const", "thread", "noexcept", "override",
                                                                   "final", "volatile", "device", "constant"):
            j = self.prev_sig(j)
        if self.tok(j).text != ")":
            return  # e.g. a trailing return type; nothing to check
        self.in_kernel = j in self.kernel_parens
        depth, o = 0, j
        while o >= 0:
            t = toks[o]
            if t.kind == "punct" and t.text == ")":
                depth += 1
            elif t.kind == "punct" and t.text == "(":
                depth -= 1
                if depth == 0:
                    break
            o -= 1
        if self.tok(self.prev_sig(o)).text == "]":
            return  # a lambda's parameters (captures are not address-space qualified)
        for pa, pb in self.split_params(o, j):
            words = [toks[m] for m in range(pa, pb + 1) if toks[m].kind != "comment" and toks[m].orig.strip()]
            texts = [w.orig for w in words]
            angle = 0
            indirect = False
            for w in texts:
                if w == "<":
                    angle += 1
                elif w == ">":
                    angle -= 1
                elif angle == 0 and w in ("*", "&", "&&"):
                    indirect = True
            if indirect and not any(w in ADDRESS_SPACES for w in texts):
                self.err(words[0], f"parameter '{tidy(' '.join(texts))}' is a pointer or reference without an "
                                   f"address space (device, constant, threadgroup or thread): Apple's compiler "
                                   f"rejects it")

    def check_pointer_statement(self, i, k):
        """In `threadgroup T *a = ..., *b;` every declarator must be a pointer or reference:
        `threadgroup T *a, b[4];` would silently make b per-thread storage."""
        toks = self.toks
        j = k
        while True:
            t = self.tok(j)
            if t.kind == "eof":
                self.err(toks[i], "unterminated threadgroup declaration")
            if t.kind == "punct" and t.text == "{" and self.tok(self.prev_sig(j)).text in (")", "const"):
                return  # a function returning a pointer: its body follows
            if t.kind == "punct" and t.text in "([{":
                j = self.next_sig(self.match_group(j))
                continue
            if t.kind == "punct" and t.text == ";":
                return
            if t.kind == "punct" and t.text == "," and not self.is_ptr_declarator(self.next_sig(j)):
                self.err(toks[i], "declare one threadgroup variable per statement (a declaration that "
                                  "mixes pointers and storage cannot be classified)")
            j = self.next_sig(j)

    def text(self, a, b):
        """Source text of the significant tokens a..b-1, space separated."""
        return " ".join(t.text for t in self.toks[a:b] if significant(t))

    # kernel void f(params) / [[kernel]] void f(params)
    def kernel_def(self, a, b, attrs):
        toks = self.toks
        start = self.decl_start(a)
        is_template = any(toks[k].text == "template" for k in range(start, a) if significant(toks[k]))
        max_threads = "1024"
        for name, arg in attrs:
            if name == "max_total_threads_per_threadgroup":
                max_threads = arg
            elif name != "kernel":
                self.err(toks[a], f"unsupported kernel attribute '{name}'")
        self.blank(a, b)
        # find name and '('
        k = self.next_sig(b)
        # leading attributes after `kernel`, e.g. [[max_total_threads_per_threadgroup(N)]]
        name_idx = None
        while k < len(toks):
            tk = toks[k]
            if tk.kind == "punct" and tk.text == "[" and self.is_attr_start(k):
                more, end = self.parse_attr(k)
                for nm, arg in more:
                    if nm == "max_total_threads_per_threadgroup":
                        max_threads = arg
                    else:
                        self.err(tk, f"unsupported kernel attribute '{nm}'")
                self.blank(k, end)
                k = self.next_sig(end)
                continue
            if tk.kind == "punct" and tk.text == "(":
                break
            if tk.kind == "ident":
                name_idx = k
            k = self.next_sig(k)
        if name_idx is None:
            self.err(toks[a], "cannot find the kernel's name")
        fname = toks[name_idx].text
        close = self.match_close(k)
        params = self.split_params(k, close)
        self.kernel_parens.add(close)
        table = []
        grid = []  # (token, attribute, declaration) of the grid-position parameters
        for (pa, pb) in params:
            attr = None
            decl = []  # the parameter's source text without its attribute, for messages
            m = pa
            while m <= pb:
                if toks[m].kind == "punct" and toks[m].text == "[" and self.is_attr_start(m):
                    found, end = self.parse_attr(m)
                    for nm, arg in found:
                        if nm in ("buffer", "threadgroup"):
                            attr = (nm, arg)
                        elif nm in POSITION_ATTRS:
                            attr = (nm, "0")
                        else:
                            self.err(toks[m], f"unsupported kernel parameter attribute [[{nm}]] in kernel '{fname}'")
                    self.blank(m, end)
                    m = end + 1
                    continue
                if significant(toks[m]):
                    decl.append(toks[m].text)
                m += 1
            if attr is None:
                self.err(toks[pa], f"kernel '{fname}': every parameter needs an attribute such as [[buffer(n)]]")
            if attr[0] in GRID_ATTRS:
                first = pa if significant(toks[pa]) else self.next_sig(pa)
                grid.append((toks[first], attr[0], decl))
            self.check_kernel_param(toks[pa], fname, attr[0], decl)
            table.append(attr + (c_string(tidy(" ".join(decl))),))
        self.check_grid_components(fname, grid)
        entries = ", ".join(f"{{::lily::sim::Attr::{nm}, {arg}u, {d}}}" for nm, arg, d in table)
        if fname in self.kernels:
            self.err(toks[a], f"kernel '{fname}' defined twice")
        self.kernels[fname] = {"template": is_template, "line": toks[a].line}
        decl = (f"static const ::lily::sim::ParamAttr __lily_params_{fname}[] = {{{entries}}}; "
                f"static constexpr unsigned __lily_nparams_{fname} = {len(table)}; "
                f"static constexpr unsigned __lily_maxtg_{fname} = {max_threads}; ")
        if not table:
            decl = (f"static const ::lily::sim::ParamAttr* const __lily_params_{fname} = nullptr; "
                    f"static constexpr unsigned __lily_nparams_{fname} = 0; "
                    f"static constexpr unsigned __lily_maxtg_{fname} = {max_threads}; ")
        toks[start].text = decl + toks[start].text

    def check_grid_components(self, fname, grid):
        """MSL: the grid-position parameters of a kernel are all scalars or all vectors of one
        component count (Apple's compiler rejects `uint2 [[threadgroup_position_in_grid]]`
        with `uint [[threads_per_threadgroup]]`)."""
        seen = None
        for tok, attr, decl in grid:
            m = re.match(r"^(?:const\s+)?(u?int|u?short)([234])?$", " ".join(decl[:-1]))
            if not m:
                self.err(tok, f"kernel '{fname}': [[{attr}]] needs a uint or ushort scalar or vector type, "
                              f"not '{' '.join(decl[:-1])}'")
            n = int(m.group(2) or 1)
            if seen and seen[0] != n:
                self.err(tok, f"kernel '{fname}': [[{attr}]] '{' '.join(decl)}' has {n} component(s) but "
                              f"[[{seen[1]}]] '{' '.join(seen[2])}' has {seen[0]}: Metal requires the grid-position "
                              f"attributes of a kernel to match in component count")
            seen = seen or (n, attr, decl)
    def check_kernel_param(self, tok, fname, attr, decl):
        """Address space and type of a kernel parameter against its attribute (the MSL spec's
        rules that Apple's compiler enforces and the simulator would otherwise not see)."""
        what = f"kernel '{fname}': parameter '{tidy(' '.join(decl))}'"
        indirect = "*" in decl or "&" in decl
        spaces = [w for w in decl if w in ADDRESS_SPACES]
        if attr == "buffer":
            if not indirect or spaces not in (["device"], ["constant"]):
                self.err(tok, f"{what} [[buffer(n)]] must be a device or constant pointer or reference")
        elif attr == "threadgroup":
            if not indirect or spaces != ["threadgroup"]:
                self.err(tok, f"{what} [[threadgroup(n)]] must be a threadgroup pointer or reference")
            if "atomic_float" in decl or "float" in decl[decl.index("atomic") + 1:decl.index("atomic") + 3] if "atomic" in decl else False:
                self.err(tok, f"{what}: Metal supports float atomics in device memory only")
        else:
            # grid-position attributes (vectors allowed) are checked with their component counts
            type_words = [w for w in decl[:-1] if w != "const"]
            if indirect or spaces or len(type_words) != 1:
                self.err(tok, f"{what} [[{attr}]] must be a plain uint or ushort (vector) value")
            if attr in SCALAR_ATTRS and type_words[0] not in ("uint", "ushort"):
                self.err(tok, f"{what} [[{attr}]] must be uint or ushort")

    def split_params(self, open_idx, close_idx):
        toks = self.toks
        params, d, cur = [], 0, open_idx + 1
        for m in range(open_idx + 1, close_idx):
            tm = toks[m]
            if tm.kind != "punct":
                continue
            if tm.text in "([{<":
                d += 1
            elif tm.text in ")]}>":
                d -= 1
            elif tm.text == "," and d == 0:
                params.append((cur, m - 1))
                cur = m + 1
        if any(significant(toks[m]) for m in range(cur, close_idx)):
            params.append((cur, close_idx - 1))
        return params

    def registration(self, host_name, fn_id, line):
        base = re.sub(r"<.*", "", fn_id).split("::")[-1].strip()
        if base not in self.kernels and not self.is_header:
            pass  # defined in an included header: its table is visible there
        n = self.counter
        self.counter += 1
        tensor = (", true, true" if self.tensor_bfloat else ", true") if self.tensor_file else ""
        return (f"static const ::lily::sim::Registrar<decltype({fn_id})> __lily_reg_{n}("
                f"\"{host_name}\", &{fn_id}, __lily_params_{base}, __lily_nparams_{base}, "
                f"__lily_maxtg_{base}, \"{self.name}:{line}\"{tensor});")

    # template [[host_name("x")]] [[kernel]] decltype(f<T>) f<T>;
    def instantiation(self, i):
        toks = self.toks
        k = self.next_sig(i)
        host = None
        while self.is_attr_start(k):
            attrs, end = self.parse_attr(k)
            for nm, arg in attrs:
                if nm == "host_name":
                    m = re.match(r'^"([^"]*)"$', arg)
                    if not m:
                        self.err(toks[k], "host_name needs a string literal")
                    host = m.group(1)
                elif nm != "kernel":
                    self.err(toks[k], f"unsupported attribute [[{nm}]] on a kernel instantiation")
            k = self.next_sig(end)
        # end of statement
        j, d = k, 0
        while j < len(toks):
            tj = toks[j]
            if tj.kind == "punct" and tj.text in "([{":
                d += 1
            elif tj.kind == "punct" and tj.text in ")]}":
                d -= 1
            elif tj.kind == "punct" and tj.text == ";" and d == 0:
                break
            j += 1
        if toks[k].text == "decltype":
            po = self.next_sig(k)
            pc = self.match_close(po)
            fn_id = "".join(t.text for t in toks[po + 1:pc] if significant(t))
        else:
            # void f<T>(params...);
            m = k
            fn_parts = []
            started = False
            while m < j and toks[m].text != "(":
                if significant(toks[m]):
                    if toks[m].text == "void" and not started:
                        started = True
                    else:
                        fn_parts.append(toks[m].text)
                m += 1
            fn_id = "".join(fn_parts)
        if not host:
            self.err(toks[i], "kernel instantiation without [[host_name(\"...\")]]")
        nl = sum(toks[m].text.count("\n") for m in range(i, j + 1))
        line = toks[i].line
        self.blank(i, j)
        toks[i].text = self.registration(host, fn_id, line) + "\n" * nl
        toks[i].kind = "gen"
        return j + 1


def tidy(s):
    """`device const uint4 * w` -> `device const uint4* w` (for messages)."""
    s = re.sub(r" ([*&,>)\]]|::)", r"\1", s)
    return re.sub(r"([<(\[]|::) ", r"\1", s)


def c_string(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def split_top(s, sep):
    out, d, cur = [], 0, ""
    in_str = False
    for ch in s:
        if ch == '"':
            in_str = not in_str
        if not in_str:
            if ch in "([{":
                d += 1
            elif ch in ")]}":
                d -= 1
            elif ch == sep and d == 0:
                out.append(cur)
                cur = ""
                continue
        cur += ch
    out.append(cur)
    return out


def namespace_for(path):
    base = os.path.splitext(os.path.basename(path))[0]
    return "lily_msl_" + re.sub(r"\W", "_", base)


def transform(path, out_dir):
    is_header = not path.endswith(".metal")
    t = Transformer(path, is_header)
    body = t.run()
    src = os.path.abspath(path).replace("\\", "/")
    if is_header:
        out = (f"// Generated by msl2cpp.py from {os.path.basename(path)}. Do not edit.\n"
               f"#line 1 \"{src}\"\n{body}")
        dst = os.path.join(out_dir, os.path.basename(path))
    else:
        ns = namespace_for(path)
        tensor = "".join(f"#include <{h}>\n" for h in t.hoisted)
        out = (f"// Generated by msl2cpp.py from {os.path.basename(path)}. Do not edit.\n"
               f"#include <metal_stdlib>\n{tensor}#include \"gpu/sim/kernel_registry.h\"\n"
               f"namespace {ns} {{\nLILY_METAL_USING_DECLS\n#line 1 \"{src}\"\n{body}\n}}  // namespace {ns}\n")
        dst = os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0] + ".metal.cpp")
    old = None
    if os.path.exists(dst):
        with open(dst, encoding="utf-8") as f:
            old = f.read()
    if old != out:  # keep timestamps when nothing changed
        with open(dst, "w", encoding="utf-8") as f:
            f.write(out)
    return dst


def main(argv):
    if len(argv) < 3:
        print("usage: msl2cpp.py OUT_DIR FILE.metal|FILE.h ...", file=sys.stderr)
        return 2
    out_dir = argv[1]
    os.makedirs(out_dir, exist_ok=True)
    try:
        for p in argv[2:]:
            transform(p, out_dir)
    except TransformError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
