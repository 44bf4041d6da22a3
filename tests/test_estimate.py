"""lily.lab.estimate / `lily estimate`: the performance model's structure and sanity (never timings):
every dispatched kernel is in the cost table with its latency chains, the decode estimate
stays under the bandwidth floor, speed falls with context within a code path, occupancy and
latency chains cost what they should, an unknown kernel fails loudly, the stage gap matches its
stated calibration, every figure comes as low <= likely <= high, JSON schema."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from dataclasses import replace

import jsonschema
import pytest

from lily import _core
from lily.lab import calibration, estimate
from lily.errors import InvalidParameterError
from lily.native_backend import count_decode_step, count_prefill_chunk

CFG = estimate.model_config()


def _plans():
    """Records of every code path of the real model's plan."""
    yield "decode 4K", count_decode_step(CFG, 4096)
    yield "decode 32K (split attention)", count_decode_step(CFG, 32768)
    yield "prefill simdgroup", count_prefill_chunk(CFG, 512, 0)
    yield "prefill tensor", count_prefill_chunk(CFG, 512, 4096, gemm_path="tensor")
    yield "prefill split attention", count_prefill_chunk(CFG, 16, 65536)


def test_every_dispatched_kernel_is_in_the_work_table():
    """A new kernel cannot be free: the plan's every kernel has work (flops or bytes)."""
    for what, c in _plans():
        unknown = sorted({r["kernel"] for r in c["records"] if r["work"] is None})
        assert not unknown, f"{what}: add {unknown} to csrc/runtime/cost.cpp"
        assert len(c["records"]) == c["dispatches"]
        for r in c["records"]:
            w = r["work"]
            assert set(w["flops"]) == set(estimate.PATHS)
            assert w["bytes"] > 0 and all(f >= 0 for f in w["flops"].values()), r


def test_unknown_kernel_fails_loudly():
    rec = dict(count_decode_step(CFG, 256)["records"][0], kernel="new_kernel", work=None)
    with pytest.raises(estimate.UnknownKernelError, match="new_kernel"):
        estimate.time_records(estimate.machine("m5max"), [rec])


def test_records_carry_geometry_and_work():
    c = count_prefill_chunk(CFG, 512, 0)
    gemm = next(r for r in c["records"] if r["kernel"] == "gemm_q4" and "in_proj_qkv" in r["label"])
    # conv_dim 8192 columns in 64-wide blocks, 512 rows in 64-row blocks, k = 2048; bfloat
    # operands (metal/gemm_tiles.h): the products are counted on the bfloat paths only
    assert gemm["groups"] == (128, 8, 1) and gemm["threads"] == (128, 1, 1)
    assert gemm["work"]["flops"]["sgmm_bf16"] == 2 * 512 * 8192 * 2048
    assert gemm["work"]["flops"]["sgmm_f32"] == gemm["work"]["flops"]["sgmm_f16"] == 0
    assert gemm["threadgroup_memory"] == (64 + 64) * 72 * 2  # bfloat A and W tiles
    prefill_tensor = count_prefill_chunk(CFG, 512, 0, gemm_path="tensor")["records"]
    t = next(r for r in prefill_tensor if r["kernel"] == "gemm_q4_tensor" and "in_proj_qkv" in r["label"])
    assert t["work"]["flops"]["tensor_bf16"] == 2 * 512 * 8192 * 2048 and t["work"]["flops"]["tensor_f16"] == 0
    # the tensor-op twins: 128-row blocks of 256 threads, so each weight tile is dequantized
    # once per 128 rows; the bfloat W tile only (A in registers, results written from them)
    assert t["groups"] == (128, 4, 1) and t["threads"] == (256, 1, 1)
    # dequantization: 13 half operations per 8 codes (gemm_tiles.h gemm_codes4), then 3 fp32
    # per weight (conversion, FMA, rounding to bfloat)
    assert t["work"]["flops"]["alu_f16"] == 13 / 8 * 4 * 8192 * 2048 == gemm["work"]["flops"]["alu_f16"] / 2
    assert t["threadgroup_memory"] == 64 * 72 * 2
    # no prefill GEMM (dense or grouped, either path) multiplies fp32 or half operands
    for r in c["records"] + prefill_tensor:
        if "gemm" in r["kernel"]:
            f = r["work"]["flops"]
            assert f["sgmm_f32"] == f["tensor_f32"] == f["sgmm_f16"] == f["tensor_f16"] == 0, r["kernel"]
            assert f["sgmm_bf16"] + f["tensor_bf16"] > 0, r["kernel"]
    # decode attention work grows with the keys it reads
    def attn(ctx):
        return sum(r["work"]["flops"]["alu_f32"] for r in count_decode_step(CFG, ctx)["records"]
                   if r["kernel"].startswith("attn_decode"))
    assert attn(8192) / attn(4096) == pytest.approx(2, rel=0.01)


def test_decode_bytes_are_the_traffic_and_stay_under_the_raw_bandwidth_ceiling():
    for ctx in (256, 4096, 32768):
        c = count_decode_step(CFG, ctx)
        moved = c["weight_bytes"] + c["kv_bytes"] + c["state_bytes"] + c["activation_bytes"]
        assert sum(r["work"]["bytes"] for r in c["records"]) == pytest.approx(moved, rel=0.01)
        for key in estimate.MACHINES:
            m = estimate.machine(key)
            t = estimate.time_records(m, c["records"])
            assert t.bytes == pytest.approx(moved, rel=0.01)
            assert 1 / t.seconds < m.bandwidth / t.bytes  # never faster than bytes / bandwidth
            assert t.stages == c["barrier_stages"]


def test_speed_falls_with_context_within_a_code_path():
    rep = estimate.estimate("m5max", contexts=(1024, 4096, 16384, 32768, 131072), prompts=(1024, 4096, 16384),
                        breakdown_at=1024)
    tps = {r["context"]: r["tok_s"]["likely"] for r in rep["decode"]}
    assert tps[1024] > tps[4096] > tps[16384]  # one KV block per threadgroup
    assert tps[32768] > tps[131072]            # split-KV path
    pre = {r["prompt"]: r for r in rep["prefill"]}
    assert pre[1024]["seconds"]["likely"] < pre[4096]["seconds"]["likely"] < pre[16384]["seconds"]["likely"]
    assert pre[4096]["tok_s"]["likely"] > pre[16384]["tok_s"]["likely"]  # attention grows quadratically
    assert sum(f["share"] for f in rep["breakdown"]["decode"]["families"]) == pytest.approx(1)
    assert sum(f["ms"] for f in rep["breakdown"]["prefill"]["families"]) == pytest.approx(
        rep["breakdown"]["prefill"]["ms"])
    # each family's own low / high over the scenario machines brackets its likely time, and the
    # host's per-chunk cost spans its stated range (CONSTANTS chunk_overhead: 0-10 ms a chunk)
    for phase in ("decode", "prefill"):
        for f in rep["breakdown"][phase]["families"]:
            r = f["ms_range"]
            assert r["low"] <= r["likely"] == f["ms"] <= r["high"] and r["low"] < r["high"], f
    host = next(f for f in rep["breakdown"]["prefill"]["families"] if f["family"] == estimate.CHUNK_FAMILY)
    c = estimate.CONSTANTS["chunk_overhead"]
    assert host["ms_range"]["low"] == 1e3 * min(c.low, c.high) and host["ms_range"]["high"] == pytest.approx(
        1e3 * max(c.low, c.high))


def _no_latency(m):
    return replace(m, latency=dict.fromkeys(estimate.LATENCY_KINDS, 0.0))


def test_occupancy_a_small_grid_gets_its_share():
    m = estimate.machine("m5max")
    assert estimate.occupancy(m, 4, 256) == pytest.approx(4 / 40)
    assert estimate.occupancy(m, 400, 256) == 1
    assert estimate.occupancy(m, 40, 64) == pytest.approx(64 / estimate.SATURATION_THREADS)
    rec = next(r for r in count_decode_step(CFG, 4096)["records"] if r["kernel"].startswith("attn_decode"))
    rec, wide = dict(rec, groups=(4, 1, 1), threads=(256, 1, 1)), dict(rec, groups=(400, 1, 1), threads=(256, 1, 1))
    flat = _no_latency(replace(m, occupancy_rule="share"))  # the roofline alone
    assert estimate.dispatch_seconds(flat, rec) == pytest.approx(10 * estimate.dispatch_seconds(flat, wide))
    # the other small-grid rules: a core's own path to memory, or no share at all
    cb = replace(flat, occupancy_rule="core_bandwidth")
    assert estimate.dispatch_seconds(cb, rec) < estimate.dispatch_seconds(flat, rec)
    assert estimate.dispatch_seconds(replace(flat, occupancy_rule="full"), rec) == pytest.approx(
        estimate.dispatch_seconds(flat, wide))
    with pytest.raises(InvalidParameterError, match="unknown occupancy rule"):
        estimate.dispatch_seconds(replace(flat, occupancy_rule="guess"), rec)


def test_calibration_is_what_the_reference_fit_gives():
    """BANDWIDTH_EFFICIENCY and STAGE_GAP are calibrate_reference's fit to pplx-garden's
    published decode (the likely latency model and small-grid rule, core_bandwidth: the best
    fit, tied with full, and the middle of the three rules' figures), whose step has the 425
    barrier stages counted in their source and the bytes of ours within 1.5% at every context
    (same model, same checkpoint, bf16 KV cache) with our DeltaNet state written back every
    step, as theirs is. Without latency chains the efficiency is what STREAM-style kernels
    reach on an M5 (0.79); the share rule fits worse, full as well with a larger gap."""
    m = estimate.machine("m5max")
    assert m.occupancy_rule == estimate.LIKELY_RULE == "core_bandwidth"
    cal = calibration.calibrate_reference(m)
    assert cal["bandwidth_efficiency"] == pytest.approx(estimate.BANDWIDTH_EFFICIENCY, abs=1e-3)
    assert cal["stage_gap"] == pytest.approx(estimate.STAGE_GAP, rel=0.01)
    assert cal["rms_relative_error"] < 0.014
    share = calibration.calibrate_reference(replace(m, occupancy_rule="share"))
    assert share["rms_relative_error"] > cal["rms_relative_error"] and share["stage_gap"] < estimate.STAGE_GAP
    assert [r["stages"] for r in cal["rows"]] == [estimate.CALIBRATION["stages_per_step"]] * 10
    for r in cal["rows"]:
        ours = sum(x["work"]["bytes"] for x in count_decode_step(CFG, r["context"] + 32, state_window=1)["records"])
        assert r["gb_per_step"] * 1e9 == pytest.approx(ours, rel=0.015), r["context"]
    flat = calibration.calibrate_reference(_no_latency(m))
    assert flat["bandwidth_efficiency"] == pytest.approx(0.79, abs=5e-3) and flat["rms_relative_error"] < 0.0095
    full = calibration.calibrate_reference(replace(m, occupancy_rule="full"))
    assert estimate.STAGE_GAP < full["stage_gap"] < 4e-6
    assert full["rms_relative_error"] == pytest.approx(cal["rms_relative_error"], abs=5e-4)
    # below 257 positions their attention runs unsplit, one stage fewer per attention layer
    assert len({x["stage"] for x in calibration.reference_decode_step(256)}) == 415


def test_machine_table_has_sources():
    for key, m in estimate.MACHINES.items():
        for what in ("cores", "bandwidth", "clock", "f16", "tensor", "threadgroup_memory"):
            assert m.sources.get(what), f"{key}: no source for {what}"
        assert m.tensor_ops == m.tensor_attention == (m.gpu_family >= 10)
        assert estimate.gemm_path(m) == ("tensor" if m.tensor_ops else "simdgroup")
    assert {"m1max", "m3max", "m4max", "m5pro", "m5max"} <= set(estimate.MACHINES)
    with pytest.raises(InvalidParameterError, match="unknown machine"):
        estimate.machine("m9")
    with pytest.raises(InvalidParameterError, match="contexts must be a positive"):
        estimate.estimate("m5max", contexts=(0,), prompts=(256,))
    for kw, what in ((dict(chunk=-3), "chunk must be"),
                     (dict(prompts=(262145,)), "prompts 262145 is beyond the model's limit"),
                     (dict(contexts=(262144,)), "contexts 262144 is beyond"),
                     (dict(breakdown_at=999999), "breakdown_at 999999 is beyond")):
        with pytest.raises(InvalidParameterError, match=what):
            estimate.estimate("m5max", **(dict(contexts=(256,), prompts=(256,)) | kw))


SCHEMA = {
    "type": "object",
    "required": ["estimate", "notice", "model", "machine", "plan", "calibration", "decode", "prefill", "breakdown"],
    "properties": {
        "estimate": {"const": True},
        "notice": {"type": "string", "pattern": "ESTIMATE"},
        "model": {"type": "object", "required": ["name", "max_position_embeddings"]},
        "machine": {"type": "object", "required": ["key", "cores", "bandwidth_gb_s", "tflops", "sources"]},
        "decode": {"type": "array", "items": {"type": "object", "required": [
            "context", "tok_s", "ms_per_token", "stages", "gb_per_step", "raw_bandwidth_ceiling_tok_s"],
            "properties": {"tok_s": {"$ref": "#/$defs/lmh"}, "ms_per_token": {"$ref": "#/$defs/lmh"}}}},
        "prefill": {"type": "array", "items": {"type": "object", "required": ["prompt", "tok_s", "seconds"],
                                                "properties": {"tok_s": {"$ref": "#/$defs/lmh"},
                                                               "seconds": {"$ref": "#/$defs/lmh"}}}},
        "ranges": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["likely", "low", "high", "unit", "source"]}},
        "breakdown": {"type": "object", "required": ["at", "decode", "prefill"]},
    },
    "$defs": {"lmh": {"type": "object", "required": ["low", "likely", "high"], "additionalProperties": False,
                      "properties": {k: {"type": "number"} for k in ("low", "likely", "high")}}},
}


def test_estimate_command_json_and_text():
    args = [sys.executable, "-m", "lily", "estimate", "--machine", "m1max", "--contexts", "256,4096",
            "--prompts", "256,1024", "--at", "1024"]
    r = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    jsonschema.validate(rep, SCHEMA)
    assert [d["context"] for d in rep["decode"]] == [256, 4096]
    assert rep["plan"]["gemm_path"] == "simdgroup" and all(math.isfinite(d["tok_s"]["low"]) for d in rep["decode"])
    assert not any("vs_mlx_lm" in d for d in rep["decode"])  # MLX-LM's figures are an M5 Max's
    # the automatic chunk (0, as everywhere) with memory to spare, and the scratch it needs
    assert rep["plan"]["prefill_chunk"] == _core.RuntimeOptions.AUTO_PREFILL_CHUNKS[0] == 4096
    assert 734 * 2**20 < rep["plan"]["prefill_scratch_bytes"] < 742 * 2**20  # 738 MiB (docs/prefill.md)
    r = subprocess.run(args + ["--json", "--prefill-chunk", "0"], capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0 and json.loads(r.stdout)["plan"] == rep["plan"], r.stderr
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("*** ESTIMATE") and "by kernel family" in r.stdout
    assert f"prefill chunk 4096 (scratch {rep['plan']['prefill_scratch_bytes'] / 2**20:,.0f} MiB)" in r.stdout
    assert f"model: {estimate.DEFAULT_MODEL_NAME}" in r.stdout and rep["model"]["name"] == estimate.DEFAULT_MODEL_NAME
    # bad values are usage errors (exit 2) naming the flag, before anything is encoded
    for bad, what in ((["--prefill-chunk", "-3"], "--prefill-chunk: expected an integer >= 0, got -3"),
                      (["--prefill-chunk", "300000"], "--prefill-chunk 300000 is beyond the model's limit"),
                      (["--at", "0"], "--at must be a positive"),
                      (["--at", "999999"], "--at 999999 is beyond the model's limit"),
                      (["--contexts", "300000"], "--contexts 300000 is beyond the model's limit"),
                      (["--prompts", "300000"], "--prompts 300000 is beyond the model's limit")):
        r = subprocess.run([sys.executable, "-m", "lily", "estimate", *bad], capture_output=True, text=True,
                           timeout=60, check=False)
        assert r.returncode == 2 and what in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)
    r = subprocess.run([sys.executable, "-m", "lily", "estimate", "--machine", "m9"], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_estimate_of_another_checkpoint_config():
    """`--model`: the demo model's dimensions (other head sizes and kernel variants) are known too."""
    from lily.checkpoint import load_config
    from lily.engine import default_model_path
    rep = estimate.estimate("m3max", config=load_config(default_model_path())[0], contexts=(64,), prompts=(64, 300),
                        breakdown_at=64)
    assert rep["decode"][0]["tok_s"]["high"] < rep["decode"][0]["raw_bandwidth_ceiling_tok_s"]
    assert rep["prefill"][1]["seconds"]["likely"] > rep["prefill"][0]["seconds"]["likely"]


def test_estimate_defaults_fit_a_short_model(tmp_path):
    """A checkpoint whose context is shorter than the defaults' 4096 (the automatic chunk and
    the breakdown's length): both are capped at the model's context, as the runtime caps the
    chunk, instead of being refused as options the user never gave."""
    from lily.checkpoint import load_config
    from lily.engine import default_model_path
    src = default_model_path()
    for f in src.iterdir():
        (tmp_path / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["max_position_embeddings"] = 100
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rep = estimate.estimate("m5max", config=load_config(tmp_path)[0], contexts=(64,), prompts=(100,), breakdown_at=64)
    assert rep["plan"]["prefill_chunk"] == 100
    r = subprocess.run([sys.executable, "-m", "lily", "estimate", "--model", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["breakdown"]["at"] == 99 and out["plan"]["prefill_chunk"] == 100


def test_prefill_attention_operands():
    """Prefill attention (issue 11, item 5): Q K^T and P V on bfloat operands on both paths
    (sgmm_bf16 on the simdgroup path, tensor_bf16 on the *_tensor variant; nothing clipped,
    so no clamp of K or V); no fp32 or half matrix work, no half ALU work; matrix flops of the
    causal (row, key) pairs plus only the partial tiles the kernel walks (a 2048-row chunk
    after 4096 rows: under 5% over)."""
    exact = 4 * 256 * 16 * (2048 * 4096 + 2048 * 2049 / 2)  # 4 D Hq per causal pair
    for path, kernel, mm in (("simdgroup", "attn_prefill_d256_g8", "sgmm_bf16"),
                             ("tensor", "attn_prefill_d256_g8_tensor", "tensor_bf16")):
        recs = [r for r in count_prefill_chunk(CFG, 2048, 4096, gemm_path=path)["records"]
                if r["kernel"].startswith("attn_prefill_d")]
        assert {r["kernel"] for r in recs} == {kernel} and len(recs) == CFG.num_hidden_layers // 4
        for r in recs:
            f = r["work"]["flops"]
            assert r["groups"] == (256, 2, 1) and r["threads"] == (256, 1, 1)
            assert all(v == 0 for k, v in f.items() if k not in (mm, "alu_f32")), f
            assert exact <= f[mm] <= 1.05 * exact


def test_prefill_tensor_path_needs_bfloat_tensor_ops():
    """Prefill's tensor-op kernels take bfloat operands (nothing is clipped): a machine without
    bfloat tensor ops (an M5 under a tensor library without bfloat operands) is estimated on
    the simdgroup_matrix path, GEMMs and attention alike; the runtime refuses the tensor path
    on a device without them."""
    import dataclasses
    m5 = estimate.machine("m5max")
    half_only = dataclasses.replace(m5, rates={k: v for k, v in m5.rates.items() if k != "tensor_bf16"})
    assert (half_only.tensor_ops, half_only.tensor_attention) == (False, False)
    assert estimate.gemm_path(half_only) == estimate.attention_path(half_only) == "simdgroup"
    with pytest.raises(ValueError, match="gemm_path 'tensor'.*bfloat_tensor_ops=False"):
        count_prefill_chunk(CFG, 512, 0, gemm_path="tensor", tensor_attention=False)
    t = estimate.prefill(half_only, CFG, 512, 512)
    assert 0 < estimate.prefill(m5, CFG, 512, 512).seconds < t.seconds


def test_prefill_attention_tensor_geometry():
    """The tensor-op prefill attention: 64 (chunk row, head) pairs share each KV tile (8 chunk
    rows x the 8 query heads of a KV head); K and V are bf16 operands as cached (V straight
    into registers) and q arrives as bf16 from attn_prefill_prep_d256_qbf, so per score the
    ALU work is the online softmax in both halves (2 x 8: the register path, counted whichever
    path runs) and the add of the two halves' partial scores (1: D split over a pair of
    simdgroups, as MLX's attention_nax_dsplit), plus the bfloat store of the output (1 per
    element); threadgroup memory per 16-pair slab 2 KiB scores + 1 KiB P +
    196 B: two threadgroups per core even where a core has 32 KiB."""
    D = 256
    recs = count_prefill_chunk(CFG, 4096, 126976, gemm_path="tensor")["records"]
    attn = [r for r in recs if r["kernel"] == "attn_prefill_d256_g8_tensor"]
    prep = [r for r in recs if r["kernel"].startswith("attn_prefill_prep")]
    assert attn and {r["kernel"] for r in prep} == {"attn_prefill_prep_d256_qbf"}
    for r in attn:
        f = r["work"]["flops"]
        assert r["groups"] == (4096 // 8, 2, 1) and r["threads"] == (256, 1, 1)
        assert f["alu_f32"] == pytest.approx(f["tensor_bf16"] * 17 / (4 * D) + 4096 * 16 * D, rel=1e-12)
        assert r["threadgroup_memory"] == 6 * 64 * 32 + 4 * 4 * (3 * 16 + 1) == 13072
    for r in prep:  # the q read by the attention is bf16
        assert r["bytes_written"] - 2 * 2 * 2 * 4096 * D == 2 * 4096 * 16 * D  # K/V rows + bf16 q


def test_threadgroup_memory_within_the_limit():
    """No dispatch of any path asks for more threadgroup memory than Apple GPUs have (32 KiB,
    the machine table's figure)."""
    limit = min(m.threadgroup_memory for m in estimate.MACHINES.values())
    for what, c in _plans():
        for r in c["records"]:
            assert r["threadgroup_memory"] <= limit, (what, r["kernel"], r["threadgroup_memory"])


def test_prefill_gemm_activations_are_bf16():
    """Issue 27, "Nothing is clipped": the prefill GEMMs' activations are bfloat in device
    memory (xn from rms_norm_bf16 or moe_combine_norm, the shared hidden hs, the expert hidden
    hx, the GDN scan's u; the routed experts' outputs yx, the GDN gate z and the attention's
    q|gate, k and v too), rounded once by the kernel that writes them (no clamp); o_proj and
    the shared expert's down projection (gemm_q4_add_h) read bfloat rows and add into h,
    out_proj (gemm_q4_add_hs) bfloat rows times their half norm factors (a multiply and a
    rounding per element and column block, in fp32). Weights are dequantized to bfloat
    (gemm_tiles.h GemmWItems::put: codes to exact half integers, 13 half operations per 8
    codes; a conversion, the FMA and the rounding in fp32)."""
    M, H, I, k, layers = 512, 2048, 512, 8, 40  # the real model (estimate.model_config)
    recs = count_prefill_chunk(CFG, M, 0)["records"]
    qkv = next(r for r in recs if r["kernel"] == "gemm_q4" and "in_proj_qkv" in r["label"])
    n, gy = 8192, qkv["groups"][1]
    assert qkv["bytes_read"] == n * H * (4 / 8 + 4 / 64) + 2 * M * H  # weight + bfloat xn
    # the weight's dequantization only: no activation conversion
    assert qkv["work"]["flops"]["alu_f16"] == 13 / 8 * gy * n * H and qkv["work"]["flops"]["alu_f32"] == 3 * gy * n * H
    # o_proj reads the bfloat attention output (written with its rounding): no GEMM stages
    # fp32 activations
    oprojs = [r for r in recs if "o_proj" in r["label"]]
    assert len(oprojs) == 10 and {r["kernel"] for r in oprojs} == {"gemm_q4_add_h"}
    gy = oprojs[0]["groups"][1]
    assert oprojs[0]["work"]["flops"]["alu_f16"] == 13 / 8 * gy * H * 4096
    assert oprojs[0]["work"]["flops"]["alu_f32"] == 3 * gy * H * 4096
    assert oprojs[0]["bytes_read"] == H * 4096 * (4 / 8 + 4 / 64) + 2 * M * 4096 + 4 * M * H  # W, bfloat x, h
    attns = [r for r in recs if r["kernel"].startswith("attn_prefill_d")]
    assert len(attns) == 10 and all(r["bytes_written"] == 2 * M * 4096 for r in attns)
    assert not [r for r in recs if r["kernel"].startswith("gemm_q4_add") and not r["kernel"].startswith("gemm_q4_add_h")]
    # out_proj: u (bfloat, the scan wrote it) times a half factor per (token, head, split of
    # 32 rows), in fp32 and rounded to bfloat by every column block (grid x)
    outs = [r for r in recs if "out_proj" in r["label"]]
    assert len(outs) == 30 and {r["kernel"] for r in outs} == {"gemm_q4_add_hs"}
    gx = outs[0]["groups"][0]
    assert outs[0]["work"]["flops"]["alu_f16"] == 13 / 8 * gy * H * 4096
    assert outs[0]["work"]["flops"]["alu_f32"] == 3 * gy * H * 4096 + 3 * gx * M * 4096
    assert outs[0]["bytes_read"] == H * 4096 * (4 / 8 + 4 / 64) + 2 * M * 4096 + 2 * M * 128 + 4 * M * H  # W, u, f, h
    assert not [r for r in recs if r["kernel"].startswith("gdn_gated_norm")]  # the norm is split (no pass of its own)
    scans = [r for r in recs if r["kernel"].startswith("gdn_scan")]
    assert len(scans) == 30 and all(r["bytes_written"] >= 2 * M * 4096 + 4 * M * 128 for r in scans)  # u, the sums
    norms = [r for r in recs if r["kernel"].startswith("gdn_norm_scale")]
    assert len(norms) == 30 and all(r["bytes_read"] == 4 * M * 128 and r["bytes_written"] == 2 * M * 128
                                    for r in norms)
    # in_proj_z stores z as bfloat (gemm_q4_bf16); the scan reads it with norm.weight
    zs = [r for r in recs if "in_proj_z" in r["label"]]
    assert len(zs) == 30 and {r["kernel"] for r in zs} == {"gemm_q4_bf16"}
    assert all(r["bytes_written"] == 2 * M * 4096 for r in zs)
    # q_proj, k_proj, v_proj store bfloat (gemm_q4_bf16); the prep reads bfloat q|gate, k, v
    # and the norm weights, the attention its fp32 q, the bfloat q|gate (declared whole) and
    # the cache
    Hq, Hkv, D = 16, 2, 256
    for name, n in (("q_proj", Hq * 2 * D), ("k_proj", Hkv * D), ("v_proj", Hkv * D)):
        projs = [r for r in recs if name in r["label"]]
        assert len(projs) == 10 and {r["kernel"] for r in projs} == {"gemm_q4_bf16"}
        assert all(r["bytes_written"] == 2 * M * n for r in projs)
        gy = projs[0]["groups"][1]
        assert projs[0]["work"]["flops"]["alu_f32"] == 3 * gy * n * H + M * n  # the dequantization, the rounding
    preps = [r for r in recs if r["kernel"].startswith("attn_prefill_prep")]
    assert len(preps) == 10 and all(r["bytes_read"] == 2 * M * (Hq * 2 + 2 * Hkv) * D + 2 * 2 * D for r in preps)
    assert all(r["bytes_read"] == 4 * M * Hq * D + 2 * M * Hq * 2 * D + 2 * 2 * M * Hkv * D for r in attns)
    # layer 0's input norm and every post-attention norm; layers 1..39 get their input xn from
    # the previous layer's combine (moe_combine_norm), the last layer's combine writes h only
    norms = [r for r in recs if r["kernel"] == "rms_norm_bf16"]
    assert len(norms) == layers + 1 and all(r["bytes_written"] == 2 * M * H for r in norms)
    assert not [r for r in recs if r["kernel"] == "rms_norm"]
    fused = [r for r in recs if r["kernel"] == "moe_combine_norm"]
    assert len(fused) == layers - 1 and [r["kernel"] for r in recs if "combine" in r["label"]][-1] == "moe_combine"
    # h in and out, bfloat xn out; bfloat yx, the weights and the norm weight in (the shared
    # expert is already in h)
    assert all(r["bytes_written"] == 4 * M * H + 2 * M * H for r in fused)
    assert all(r["bytes_read"] == 4 * M * H + 2 * M * k * H + 4 * M * (k + 1) + 2 * H for r in fused)
    # the shared expert's down projection adds into h (its hidden carries the shared gate)
    sd = [r for r in recs if "shared expert down" in r["label"]]
    assert len(sd) == layers and {r["kernel"] for r in sd} == {"gemm_q4_add_h"}
    assert all(r["bytes_written"] == 4 * M * H for r in sd)
    assert sd[0]["work"]["flops"]["alu_f32"] == 3 * sd[0]["groups"][1] * H * I  # the dequantization alone
    gate_up = [r for r in recs if r["kernel"].startswith("moe_gemm_gate_up")]
    shared = [r for r in recs if r["kernel"] == "gemm_swiglu_q4"]
    assert gate_up and all(r["bytes_written"] == 2 * M * k * I for r in gate_up)  # hx written as bfloat
    assert all(r["bytes_written"] == 2 * M * I for r in shared)  # hs written as bfloat
    # ... scaled by the shared gate, read from the routing weights' last column
    assert all(r["bytes_read"] == 2 * I * H * (4 / 8 + 4 / 64) + 2 * M * H + 4 * ((M - 1) * (k + 1) + 1)
               for r in shared)


@pytest.mark.parametrize("rows,T,pad", [(4096, 128, 15.5), (3072, 128, 15.5), (1536, 64, 11.5), (1024, 32, 7.5),
                                        (512, 16, 7.5)])
def test_routed_expert_tiles_count_each_class(rows, T, pad):
    """Grouped expert GEMMs on the tensor-op path, one dispatch per tile class
    (docs/performance.md, "Routed-expert tiles"): over a layer's classes the rows computed
    are the real rows plus the expected padding of each reached expert's last tile under
    uniform remainders (11.5 rows at T = 64 with classes 64 / 32 / 16, 7.5 at T = 32 and 16,
    15.5 at T = 128: one class whose tiles compute their live 32-row simdgroup bands only), the
    dequantization counts one pass over the weights per tile (full tiles plus one tail per
    reached expert), and the weights read are each reached expert's once (at most the tiles
    of class 0) plus once more per tail in a class of its own. 128-row tiles from 64 rows per
    expert (a 2048-row chunk)."""
    E, k, H, I = CFG.num_experts, CFG.num_experts_per_tok, CFG.hidden_size, CFG.moe_intermediate_size
    reached = E * (1 - (1 - k / E) ** rows)
    recs = [r for r in count_prefill_chunk(CFG, rows, 0, gemm_path="tensor")["records"]
            if r["label"].startswith("L0 experts gate|up")]
    heights = [T >> c for c in range(len(recs))]
    assert [r["kernel"] for r in recs] == [_core.kernel_name("moe_gemm_gate_up", "_tensor", q=4, t=h) for h in heights]
    assert heights[-1] == (128 if T == 128 else 16) and len({r["stage"] for r in recs}) == 1
    assert all(r["threads"] == ((256 if T == 128 else 64 if h == 16 else 128), 1, 1) for r, h in zip(recs, heights))
    computed = sum(r["work"]["flops"]["tensor_bf16"] for r in recs) / (2 * 2 * I * H)
    assert computed == pytest.approx(rows * k + reached * pad, rel=1e-9)
    tiles = (rows * k - reached * (T + 1) / 2) / T + reached  # full tiles and one tail per reached expert
    dequant = sum(r["work"]["flops"]["alu_f16"] for r in recs)
    assert dequant == pytest.approx(13 / 8 * 2 * tiles * I * H, rel=1e-9)  # codes to exact half integers
    f32 = sum(r["work"]["flops"]["alu_f32"] for r in recs)  # per weight: convert, fma, round to bfloat;
    assert f32 == pytest.approx(3 * 2 * tiles * I * H + (4 + 1) * computed * I, rel=1e-9)  # silu(g) u, bf16 out
    stack = 2 * I * H * (4 / 8 + 4 / 64)  # gate and up of one expert
    weights = sum(r["work"]["bytes"] for r in recs) - (2 * rows * H + 4 * rows * k + 2 * rows * k * I)
    tails = 0.5 if 16 < T < 128 else 0.0  # the remainders r <= T/2 (half of them) go to the smaller classes
    read = min(reached, tiles - reached * tails) + reached * tails
    assert 0.98 * read * stack <= weights <= 1.01 * read * stack


def test_gdn_scan_work_is_the_lazy_decay():
    """gdn_scan's cost table entry (csrc/runtime/cost.cpp): per token, value head and state
    element 6 flops (3 FMAs: the lazy decay moves the decay into a per-row scalar c) plus the
    fold allowance of 1/3 multiply; per row the two 4-lane dot products, delta and the lazy
    decay's 6 scalar operations per lane; per token and threadgroup the staging; per output
    value the gated norm's part (y^2 and its log2(RV) shuffle-adds, SiLU of z, the products,
    the bfloat rounding of u, a_s: 1 + 5 + 1 + 4 + 3 + 1 + 4). The state bytes are S' and c
    (Hv Dv (Dk + 1) floats), read and written once; y leaves as bfloat u and fp32 sums per
    split of RV rows."""
    M, Hv, Dk, Dv, L, K = 512, 32, 128, 128, 4, 4
    recs = count_prefill_chunk(CFG, M, 0)["records"]
    scans = [r for r in recs if r["kernel"].startswith("gdn_scan_")]
    assert len(scans) == 30
    r = scans[0]
    gy, RV = r["groups"][1], 32
    per_row = 2 * L * (3 + math.log2(L)) + 3 + 6 * L
    staging = gy * ((2 * Dk + RV) * (2 * K + 4) + 6 * Dk + 40)
    norm = 1 + math.log2(RV) + 1 + 4 + 3 + 1 + 4
    want = M * Hv * ((6 + 1 / 3) * Dk * Dv + (per_row + norm) * Dv + staging)
    assert r["work"]["flops"]["alu_f32"] == pytest.approx(want, rel=1e-12)
    state = 4 * Hv * Dv * (Dk + 1)
    assert r["bytes_written"] == state + 2 * M * Hv * Dv + 4 * M * Hv * (Dv // RV)  # the state, u, the sums


def _tool(name: str):
    """tools/<name>.py as a module (the tools are scripts, not a package)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "tools" / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_estimate_kernels_tool_splits_the_estimate():
    """tools/estimate_kernels.py (the per-kernel split docs/performance.md quotes) adds up to
    the estimate's own time, stages and bytes of a prefill chunk and of a decode step."""
    tool = _tool("estimate_kernels")
    m = estimate.machine("m5max")
    for records in (count_prefill_chunk(CFG, 512, 0, gemm_path="tensor")["records"],
                    count_decode_step(CFG, 4096)["records"], count_decode_step(CFG, 4095)["records"]):
        want = estimate.time_records(m, records)
        total, stages, per = tool.by_kernel(m, records)
        assert total == pytest.approx(want.seconds, rel=1e-12) and stages == want.stages
        assert sum(s for s, _, _ in per.values()) == pytest.approx(want.seconds, rel=1e-9)
        assert sum(n for _, n, _ in per.values()) == len(records)
        assert sum(b for _, _, b in per.values()) == pytest.approx(want.bytes, rel=1e-12)


def test_decode_options_cost_what_they_change():
    """tools/estimate_kernels.py decode-options (docs/performance.md): the plan's mean step of a
    write-back window moves, against the state written back every step, the state write but
    for 1/W of it less the ring (an entry written by W - 1 of the W steps, (W - 1) / 2 read on
    average), and is faster; moving the DeltaNet step into its in_proj's stage removes exactly
    one stage per DeltaNet layer and no byte."""
    from lily.native_backend import default_state_window
    tool = _tool("estimate_kernels")
    W = default_state_window()
    state = 4 * CFG.linear_num_value_heads * CFG.linear_value_head_dim * (CFG.linear_key_head_dim + 1)
    entry = 4 * (CFG.linear_num_value_heads * (CFG.linear_value_head_dim + 1)
                 + CFG.linear_num_key_heads * CFG.linear_key_head_dim)
    gdn = CFG.num_hidden_layers - len(CFG.full_attention_layers)
    m = estimate.machine("m5max")
    rows = tool.decode_options(m, CFG, 4096)
    (_, today, stages, gb), (_, every, stages1, gb1), (_, moved, stages2, gb2) = rows
    assert W > 1 and today > every and moved > today
    # the window's steps sit at 4096..4096+W-1: their KV rows are (W - 1) / 2 more on average
    kv_row = len(CFG.full_attention_layers) * CFG.num_key_value_heads * CFG.head_dim * 2 * 2
    assert (gb1 - gb) * 1e9 + kv_row * (W - 1) / 2 == pytest.approx(
        gdn * (state * (W - 1) / W - entry * ((W - 1) / W + (W - 1) / 2)), rel=1e-6)
    assert stages == stages1 and stages2 == stages - gdn and gb2 == pytest.approx(gb, rel=1e-12)


def test_estimate_reports_the_scratch_a_real_load_allocates():
    """The header's prefill scratch is the runtime's at any real context, also for chunks
    smaller than the part of the scratch that grows with the context (512: 186 MiB, not the
    129 a runtime of 512 positions allocates)."""
    from lily.native_backend import counting_runtime
    for chunk in (512, 4096):
        rep = estimate.estimate("m5max", contexts=[256], prompts=[256], chunk=chunk)
        want = [counting_runtime(CFG, 4, 8, ctx, prefill_chunk=chunk).prefill_scratch_bytes for ctx in (16384, 131072)]
        assert rep["plan"]["prefill_scratch_bytes"] == want[0] == want[1]


# ---- latency chains (docs/performance.md, "Latency chains") --------------------------------


def _first(records, prefix):
    return next(r for r in records if r["kernel"].startswith(prefix))


def test_every_kernel_reports_its_latency_chains():
    """The cost table reports, per dispatch, its dependent latencies by kind (csrc/runtime/cost.h
    Lat): the whole critical path, the prologue before the bulk traffic (part of it) and the
    run-time loops' loads; counts are never negative and a prologue never exceeds its chain."""
    for what, c in _plans():
        for r in c["records"]:
            w = r["work"]
            for part in ("chain", "lead", "loop"):
                assert set(w[part]) == set(estimate.LATENCY_KINDS), (what, r["kernel"])
                assert all(v >= 0 for v in w[part].values()), (what, r["kernel"], part, w[part])
            assert all(w["lead"][k] <= w["chain"][k] + 1e-9 for k in estimate.LATENCY_KINDS), (what, r["kernel"])


def test_chains_follow_the_kernels():
    """Each chain the issue names, from the kernels' own structure: the GDN replay's ring entries
    (a DRAM round trip per entry and batch of state rows, gdn.metal gdn_replay), the norm every norm_gemv
    threadgroup takes before its first weight load (gemv.metal), the routing every MoE gate/up
    simdgroup replays (a pass per top-k round, route.h), the k loop's load and barrier per
    64-wide step (its loads issued a step ahead: the products and the second barrier overlap
    them; gemm_tensor.h, gemm_tiles.h; two barriers more for the simdgroup_matrix path's staged
    epilogue), decode attention's rows per simdgroup (attention.metal)."""
    window = estimate.decode_records(CFG, 4096)
    steps = [_first(recs, "gdn_decode_step") for recs in window]
    rows = CFG.linear_value_head_dim / steps[0]["groups"][1] / (steps[0]["threads"][0] / 32)  # R per simdgroup
    batches = -(-rows // 4)  # gdn.metal kGdnRowBatch rows side by side: one round trip per entry and batch
    pend = [_core_pending(s) for s in steps]
    assert sorted(pend) == list(range(len(window)))
    for s, p in zip(steps, pend):
        assert s["work"]["loop"]["dram"] == batches * p
    norm = _first(window[0], "norm_gemv_q4")["work"]["lead"]  # the first weight chunk is in flight meanwhile
    assert norm["barrier"] == 2 and norm["reduce"] == 1 and norm["dram"] == 0
    route = _first(window[0], "moe_route_gate_up")["work"]
    k = CFG.num_experts_per_tok
    assert route["lead"]["reduce"] == 2 + 2 * k / 2 and route["chain"]["reduce"] == 2 + 2 * k
    gemm = _first(count_prefill_chunk(CFG, 512, 0, gemm_path="tensor")["records"], "gemm_q4_tensor")["work"]
    assert gemm["chain"]["barrier"] == CFG.hidden_size / 64 and gemm["chain"]["dram"] == CFG.hidden_size / 64 - 1
    assert gemm["chain"]["mem"] == 0  # the A loads overlap the dequantization and the barrier
    simd = _first(count_prefill_chunk(CFG, 512, 0)["records"], "gemm_q4")["work"]
    assert simd["chain"]["barrier"] == CFG.hidden_size / 64 + 2 and simd["chain"]["dram"] == CFG.hidden_size / 64 - 1
    at = {ctx: _first(estimate.decode_records(CFG, ctx)[0], "attn_decode")["work"]["loop"]["dram"]
          for ctx in (4096, 32768, 131072)}
    assert at[4096] < at[32768] < at[131072]  # a block of 32 / G rows per iteration, longer blocks at longer contexts


def _core_pending(rec):
    """GdnDecodeArgs.pending of a recorded step: the ring entries it reads (decode.cpp declares
    pending entries of the ring), from the cost table's replay arithmetic."""
    flops = rec["work"]["flops"]["alu_f32"]
    hv, dk, dv = CFG.linear_num_value_heads, CFG.linear_key_head_dim, CFG.linear_value_head_dim
    base = hv * (9.0 * dk * dv + 12.0 * (rec["groups"][1] * dk + dv))
    return round((flops - base) / (2.0 * hv * dk * dv))


def test_latency_chains_cost_time_where_they_are_not_hidden():
    """Priced at their latencies, the chains slow a decode step (prologues before the first
    weight load, the replay, the combine), and a replay of more entries costs more; a GEMM whose
    threadgroups cannot share a core (one per core) exposes its k loop's round trips and
    barriers, which several per core hide. Without latencies the roofline is what is left."""
    m = estimate.machine("m5max")
    flat = _no_latency(m)
    window = estimate.decode_records(CFG, 4096)
    assert estimate.decode_step(m, CFG, 4096).seconds > estimate.decode_step(flat, CFG, 4096).seconds
    steps = sorted((_core_pending(_first(r, "gdn_decode_step")), estimate.dispatch_seconds(m, _first(r, "gdn_decode_step")))
                   for r in window)
    assert steps[-1][1] > steps[0][1] * 1.5  # 15 pending entries against none
    gemm = _first(count_prefill_chunk(CFG, 4096, 0, gemm_path="tensor")["records"], "gemm_q4_tensor")
    tile = gemm["threadgroup_memory"]  # 9 KiB: five per core at the range's low end (45 KiB), six at 60 KiB
    one, two = (estimate.dispatch_seconds(estimate.with_constants(m, {"tg_memory_per_core": b}), gemm) for b in (tile, 61440))
    assert one > 1.1 * two and two == pytest.approx(estimate.dispatch_seconds(replace(flat, tg_memory_per_core=61440), gemm),
                                                    rel=0.02)


# ---- low / likely / high (docs/performance.md, "Low, likely, high") --------------------------


@pytest.fixture(scope="module")
def ranged():
    return estimate.estimate("m5max", contexts=(4096, 131072), prompts=(4096, 32768), breakdown_at=4096)


def test_every_figure_comes_with_low_likely_high(ranged):
    """Each throughput, time and ratio to the published engines has low <= likely <= high, the
    low strictly below the likely (every range is a real range), and the ratios are the
    throughputs over MLX-LM's and pplx-garden's published M5 Max figures."""
    from lily.lab.published import PPLX_PUBLISHED_M5MAX as pub
    jsonschema.validate(ranged, SCHEMA)
    for phase, key, col in (("decode", "context", 0), ("prefill", "prompt", 2)):
        for r in ranged[phase]:
            t = r["tok_s"]
            assert t["low"] < t["likely"] <= t["high"], (phase, r[key], t)
            for who, c in (("vs_pplx_garden", col), ("vs_mlx_lm", col + 1)):
                assert r[who] == pytest.approx({k: v / pub[r[key]][c] for k, v in t.items()}), (phase, who)
            secs = r["ms_per_token"] if phase == "decode" else r["seconds"]
            assert secs["low"] <= secs["likely"] <= secs["high"]
    assert set(ranged["ranges"]) == set(estimate.CONSTANTS)
    for name, c in estimate.CONSTANTS.items():
        assert c.source and c.low != c.high, name
    cal = ranged["calibration"]["decompositions"]
    assert len(cal["likely"]) == 1 and len(cal["low"]) + len(cal["high"]) + len(cal["excluded"]) == 2 * len(
        estimate.LATENCY_POINTS) * len(estimate.OCCUPANCY_RULES) * len(estimate.RUNS)


def test_the_likely_figure_is_the_likely_constants(ranged):
    """The likely figure is the estimate on the machine with every constant likely and the
    calibrations fitted to the primary published run (BANDWIDTH_EFFICIENCY, STAGE_GAP; the
    tensor efficiencies of PATH_EFFICIENCY, pplx-garden's prefill fit, quoted with the
    effective rate they give), and a low or high figure is one of its scenario machines'
    figures."""
    sc = estimate.scenarios(estimate.machine("m5max"))
    m = sc["likely"][0]
    assert m is estimate.likely_machine(estimate.machine("m5max")) and m.occupancy_rule == estimate.LIKELY_RULE
    assert m.bandwidth_efficiency == pytest.approx(estimate.BANDWIDTH_EFFICIENCY, abs=1e-3)
    for path in estimate.TENSOR_PATHS:  # the GEMMs' (ours bfloat, the restatements' half)
        assert m.path_efficiency[path] == pytest.approx(estimate.PATH_EFFICIENCY[path]), path
    assert m.attention_efficiency == pytest.approx(estimate.ATTENTION_EFFICIENCY * estimate.ATTENTION_TRANSFER)
    tflops = ranged["calibration"]["effective_tflops"]
    assert tflops["gemms"] == pytest.approx(m.rates["tensor_bf16"] * m.path_efficiency["tensor_bf16"] / 1e12)
    assert tflops["attention"] == pytest.approx(m.rates["tensor_bf16"] * m.attention_efficiency / 1e12)
    assert m.chunk_overhead == estimate.CHUNK_OVERHEAD and m.tg_memory_per_core == estimate.TG_MEMORY_PER_CORE
    assert ranged["decode"][0]["tok_s"]["likely"] == pytest.approx(1 / estimate.decode_step(m, CFG, 4096).seconds)
    lows = [1 / estimate.decode_step(x, CFG, 4096).seconds for x in sc["low"] + sc["high"] + sc["likely"]]
    assert ranged["decode"][0]["tok_s"]["low"] == pytest.approx(min(lows))
    assert ranged["decode"][0]["tok_s"]["high"] == pytest.approx(max(lows))


def test_residency_is_several_threadgroups_per_core(ranged):
    """How much threadgroup memory an M5 core holds is unknown (45 to 64 KiB); issue 27's
    kernels need at most 13 KiB a threadgroup (the prefill GEMMs' 9 KiB weight tile, the
    tensor-op attention's 13 KiB, decode attention's 12 KiB), so every one of them runs at least
    three per core at either end: the report lists them with their threadgroups per core at both
    ends (the slots the model prices), and the likely figure at the high end's memory, printed
    beside it, is no step away (within 1%)."""
    lo, hi = estimate.CONSTANTS["tg_memory_per_core"].low, estimate.CONSTANTS["tg_memory_per_core"].high
    assert lo == estimate.TG_MEMORY_PER_CORE and hi > lo
    rows = ranged["residency"]
    kernels = {r["kernel"]: r for r in rows}
    assert {"gemm_q4_tensor", "moe_gemm_gate_up_q4_t128_tensor", "attn_prefill_d256_g8_tensor"} <= set(kernels)
    assert kernels["gemm_q4_tensor"]["bytes"] == 9 * 1024 and kernels["gemm_q4_tensor"]["per_core"] == {
        "likely": 5, "high": 7}
    for r in rows:
        assert r["bytes"] <= 13 * 1024, r
        # memory binds before threads (2048 a core hold 8 of 256 threads)
        assert r["per_core"] == {"likely": lo // r["bytes"], "high": hi // r["bytes"]} and lo // r["bytes"] >= 3, r
    for phase in ("prefill", "decode"):
        for row in ranged[phase]:
            other = row["likely_tok_s_high_memory"]
            assert row["tok_s"]["likely"] <= other <= row["tok_s"]["likely"] * 1.01, (phase, row)
    text = estimate.format_report(ranged)
    assert "attn_prefill_d256_g8_tensor 12.8 KiB: 3 / 5" in text
    assert f"{ranged['prefill'][0]['likely_tok_s_high_memory']:,.0f} at 4K" in text


def test_every_scenario_machine_describes_the_data_it_was_fitted_to(ranged):
    """No end is counted twice: every scenario machine (likely, low, high) carries its own
    refits, and with its constants reproduces pplx-garden's published decode (its bandwidth
    efficiency and stage gap on their step) and prefill (its tensor efficiencies, before the
    design transfer, on their chunks) within the error its fit states, which is at most 2.5%
    rms (decode) and 3.5% rms (prefill); the efficiencies our plan takes are those times the
    machine's transfer margins. Excluded machines say why, kept ones are plausible."""
    from lily.lab import tensor_rate
    from lily.lab.calibration import published, reference_decode_step
    sc = estimate.scenarios(estimate.machine("m5max"))
    # their step at the mean position of each length's 64 timed steps (the same lengths in both runs)
    steps = {L: estimate.make_plan(reference_decode_step(L + 33)) for L in published(estimate.RUNS[0])}
    for end in ("likely", "low", "high"):
        for m in sc[end]:
            cal = m.calibration
            dec, pre, run = cal["decode"], cal["prefill"], cal["run"]
            assert cal["excluded"] is None and dec["bandwidth_efficiency"] <= estimate.PLAUSIBLE_BANDWIDTH_EFFICIENCY
            assert (m.bandwidth_efficiency, m.stage_gap * 1e6) == pytest.approx(
                (dec["bandwidth_efficiency"], dec["stage_gap_us"]))
            table = published(run)
            # time_records' stage times (with the gap) on the plans built once
            errs = [float((estimate._stages(m, steps[L])[0][:, 0] + m.stage_gap).sum()) * table[L][0] - 1
                    for L in table]
            rms = math.sqrt(sum(e * e for e in errs) / len(errs))
            assert rms == pytest.approx(dec["rms_relative_error"], abs=1e-6) and rms < 0.025, (end, cal["rule"], run)
            for path in estimate.TENSOR_PATHS:
                assert m.path_efficiency[path] == pytest.approx(pre["tensor_efficiency"] * cal["transfer"]["gemm"])
            assert m.attention_efficiency == pytest.approx(pre["attention_efficiency"] * cal["transfer"]["attention"])
            fit = tensor_rate.predict_engine("pplx_garden", m, run, tensor=pre["tensor_efficiency"],
                                             attention=pre["attention_efficiency"])
            assert fit["rms_time"] == pytest.approx(pre["rms_relative_error"], abs=1e-6) and fit["rms_time"] < 0.035
            assert fit["chunk_ms"] == pytest.approx(pre["chunk_ms"], abs=1e-6)
    for m in sc["excluded"]:
        assert m.calibration["excluded"]
    # the transfer margins are the only difference between the ends' tensor efficiencies and the fits
    assert {m.calibration["transfer"]["gemm"] for m in sc["low"]} == {1 - estimate.GEMM_SPREAD}
    assert all(m.calibration["transfer"]["attention"] == pytest.approx(
        (1 + estimate.ATTENTION_SPREAD) * (1 + estimate.GEMM_SPREAD)) for m in sc["high"])


def test_implausible_refits_are_excluded():
    """A decode refit beyond PLAUSIBLE_BANDWIDTH_EFFICIENCY (all latencies at their slow ends:
    pplx-garden's step then needs ~0.9-0.96 of the bandwidth) leaves the low and high figures,
    with the reason; a prefill refit at its search's bound would too."""
    assert estimate._implausible({"decode": {"bandwidth_efficiency": 0.95}}).startswith("decode refit")
    assert "bound" in estimate._implausible({"prefill": {"at_bound": ["attention_efficiency"]}})
    assert estimate._implausible({"decode": {"bandwidth_efficiency": 0.85}, "prefill": {"at_bound": []}}) is None
    sc = estimate.scenarios(estimate.machine("m5max"))
    slow = [m for m in sc["excluded"] if m.latency["mem"] == estimate.CONSTANTS["latency_mem"].low
            and m.loop_overlap == estimate.CONSTANTS["loop_overlap"].low]
    assert slow and all("decode refit" in m.calibration["excluded"] for m in slow)


def test_what_the_prefill_targets_need_of_the_attention():
    """tools/estimate_calibration.py targets (docs/performance.md, "What the prefill targets
    need"): its likely and low figures are `lily estimate`'s; each attention efficiency it
    names (for the likely 1.25x; on every low scenario machine, for the low figure's 1.0x) is
    the smallest that meets its target in the estimate itself; the rest's factor meets the
    likely target exactly."""
    tool = _tool("estimate_calibration")
    assert tool._needed(lambda e: 1.0 / e, 0.2, 1.0, 2.0) == pytest.approx(0.5, abs=1e-3)
    assert tool._needed(lambda e: 1.0 / e, 0.2, 1.0, 0.5) is None  # beyond the peak
    rows = tool.target_rows(1.25)
    rep = estimate.estimate("m5max", prompts=[r["prompt"] for r in rows], contexts=[4096], batches=[1])
    figures = {p["prompt"]: p["tok_s"] for p in rep["prefill"]}
    base = estimate.machine("m5max")
    m, lows = estimate.likely_machine(base), estimate.scenarios(base)["low"]
    cfg = estimate.model_config()
    cache: dict = {}  # the plan's records, encoded once

    def low_at(L, eff):  # the low figure with every low machine's attention at eff
        return min(L / estimate.prefill(replace(x, attention_efficiency=eff), cfg, L, 4096, cache).seconds for x in lows)

    checked = checked_low = 0
    for r in rows:
        L = r["prompt"]
        assert r["likely"] == pytest.approx(figures[L]["likely"], rel=1e-9)
        assert r["low"] == pytest.approx(figures[L]["low"], rel=1e-9)
        if r["low"] >= r["mlx_lm"]:
            assert r["need_low"] <= r["low_efficiency"] + 1e-3
        else:
            checked_low += 1
            assert low_at(L, r["need_low"]) >= r["mlx_lm"] > low_at(L, r["need_low"] - 2e-3)
        goal = 1.25 * r["mlx_lm"]
        if r["likely"] >= goal:
            assert r["need"] <= r["efficiency"] + 1e-3 and r["rest"] == 1.0
            continue
        # the rest's factor: everything but the attention that much faster meets the goal exactly
        t = estimate.prefill(m, cfg, L, 4096, cache)
        att = t.families["attention"]
        assert L / ((t.seconds - att) / r["rest"] + att) == pytest.approx(goal, rel=1e-9)
        if r["need"] is None:
            assert L / estimate.prefill(replace(m, attention_efficiency=1.0), cfg, L, 4096, cache).seconds < goal
            continue
        checked += 1
        at = estimate.prefill(replace(m, attention_efficiency=r["need"]), cfg, L, 4096, cache).seconds
        below = estimate.prefill(replace(m, attention_efficiency=r["need"] - 2e-3), cfg, L, 4096, cache).seconds
        assert L / at >= goal > L / below
    assert checked >= 3 and checked_low >= 3
