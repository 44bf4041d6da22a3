"""Checkpoint loading and validation: the layout, memory mapping, and every fault a user
can hand us (missing, truncated, mis-shaped, unknown architecture, HF layout)."""

from __future__ import annotations

import json
import re
import shutil
import struct

import numpy as np
import pytest

from fixtures_checkpoints import BF16_INF, BF16_NAN, BF16_NEG_INF, DEMO_NORM, DEMO_SCALE, poison_tensor
from lily.checkpoint import (
    bf16_to_f32,
    check_finite,
    f32_to_bf16,
    open_checkpoint,
    parse_config,
    quantization_for,
)
from lily.engine import Engine
from lily.errors import CheckpointError, ConfigError, LilyError


@pytest.fixture()
def demo_copy(tmp_path, demo_path):
    dst = tmp_path / "model"
    shutil.copytree(demo_path, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


def _rewrite_header(path, mutate):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    mutate(header)
    new = json.dumps(header).encode()
    new += b" " * ((8 - len(new) % 8) % 8)
    # Keep data offsets valid: the header is a different length but offsets are relative.
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_demo_layout_and_quantization(demo_path):
    ck = open_checkpoint(demo_path)
    c = ck.config
    assert c.num_hidden_layers == 8 and c.full_attention_layers == (3, 7)
    assert c.head_dim == 256 and c.linear_key_head_dim == 128 and c.rotary_dim == 64
    assert ck.quant_spec("model.layers.0.mlp.gate").bits == 8
    assert ck.quant_spec("model.layers.0.mlp.shared_expert_gate").bits == 8
    assert ck.quant_spec("model.layers.0.mlp.switch_mlp.up_proj").bits == 4
    assert ck.quant_spec("lm_head").bits == 4
    # Memory-mapped, not loaded.
    assert isinstance(ck.raw("lm_head.weight").base, np.memmap) or isinstance(ck.raw("lm_head.weight"), np.memmap)


def test_dequantize_matches_definition(demo_path):
    """w[o, i] = scales[o, i/64] * ((weight[o, i/8] >> 4*(i%8)) & 15) + biases[o, i/64]."""
    ck = open_checkpoint(demo_path)
    q = ck.quantized("model.layers.0.linear_attn.in_proj_qkv")
    w = q.dequantize()
    rng = np.random.default_rng()
    for _ in range(50):
        o, i = rng.integers(w.shape[0]), rng.integers(w.shape[1])
        code = (int(q.weight[o, i // 8]) >> (4 * (i % 8))) & 15
        s = bf16_to_f32(q.scales[o, i // 64])
        b = bf16_to_f32(q.biases[o, i // 64])
        assert w[o, i] == pytest.approx(float(s) * code + float(b), rel=1e-6, abs=1e-7)
    q8 = ck.quantized("model.layers.0.mlp.gate")
    w8 = q8.dequantize()
    o, i = 3, 77
    code = (int(q8.weight[o, i // 4]) >> (8 * (i % 4))) & 255
    assert w8[o, i] == pytest.approx(float(bf16_to_f32(q8.scales[o, i // 64])) * code
                                     + float(bf16_to_f32(q8.biases[o, i // 64])), rel=1e-6)
    # Expert slices and blocks of rows dequantize only what is asked for.
    qe = ck.quantized("model.layers.0.mlp.switch_mlp.down_proj")
    np.testing.assert_array_equal(qe.dequantize(5), qe.dequantize()[5])
    np.testing.assert_array_equal(qe.dequantize(5, rows=slice(3, 40)), qe.dequantize()[5, 3:40])
    np.testing.assert_array_equal(q.dequantize(rows=slice(7, 9)), w[7:9])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_unpack_codes_table_equals_shifts(bits):
    """The byte-table unpacking of 4- and 8-bit codes gives what shifting and masking gives
    (lowest bits first), on every byte value."""
    from lily.checkpoint import unpack_codes
    words = np.random.default_rng(bits).integers(0, 2**32, size=(3, 64), dtype=np.uint32)
    words[0, :64] = np.arange(256, dtype=np.uint8).view(np.uint32)  # every byte value
    per = 32 // bits
    want = (words[..., None] >> (np.arange(per, dtype=np.uint32) * bits)) & np.uint32((1 << bits) - 1)
    got = unpack_codes(words, bits)
    assert got.dtype == np.float32 and got.shape == (3, 64 * per)
    np.testing.assert_array_equal(got, want.reshape(3, -1).astype(np.float32))


def test_flat_config_and_interval(demo_path):
    raw = json.loads((demo_path / "config.json").read_text())
    text = dict(raw["text_config"])
    del text["layer_types"]
    flat = parse_config(text)
    nested = parse_config(raw)
    assert flat.layer_types == nested.layer_types
    text["full_attention_interval"] = 2
    assert parse_config(text).full_attention_layers == (1, 3, 5, 7)


@pytest.mark.parametrize("mutate, match", [
    (lambda c: c.update(model_type="llama", text_config={**c["text_config"], "model_type": "llama"}),
     "unsupported architecture"),
    (lambda c: c["text_config"].pop("hidden_size"), "missing required key 'hidden_size'"),
    (lambda c: c["text_config"].update(layer_types=["full_attention"] * 3), "layer_types has 3 entries"),
    (lambda c: c["text_config"].update(num_key_value_heads=3), "not a multiple of num_key_value_heads"),
    (lambda c: c["text_config"].update(tie_word_embeddings=True), "tie_word_embeddings"),
])
def test_bad_config(demo_copy, mutate, match):
    raw = json.loads((demo_copy / "config.json").read_text())
    mutate(raw)
    (demo_copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=match):
        Engine.load(demo_copy)


def test_unknown_config_key_warns_or_fails_strict(demo_path):
    raw = json.loads((demo_path / "config.json").read_text())
    raw["text_config"]["frobnicate_heads"] = 3
    with pytest.warns(UserWarning, match="frobnicate_heads"):
        parse_config(raw)
    with pytest.raises(ConfigError, match="frobnicate_heads"):
        parse_config(raw, strict=True)
    del raw["text_config"]["frobnicate_heads"]
    raw["bogus_key"] = 1  # the nested config's wrapper is checked too
    with pytest.raises(ConfigError, match=r"\(top level\) bogus_key"):
        parse_config(raw, strict=True)


def test_demo_and_preset_configs_have_no_unknown_keys(demo_path, tiny_checkpoint, dims_checkpoint):
    import warnings
    for d in (demo_path, tiny_checkpoint, dims_checkpoint):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            parse_config(json.loads((d / "config.json").read_text()), strict=True)


def test_cli_prints_config_warnings_on_one_line(tmp_path, demo_path):
    import shutil
    import subprocess
    import sys
    d = tmp_path / "m"
    shutil.copytree(demo_path, d)
    raw = json.loads((d / "config.json").read_text())
    raw["bogus_key"] = 1
    (d / "config.json").write_text(json.dumps(raw))
    r = subprocess.run([sys.executable, "-m", "lily", "info", "--model", str(d)], capture_output=True, text=True)
    assert r.returncode == 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("lily: warning:") and "bogus_key" in lines[0], r.stderr


def test_missing_config_and_weights(tmp_path, demo_copy):
    with pytest.raises(CheckpointError, match="nope: the path does not exist"):
        Engine.load(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="file: not a directory"):
        Engine.load(tmp_path / "file")
    (demo_copy / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json: not found"):
        Engine.load(demo_copy)


def test_corrupt_config_json(demo_copy):
    (demo_copy / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="unreadable JSON"):
        Engine.load(demo_copy)


def test_missing_shard_named_by_index(demo_copy):
    (demo_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors, which does not exist"):
        Engine.load(demo_copy)


def test_no_weights_at_all(demo_copy):
    (demo_copy / "model.safetensors").unlink()
    (demo_copy / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="no model\\*.safetensors"):
        Engine.load(demo_copy)


def test_truncated_file(demo_copy):
    f = demo_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"truncated: tensor .* ends at byte"):
        Engine.load(demo_copy)
    f.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        Engine.load(demo_copy)


def test_corrupt_header(demo_copy):
    f = demo_copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:16] = b"garbage!"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable safetensors header"):
        Engine.load(demo_copy)


def test_missing_tensor(demo_copy):
    name = "language_model.model.layers.5.mlp.switch_mlp.up_proj.scales"
    _rewrite_header(demo_copy / "model.safetensors", lambda h: h.pop(name))
    with pytest.raises(CheckpointError, match="missing tensor model.layers.5.mlp.switch_mlp.up_proj.scales"):
        Engine.load(demo_copy)


def test_misshaped_tensor(demo_copy):
    name = "language_model.model.layers.3.self_attn.k_norm.weight"

    def mutate(h):
        t = h[name]
        t["shape"] = [128]
        t["data_offsets"] = [t["data_offsets"][0], t["data_offsets"][0] + 256]
    _rewrite_header(demo_copy / "model.safetensors", mutate)
    with pytest.raises(CheckpointError) as e:
        Engine.load(demo_copy)
    msg = str(e.value)
    assert "model.safetensors" in msg and "k_norm.weight" in msg and "[128]" in msg and "[256]" in msg


def test_wrong_dtype(demo_copy):
    name = "language_model.model.layers.0.mlp.gate.weight"

    def mutate(h):
        h[name]["dtype"] = "I32"
    _rewrite_header(demo_copy / "model.safetensors", mutate)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(demo_copy))}/model.safetensors: tensor {name} "
                                              "has dtype I32, expected U32"):
        Engine.load(demo_copy)


def test_wrong_router_bits(demo_copy):
    """Dropping the 8-bit override makes the stored router the wrong shape for 4 bits."""
    raw = json.loads((demo_copy / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        raw[key].pop("language_model.model.layers.2.mlp.gate")
    (demo_copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"layers.2.mlp.gate.weight has shape \[32, 64\], expected \[32, 32\]"):
        Engine.load(demo_copy)


def test_hf_layout_is_refused_with_conversion_command(tiny_hf_checkpoint):
    with pytest.raises(CheckpointError) as e:
        Engine.load(tiny_hf_checkpoint)
    assert "Hugging Face" in str(e.value) and "mlx_lm convert" in str(e.value)


def test_quantization_override_lookup():
    raw = {"quantization": {"bits": 4, "group_size": 64,
                            "language_model.model.layers.0.mlp.gate": {"bits": 8, "group_size": 64}}}
    assert quantization_for(raw, "language_model.model.layers.0.mlp.gate").bits == 8
    assert quantization_for(raw, "language_model.model.layers.1.mlp.gate").bits == 4
    assert quantization_for({}, "x") is None
    with pytest.raises(LilyError, match="3-bit"):
        quantization_for({"quantization": {"bits": 3, "group_size": 64}}, "lm_head")


def test_presets_load(tiny_checkpoint, dims_checkpoint):
    for path in (tiny_checkpoint, dims_checkpoint):
        ck = open_checkpoint(path)
        assert ck.config.vocab_size == 248320
        assert ck.quant_spec("model.layers.0.mlp.gate").bits == 8
    dims = open_checkpoint(dims_checkpoint).config
    assert (dims.linear_key_head_dim, dims.linear_value_head_dim, dims.head_dim) == (128, 128, 256)
    assert dims.num_attention_heads // dims.num_key_value_heads == 8 and dims.num_experts_per_tok == 8


@pytest.mark.parametrize("where, key, value, match", [
    ("text", "hidden_size", "256", "hidden_size must be an integer, got '256'"),
    ("text", "num_experts", 8.0, "num_experts must be an integer"),
    ("text", "rms_norm_eps", "small", "rms_norm_eps must be a number"),
    ("text", "eos_token_id", "x", "eos_token_id must be a token id"),
    ("text", "eos_token_id", [10**9], "outside the vocabulary"),
    ("top", "model_type", "llama", "unsupported architecture model_type='llama'"),
])
def test_config_value_types(demo_path, where, key, value, match):
    raw = json.loads((demo_path / "config.json").read_text())
    (raw["text_config"] if where == "text" else raw)[key] = value
    with pytest.raises(ConfigError, match=match):
        parse_config(raw)


# --------------------------------------------------------------------------- NaN / Inf

@pytest.mark.parametrize("dtype, bits, what", [
    ("BF16", BF16_NAN, "NaN"), ("BF16", BF16_INF, "Inf"), ("BF16", BF16_NEG_INF, "Inf"),
    ("BF16", 0xFFC1, "NaN"), ("F16", 0x7C00, "Inf"), ("F16", 0x7E00, "NaN"),
    ("F32", 0x7F800000, "Inf"), ("F32", 0xFFC00000, "NaN"), ("F32", 0x7F800001, "NaN"),
])
def test_check_finite_finds_the_first_non_finite_element(dtype, bits, what):
    shape = (3, 5, 70000)  # more than one scan chunk
    udt = np.uint32 if dtype == "F32" else np.uint16
    a = np.zeros(shape, dtype=udt)
    a[2, 4, 69999] = a[2, 1, 7] = bits
    with pytest.raises(CheckpointError, match=rf"tensor w \({dtype} \[3, 5, 70000\]\) holds {what} "
                                              r"at index \[2, 1, 7\]"):
        check_finite("w", dtype, a, shape)
    # a later block of the same tensor: the index is the tensor's, not the block's
    data, cut = a.tobytes(), a[:2].nbytes
    check_finite("w", dtype, data[:cut], shape)
    with pytest.raises(CheckpointError, match=r"at index \[2, 1, 7\]"):
        check_finite("w", dtype, data[cut:], shape, byte_offset=cut)


def test_check_finite_passes_extreme_finite_values_and_integer_codes():
    big = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, np.finfo(np.float32).tiny, 0.0, -0.0],
                   dtype=np.float32)
    check_finite("f", "F32", big, big.shape)
    check_finite("b", "BF16", f32_to_bf16(big[[2, 3, 4]]), (3,))
    check_finite("b", "BF16", np.array([0x7F7F, 0xFF7F, 0x0001], dtype=np.uint16), (3,))  # +-max, subnormal
    check_finite("q", "U32", np.full(8, 0xFFFFFFFF, dtype=np.uint32), (8,))  # packed codes: never floats


@pytest.mark.parametrize("name, index, bits, what", [(DEMO_SCALE, (17, 100, 3), BF16_NAN, "NaN"),
                                                      (DEMO_NORM, (200,), BF16_INF, "Inf")])
def test_non_finite_weights_are_refused_on_the_reference_device(demo_copy, name, index, bits, what, monkeypatch):
    poison_tensor(demo_copy, name, index, bits)
    open_checkpoint(demo_copy)  # the headers are fine: nothing is read yet
    monkeypatch.chdir(demo_copy.parent)  # loaded by a relative path: the message still has the full one
    # the file by its path, the tensor as the file stores it (the demo keeps MLX's language_model. prefix)
    file, stored = re.escape(str(demo_copy / "model.safetensors")), re.escape("language_model." + name)
    with pytest.raises(CheckpointError, match=rf"^{file}: tensor {stored} \(BF16 .*\) holds {what} "
                                              rf"at index \[{', '.join(map(str, index))}\]"):
        Engine.load(demo_copy.name, device="reference")


def test_clean_checkpoint_scans_every_floating_tensor_once(demo_path, monkeypatch):
    import lily.checkpoint as ckmod
    seen = []
    real = ckmod.check_finite
    monkeypatch.setattr(ckmod, "check_finite", lambda name, *a, **k: (seen.append(name), real(name, *a, **k)))
    ck = open_checkpoint(demo_path)
    ck.check_floats()
    floats = sorted(t.name for t in ck.tensors.values() if t.dtype in ("BF16", "F32"))  # as stored
    assert sorted(seen) == floats and any(n.endswith(".scales") for n in seen)
    assert not any(t.dtype == "U32" for t in ck.tensors.values() if t.name in seen)
    ck.check_floats()  # once per Checkpoint
    assert len(seen) == len(floats)
