"""tools/check_sdk26.py on small made-up headers and sources (no Apple file is needed or
committed), and its operand-combination reading of the real metal/*_tensor* sources."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("check_sdk26", ROOT / "tools" / "check_sdk26.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(root: Path, framework: str, name: str, text: str) -> Path:
    p = root / "System/Library/Frameworks" / f"{framework}.framework/Versions/A/Headers" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text), encoding="utf-8")
    return p


def test_used_apis_reads_nested_receivers_casts_blocks_and_setters(tool):
    src = textwrap.dedent("""
        void f(id<MTLComputePipelineState> pso, id b, id<MTLBuffer> buf, id<MTLCommandBuffer> cb) {
          id p = [[pso device] makeThingWithDescriptor:d options:MTLOptNone reflection:nil error:&e];
          size_t a = [(id<MTLBufferBinding>)b bufferAlignment];
          std::string s([[e localizedDescription] UTF8String] ?: "none");
          [buf setLabel:@(name.c_str())];
          [cb addCompletedHandler:^(id<MTLCommandBuffer> done) {
            Status st = [done status] == MTLCommandBufferStatusError ? Status::error : Status::completed;
            std::string m = std::string("x");
          }];
        }
        """)
    names = tool.used_apis(src)
    for want in ("makeThingWithDescriptor:options:reflection:error:", "device", "bufferAlignment", "UTF8String",
                 "localizedDescription", "setLabel:", "addCompletedHandler:", "status", "MTLCommandBufferStatusError"):
        assert want in names, want
    assert not [n for n in names if "std:" in n or "Status:" in n], names


def test_newest_sdk_branch_drops_fallbacks_of_both_guard_spellings(tool):
    src = textwrap.dedent("""
        #if defined(__MAC_26_0)
        [a newStyle];
        #else
        [a oldStyle];
        #endif
        #if defined(MAC_OS_VERSION_13_0)
        #define HAVE_NEW 1
        #else
        [a olderStyle];
        #endif
        #ifdef HAVE_NEW
        [a newer];
        #else
        [a oldest];
        #endif
        """)
    names = tool.used_apis(src)
    assert {"newStyle", "newer"} <= set(names)
    assert not {"oldStyle", "olderStyle", "oldest"} & set(names)


def test_api_audit_flags_a_deprecated_use_and_maps_setters_to_properties(tool, tmp_path, capsys):
    _write(tmp_path, "Metal", "MTLThing.h", """
        typedef NS_ENUM(NSUInteger, MTLThingKind) {
            MTLThingKindPlain = 0,
            MTLThingKindOld API_DEPRECATED_WITH_REPLACEMENT("MTLThingKindPlain", macos(10.11, 13.0)) = 1,
        } API_AVAILABLE(macos(10.11));
        @protocol MTLThing <NSObject>
        @property (nullable, copy, atomic) NSString *label;
        - (void)runWithCount:(NSUInteger)count API_AVAILABLE(macos(10.13));
        - (void)runOldWay API_DEPRECATED("use runWithCount:", macos(10.11, 14.0));
        @end
        """)
    good = "void f(id<MTLThing> t) { [t setLabel:@\"x\"]; [t runWithCount:2]; int k = MTLThingKindPlain; }"
    assert tool.api_audit(tmp_path, None, source=good)
    out = capsys.readouterr().out
    assert "setLabel: (property label)" in out and "runWithCount:" in out and "10.13" in out
    assert not tool.api_audit(tmp_path, None, source="void f(id<MTLThing> t) { [t runOldWay]; }")
    assert "DEPRECATED in macOS 14.0" in capsys.readouterr().out
    assert not tool.api_audit(tmp_path, None, source="int k = MTLThingKindOld;")
    assert "DEPRECATED in macOS 13.0" in capsys.readouterr().out


def test_api_audit_without_metal_headers_says_skipped(tool, tmp_path, capsys):
    """An overlay of MetalPerformancePrimitives headers only, without --sdk12: a notice, not a
    traceback."""
    assert tool.api_audit(tmp_path, None, source="void f(id<MTLThing> t) { [t runOldWay]; }")
    assert "Metal API audit: SKIPPED" in capsys.readouterr().out
    # headers given that declare none of the APIs used: a wrong path, not a pass
    _write(tmp_path, "Metal", "MTLOther.h", "@protocol MTLOther <NSObject>\n- (void)unrelated;\n@end\n")
    assert not tool.api_audit(tmp_path, None, source="void f(id<MTLThing> t) { [t runOldWay]; }")
    assert "Metal API audit: FAILED" in capsys.readouterr().out


# A made-up tensor-op header in the shape check_sdk26.py reads (no Apple text): an operand
# table in the leading comment, the scopes the comment names, the descriptor, and matmul2d's
# members. MATMUL_H's operands are tensors only and its one getter is the destination's;
# MATMUL_INPUTS_H adds cooperative inputs (getters, and operands of run and the destination).
MATMUL_H = """
    // Element types this operation accepts (A, B, C):
    //   half     half     float
    //   int8_t   int8_t   int32_t
    // Scopes: metal::execution_simdgroup, metal::execution_simdgroups<N>.
    #if defined(__METAL_VERSION__)
    struct matmul2d_descriptor
    {
      enum class mode
      {
        multiply,
        multiply_accumulate,
      };
      int m, n, k;
      bool transpose_left, transpose_right;
      bool relaxed_precision;
      mode matmul_mode;
      constexpr matmul2d_descriptor(int __m, int __n, int __k = dynamic_length_v<int>,
                                    bool __transpose_left = false, bool __transpose_right = false,
                                    bool __relaxed_precision = false, mode __matmul_mode = mode::multiply) thread
          : m(__m) {}
    };
    template <matmul2d_descriptor Descriptor, typename Scope, class... Args>
    class matmul2d
    {
    public:
      template <typename LeftOperandType, typename RightOperandType, typename DestinationOperandType,
                typename V = enable_if_t<is_tensor_v<LeftOperandType> && is_tensor_v<RightOperandType>>,
                typename... RunArgs>
      void run(thread LeftOperandType &left, thread RightOperandType &right,
               thread DestinationOperandType &destination) thread const
      {
        detail::do_run<Descriptor>(left, right, destination);
      }
      template <typename LeftOperandType, typename RightOperandType, typename ElementType, typename CoordType = int,
                typename U = enable_if_t<is_tensor_v<LeftOperandType> && is_tensor_v<RightOperandType>>,
                typename... CoopArgs>
      dest_t<LeftOperandType, RightOperandType, ElementType> get_destination_cooperative_tensor() thread const;
    };
    #endif
    """

_COOP = "(is_tensor_v<{0}> || __is_cooperative_tensor_type_v<{0}>)"
MATMUL_INPUTS_H = (MATMUL_H
                   .replace("enable_if_t<is_tensor_v<LeftOperandType> && is_tensor_v<RightOperandType>>",
                            "enable_if_t<" + _COOP.format("LeftOperandType") + " && "
                            + _COOP.format("RightOperandType") + ">")
                   .replace("    };\n    #endif", """\
      template <typename LeftElementType, typename RightElementType, typename ElementType, typename CoordType = int,
                typename U = enable_if_t<is_scalar_v<LeftElementType>>, typename... CoopArgs>
      left_t<LeftElementType, RightElementType, ElementType> get_left_input_cooperative_tensor() thread const;
      template <typename LeftElementType, typename RightElementType, typename ElementType, typename CoordType = int,
                typename U = enable_if_t<is_scalar_v<RightElementType>>, typename... CoopArgs>
      right_t<LeftElementType, RightElementType, ElementType> get_right_input_cooperative_tensor() thread const;
      template <typename LeftElementType, typename RightElementType, typename ElementType, typename CoordType = int,
                typename SrcElemType, typename SrcExtents, typename SrcLayout, typename... CoopArgs>
      left_t<LeftElementType, RightElementType, ElementType> get_left_input_cooperative_tensor(
          const thread cooperative_tensor<SrcElemType, SrcExtents, SrcLayout> &src) thread const;
    };
    #endif"""))

TYPES_H = """
    template <typename ElementType> constexpr int datatype_of() {
      if constexpr (__is_same_v<ElementType, float>) return 1;
    #if __HAVE_BFLOAT__
      else if constexpr (__is_same_v<ElementType, bfloat>) return 2;
    #endif
      else if constexpr (__is_same_v<ElementType, half>) return 3;
    }
    """


def _kernels(tmp_path: Path, attention_operand: str, probe_operand: str, probe: str = "tensor_ops_probe_bfloat"
             ) -> list[Path]:
    k = tmp_path / "k"
    k.mkdir()
    (k / "tiles_tensor.h").write_text(textwrap.dedent("""
        template <uint R>
        using Tile = tensor<threadgroup half, extents<int32_t, 64, R>, tensor_inline>;
        template <uint R>
        inline Tile<R> tile_at(threadgroup half* p) { return Tile<R>(p, extents<int32_t, 64, R>()); }
        inline void gemm(threadgroup half* a) {
          matmul2d<desc, execution_simdgroups<4>> op;
          auto acc = op.template get_destination_cooperative_tensor<Tile<32>, Tile<64>, float>();
          auto tA = tile_at<32>(a);
          auto tW = tile_at<64>(a + 32);
          op.run(tA, tW, acc);
        }
        """))
    (k / "attn_tensor.metal").write_text(textwrap.dedent(f"""
        using Rows = tensor<device {attention_operand}, dextents<int32_t, 2>, tensor_inline>;
        using S = tensor<threadgroup float, extents<int32_t, 32, 64>, tensor_inline>;
        kernel void attn(device {attention_operand}* q) {{
          Rows tQ(q, dextents<int32_t, 2>(64, 64));
          Rows tK(q, dextents<int32_t, 2>(64, 32));
          S tS(s, extents<int32_t, 32, 64>());
          qk.run(tQ, tK, tS);
        }}
        """))
    (k / "probe_tensor.metal").write_text(textwrap.dedent(f"""
        kernel void {probe}(device {probe_operand}* x) {{
          auto a = tensor<device {probe_operand}, dextents<int32_t, 2>, tensor_inline>(x, dextents<int32_t, 2>(64, 32));
          auto whole = tensor<device {probe_operand}, dextents<int32_t, 2>, tensor_inline>(x, dextents<int32_t, 2>(64, 64));
          auto b = whole.slice(0, 32);
          auto c = tensor<threadgroup float, extents<int32_t, 32, 64>, tensor_inline>(s, extents<int32_t, 32, 64>());
          op.run(a, b, c);
        }}
        """))
    return sorted(k.iterdir())


def test_operand_combinations_resolve_aliases_functions_slices_and_cooperative_tensors(tool, tmp_path):
    combos = dict((where.split(":")[0], c) for c, where in tool.operand_combinations(_kernels(tmp_path, "bfloat", "half")))
    assert combos["tiles_tensor.h"] == ("half", "threadgroup", "half", "threadgroup", "float", "cooperative")
    assert combos["attn_tensor.metal"] == ("bfloat", "device", "bfloat", "device", "float", "threadgroup")
    assert combos["probe_tensor.metal"] == ("half", "device", "half", "device", "float", "threadgroup")


@pytest.mark.parametrize("probe_operand, probe, ok", [("bfloat", "tensor_ops_probe_bfloat", True),
                                                      ("half", "tensor_ops_probe_bfloat", False),
                                                      ("bfloat", "tensor_ops_probe", True),
                                                      ("half", "tensor_ops_probe", False)])
def test_tensor_check_passes_a_combination_missing_from_the_table_only_when_a_probe_runs_it(
        tool, tmp_path, capsys, probe_operand, probe, ok):
    """A combination the table lacks must be run by one of the probes: prefill takes its tensor
    path only where both build (csrc/runtime/prefill.cpp), so either one failing on an OS without
    it sends prefill to the simdgroup_matrix kernels before a shipped kernel could fail."""
    sdk = tmp_path / "sdk"
    _write(sdk, "MetalPerformancePrimitives", "MPPTensorOpsMatMul2d.h", MATMUL_H)
    _write(sdk, "MetalPerformancePrimitives", "__impl/MPPTensorOpsTypes.h", TYPES_H)
    assert tool.tensor_check(sdk, sources=_kernels(tmp_path, "bfloat", probe_operand, probe)) is ok
    out = capsys.readouterr().out
    assert "half (threadgroup) x half (threadgroup) -> float (cooperative): in the table" in out
    assert "bfloat (device) x bfloat (device) -> float (threadgroup): NOT in the table" in out
    if ok:
        assert f"{probe} runs it, so on an OS without it prefill's tensor path falls back" in out
    else:
        assert "NOT in the table and NOT run by any probe" in out
    assert "matmul2d_descriptor(...) parameters (type, default): same" in out
    assert "(bfloat only where the compiler defines __HAVE_BFLOAT__)" in out


def test_every_shipped_tensor_operand_combination_is_resolved_and_run_by_a_probe(tool):
    """The standing guarantee behind the check: whatever Apple's table says, an OS whose
    tensor library lacks a combination the shipped kernels use fails a probe at load (the
    device then uses the simdgroup_matrix kernels), never a shipped kernel. Every tensor
    kernel takes bfloat operands (nothing is clipped), so both probes run bfloat ones: a
    library without them (MacOSX 26.0's table) takes prefill off the tensor path.

    One exception, named exactly: the attention's register path runs P V with both operands
    cooperative inputs, which no probe runs (found 2026-12-06, when the check learned to read
    `pv.run(pin, vb[j % 2], o[j])`). The attention family's own load-time check
    (Runtime::check_tensor_families: its pipelines built and run against the simdgroup_matrix
    twins) guards it, so an OS without it sends the attention alone back; whether the probe
    should run it too (which would send every bfloat tensor kernel back) is left open."""
    sources = [f for f in tool.tensor_sources() if not f.name.startswith("selftest")]
    combos = tool.operand_combinations(sources)
    shipped = {c for c, where in combos if tool.probe_of(where) is None}
    probes = {p: {c for c, where in combos if tool.probe_of(where) == p} for p in tool.PROBES}
    assert shipped and all(probes.values()), probes
    assert all(set(c[0:6:2]) <= tool.ELEMENT_TYPES for c in shipped | set().union(*probes.values()))
    unprobed = {(c, where.split(":")[0]) for c, where in combos
                if tool.probe_of(where) is None and c not in set().union(*probes.values())}
    register_pv = ("bfloat", "cooperative", "bfloat", "cooperative", "float", "cooperative")
    assert unprobed == {(register_pv, "attention_prefill_tensor.metal")}, unprobed
    # each probe runs its own family's operations: the GEMMs' (cooperative left input) and the
    # attention's (S: Q a cooperative left input, K a device tensor; P V: P in threadgroup
    # memory, V a cooperative right input)
    assert {c[1] for c in probes["tensor_ops_probe"]} == {"cooperative"}
    assert {(c[1], c[3]) for c in probes["tensor_ops_probe_bfloat"]} == {("cooperative", "device"),
                                                                       ("threadgroup", "cooperative")}
    assert {c[0] for cs in probes.values() for c in cs} == {"bfloat"}


def _register_kernel(tmp_path: Path, body: str) -> list[Path]:
    """A made-up kernel with a register-path product (cooperative left and right inputs)."""
    f = tmp_path / "reg_tensor.metal"
    f.write_text(textwrap.dedent("""
        kernel void reg(device bfloat* x) {
          constexpr auto desc = matmul2d_descriptor(16, 32, 32, false, false, false,
                                                    matmul2d_descriptor::mode::multiply_accumulate);
          matmul2d<desc, execution_simdgroup> op;
        """) + textwrap.dedent(body) + "}\n", encoding="utf-8")
    return [f]


REGISTER_PATH = """
    using VIn = decltype(op.template get_right_input_cooperative_tensor<bfloat, bfloat, float>());
    using Tile = tensor<threadgroup bfloat, extents<int32_t, 32, 16>, tensor_inline>;
    auto a = op.template get_left_input_cooperative_tensor<bfloat, bfloat, float>();
    using ODest = decltype(op.template get_destination_cooperative_tensor<conditional_t<true, decltype(a), Tile>, VIn,
                                                                          float>());
    ODest o[2];
    VIn vb[2];
    for (uint j = 0; j < 2; ++j) {
      op.run(a, vb[j % 2], o[j]);
    }
    """


def test_operand_combinations_read_array_elements_and_decltype_aliases(tool, tmp_path):
    """run(a, vb[j % 2], o[j]), its operands' types named by decltype aliases of the getters:
    the attention's P V products are written so, and were once skipped."""
    combos = tool.operand_combinations(_register_kernel(tmp_path, REGISTER_PATH))
    assert [c for c, _ in combos] == [("bfloat", "cooperative", "bfloat", "cooperative", "float", "cooperative")]
    # an operand the check cannot read (a temporary) is unresolved, not skipped
    combos = tool.operand_combinations(_register_kernel(tmp_path, REGISTER_PATH.replace("op.run(a,", "op.run(a.x(),")))
    assert [c[:2] for c, _ in combos] == [("?", "?")]


def test_member_check_needs_the_getters_and_cooperative_operands_the_kernels_use(tool, tmp_path, capsys):
    """The register path against a header whose operands are tensors only (MacOSX 26.1's
    kind): the input getters are missing and the cooperative operands refused, each named with
    its file:line; against one with cooperative inputs (26.2's kind) every call fits."""
    ours = (ROOT / "csrc/gpu/sim/msl/MetalPerformancePrimitives/MetalPerformancePrimitives.h").read_text()
    kernels = _register_kernel(tmp_path, REGISTER_PATH)
    assert not tool.member_check(textwrap.dedent(MATMUL_H), ours, kernels)
    out = capsys.readouterr().out
    assert "get_left_input_cooperative_tensor: NOT DECLARED" in out
    assert "get_right_input_cooperative_tensor: NOT DECLARED" in out
    assert "reg_tensor.metal:15: run's LeftOperandType is a cooperative tensor" in out
    assert "reg_tensor.metal:15: run's RightOperandType is a cooperative tensor" in out
    assert "reg_tensor.metal:10: get_destination_cooperative_tensor's LeftOperandType is a cooperative tensor" in out
    assert tool.member_check(textwrap.dedent(MATMUL_INPUTS_H), ours, kernels), capsys.readouterr().out
    out = capsys.readouterr().out
    assert "get_left_input_cooperative_tensor<LeftElementType, RightElementType, ElementType, CoordType = int>() " \
           "const -> left_t<LeftElementType, RightElementType, ElementType>: same" in out
    assert "run<LeftOperandType, RightOperandType, DestinationOperandType>(LeftOperandType&, RightOperandType&, " \
           "DestinationOperandType&) const -> void: same" in out
    assert "all fit these declarations" in out
    # the right input's getter alone missing: that alone fails
    no_right = textwrap.dedent(MATMUL_INPUTS_H).replace("get_right_input_cooperative_tensor", "get_other_tensor")
    assert not tool.member_check(no_right, ours, kernels)
    out = capsys.readouterr().out
    assert "get_right_input_cooperative_tensor: NOT DECLARED" in out and "CALL DOES NOT FIT" not in out


@pytest.mark.parametrize("call, complaint", [
    ("get_left_input_cooperative_tensor<decltype(a), bfloat, float>()", "LeftElementType must be an element type"),
    ("get_destination_cooperative_tensor<bfloat, VIn, float>()", "LeftOperandType must be a tensor type"),
    ("get_right_input_cooperative_tensor<bfloat>()", "takes 3-4 template arguments, given 1")])
def test_member_check_names_a_wrong_template_argument(tool, tmp_path, capsys, call, complaint):
    ours = (ROOT / "csrc/gpu/sim/msl/MetalPerformancePrimitives/MetalPerformancePrimitives.h").read_text()
    kernels = _register_kernel(tmp_path, REGISTER_PATH + f"    auto bad = op.template {call};\n")
    line = next(i for i, t in enumerate(kernels[0].read_text().splitlines(), 1) if "auto bad" in t)
    assert not tool.member_check(textwrap.dedent(MATMUL_INPUTS_H), ours, kernels)
    out = capsys.readouterr().out
    assert f"CALL DOES NOT FIT: reg_tensor.metal:{line}: {call.split('<')[0]}" in out.split(complaint)[0].splitlines()[-1]
    assert out.count("CALL DOES NOT FIT") == 1, out


def test_member_check_compares_const_this_and_parameters_with_the_stand_in(tool, tmp_path, capsys):
    """A stand-in whose getter is not const (a const matmul2d could not call it on the
    simulator while Apple's compiler accepts it) or whose run() takes its operands by value."""
    ours = (ROOT / "csrc/gpu/sim/msl/MetalPerformancePrimitives/MetalPerformancePrimitives.h").read_text()
    kernels = _register_kernel(tmp_path, REGISTER_PATH)
    getter = "auto get_left_input_cooperative_tensor() const {"
    assert getter in ours
    assert not tool.member_check(textwrap.dedent(MATMUL_INPUTS_H), ours.replace(getter, getter.replace(" const", "")),
                                 kernels)
    assert "get_left_input_cooperative_tensor" in capsys.readouterr().out.split("DIFFERENT (const this)")[0]
    run = "void run(LeftOperandType& left,"
    assert run in ours
    assert not tool.member_check(textwrap.dedent(MATMUL_INPUTS_H), ours.replace(run, run.replace("& left", " left")),
                                 kernels)
    assert "DIFFERENT (parameter types)" in capsys.readouterr().out
