"""The kernels' host-visible facts have one home (metal/*_args.h, the plans' headers) and
Python reads them from the native module: argument struct layouts (lily._core.KERNEL_ARGS,
packed by field name with lily.lab.device.pack_args) and constants (lily._core.CONSTANTS)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from lily import _core
from lily.lab.device import pack_args

ROOT = Path(__file__).resolve().parents[1]


def _header_structs() -> dict[str, list[str]]:
    """Every `struct T { ... };` of metal/*_args.h with its field names, read from the source."""
    out = {}
    for path in sorted((ROOT / "metal").glob("*_args.h")):
        for m in re.finditer(r"^struct (\w+) \{\n(.*?)^\};", path.read_text(), re.S | re.M):
            out[m.group(1)] = re.findall(r"^\s*(?:uint|float) (\w+)", m.group(2), re.M)
    return out


def test_every_argument_struct_is_reflected_in_order():
    """KERNEL_ARGS has every struct of the headers (but GdnRing, a host-side layout helper)
    with its fields in declaration order, 4 bytes each, back to back."""
    structs = _header_structs()
    assert set(structs) - set(_core.KERNEL_ARGS) == {"GdnRing"}
    for name, (size, fields) in _core.KERNEL_ARGS.items():
        assert [f[0] for f in fields] == structs[name], name
        at = 0
        for field, kind, offset, count in fields:
            assert kind in ("uint", "float") and offset == at, (name, field)
            at += 4 * count
        assert at == size, name


def test_pack_args_by_name():
    """Fields land at their offsets as uint32 / float32, whatever order they are given in;
    an array field takes its values in order."""
    b = pack_args("NormGemvArgs", eps=1e-6, k_splits=2, rows_per_simdgroup=8, write_xn=True, cols=2048,
                  rows=[3, 2, 1, 0])
    assert len(b) == _core.KERNEL_ARGS["NormGemvArgs"][0] == 36
    assert np.frombuffer(b[:16], np.uint32).tolist() == [3, 2, 1, 0]
    assert np.frombuffer(b, np.uint32)[4] == 2048 and np.frombuffer(b, np.float32)[5] == np.float32(1e-6)
    assert np.frombuffer(b[24:], np.uint32).tolist() == [1, 8, 2]


@pytest.mark.parametrize("struct,fields,message", [
    ("NoSuchArgs", {}, "unknown argument struct 'NoSuchArgs'"),
    ("GemvArgs", {"rows": 1}, "GemvArgs: missing cols"),
    ("GemvArgs", {"rows": 1, "cols": 64, "depth": 2}, "GemvArgs: no field depth"),
    ("GemvArgs", {"rows": -1, "cols": 64}, "GemvArgs.rows is a uint"),
    ("GemvArgs", {"rows": 2**32, "cols": 64}, "GemvArgs.rows is a uint"),
    ("GemvArgs", {"rows": 1.5, "cols": 64}, "GemvArgs.rows is a uint"),
    ("NormArgs", {"n": 64, "eps": "small"}, "NormArgs.eps is a float"),
    ("NormGemvArgs", {"rows": [1, 2], "cols": 64, "eps": 1e-6, "write_xn": 0, "rows_per_simdgroup": 4,
                      "k_splits": 1},
     "NormGemvArgs.rows: 4 values, got 2"),
])
def test_pack_args_refuses(struct, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        pack_args(struct, **fields)


def test_constants_are_the_headers():
    """CONSTANTS holds the values the headers define (read from the source here, so a constant
    moved or changed on one side only fails)."""
    text = "\n".join(p.read_text() for p in (ROOT / "metal").glob("*_args.h"))
    text += (ROOT / "csrc/runtime/decode.h").read_text()
    for name, value in _core.CONSTANTS.items():
        m = re.search(rf"\b{name}\s*=\s*([^;,}}]+)", text)
        assert m, name
        expr = re.sub(r"(\d)[fu]\b", r"\1", m.group(1).split("//")[0])
        # a literal, or an expression of the constants before it (kGemmLd = kGemmBK + 8)
        want = eval(expr, {"__builtins__": {}}, dict(_core.CONSTANTS))  # noqa: S307 (our header)
        # a float constant is a float32 in the headers (1e-6f), exported as the double it holds
        assert (np.float32(want) if isinstance(value, float) else want) == value, name


def _sources(*patterns: str) -> dict[Path, str]:
    return {p: p.read_text() for pattern in patterns for p in sorted(ROOT.glob(pattern))}


def _words(name: str) -> set[str]:
    """The lowercase words of a constant's or a Python name (kAttnDecodeThreads, ATTN_TG:
    attn, decode, threads; attn, threads), singular, with the lab's abbreviations spelled out."""
    name = re.sub(r"^k(?=[A-Z])", "", name)
    parts = name.split("_") if "_" in name or name.isupper() else re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)
    aliases = {"tg": "thread", "sg": "simdgroup", "per": "", "max": ""}
    words = {aliases.get(w.lower().rstrip("s"), w.lower().rstrip("s")) for w in parts}
    return words - {""}


def _python_numbers(python: dict[Path, str]) -> list[tuple[str, float, str]]:
    """(name, value, where) of each module-level assignment of a number to a name of two words
    or more (`ATTN_THREADS = 256`)."""
    out = []
    for path, text in python.items():
        for node in ast.parse(text).body:
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)):
                continue
            v = node.value.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            out += [(t.id, v, f"{path.relative_to(ROOT)}:{node.lineno} {t.id}") for t in node.targets
                    if isinstance(t, ast.Name) and len(_words(t.id)) >= 2]
    return out


def test_constants_have_one_home():
    """Each reflected constant is defined in one header (metal/*_args.h, decode.h) and written
    as a number nowhere else: no other header's, kernel's or C++ file's code restates it
    (`name = 64`; they include the header), and no Python module pins a number beside its name
    (`X = 64  # name`) or under a name of the constant's words (`ATTN_THREADS = 256` for
    kAttnDecodeThreads; they read lily._core.CONSTANTS)."""
    native = _sources("metal/*.h", "metal/*.metal", "csrc/**/*.h", "csrc/**/*.cpp")
    code = {p: re.sub(r"//[^\n]*", "", text) for p, text in native.items()}  # comments may derive a value
    python = _sources("src/lily/**/*.py", "tests/**/*.py", "tools/**/*.py")
    numbers = _python_numbers(python)
    for name in _core.CONSTANTS:
        # (a definition naming the header's, `= args::{name}`, is not a second home)
        homes = [p for p, text in native.items()
                 if re.search(rf"(?:constexpr|enum)\b[^;]*\b{name}\s*=\s*(?![\s=]|args::)", text)]
        assert len(homes) == 1, f"{name} defined in {[str(p.relative_to(ROOT)) for p in homes]}"
        copies = [p for p, text in code.items() if p != homes[0] and re.search(rf"\b{name}\s*=\s*\d", text)]
        copies += [p for p, text in python.items()
                   if re.search(rf"^\w+\s*=\s*[\d.]+\s*#.*\b{name}\b", text, re.M)]
        assert not copies, f"{name} (home {homes[0].relative_to(ROOT)}) copied in " + \
            ", ".join(str(p.relative_to(ROOT)) for p in copies)
        # a number equal to the constant's under a name of its words (all of them the constant's)
        named = [where for n, v, where in numbers if v == _core.CONSTANTS[name] and _words(n) <= _words(name)]
        assert not named, f"{name} (home {homes[0].relative_to(ROOT)}) copied in " + ", ".join(named)
    # The grouped expert GEMMs' geometry (prefill_args.h: kExpertTileRows, moe_gemm_sm/_sn/_bn/
    # _threads/_band): no second list of the tile heights anywhere, and no choice between
    # geometry numbers (`h <= 32 ? 16 : 32`, `T == 128 ? 256 : ...`, `return 128;`) where the
    # host picks (prefill.cpp's moe_tile_rows), dispatches and models them; their threadgroup
    # memory is the kernels' (gemm_args.h, prefill_args.h, mixer_args.h *_smem_bytes), not a
    # formula of the cost table's.
    heights = [p for p, text in code.items() if re.search(r"\{\s*16u?,\s*32u?,\s*64u?,\s*128u?\s*\}", text)]
    assert heights == [ROOT / "metal/prefill_args.h"], heights
    for rel in ("csrc/runtime/cost.cpp", "csrc/runtime/families/moe_prefill.cpp", "csrc/runtime/prefill.cpp"):
        pick = re.search(r"\?\s*(?:16|32|64|128|256)u?\s*:\s*(?:16|32|64|128|256)u?\b"
                         r"|\breturn\s+(?:16|32|64|128)u?\s*;", code[ROOT / rel])
        assert not pick, f"{rel}: {pick.group(0)} restates the geometry of metal/prefill_args.h"
    cost = code[ROOT / "csrc/runtime/cost.cpp"]
    for rhs in re.findall(r"threadgroup_memory = ([^;]*);", cost):
        assert "_smem" in rhs, rhs
    assert "kGemmLd" not in cost and "kAttnPrefillSlabRows" not in cost  # the ingredients of those sizes


# The kernels whose [[max_total_threads_per_threadgroup]] is a number, and why no constant
# names their threads: a cap on a size the caller picks, or a size the kernel derives.
UNNAMED_THREAD_LIMITS = {
    "tensor_ops_probe": "doctor's probe of the tensor-op path, a fixed 128-thread test",
    "tensor_ops_probe_bfloat": "doctor's probe of the tensor-op path, a fixed 128-thread test",
    "attn_qk_prep": "threads = head_dim (a multiple of 32), capped",
    "attn_prefill_combine": "threads = head_dim (a multiple of 32), capped",
    "gdn_decode_step": "Dv / kGdnDecodeSplits * 8 threads: a function of the head size, capped",
    "gdn_state_writeback": "gdn_decode_step's grid and threadgroups",
    "gdn_scan": "RV * kGdnScanLanesPerRow, per instantiation, at most 128",
    "rms_norm_t": "any size up to 1024 (the caller's)",
    "moe_combine_norm": "any multiple of 32 up to 1024 (the caller's; rms_norm's for identical bits)",
    "moe_route": "round_up(experts, 32), 32..1024",
    "gemv_q": "any multiple of 32 * k_splits up to 256 (kGemvThreads, decode_args.h, is the default)",
    "gemv_gated_q": "as gemv_q",
    "gemv_batch_q": "as gemv_q",
    "gemv_gated_batch_q": "as gemv_q",
    "norm_gemv_q": "as gemv_q (kGemvThreads, decode_args.h, or kLmHeadThreads, decode.h)",
    "norm_gemv_batch_q": "as norm_gemv_q",
    "embed_norm_gemv_q": "as norm_gemv_q",
    "moe_gate_up_swiglu_q4": "any multiple of 64 up to 256 (kGemvThreads, decode_args.h, is the default)",
    "moe_route_gate_up_swiglu_q4": "as moe_gate_up_swiglu_q4",
    "moe_route_gate_up_batch_q4": "as moe_gate_up_swiglu_q4",
    "moe_down_q4": "as moe_gate_up_swiglu_q4",
}


def test_thread_limits_are_named():
    """The kernels whose threads per threadgroup have a name in metal/*_args.h declare that
    name as their [[max_total_threads_per_threadgroup]] (the simulator evaluates it as Apple's
    compiler does and reports the constant's value for every instantiation); in every
    metal/*.metal file a number is left only for the kernels of UNNAMED_THREAD_LIMITS."""
    dev = _core.sim_device(record_only=True, gpu_family="apple10")
    declared = re.compile(r"\[\[max_total_threads_per_threadgroup\((\w+)\)\]\] kernel void (\w+)\(")
    instances = re.compile(r'host_name\("(\w+)"\)\]\] \[\[kernel\]\] decltype\((\w+)<')
    literal, named = set(), 0
    for path in sorted((ROOT / "metal").glob("*.metal")):
        text = path.read_text()
        hosts: dict[str, list[str]] = {}
        for host, fn in instances.findall(text):
            hosts.setdefault(fn, []).append(host)
        # every limit is one the pattern reads (none hides on a line of another shape)
        assert len(declared.findall(text)) == text.count("max_total_threads_per_threadgroup("), path.name
        for limit, fn in declared.findall(text):
            if limit.isdigit():
                literal.add(fn)
                continue
            for host in hosts.get(fn, [fn]):
                info = dev.pipeline_info(host)
                assert info["max_threads_per_threadgroup"] == _core.CONSTANTS[limit], (host, limit)
                named += 1
    assert literal == set(UNNAMED_THREAD_LIMITS), literal ^ set(UNNAMED_THREAD_LIMITS)
    assert named > 40


def test_kernel_names_follow_one_rule():
    """Every templated kernel of the library is base, '_<key><value>' per parameter, suffix
    (csrc/runtime/kernel_names.h), so the plans, the cost table and Python build and read its
    name with lily._core.kernel_name / kernel_params."""
    assert _core.kernel_name("gdn_scan", k=128, v=128, r=32) == "gdn_scan_k128_v128_r32"
    assert _core.kernel_name("gemm", "_add_h_tensor", q=4) == "gemm_q4_add_h_tensor"
    assert _core.kernel_params("moe_gemm_down_q4_t64_tensor") == {"q": 4, "t": 64}
    assert _core.kernel_params("rms_norm_bf16") == {}
    templated = 0
    for name in _core.sim_device(record_only=True).kernel_names():
        parts = name.split("_")
        at = [i for i, p in enumerate(parts) if re.fullmatch(r"[a-z]\d+", p)]
        if not at:
            continue
        templated += 1
        assert at == list(range(at[0], at[-1] + 1)), f"{name}: parameters not in one run"
        base, suffix = "_".join(parts[:at[0]]), "".join("_" + p for p in parts[at[-1] + 1:])
        assert _core.kernel_name(base, suffix, **_core.kernel_params(name)) == name
    assert templated > 40
    with pytest.raises(ValueError, match="one lowercase letter"):
        _core.kernel_name("gemm", qq=4)
