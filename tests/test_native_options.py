"""Engine.load's device options on the native devices: every unknown or invalid option is
an InvalidParameterError naming it, before anything is allocated."""

from __future__ import annotations

import numpy as np
import pytest

from lily import Engine, _core
from lily.errors import ContextLengthError, DeviceError, InvalidParameterError

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")


@pytest.mark.parametrize("options, match", [
    ({"bogus": 1}, "unknown device option 'bogus'"),
    ({"device_options": {"bogus": 1}}, "unknown sim device option 'bogus'"),
    ({"device_options": {"order": "sideways"}}, "order must be"),
    ({"device_options": {"gpu_family": "apple3"}}, "gpu_family must be"),
    ({"device_options": {"record_only": True}}, "record-only simulator executes nothing"),
    ({"prefill_chunk": -1}, "prefill_chunk must be a non-negative integer"),
    ({"gemm_path": "fast"}, "gemm_path must be one of"),
    ({"weight_cache": 3}, "weight_cache must be"),
])
def test_invalid_native_options(demo_path, options, match):
    with pytest.raises(InvalidParameterError, match=match):
        Engine.load(demo_path, device="sim", device_options=options)


@pytest.mark.parametrize("name, value, match", [
    ("max_context", 0, "max_context must be a positive integer, got 0"),
    ("split_threshold", 0, "split_threshold must be a positive integer, got 0"),
    # one rule per option: a positive one says "positive" for 0, -1 and a wrong type alike
    ("split_threshold", -1, "split_threshold must be a positive integer, got -1"),
    ("prefill_chunk", -1, "prefill_chunk must be a non-negative integer, got -1"),
    ("prefill_chunk", True, "prefill_chunk must be a non-negative integer, got True"),
    ("split_block", -1, "split_block must be a non-negative integer, got -1"),
    ("prefill_chunk", 2.5, "prefill_chunk must be a non-negative integer, got 2.5"),
    ("max_context", 2**32, "max_context must be a positive integer"),
    ("gemm_path", "fast", "gemm_path must be one of auto, simdgroup, tensor, got 'fast'"),
    ("virtual_weights", 1, "virtual_weights must be True or False, got 1"),
])
def test_runtime_options_name_the_invalid_option(name, value, match):
    """RuntimeOptions (csrc/runtime/runtime.h) is the one home of the options' rules: the
    binding, lily.native_backend.runtime_options and the Runtime itself give the same message."""
    from lily.native_backend import make_device, model_dims, runtime_options
    from lily.lab.testing import PRESETS
    with pytest.raises(InvalidParameterError, match=match):
        runtime_options(**{"max_context": 16, name: value})
    o = _core.RuntimeOptions()
    if match.endswith("got 0"):  # a value of the right type: set, refused by validate()
        setattr(o, name, value)
        with pytest.raises(ValueError, match=match):
            o.validate()
        # the Runtime checks it before it allocates anything
        from lily.checkpoint import parse_config
        dims = model_dims(parse_config(PRESETS["tiny"].config()))
        with pytest.raises(ValueError, match=match):
            _core.Runtime(make_device("sim", record_only=True), dims, [], o)
    else:
        with pytest.raises(ValueError, match=match):
            setattr(o, name, value)


def test_runtime_options_defaults_and_names():
    from lily.native_backend import runtime_options
    o = _core.RuntimeOptions()
    assert o.FIELDS == ("max_context", "split_threshold", "split_block", "prefill_chunk", "state_window",
                        "command_buffer_rows", "virtual_weights")
    assert (o.split_threshold, o.split_block, o.prefill_chunk, o.state_window, o.command_buffer_rows, o.gemm_path,
            o.virtual_weights) == (256, 0, 0, 16, 4096, "auto", False)
    assert o.AUTO_PREFILL_CHUNKS == (4096, 2048, 1024, 512)
    o = runtime_options(64, prefill_chunk=8, gemm_path="simdgroup")
    assert (o.max_context, o.prefill_chunk, o.gemm_path) == (64, 8, "simdgroup")
    with pytest.raises(InvalidParameterError, match="unknown runtime option 'bogus'"):
        runtime_options(64, bogus=1)


def test_reference_takes_no_device_options(demo_path):
    with pytest.raises(InvalidParameterError, match="applies only to the native devices"):
        Engine.load(demo_path, device="reference", device_options={"prefill_chunk": 4})


def test_context_full_in_decode_names_the_count(demo_path):
    e = Engine.load(demo_path, device="sim", max_context=8)
    e.prefill(list(range(1, 9)))
    with pytest.raises(ContextLengthError, match="1 more token does not fit: 8 tokens are already"):
        e.decode(1)
    assert e.position == 8


def test_native_devices_need_the_kernels_dtypes(tmp_path, demo_path):
    """A float32 norm weight is fine for the reference but not for the bf16-reading kernels."""
    import json
    import shutil
    import struct

    from lily.checkpoint import bf16_to_f32, read_safetensors_header
    from lily.errors import CheckpointError

    d = tmp_path / "f32norm"
    shutil.copytree(demo_path, d)
    src = d / "model.safetensors"
    infos = read_safetensors_header(src)
    blob = src.read_bytes()
    header, parts, at = {}, [], 0
    for name, t in infos.items():
        data = blob[t.start:t.start + t.nbytes]
        dtype = t.dtype
        if name.endswith("model.norm.weight"):
            data = bf16_to_f32(np.frombuffer(data, np.uint16)).astype("<f4").tobytes()
            dtype = "F32"
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [at, at + len(data)]}
        parts.append(data)
        at += len(data)
    head = json.dumps(header).encode()
    src.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(parts))
    (d / "model.safetensors.index.json").unlink(missing_ok=True)

    assert Engine.load(d, device="reference").generate("ROMEO.", max_tokens=3, temperature=0).token_ids  # the reference runs it
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight is F32; the native kernels read it as BF16"):
        Engine.load(d, device="sim")


# ---- checked at load (docs/device-layer.md "Checked at load, not at first dispatch")

def _load_sim(path, max_context, chunk=2048, **sim):
    return Engine.load(path, device="sim", max_context=max_context,
                       device_options={"prefill_chunk": chunk, "device_options": sim})


def test_memory_budget_is_checked_at_load_with_a_suggested_context(demo_path):
    """The sim reports a fake budget: over it, the load is refused with the numbers and a
    max_context that fits; that context loads under the same budget."""
    import re

    from lily.errors import DeviceError
    use = _load_sim(demo_path, 2048).backend.runtime.memory_use
    assert use["total"] == use["weights"] + use["kv_cache"] + use["state"] + use["scratch"]
    assert use["kv_cache"] > 0 and use["weights"] > 0 and use["max_context"] == 2048
    budget = use["total"] - use["kv_cache"] // 2  # room for about half the context
    with pytest.raises(DeviceError, match="recommended working set") as err:
        _load_sim(demo_path, 2048, working_set_bytes=budget)
    msg = str(err.value)
    assert "weights" in msg and "KV cache" in msg and "max_context 2048" in msg
    suggested = int(re.search(r"--max-context (\d+)", msg).group(1))
    assert 256 <= suggested < 2048
    e = _load_sim(demo_path, suggested, working_set_bytes=budget)
    assert e.backend.runtime.memory_use["total"] <= budget
    assert e.backend.device.memory_limits == {"working_set": budget, "max_buffer": 0}
    with pytest.raises(DeviceError, match="does not fit this device"):  # not even the weights
        _load_sim(demo_path, 256, working_set_bytes=use["weights"] // 2)


def test_automatic_prefill_chunk_is_the_largest_that_fits(demo_path):
    """prefill_chunk 0 (the default) takes the first of AUTO_PREFILL_CHUNKS, capped at
    max_context, whose memory fits the working set; when none fits, the load is refused with
    the numbers of the smallest."""
    from lily.errors import DeviceError
    use = {c: _load_sim(demo_path, 8192, c).backend.runtime.memory_use for c in (4096, 2048, 1024, 512)}
    assert use[4096]["scratch"] > use[2048]["scratch"] > use[1024]["scratch"] > use[512]["scratch"]
    auto = _load_sim(demo_path, 8192, 0).backend.runtime
    assert auto.prefill_chunk == 4096 and auto.memory_use == use[4096]
    assert Engine.load(demo_path, device="sim", max_context=1000).prefill_chunk == 1000  # capped
    for budget, want in ((use[2048]["total"], 2048), (use[1024]["total"] + 1, 1024), (use[512]["total"], 512)):
        rt = _load_sim(demo_path, 8192, 0, working_set_bytes=budget).backend.runtime
        assert (rt.prefill_chunk, rt.memory_use) == (want, use[want])
    with pytest.raises(DeviceError, match="recommended working set") as err:
        _load_sim(demo_path, 8192, 0, working_set_bytes=use[512]["total"] - 1)
    assert f"scratch {use[512]['scratch'] / 2**20:.1f} MiB" in str(err.value)
    # an explicit chunk is taken as it is: refused rather than shrunk, naming one that fits
    with pytest.raises(DeviceError, match="recommended working set") as err:
        _load_sim(demo_path, 8192, 4096, working_set_bytes=use[2048]["total"])
    assert f"A smaller prefill_chunk also fits: 2048 (its scratch is {use[2048]['scratch'] / 2**20:.1f} MiB" \
        in str(err.value)
    with pytest.raises(DeviceError) as err:  # nothing smaller fits: no such hint
        _load_sim(demo_path, 8192, 1024, working_set_bytes=use[512]["total"] - 1)
    assert "recommended working set" in str(err.value) and "smaller prefill_chunk" not in str(err.value)


def test_largest_buffer_is_checked_at_load(demo_path):
    from lily.errors import DeviceError
    use = Engine.load(demo_path, device="sim", max_context=64).backend.runtime.memory_use
    with pytest.raises(DeviceError, match=r"the buffer '.*' needs .*largest buffer.*maxBufferLength"):
        _load_sim(demo_path, 64, max_buffer_bytes=use["largest_buffer"] - 1)


def test_pipeline_thread_limit_is_checked_at_load(demo_path):
    """A pipeline allowing fewer threads than the runtime dispatches (register pressure on a
    Mac) is refused when the model loads, naming the kernel and both numbers; the samplers,
    which take any power of two from 32 threads, are sized to it instead."""
    from lily.errors import DeviceError
    with pytest.raises(DeviceError, match=r"checked at load.*kernel '\w+'.* \d+ threads exceeds the pipeline's "
                                          r"maximum of 128 \(the kernel declares up to \d+\)"):
        _load_sim(demo_path, 64, pipeline_thread_limit=128)
    table = {k["kernel"]: k for k in _load_sim(demo_path, 64, pipeline_thread_limit=512).backend.runtime.kernel_table}
    assert table["sample_token"]["threads"] == 512


def test_kernel_table_lists_every_dispatched_kernel(demo_path):
    rt = Engine.load(demo_path, device="sim", max_context=64).backend.runtime
    table = {k["kernel"]: k for k in rt.kernel_table}
    for name in ("argmax_partial", "sample_greedy_combine", "sample_token", "rms_norm_bf16", "embed_rows_q4",
                 "moe_combine"):
        assert name in table
    assert any(n.startswith("gdn_scan_") for n in table) and any(n.startswith("gdn_decode_step_") for n in table)
    assert all(any(n.endswith(f"_t{T}") for n in table) for T in (16, 32, 64))
    for b in (2, 4, 8):  # the batched step's kernels, at each width (the preflight encodes them)
        kn = _core.kernel_name
        for name in (kn("norm_gemv_batch", q=4, b=b), kn("norm_gemv_batch", q=8, b=b), kn("gemv_batch", "_add", q=4, b=b),
                     kn("gemv_gated_batch", "_add", q=4, b=b), kn("moe_route_gate_up_batch", q=4, b=b),
                     kn("moe_down_batch", q=4, b=b)):
            assert name in table, name
    for k in table.values():
        assert 0 < k["threads"] <= k["max_threads_per_threadgroup"] <= 1024, k
    assert table["sample_token"]["threads"] == 1024
    assert table["moe_combine"]["max_threads_per_threadgroup"] == 64  # the declared limit


@pytest.mark.parametrize("missing", ["model.layers.3.self_attn.k_norm.weight",
                                     "model.layers.5.mlp.switch_mlp.up_proj.scales", "lm_head.biases"])
def test_missing_tensor_fails_at_load_naming_it(missing):
    """The runtime resolves every layer's tensors when it is built (ModelWeights::bind), not at
    the first dispatch: a table without one tensor is refused naming it (Engine.load checks the
    checkpoint first, with the same words: test_checkpoint.test_missing_tensor)."""
    from lily.lab import estimate
    from lily.native_backend import _virtual_tensors, make_device, model_dims, runtime_options
    cfg = estimate.model_config()
    tensors = [t for t in _virtual_tensors(cfg, 4, 8) if t[0] != missing]
    assert len(tensors) == len(_virtual_tensors(cfg, 4, 8)) - 1
    with pytest.raises(ValueError, match=f"missing tensor {missing}$"):
        _core.Runtime(make_device("sim", record_only=True), model_dims(cfg), tensors,
                      runtime_options(64, virtual_weights=True))


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64)], ids=["group-32", "8-bit-experts"])
def test_other_quantization_is_refused_before_anything_is_mapped(bits, group, tokenizer_dir, checkpoint_cache_dir,
                                                                 tmp_path, monkeypatch):
    """A checkpoint converted by MLX-LM with --q-group-size 32, or --q-bits 8 (8-bit experts),
    runs on the reference but not on the native devices, whose kernels read 4 bits in groups
    of 64: Engine.load refuses it by name before any weight is cached or mapped, and the
    runtime itself refuses its tensors when given them directly."""
    pytest.importorskip("mlx_lm", reason="mlx-lm converts the checkpoint")
    from lily.checkpoint import open_checkpoint
    from lily.errors import QuantizationError
    from lily.native_backend import make_device, model_dims, runtime_options, tensor_table
    from lily.lab.testing import cached_checkpoint
    path = cached_checkpoint("tiny", tokenizer_dir=tokenizer_dir, cache_dir=checkpoint_cache_dir,
                             q_bits=bits, q_group_size=group)
    cache = tmp_path / "weights"
    monkeypatch.setenv("LILY_CACHE_DIR", str(cache))
    with pytest.raises(QuantizationError, match=rf"model.embed_tokens is quantized {bits}-bit in groups of {group} "
                                                rf"\(and \d+ more modules\); the native kernels .* read 4-bit"):
        Engine.load(path, device="sim")
    assert not cache.exists()  # refused before the weight cache was written
    ck = open_checkpoint(path)
    with pytest.raises(ValueError, match="is not quantized as the native kernels read it"):
        _core.Runtime(make_device("sim"), model_dims(ck.config), tensor_table(ck), runtime_options(64))
    logits = Engine.load(path, device="reference", max_context=64).prefill([1, 2, 3])
    assert np.isfinite(logits).all()


# ---- load-time fallbacks (issue 28): a family of tensor-op kernels that fails its check, a
# pipeline whose thread limit is lower than the runtime asks, prefill command buffers

M5 = {"gpu_family": "apple10"}
TEXT = "ROMEO.\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. " * 2


@pytest.fixture(scope="module")
def m5_engine(demo_path):
    return Engine.load(demo_path, device="sim", max_context=64, device_options={"prefill_chunk": 16,
                                                                                  "device_options": M5})


@pytest.mark.parametrize("faults, family", [({"gemm_q4_bf16_tensor": "wrong"}, "gemm"),
                                            ({"moe_gemm_down_q4_t16_tensor": "wrong"}, "moe_prefill"),
                                            ({"moe_gemm_gate_up_q4_t128_tensor": "build"}, "moe_prefill"),
                                            ({"attn_prefill_d256_g8_tensor": "wrong"}, "attention_prefill")],
                         ids=["gemm-wrong", "moe-wrong", "moe-build", "attention-wrong"])
def test_a_tensor_family_failing_its_check_falls_back_alone(demo_path, m5_engine, faults, family, capfd):
    """At load every family of tensor-op kernels runs once against its simdgroup_matrix twins
    (a short chunk through the first layers, every expert tile height); the simulator's faults
    option makes one kernel give wrong results or not build, as an M5's compiler or a macOS
    release might: that family alone goes back to its twins, with one line saying why, and the
    engine computes what a healthy M5's does (on the simulator the GEMMs' twins agree bit for
    bit; the attention's sum in another order, so without it the logits are the simdgroup
    attention's: those of the engine without bfloat tensor operands, whose prefill runs
    simdgroup_matrix throughout)."""
    assert m5_engine.backend.runtime.tensor_families == ["gemm", "moe_prefill", "attention_prefill"]
    capfd.readouterr()
    bad = Engine.load(demo_path, device="sim", max_context=64,
                      device_options={"prefill_chunk": 16, "device_options": {**M5, "faults": faults}})
    rt = bad.backend.runtime
    assert family not in rt.tensor_families and len(rt.tensor_families) == 2
    err = capfd.readouterr().err
    assert err.count("lily: the Metal 4 tensor-op kernels of ") == 1 and f"of {family} " in err, err
    assert ("cannot build the pipeline" if "build" in faults.values() else "differ from the simdgroup_matrix") in err
    ids = m5_engine.tokenizer.encode(TEXT)[:24]
    got = bad.prefill(ids, all_logits=True)
    bad.reset()
    if family == "attention_prefill":
        want = Engine.load(demo_path, device="sim", max_context=64, device_options={
            "prefill_chunk": 16, "device_options": {**M5, "bfloat_tensor_ops": False}}).prefill(ids, all_logits=True)
    else:
        m5_engine.reset()
        want = m5_engine.prefill(ids, all_logits=True)
        m5_engine.reset()
    np.testing.assert_array_equal(got, want)


def test_a_tensor_kernel_the_preflight_refuses_drops_its_family(demo_path, capfd):
    """A kernel the check does not run (the split attention, only at long contexts) that the
    load-time preflight refuses at the shape the plan dispatches (here a thread limit below
    its threadgroup, as register pressure may set it): its family falls back too."""
    bad = Engine.load(demo_path, device="sim", max_context=2048, device_options={
        "prefill_chunk": 16, "device_options": {**M5, "faults": {"attn_prefill_split_d256_g8_tensor": 32}}})
    assert bad.backend.runtime.tensor_families == ["gemm", "moe_prefill"]
    err = capfd.readouterr().err
    assert "of attention_prefill cannot run here" in err and "attn_prefill_split_d256_g8_tensor" in err


def test_sampler_threads_follow_the_pipeline_limit(demo_path):
    """A Mac's compiler may give the samplers' pipelines fewer than 1024 threads (register
    pressure): the runtime dispatches as many as each allows instead of refusing the load,
    and draws the same tokens."""
    low = Engine.load(demo_path, device="sim", max_context=64,
                      device_options={"device_options": {"faults": {"sample_token": 256, "sample_greedy_combine": 32}}})
    table = {k["kernel"]: k for k in low.backend.runtime.kernel_table}
    assert (table["sample_token"]["threads"], table["sample_greedy_combine"]["threads"]) == (256, 32)
    full = Engine.load(demo_path, device="sim", max_context=64)
    for kw in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=4, logprobs=True)):
        a, b = low.generate("ROMEO.", max_tokens=4, **kw), full.generate("ROMEO.", max_tokens=4, **kw)
        assert a.token_ids == b.token_ids


def test_the_preflight_encodes_the_batched_steps(demo_path):
    """The load-time preflight also encodes the batched decode step (several requests at once)
    at each width of its kernels (their threads are in the kernel table: the test above), so a
    batched kernel a Mac's compiler limits below its threadgroup (here the 4-row down
    projections) fails the load, naming it, instead of the step that first batches 3 or 4 rows."""
    with pytest.raises(DeviceError, match=r"cannot run on this device \(checked at load\): kernel "
                                          r"'moe_down_batch_q4_b4'.*exceeds the pipeline's maximum of 32"):
        Engine.load(demo_path, device="sim", max_context=64,
                    device_options={"device_options": {"faults": {"moe_down_batch_q4_b4": "32"}}})


def test_prefill_command_buffers_bound_the_work(demo_path):
    """A prefill chunk's layers go in command buffers of at most command_buffer_rows
    layer-rows (an attention layer weighted by its context), at least a layer each; the
    results are those of one command buffer per chunk, the generation's hand-off included."""
    from lily.lab.estimate import model_config
    from lily.native_backend import counting_runtime
    rt = counting_runtime(model_config(), 4, 8, 131072, prefill_chunk=4096)
    assert rt.prefill_command_buffers(0, 4096) == [(i, i + 1) for i in range(40)]  # a 4096-row chunk: a layer each
    assert rt.prefill_command_buffers(0, 100) == [(0, 40)]
    assert rt.prefill_command_buffers(0, 512) == [(0, 7), (7, 14), (14, 21), (21, 28), (28, 35), (35, 40)]
    long = rt.prefill_command_buffers(120000, 512)  # attention layers (3, 7, ...) cost 16x at 120K
    assert (3, 4) in long and all(b - a <= 8 for a, b in long)
    one = counting_runtime(model_config(), 4, 8, 8192, prefill_chunk=4096, command_buffer_rows=0)
    assert one.prefill_command_buffers(0, 4096) == [(0, 40)]
    kw = dict(max_context=64, device_options={"prefill_chunk": 16})
    split = Engine.load(demo_path, device="sim", **{**kw, "device_options": {"prefill_chunk": 16,
                                                                             "command_buffer_rows": 20}})
    whole = Engine.load(demo_path, device="sim", **{**kw, "device_options": {"prefill_chunk": 16,
                                                                             "command_buffer_rows": 0}})
    assert split.backend.runtime.prefill_command_buffers(0, 16) == [(i, i + 1) for i in range(8)]
    ids = whole.tokenizer.encode(TEXT)[:24]
    np.testing.assert_array_equal(split.prefill(ids, all_logits=True), whole.prefill(ids, all_logits=True))
    split.reset(), whole.reset()
    g = dict(max_tokens=4, temperature=0.7, seed=2)
    assert split.generate(ids, **g).token_ids == whole.generate(ids, **g).token_ids
