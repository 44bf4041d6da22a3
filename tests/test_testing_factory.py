"""Tests of lily.lab.testing: HF-layout random checkpoints and their MLX-LM 4-bit conversion."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from lily.lab import testing as lt
from lily.lab.testing import (
    PRESETS,
    Preset,
    cached_checkpoint,
    hf_tensor_specs,
    make_hf_checkpoint,
    make_mlx_checkpoint,
)

from fixtures_checkpoints import (  # noqa: F401  (pytest fixtures)
    checkpoint_cache_dir,
    dims_checkpoint,
    tiny_checkpoint,
    tiny_hf_checkpoint,
    tokenizer_dir,
)

LM = "language_model.model.layers"


# ------------------------------------------------------------------------------ presets


def test_presets_dimensions():
    t, d = PRESETS["tiny"], PRESETS["dims"]
    for p in (t, d):
        assert isinstance(p, Preset)
        assert p.vocab_size == 248320
        assert p.layer_types == [
            "linear_attention", "linear_attention", "linear_attention", "full_attention"
        ]
        tc = p.text_config()
        assert tc["layer_types"] == p.layer_types
        assert tc["model_type"] == "qwen3_5_moe_text"
        assert tc["rope_parameters"]["partial_rotary_factor"] == 0.25
        assert sum(tc["rope_parameters"]["mrope_section"]) == p.rotary_dim // 2
        cfg = p.config()
        assert cfg["model_type"] == "qwen3_5_moe"
        assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
        assert cfg["text_config"] == tc
    assert (d.linear_key_head_dim, d.linear_value_head_dim, d.head_dim) == (128, 128, 256)
    assert d.num_attention_heads // d.num_key_value_heads == 8
    assert d.num_experts_per_tok == 8
    assert d.text_config()["rope_parameters"]["mrope_section"] == [11, 11, 10]
    with pytest.raises(ValueError):
        PRESETS["tiny"].__class__(**{**t.__dict__, "name": "bad", "hidden_size": 100}).validate()
    with pytest.raises(ValueError, match="unknown preset"):
        hf_tensor_specs("nope")
    assert t.content_hash() != d.content_hash()


def test_preset_fields_come_from_model_config():
    """Preset's fields are ModelConfig's (the one list) less those the factory fixes, plus
    its own three; every preset's config.json parses back to the values it names."""
    import dataclasses

    from lily.checkpoint import ModelConfig, parse_config
    preset = {f.name for f in dataclasses.fields(Preset)}
    config = {f.name for f in dataclasses.fields(ModelConfig)}
    assert preset - config == {"name", "full_attention_interval", "mtp_num_hidden_layers"}
    assert config - preset == {"layer_types", "tie_word_embeddings", "norm_topk_prob", "model_type",
                               "eos_token_ids"}
    for p in PRESETS.values():
        c = parse_config(p.config())
        assert {n: getattr(c, n) for n in preset & config} == {n: getattr(p, n) for n in preset & config}
        assert list(c.layer_types) == p.layer_types
    with pytest.raises(TypeError, match="head_dim"):  # a ModelConfig field a preset must choose
        Preset(**{k: v for k, v in dataclasses.asdict(PRESETS["tiny"]).items() if k != "head_dim"})


def test_transformers_accepts_config(tiny_hf_checkpoint):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(str(tiny_hf_checkpoint))
    tc = cfg.text_config
    assert tc.layer_types == PRESETS["tiny"].layer_types
    assert tc.linear_num_value_heads == 4 and tc.vocab_size == 248320


def test_missing_tokenizer_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer_dir"):
        make_hf_checkpoint("tiny", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="tokenizer_dir"):
        cached_checkpoint("tiny", cache_dir=tmp_path)


# ------------------------------------------------------------------------------ HF layout


def _hf_headers(d: Path) -> dict:
    """name -> (dtype, shape) from the safetensors headers, via the index."""
    index = json.loads((d / "model.safetensors.index.json").read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        raw = (d / fname).read_bytes()[:8]
        n = int.from_bytes(raw, "little")
        with open(d / fname, "rb") as f:
            f.seek(8)
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                assert index["weight_map"][k] == fname
                out[k] = (v["dtype"], tuple(v["shape"]))
    assert set(out) == set(index["weight_map"])
    return out


def test_hf_checkpoint_layout(tiny_hf_checkpoint):
    d = tiny_hf_checkpoint
    p = PRESETS["tiny"]
    H, E, I = p.hidden_size, p.num_experts, p.moe_intermediate_size
    for f in ("config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "chat_template.jinja"):
        assert (d / f).is_file(), f
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [248046, 248044]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg == p.config()

    h = _hf_headers(d)
    assert h == {s.name: (s.dtype, s.shape) for s in hf_tensor_specs("tiny")}
    pre = "model.language_model"
    assert h[f"{pre}.embed_tokens.weight"] == ("BF16", (248320, H))
    assert h["lm_head.weight"] == ("BF16", (248320, H))
    assert h[f"{pre}.norm.weight"] == ("BF16", (H,))
    g = f"{pre}.layers.0.linear_attn"
    assert h[f"{g}.in_proj_qkv.weight"] == ("BF16", (2 * 2 * 32 + 4 * 32, H))
    assert h[f"{g}.in_proj_z.weight"] == ("BF16", (128, H))
    assert h[f"{g}.in_proj_a.weight"] == ("BF16", (4, H))
    assert h[f"{g}.in_proj_b.weight"] == ("BF16", (4, H))
    assert h[f"{g}.conv1d.weight"] == ("BF16", (256, 1, 4))
    assert h[f"{g}.A_log"] == ("F32", (4,))
    assert h[f"{g}.dt_bias"] == ("BF16", (4,))
    assert h[f"{g}.norm.weight"] == ("BF16", (32,))
    assert h[f"{g}.out_proj.weight"] == ("BF16", (H, 128))
    a = f"{pre}.layers.3.self_attn"
    assert h[f"{a}.q_proj.weight"] == ("BF16", (2 * 4 * 64, H))
    assert h[f"{a}.k_proj.weight"] == ("BF16", (2 * 64, H))
    assert h[f"{a}.o_proj.weight"] == ("BF16", (H, 4 * 64))
    assert h[f"{a}.q_norm.weight"] == ("BF16", (64,))
    m = f"{pre}.layers.3.mlp"
    assert h[f"{m}.gate.weight"] == ("BF16", (E, H))
    assert h[f"{m}.experts.gate_up_proj"] == ("BF16", (E, 2 * I, H))
    assert h[f"{m}.experts.down_proj"] == ("BF16", (E, H, I))
    assert h[f"{m}.shared_expert_gate.weight"] == ("BF16", (1, H))
    assert h[f"{m}.shared_expert.down_proj.weight"] == ("BF16", (H, 64))
    assert not any(k.startswith("model.visual") for k in h)
    assert any(k.startswith("mtp.") for k in h)
    assert f"{pre}.layers.3.linear_attn.A_log" not in h
    assert f"{pre}.layers.0.self_attn.q_proj.weight" not in h


def test_hf_values_deterministic_and_sane(tiny_hf_checkpoint, tokenizer_dir, tmp_path):
    mx = pytest.importorskip("mlx.core")
    w = {}
    for f in sorted(tiny_hf_checkpoint.glob("model-*.safetensors")):
        w.update(mx.load(str(f)))
    pre = "model.language_model"
    ln = np.array(w[f"{pre}.layers.0.input_layernorm.weight"].astype(mx.float32))
    assert abs(ln.mean()) < 0.05 and 0.02 < ln.std() < 0.3  # offsets around 0
    gn = np.array(w[f"{pre}.layers.0.linear_attn.norm.weight"].astype(mx.float32))
    assert abs(gn.mean() - 1) < 0.1  # plain multiplier around 1
    A = np.exp(np.array(w[f"{pre}.layers.0.linear_attn.A_log"]))
    assert ((A >= 1) & (A <= 16)).all()
    for k, v in w.items():
        assert np.isfinite(np.array(v.astype(mx.float32))).all(), k
    # Same seed -> same bytes, different seed -> different values.
    spec = [s for s in hf_tensor_specs("tiny") if s.name.endswith("layers.1.mlp.gate.weight")][0]
    assert lt._tensor_bytes(spec, 0) == lt._tensor_bytes(spec, 0)
    assert lt._tensor_bytes(spec, 0) != lt._tensor_bytes(spec, 1)
    got = np.array(w[spec.name].astype(mx.float32))
    ref = lt._tensor_values(spec, 0)
    assert np.abs(got - ref).max() <= np.abs(ref).max() * 2 ** -8


def test_bf16_rounding():
    """lily.checkpoint.f32_to_bf16, the encoder the factory writes its bf16 tensors with."""
    from lily.checkpoint import f32_to_bf16
    x = np.array([1.0, -2.5, 1 + 2 ** -8, 1 + 3 * 2 ** -9, 3.0e38, 0.0, np.nan], dtype=np.float32)
    bits = f32_to_bf16(x)
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(back[:2], x[:2])
    assert back[2] == 1.0  # tie rounds to even
    assert back[3] == 1 + 2 ** -7
    assert np.isfinite(back[4]) and back[5] == 0
    assert np.isnan(back[6])


# ------------------------------------------------------------------------------ MLX layout


def _mlx_weights(d: Path) -> dict:
    mx = pytest.importorskip("mlx.core")
    w = {}
    for f in sorted(d.glob("model*.safetensors")):
        w.update(mx.load(str(f)))
    return w


@pytest.mark.parametrize("which", ["tiny", "dims"])
def test_mlx_checkpoint_quantization(which, request, tokenizer_dir):
    d = request.getfixturevalue(f"{which}_checkpoint")
    p = PRESETS[which]
    mx = pytest.importorskip("mlx.core")
    H, E, I, Is = p.hidden_size, p.num_experts, p.moe_intermediate_size, p.shared_expert_intermediate_size
    cfg = json.loads((d / "config.json").read_text())
    q = cfg["quantization"]
    assert (q["bits"], q["group_size"], q["mode"]) == (4, 64, "affine")
    assert cfg["quantization_config"] == q
    overrides = {k: v for k, v in q.items() if isinstance(v, dict)}
    assert overrides == {
        f"{LM}.{i}.mlp.{m}": {"group_size": 64, "bits": 8}
        for i in range(p.num_hidden_layers) for m in ("gate", "shared_expert_gate")
    }
    assert cfg["text_config"]["layer_types"] == p.layer_types
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (d / f).is_file(), f
    assert (d / "chat_template.jinja").read_bytes() == (tokenizer_dir / "chat_template.jinja").read_bytes()

    w = _mlx_weights(d)
    assert not any(k.startswith("mtp.") or ".mtp." in k for k in w)
    for i, kind in enumerate(p.layer_types):
        m = f"{LM}.{i}.mlp"
        for proj, (o, inn) in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
            k = f"{m}.switch_mlp.{proj}"
            assert w[k + ".weight"].dtype == mx.uint32
            assert w[k + ".weight"].shape == (E, o, inn // 8)
            assert w[k + ".scales"].shape == (E, o, inn // 64)
            assert w[k + ".biases"].dtype == mx.bfloat16
        assert w[f"{m}.gate.weight"].shape == (E, H // 4)  # 8-bit: 4 codes per uint32
        assert w[f"{m}.gate.scales"].shape == (E, H // 64)
        assert w[f"{m}.shared_expert_gate.weight"].shape == (1, H // 4)
        assert w[f"{m}.shared_expert.down_proj.weight"].shape == (H, Is // 8)
        if kind == "linear_attention":
            g = f"{LM}.{i}.linear_attn"
            assert w[f"{g}.conv1d.weight"].shape == (p.conv_dim, 4, 1)
            assert w[f"{g}.A_log"].dtype == mx.float32
            assert w[f"{g}.in_proj_qkv.weight"].shape == (p.conv_dim, H // 8)
        else:
            a = f"{LM}.{i}.self_attn"
            assert w[f"{a}.q_proj.weight"].shape == (2 * p.num_attention_heads * p.head_dim, H // 8)
            assert w[f"{a}.q_norm.weight"].dtype == mx.bfloat16
    assert w["language_model.model.embed_tokens.weight"].shape == (248320, H // 8)
    assert w["language_model.lm_head.weight"].shape == (248320, H // 8)


def test_mlx_matches_hf_values(tiny_checkpoint, tiny_hf_checkpoint):
    """The conversion folds the norm +1, splits gate_up, moves the conv axis (same seed)."""
    mx = pytest.importorskip("mlx.core")
    hf = {}
    for f in sorted(tiny_hf_checkpoint.glob("model-*.safetensors")):
        hf.update(mx.load(str(f)))
    ml = _mlx_weights(tiny_checkpoint)
    f32 = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
    pre = "model.language_model.layers"
    np.testing.assert_allclose(
        f32(ml[f"{LM}.0.input_layernorm.weight"]), 1 + f32(hf[f"{pre}.0.input_layernorm.weight"]),
        atol=1e-2)
    np.testing.assert_array_equal(
        f32(ml[f"{LM}.0.linear_attn.norm.weight"]), f32(hf[f"{pre}.0.linear_attn.norm.weight"]))
    np.testing.assert_array_equal(
        f32(ml[f"{LM}.0.linear_attn.conv1d.weight"])[:, :, 0],
        f32(hf[f"{pre}.0.linear_attn.conv1d.weight"])[:, 0, :])
    I = PRESETS["tiny"].moe_intermediate_size

    def deq(prefix, bits=4):
        return f32(mx.dequantize(ml[prefix + ".weight"], ml[prefix + ".scales"],
                                 ml[prefix + ".biases"], group_size=64, bits=bits))

    gu = f32(hf[f"{pre}.1.mlp.experts.gate_up_proj"])
    for name, ref in (("gate_proj", gu[:, :I]), ("up_proj", gu[:, I:])):
        got = deq(f"{LM}.1.mlp.switch_mlp.{name}")
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.15
    ref = f32(hf[f"{pre}.1.mlp.gate.weight"])
    got = deq(f"{LM}.1.mlp.gate", bits=8)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.01


def test_mlx_lm_load_and_generate(tiny_checkpoint):
    """``mlx_lm.load`` (model + tokenizer) works and greedy decoding emits decodable ids.

    Note: on the CPU, MLX's 4-bit matmul over the 248320-row lm_head costs ~0.25 s per
    position (tiny), so keep peer prompts/generations short and take last-position logits.
    """
    mx = pytest.importorskip("mlx.core")
    from mlx_lm import load

    model, tok = load(str(tiny_checkpoint))
    assert tok.encode("<|im_end|>") == [248046]
    assert tok.eos_token_id in (248046, 248044)
    ids = tok.encode("Hello there")
    cache = model.make_cache()
    logits = model(mx.array([ids]), cache=cache)[:, -1:]
    out = []
    for _ in range(3):
        nxt = int(mx.argmax(logits[0, -1]).item())
        out.append(nxt)
        logits = model(mx.array([[nxt]]), cache=cache)
    assert all(0 <= t < lt.TOKENIZER_VOCAB_SIZE for t in out)
    assert isinstance(tok.decode(out), str)


@pytest.mark.parametrize("which", ["tiny", "dims"])
def test_mlx_lm_forward_is_healthy(which, request):
    """Residual stream stays O(1), every block contributes, logits are finite and varied."""
    d = request.getfixturevalue(f"{which}_checkpoint")
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(d))
    # A fixed id sequence (no tokenizer load: it costs ~5 s).
    ids = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 11, 323, 1221]
    x = mx.array([ids])
    lm = model.language_model
    rms = lambda a: float(mx.sqrt(mx.mean(a.astype(mx.float32) ** 2)))  # noqa: E731
    h = lm.model.embed_tokens(x)
    for layer in lm.model.layers:
        n = layer.input_layernorm(h)
        if layer.is_linear:
            r = layer.linear_attn(n, None, None)
        else:
            r = layer.self_attn(n, create_attention_mask(h, None), None)
        h = h + r
        m = layer.mlp(layer.post_attention_layernorm(h))
        h = h + m
        assert 0.05 < rms(r) < 3 and 0.05 < rms(m) < 3
        assert rms(h) < 5
    # The manual walk equals the model's own forward.
    body = lm.model(x)
    np.testing.assert_allclose(
        np.array(lm.model.norm(h).astype(mx.float32)), np.array(body.astype(mx.float32)), atol=1e-2
    )
    logits = np.array(lm.lm_head(body[:, -3:]).astype(mx.float32))[0]
    assert logits.shape == (3, 248320)
    assert np.isfinite(logits).all()
    assert (logits.std(-1) > 0.5).all()
    assert len(set(logits.argmax(-1).tolist())) >= 2
    assert (logits.argmax(-1) < lt.TOKENIZER_VOCAB_SIZE).all()
    assert np.abs(logits[:, lt.TOKENIZER_VOCAB_SIZE:]).max() < 1.0  # padding rows ~0


# ------------------------------------------------------------------------------ cache


def test_cached_checkpoint_hit(tiny_checkpoint, tokenizer_dir, checkpoint_cache_dir):
    before = (tiny_checkpoint / "model.safetensors").stat().st_mtime_ns
    again = cached_checkpoint("tiny", tokenizer_dir=tokenizer_dir, cache_dir=checkpoint_cache_dir)
    assert again == tiny_checkpoint
    assert (again / "model.safetensors").stat().st_mtime_ns == before
    assert tiny_checkpoint.name.startswith("tiny-s0-")


def test_cached_checkpoint_race(tmp_path, tokenizer_dir, monkeypatch):
    """Two concurrent builders: both get the same complete directory, no temp dirs remain."""
    calls = []
    barrier = threading.Barrier(2)
    racing = [True]

    def fake_make(preset, out_dir, *, seed, tokenizer_dir, **quantization):
        out = Path(out_dir)
        out.mkdir(parents=True)
        if racing[0]:
            barrier.wait(timeout=10)  # both builders finish together
        (out / "model.safetensors").write_text(str(threading.get_ident()))
        (out / "config.json").write_text("{}")
        calls.append(out)
        return out

    monkeypatch.setattr(lt, "make_mlx_checkpoint", fake_make)
    results, errors = [], []

    def run():
        try:
            results.append(cached_checkpoint("tiny", tokenizer_dir=tokenizer_dir, cache_dir=tmp_path, seed=7))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=run) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert len(calls) == 2 and results[0] == results[1]
    assert (results[0] / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]
    assert results[0].name.startswith("tiny-s7-")
    # Different seed -> different key.
    racing[0] = False
    other = cached_checkpoint("tiny", tokenizer_dir=tokenizer_dir, cache_dir=tmp_path, seed=8)
    assert other != results[0]


def test_make_mlx_checkpoint_argument_errors(tmp_path, tokenizer_dir, tiny_hf_checkpoint):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        make_mlx_checkpoint("tiny", tmp_path / "out", tokenizer_dir=tokenizer_dir)
    with pytest.raises(ValueError, match="preset 'dims'"):
        make_mlx_checkpoint("dims", tmp_path / "o2", tokenizer_dir=tokenizer_dir,
                            hf_dir=tiny_hf_checkpoint)
    with pytest.raises(ValueError, match="tokenizer_dir"):
        make_mlx_checkpoint("tiny", tmp_path / "o3")


# ------------------------------------------------------------------------------ direct MLX writer


def _table(d: Path) -> dict:
    from lily.checkpoint import discover_weight_files, read_safetensors_header
    out = {}
    for f in discover_weight_files(d):
        out.update({k: (t.dtype, t.shape) for k, t in read_safetensors_header(f).items()})
    return out


@pytest.mark.parametrize("which", ["tiny", "dims"])
def test_direct_mlx_checkpoint_matches_the_converter(which, request, tokenizer_dir, tmp_path):
    """write_mlx_checkpoint (no bf16 intermediate, no MLX-LM) gives what mlx_lm convert -q
    gives for the same preset: config.json (quantization block and 8-bit overrides included),
    the index (total_size, total_parameters, weight_map), the tensor table (names, dtypes,
    shapes) and the tokenizer files; the unquantized tensors hold the converter's values (same
    seed, norm offsets folded); the quantized ones dequantize to the HF init's std (uniform
    codes, scales around std / code_std), centred on 0."""
    from lily.checkpoint import open_checkpoint
    conv = request.getfixturevalue(f"{which}_checkpoint")
    d = lt.write_mlx_checkpoint(which, tmp_path / which, tokenizer_dir=tokenizer_dir, workers=2)
    read = lambda p, f: json.loads((p / f).read_text())  # noqa: E731
    assert read(d, "config.json") == read(conv, "config.json") == lt.mlx_config(which)
    assert read(d, "model.safetensors.index.json") == read(conv, "model.safetensors.index.json")
    assert _table(d) == _table(conv)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (d / f).read_bytes() == (conv / f).read_bytes(), f
    a, b = open_checkpoint(conv), open_checkpoint(d)
    ratios = []
    for name, t in a.tensors.items():
        if t.dtype == "U32":
            m = name[: -len(".weight")]
            rows = slice(0, 8192)  # of the vocabulary's 248,320 (a sample: the std is all we compare)
            x, y = a.quantized(m).dequantize(rows=rows), b.quantized(m).dequantize(rows=rows)
            if m == "lm_head":  # the padding rows past the tokenizer's ids: 1/100 of the std
                pad = b.quantized(m).dequantize(rows=slice(lt.TOKENIZER_VOCAB_SIZE, None))
                assert 0 < pad.std() < 0.02 * y.std()
            # the std of n samples has a relative standard error of about 1/sqrt(2n)
            assert abs(y.std() / x.std() - 1) < 0.05 + 4 / np.sqrt(2 * y.size), (m, y.std() / x.std())
            ratios.append(y.std() / x.std())
            assert abs(y.mean()) < 4 * y.std() / np.sqrt(y.size), m  # 4 standard errors
        elif not name.endswith((".scales", ".biases")):
            x, y = a.float(name), b.float(name)
            np.testing.assert_allclose(y, x, rtol=2 ** -7, atol=0, err_msg=name)  # one bf16 rounding apart
    assert len(ratios) > 20 and 0.97 < np.median(ratios) < 1.03, ratios


def test_direct_writer_bytes_depend_on_the_seed_only(tokenizer_dir, tmp_path):
    """One process or several, the same bytes; another seed, other codes. Sizes multiple of
    16 come first in a shard and the data starts at a multiple of 64, so such tensors are
    16-byte aligned (all of the full-size model's are: the native devices map it in place)."""
    from lily.checkpoint import open_checkpoint
    one = lt.write_mlx_checkpoint("tiny", tmp_path / "a", tokenizer_dir=tokenizer_dir, workers=1, shard_bytes=8 << 20)
    two = lt.write_mlx_checkpoint("tiny", tmp_path / "b", tokenizer_dir=tokenizer_dir, workers=3, shard_bytes=8 << 20)
    other = lt.write_mlx_checkpoint("tiny", tmp_path / "c", tokenizer_dir=tokenizer_dir, seed=1, workers=2,
                                    shard_bytes=8 << 20)
    files = sorted(p.name for p in one.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for f in files:
        assert (one / f).read_bytes() == (two / f).read_bytes(), f
    ck = open_checkpoint(other)
    assert not np.array_equal(ck.raw("lm_head.weight"), open_checkpoint(one).raw("lm_head.weight"))
    for t in ck.tensors.values():
        assert t.start % 16 == 0 or t.nbytes % 16, t.name


def test_full_preset_layout_is_planned_aligned():
    """The full-size preset is lily.lab.estimate's real config; its planned checkpoint (not written:
    19.5 GB) has MLX-LM's four 5-GiB shards and every tensor 16-byte aligned."""
    import dataclasses

    from lily.checkpoint import parse_config
    from lily.lab.estimate import QWEN36_35B_A3B
    p = PRESETS["full"]
    assert dataclasses.replace(parse_config(p.config()), eos_token_ids=()) == parse_config(QWEN36_35B_A3B)
    _, tensors = lt._mlx_layout(p)
    shards = lt._shard_plan(tensors, lt.MLX_SHARD_BYTES)
    assert len(shards) == 4 and 19.4e9 < sum(t.nbytes for t in tensors) < 19.6e9
    for group in shards:
        _, offsets = lt._safetensors_header(group)
        assert all(o % 16 == 0 for o in offsets.values())
    assert sum(len(g) for g in shards) == len(tensors) == 1757


def test_writer_command_line(tokenizer_dir, tmp_path, capsys):
    assert lt.main(["write", "--preset", "tiny", "--out", str(tmp_path / "t"), "--tokenizer-dir",
                    str(tokenizer_dir), "--workers", "1"]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "t" / "config.json").is_file()
    assert lt.main(["write", "--preset", "tiny", "--out", str(tmp_path / "t"), "--tokenizer-dir",
                    str(tokenizer_dir)]) == 1  # not empty
    assert "exists" in capsys.readouterr().err
    assert lt.main(["write", "--preset", "tiny", "--out", str(tmp_path / "u"), "--tokenizer-dir",
                    str(tokenizer_dir), "--workers", "0"]) == 1
    assert "workers" in capsys.readouterr().err
