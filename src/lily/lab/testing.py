"""Random-weight ``qwen3_5_moe`` checkpoints for tests.

This module writes small checkpoints of the Qwen3.5/3.6-MoE architecture with random but
numerically healthy weights, in the two layouts users meet:

* the **Hugging Face original layout** of ``Qwen3_5MoeForConditionalGeneration``
  (:func:`make_hf_checkpoint`): bf16 safetensors shards + ``model.safetensors.index.json``,
  keys ``model.language_model.*`` / ``lm_head.weight`` / ``mtp.*``, fused experts, RMSNorm
  weights stored as offsets, ``config.json`` with a nested ``text_config``;
* the **MLX 4-bit layout** (:func:`make_mlx_checkpoint`), produced by running the peer's own
  converter on the HF checkpoint in a subprocess::

      python -m mlx_lm convert --hf-path HF --mlx-path OUT -q --q-bits 4 --q-group-size 64

  MLX-LM's ``qwen3_5_moe`` model class carries a ``quant_predicate`` that quantizes every
  ``mlp.gate`` (router) and ``mlp.shared_expert_gate`` to 8 bits (group 64), exactly like
  the published MLX checkpoints; :func:`make_mlx_checkpoint` checks that the converted
  ``config.json`` records those overrides and raises :class:`RuntimeError` otherwise.

:func:`cached_checkpoint` memoises converted checkpoints on disk (safe under concurrent
processes). The tokenizer files (``tokenizer.json`` or ``tokenizer.json.xz``,
``tokenizer_config.json``, ``chat_template.jinja``) are copied from a caller-supplied
``tokenizer_dir``; nothing here hard-codes a repository path.

Weights are drawn from a NumPy generator seeded from ``(seed, tensor name)``, so a tensor's
values do not depend on sharding or on the other tensors. Requires only NumPy for the HF
layout; the MLX layout needs ``mlx-lm`` (and ``mlx``/``mlx-cpu``) in the running interpreter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from lily.checkpoint import MLX_DEFAULT_BITS, MLX_DEFAULT_GROUP_SIZE, ModelConfig, bf16_to_f32, f32_to_bf16

__all__ = [
    "PRESETS",
    "Preset",
    "TensorSpec",
    "hf_tensor_specs",
    "make_hf_checkpoint",
    "make_mlx_checkpoint",
    "write_mlx_checkpoint",
    "mlx_config",
    "cached_checkpoint",
    "amplify_shared_expert",
    "default_cache_dir",
    "copy_tokenizer_files",
    "EOS_TOKEN_IDS",
    "REAL_VOCAB_SIZE",
    "TOKENIZER_VOCAB_SIZE",
]

#: Bump when the weight generator or file layout changes (invalidates cached checkpoints).
FACTORY_VERSION = 2

#: Embedding / lm_head rows of the real model (the tokenizer has fewer ids).
REAL_VOCAB_SIZE = 248320
#: Number of ids of the real tokenizer (248044 BPE ranks + 33 special tokens).
TOKENIZER_VOCAB_SIZE = 248077
#: ``<|im_end|>`` and ``<|endoftext|>``.
EOS_TOKEN_IDS = (248046, 248044)

#: Default MLX quantization of the converted checkpoints (MLX's own default).
Q_BITS, Q_GROUP_SIZE = MLX_DEFAULT_BITS, MLX_DEFAULT_GROUP_SIZE
#: Bits of the router (``mlp.gate``) and ``mlp.shared_expert_gate`` in MLX checkpoints.
ROUTER_BITS = 8

_DEFAULT_SHARD_BYTES = 96 * 1024 * 1024


# --------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------


# A preset chooses ModelConfig's fields (lily.checkpoint, the one list of them) but those the
# factory fixes: layer_types follows full_attention_interval, and the rest are the real
# model's settings that text_config writes. Two fields of config.json that ModelConfig does
# not read are added; the defaults are the real model's.
_FIXED_FIELDS = ("layer_types", "tie_word_embeddings", "norm_topk_prob", "model_type", "eos_token_ids")
_PRESET_DEFAULTS = {"linear_conv_kernel_dim": 4, "vocab_size": REAL_VOCAB_SIZE, "rms_norm_eps": 1e-6,
                    "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                    "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1}
_config_fields = [(f.name, f.type) for f in dataclasses.fields(ModelConfig) if f.name not in _FIXED_FIELDS]
_PresetFields = dataclasses.make_dataclass(
    "_PresetFields",
    [("name", str), *[f for f in _config_fields if f[0] not in _PRESET_DEFAULTS], ("full_attention_interval", int),
     *[(n, t, dataclasses.field(default=_PRESET_DEFAULTS[n])) for n, t in _config_fields if n in _PRESET_DEFAULTS],
     ("mtp_num_hidden_layers", int, dataclasses.field(default=_PRESET_DEFAULTS["mtp_num_hidden_layers"]))],
    frozen=True)


class Preset(_PresetFields):
    """Dimensions of a random test model (field names follow ``text_config``): ``name``,
    :class:`lily.checkpoint.ModelConfig`'s fields but ``layer_types`` (from
    ``full_attention_interval``) and the fixed settings, and ``mtp_num_hidden_layers``.

    Every quantized matmul's input dimension (hidden_size, GDN value_dim, attention
    ``num_attention_heads * head_dim``, ``moe_intermediate_size``,
    ``shared_expert_intermediate_size``) must be a multiple of the quantization group size
    64, otherwise MLX-LM would leave that linear unquantized; :meth:`validate` checks this.
    """

    # -- derived sizes -------------------------------------------------------------
    @property
    def layer_types(self) -> List[str]:
        """``"linear_attention"`` / ``"full_attention"`` per layer (full iff (i+1) % interval == 0)."""
        return [
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        ]

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: q | k | v = 2 * key_dim + value_dim."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mrope_section(self) -> List[int]:
        """Three mRoPE sections summing to rotary_dim / 2 ([11, 11, 10] for head_dim 256)."""
        half = self.rotary_dim // 2
        a = int(round(half * 11 / 32))
        return [a, a, half - 2 * a]

    def validate(self) -> None:
        """Raise :class:`ValueError` if the dimensions are inconsistent."""
        problems = []
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts_per_tok > self.num_experts:
            problems.append("num_experts_per_tok > num_experts")
        for label, dim in (
            ("hidden_size", self.hidden_size),
            ("GDN value dim", self.gdn_value_dim),
            ("attention output dim", self.num_attention_heads * self.head_dim),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("shared_expert_intermediate_size", self.shared_expert_intermediate_size),
        ):
            if dim % Q_GROUP_SIZE:
                problems.append(f"{label} {dim} is not a multiple of {Q_GROUP_SIZE}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            problems.append("bad rotary dim")
        if problems:
            raise ValueError(f"preset {self.name!r}: " + "; ".join(problems))

    # -- configs -------------------------------------------------------------------
    def text_config(self) -> dict:
        """The ``text_config`` dict of ``config.json`` (real-model keys, preset values): every
        field under its own key (``rope_theta`` inside ``rope_parameters``, as the real
        model has it), plus the real model's constant settings."""
        dims = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("name", "rope_theta")}
        return {
            **dims,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_output_gate": True,
            "bos_token_id": None,
            "dtype": "bfloat16",
            "eos_token_id": EOS_TOKEN_IDS[1],
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "layer_types": self.layer_types,
            "mlp_only_layers": [],
            "model_type": "qwen3_5_moe_text",
            "mtp_use_dedicated_embeddings": False,
            "norm_topk_prob": True,
            "output_router_logits": False,
            "pad_token_id": None,
            "rope_parameters": {
                "mrope_interleaved": True,
                "mrope_section": self.mrope_section,
                "partial_rotary_factor": self.partial_rotary_factor,
                "rope_theta": self.rope_theta,
                "rope_type": "default",
            },
            "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": False,
            "use_cache": True,
        }

    def config(self) -> dict:
        """The full HF ``config.json`` dict (``Qwen3_5MoeForConditionalGeneration``).

        ``vision_config`` mirrors the real model's vision tower settings; no vision
        tensors are written (text inference ignores them).
        """
        return {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "image_token_id": 248056,
            "model_type": "qwen3_5_moe",
            "text_config": self.text_config(),
            "tie_word_embeddings": False,
            "transformers_version": "4.57.0.dev0",
            "video_token_id": 248057,
            "vision_config": {
                "deepstack_visual_indexes": [],
                "depth": 27,
                "hidden_act": "gelu_pytorch_tanh",
                "hidden_size": 1152,
                "in_channels": 3,
                "initializer_range": 0.02,
                "intermediate_size": 4304,
                "model_type": "qwen3_5_moe",
                "num_heads": 16,
                "num_position_embeddings": 2304,
                "out_hidden_size": self.hidden_size,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
            "vision_end_token_id": 248054,
            "vision_start_token_id": 248053,
        }

    def content_hash(self) -> str:
        """Hex digest of every field plus :data:`FACTORY_VERSION` (a cache key part)."""
        payload = json.dumps(
            {"fields": dataclasses.asdict(self), "factory_version": FACTORY_VERSION},
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


PRESETS: Dict[str, Preset] = {
    # Fast: small everything, GDN head dims 32, attention head_dim 64.
    "tiny": Preset(
        name="tiny",
        hidden_size=128,
        num_hidden_layers=4,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    ),
    # The real per-head dims (GDN 128/128, attention 256, 8 q heads per kv head, top-8),
    # with few heads, experts and layers.
    "dims": Preset(
        name="dims",
        hidden_size=256,
        num_hidden_layers=4,
        full_attention_interval=4,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=32,
        num_experts_per_tok=8,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
    ),
}


def _full_preset() -> Preset:
    """The real model's dimensions (:data:`lily.lab.estimate.QWEN36_35B_A3B`, the one copy of them)
    as a preset: 40 layers, 256 experts, hidden 2048. Its MLX 4-bit checkpoint is about
    19.5 GB; write it with :func:`write_mlx_checkpoint` (the HF route would first write a
    70 GB bf16 checkpoint)."""
    from lily.checkpoint import parse_config
    from lily.lab.estimate import QWEN36_35B_A3B
    c = parse_config(QWEN36_35B_A3B)
    keep = {f.name for f in dataclasses.fields(Preset)} - {"name", "full_attention_interval", "mtp_num_hidden_layers"}
    p = Preset(name="full", full_attention_interval=4, **{n: getattr(c, n) for n in keep})
    if tuple(p.layer_types) != c.layer_types:
        raise AssertionError("the full preset's layer pattern differs from lily.lab.estimate's config")
    return p


PRESETS["full"] = _full_preset()
for _p in PRESETS.values():
    _p.validate()


def _resolve_preset(preset: Union[str, Preset]) -> Preset:
    if isinstance(preset, Preset):
        preset.validate()
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}") from None


# --------------------------------------------------------------------------------------
# Tensor specs and random initialisation
# --------------------------------------------------------------------------------------

# A generator returns float32 values of the tensor's shape given a numpy Generator.
_Init = Callable[[np.random.Generator, Tuple[int, ...]], np.ndarray]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the HF checkpoint: ``name``, ``shape``, safetensors ``dtype`` ("BF16"/"F32")."""

    name: str
    shape: Tuple[int, ...]
    dtype: str
    init: _Init = dataclasses.field(compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * (2 if self.dtype == "BF16" else 4)


def _normal(std: float) -> _Init:
    def f(rng: np.random.Generator, shape):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    f.std = lambda shape: std  # what the direct MLX writer matches (write_mlx_checkpoint)
    return f


def _fan_in(gain: float = 1.0) -> _Init:
    """std = gain / sqrt(last dim): keeps activations O(1) through a matmul."""

    def f(rng: np.random.Generator, shape):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(f.std(shape))

    f.std = lambda shape: gain / math.sqrt(shape[-1])
    return f


def _ones_plus(std: float) -> _Init:
    def f(rng, shape):
        return 1.0 + rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    return f


def _uniform(lo: float, hi: float, log: bool = False) -> _Init:
    def f(rng, shape):
        u = rng.uniform(lo, hi, size=shape).astype(np.float32)
        return np.log(u) if log else u

    return f


def _lm_head_init(gain: float) -> _Init:
    """fan-in init; the padding rows past the tokenizer's ids get 1/100 of it so their
    logits stay near 0 and never win a greedy pick (those ids cannot be decoded)."""
    base = _fan_in(gain)

    def f(rng, shape):
        w = base(rng, shape)
        if shape[0] > TOKENIZER_VOCAB_SIZE:
            w[TOKENIZER_VOCAB_SIZE:] *= np.float32(_PAD_ROW_SCALE)
        return w

    f.std = base.std
    return f


#: Scale of lm_head's rows past the tokenizer's ids (:func:`_lm_head_init`).
_PAD_ROW_SCALE = 0.01


# Offsets (multiplier 1 + w) of the Gemma-style RMSNorms.
_NORM_OFFSET = _normal(0.1)


def _decoder_layer_specs(p: Preset, prefix: str, full_attention: bool) -> List[TensorSpec]:
    H = p.hidden_size
    s: List[TensorSpec] = []

    def add(name, shape, init, dtype="BF16"):
        s.append(TensorSpec(f"{prefix}.{name}", tuple(int(x) for x in shape), dtype, init))

    add("input_layernorm.weight", (H,), _NORM_OFFSET)
    add("post_attention_layernorm.weight", (H,), _NORM_OFFSET)
    if full_attention:
        nq, nkv, hd = p.num_attention_heads, p.num_key_value_heads, p.head_dim
        add("self_attn.q_proj.weight", (2 * nq * hd, H), _fan_in())  # per head: query | gate
        add("self_attn.k_proj.weight", (nkv * hd, H), _fan_in())
        add("self_attn.v_proj.weight", (nkv * hd, H), _fan_in())
        add("self_attn.o_proj.weight", (H, nq * hd), _fan_in(0.7))
        add("self_attn.q_norm.weight", (hd,), _NORM_OFFSET)
        add("self_attn.k_norm.weight", (hd,), _NORM_OFFSET)
    else:
        hv = p.linear_num_value_heads
        add("linear_attn.in_proj_qkv.weight", (p.conv_dim, H), _fan_in())
        add("linear_attn.in_proj_z.weight", (p.gdn_value_dim, H), _fan_in())
        add("linear_attn.in_proj_b.weight", (hv, H), _fan_in())
        add("linear_attn.in_proj_a.weight", (hv, H), _fan_in(0.5))
        add("linear_attn.conv1d.weight", (p.conv_dim, 1, p.linear_conv_kernel_dim), _normal(0.3))
        # softplus(dt_bias) ~ 0.007..0.13 and A in [1, 16]: decays g from ~0.1 to ~0.99.
        add("linear_attn.dt_bias", (hv,), _uniform(-5.0, -2.0))
        add("linear_attn.A_log", (hv,), _uniform(1.0, 16.0, log=True), dtype="F32")
        add("linear_attn.norm.weight", (p.linear_value_head_dim,), _ones_plus(0.1))
        add("linear_attn.out_proj.weight", (H, p.gdn_value_dim), _fan_in(0.7))
    E, I, Is = p.num_experts, p.moe_intermediate_size, p.shared_expert_intermediate_size
    add("mlp.gate.weight", (E, H), _fan_in(1.5))
    add("mlp.experts.gate_up_proj", (E, 2 * I, H), _fan_in())  # gate rows then up rows
    add("mlp.experts.down_proj", (E, H, I), _fan_in())
    add("mlp.shared_expert.gate_proj.weight", (Is, H), _fan_in())
    add("mlp.shared_expert.up_proj.weight", (Is, H), _fan_in())
    add("mlp.shared_expert.down_proj.weight", (H, Is), _fan_in())
    add("mlp.shared_expert_gate.weight", (1, H), _fan_in())
    return s


def hf_tensor_specs(preset: Union[str, Preset]) -> List[TensorSpec]:
    """Every tensor of the HF-layout checkpoint of ``preset``, in file order.

    Shapes (H = hidden, E = experts, I = moe intermediate, Is = shared intermediate)::

        model.language_model.embed_tokens.weight          [V, H]             BF16
        model.language_model.layers.N.input_layernorm.weight / post_attention_layernorm.weight
                                                          [H]   (offset)     BF16
        ...linear_attn.in_proj_qkv.weight                 [2*Hk*Dk + Hv*Dv, H]
        ...linear_attn.in_proj_z.weight                   [Hv*Dv, H]
        ...linear_attn.in_proj_b.weight / in_proj_a.weight [Hv, H]
        ...linear_attn.conv1d.weight                      [conv_dim, 1, 4]
        ...linear_attn.dt_bias                            [Hv]               BF16
        ...linear_attn.A_log                              [Hv]               F32
        ...linear_attn.norm.weight                        [Dv]  (not offset) BF16
        ...linear_attn.out_proj.weight                    [H, Hv*Dv]
        ...self_attn.q_proj.weight                        [2*nq*hd, H]  (per head query|gate)
        ...self_attn.k_proj.weight / v_proj.weight        [nkv*hd, H]
        ...self_attn.o_proj.weight                        [H, nq*hd]
        ...self_attn.q_norm.weight / k_norm.weight        [hd]  (offset)
        ...mlp.gate.weight                                [E, H]
        ...mlp.experts.gate_up_proj                       [E, 2*I, H]  (gate rows first)
        ...mlp.experts.down_proj                          [E, H, I]
        ...mlp.shared_expert.{gate,up}_proj.weight        [Is, H]
        ...mlp.shared_expert.down_proj.weight             [H, Is]
        ...mlp.shared_expert_gate.weight                  [1, H]
        model.language_model.norm.weight                  [H]   (offset)
        lm_head.weight                                    [V, H]  (rows >= 248077 ~0)
        mtp.*  (multi-token-prediction head, ignored by text inference)

    Raises :class:`ValueError` for an unknown preset name.
    """
    p = _resolve_preset(preset)
    H, V = p.hidden_size, p.vocab_size
    specs: List[TensorSpec] = [
        TensorSpec("model.language_model.embed_tokens.weight", (V, H), "BF16", _normal(1.0))
    ]
    for i, kind in enumerate(p.layer_types):
        specs += _decoder_layer_specs(
            p, f"model.language_model.layers.{i}", kind == "full_attention"
        )
    specs.append(TensorSpec("model.language_model.norm.weight", (H,), "BF16", _NORM_OFFSET))
    specs.append(TensorSpec("lm_head.weight", (V, H), "BF16", _lm_head_init(2.0)))
    for j in range(p.mtp_num_hidden_layers):
        specs += _decoder_layer_specs(p, f"mtp.layers.{j}", True)
    if p.mtp_num_hidden_layers:
        specs += [
            TensorSpec("mtp.fc.weight", (H, 2 * H), "BF16", _fan_in()),
            TensorSpec("mtp.norm.weight", (H,), "BF16", _NORM_OFFSET),
            TensorSpec("mtp.pre_fc_norm_embedding.weight", (H,), "BF16", _NORM_OFFSET),
            TensorSpec("mtp.pre_fc_norm_hidden.weight", (H,), "BF16", _NORM_OFFSET),
        ]
    return specs


def _tensor_values(spec: TensorSpec, seed: int) -> np.ndarray:
    """Deterministic float32 values of ``spec`` from (seed, name)."""
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(spec.name.encode())])
    return np.ascontiguousarray(spec.init(rng, spec.shape), dtype=np.float32)


def _tensor_bytes(spec: TensorSpec, seed: int) -> bytes:
    v = _tensor_values(spec, seed)
    if spec.dtype == "BF16":
        return f32_to_bf16(v).astype("<u2").tobytes()
    return v.astype("<f4").tobytes()


def _write_safetensors(path: Path, specs: List[TensorSpec], seed: int) -> None:
    """Stream ``specs`` into one safetensors file (header first, then data in order)."""
    header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for sp in specs:
        header[sp.name] = {
            "dtype": sp.dtype,
            "shape": list(sp.shape),
            "data_offsets": [offset, offset + sp.nbytes],
        }
        offset += sp.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for sp in specs:
            data = _tensor_bytes(sp, seed)
            assert len(data) == sp.nbytes
            f.write(data)


# --------------------------------------------------------------------------------------
# Tokenizer files
# --------------------------------------------------------------------------------------

_TOKENIZER_FILES = ("tokenizer_config.json", "chat_template.jinja")


def copy_tokenizer_files(tokenizer_dir: Union[str, os.PathLike, None], out_dir: Union[str, os.PathLike]) -> None:
    """Copy ``tokenizer.json`` (or decompress ``tokenizer.json.xz``), ``tokenizer_config.json``
    and ``chat_template.jinja`` from ``tokenizer_dir`` into ``out_dir``.

    Raises :class:`ValueError` if ``tokenizer_dir`` is None and :class:`FileNotFoundError`
    if a file is missing.
    """
    if tokenizer_dir is None:
        raise ValueError(
            "lily.lab.testing needs tokenizer_dir=<folder with tokenizer.json[.xz], "
            "tokenizer_config.json, chat_template.jinja> (e.g. the repository's "
            "tests/data/qwen3.5-moe-tokenizer)"
        )
    src = Path(tokenizer_dir)
    out = Path(out_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"tokenizer_dir {src} is not a directory")
    if (src / "tokenizer.json").is_file():
        shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")
    elif (src / "tokenizer.json.xz").is_file():
        with lzma.open(src / "tokenizer.json.xz", "rb") as fin, open(out / "tokenizer.json", "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
    else:
        raise FileNotFoundError(f"neither tokenizer.json nor tokenizer.json.xz in {src}")
    for name in _TOKENIZER_FILES:
        if not (src / name).is_file():
            raise FileNotFoundError(f"{name} missing from tokenizer_dir {src}")
        shutil.copyfile(src / name, out / name)


def _tokenizer_fingerprint(tokenizer_dir: Union[str, os.PathLike, None]) -> str:
    if tokenizer_dir is None:
        copy_tokenizer_files(None, ".")  # raises the clear error
    src = Path(tokenizer_dir)
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer.json.xz") + _TOKENIZER_FILES:
        f = src / name
        if f.is_file():
            h.update(name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------
# Checkpoint writers
# --------------------------------------------------------------------------------------


#: generation_config.json of the test checkpoints (the real model's sampling defaults).
_GENERATION_CONFIG = {
    "bos_token_id": EOS_TOKEN_IDS[1],
    "do_sample": True,
    "eos_token_id": list(EOS_TOKEN_IDS),
    "pad_token_id": EOS_TOKEN_IDS[1],
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}


def _split_shards(items: list, shard_bytes: int) -> List[list]:
    """``items`` (each with ``nbytes``) in order, a new shard started whenever the next item
    would take the current one past ``shard_bytes`` (an item larger than that alone), as
    MLX-LM's ``make_shards`` does."""
    shards: List[list] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards


def _prepare_empty_dir(out_dir: Path) -> None:
    if out_dir.exists():
        if not out_dir.is_dir() or any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} exists and is not an empty directory")
    else:
        out_dir.mkdir(parents=True)


def make_hf_checkpoint(
    preset: Union[str, Preset],
    out_dir: Union[str, os.PathLike],
    *,
    seed: int = 0,
    tokenizer_dir: Union[str, os.PathLike, None] = None,
    shard_bytes: int = _DEFAULT_SHARD_BYTES,
) -> Path:
    """Write a random-weight HF-layout checkpoint of ``preset`` into ``out_dir``.

    Files: ``model-0000k-of-0000n.safetensors`` (bf16, ``A_log`` fp32; tensors listed by
    :func:`hf_tensor_specs`), ``model.safetensors.index.json``, ``config.json``
    (:meth:`Preset.config`), ``generation_config.json`` (eos ``[248046, 248044]``) and the
    tokenizer files from ``tokenizer_dir``. ``out_dir`` must not exist or be empty.

    Returns ``Path(out_dir)``. Raises :class:`ValueError` (unknown preset, no
    ``tokenizer_dir``), :class:`FileExistsError` (non-empty ``out_dir``) or
    :class:`FileNotFoundError` (tokenizer files missing).
    """
    p = _resolve_preset(preset)
    if tokenizer_dir is None:
        copy_tokenizer_files(None, ".")  # raises the clear error before touching out_dir
    out = Path(out_dir)
    _prepare_empty_dir(out)
    specs = hf_tensor_specs(p)

    shards = _split_shards(specs, shard_bytes)
    n = len(shards)
    weight_map = {}
    for k, group in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        _write_safetensors(out / fname, group, seed)
        for sp in group:
            weight_map[sp.name] = fname
    index = {
        "metadata": {"total_size": sum(sp.nbytes for sp in specs)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(p.config(), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(_GENERATION_CONFIG, indent=2) + "\n")
    copy_tokenizer_files(tokenizer_dir, out)
    return out


def _check_mlx_quantization(out: Path, p: Preset, bits: int = Q_BITS, group_size: int = Q_GROUP_SIZE) -> None:
    cfg = json.loads((out / "config.json").read_text())
    q = cfg.get("quantization")
    if not q or q.get("bits") != bits or q.get("group_size") != group_size:
        raise RuntimeError(f"converted {out} has unexpected quantization {q!r}")
    for i in range(p.num_hidden_layers):
        for m in ("mlp.gate", "mlp.shared_expert_gate"):
            key = f"language_model.model.layers.{i}.{m}"
            ov = q.get(key)
            if not isinstance(ov, dict) or ov.get("bits") != ROUTER_BITS:
                raise RuntimeError(
                    f"converted {out}: {key} is not {ROUTER_BITS}-bit (got {ov!r}); "
                    "the installed mlx_lm no longer applies the qwen3_5 router quant predicate"
                )


def make_mlx_checkpoint(
    preset: Union[str, Preset],
    out_dir: Union[str, os.PathLike],
    *,
    seed: int = 0,
    tokenizer_dir: Union[str, os.PathLike, None] = None,
    hf_dir: Union[str, os.PathLike, None] = None,
    python: Optional[str] = None,
    q_bits: int = Q_BITS,
    q_group_size: int = Q_GROUP_SIZE,
) -> Path:
    """Convert a random HF checkpoint of ``preset`` to MLX 4-bit in ``out_dir`` with MLX-LM.

    If ``hf_dir`` is None the HF checkpoint is written to a temporary directory (then
    deleted); otherwise ``hf_dir`` must already hold one (e.g. from
    :func:`make_hf_checkpoint` with the same preset). Runs, with ``python`` (default
    ``sys.executable``)::

        python -m mlx_lm convert --hf-path HF --mlx-path OUT -q --q-bits 4 --q-group-size 64

    MLX-LM's ``qwen3_5_moe`` quant predicate makes every ``mlp.gate`` and
    ``mlp.shared_expert_gate`` 8-bit (group 64) and records them in ``config.json``'s
    ``quantization``; all other linears, the stacked experts
    (``mlp.switch_mlp.{gate,up,down}_proj``, uint32 ``[E, out, in/8]``), the embedding and
    ``lm_head`` are 4-bit. The original ``tokenizer.json``, ``tokenizer_config.json`` and
    ``chat_template.jinja`` are copied over the converter's re-saved ones, and
    ``generation_config.json`` is kept (MLX-LM also copies its ``eos_token_id`` into
    ``config.json``).

    ``q_bits`` / ``q_group_size`` replace ``--q-bits 4 --q-group-size 64`` (checkpoints the
    native devices must refuse: 8-bit experts, groups of 32).

    Returns ``Path(out_dir)``. Raises :class:`ValueError`/:class:`FileExistsError` as
    :func:`make_hf_checkpoint`, and :class:`RuntimeError` if the converter fails (the
    message holds its output) or the result lacks the 8-bit router overrides;
    :class:`ValueError` if ``hf_dir``'s ``text_config`` is not the preset's.
    """
    p = _resolve_preset(preset)
    if tokenizer_dir is None:
        copy_tokenizer_files(None, ".")
    out = Path(out_dir)
    _prepare_empty_dir(out)
    out.rmdir()  # mlx_lm refuses an existing --mlx-path
    tmp_hf = None
    try:
        if hf_dir is None:
            tmp_hf = Path(tempfile.mkdtemp(prefix="lily-hf-", dir=out.parent))
            hf = make_hf_checkpoint(p, tmp_hf / "hf", seed=seed, tokenizer_dir=tokenizer_dir)
        else:
            hf = Path(hf_dir)
            if not (hf / "config.json").is_file():
                raise FileNotFoundError(f"hf_dir {hf} has no config.json")
            got = json.loads((hf / "config.json").read_text()).get("text_config")
            if got != p.text_config():
                raise ValueError(f"hf_dir {hf} does not hold a checkpoint of preset {p.name!r}")
        cmd = [
            python or sys.executable, "-m", "mlx_lm", "convert",
            "--hf-path", str(hf), "--mlx-path", str(out),
            "-q", "--q-bits", str(q_bits), "--q-group-size", str(q_group_size),
        ]
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            shutil.rmtree(out, ignore_errors=True)
            raise RuntimeError(
                f"mlx_lm convert failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-4000:]}"
            )
        # Keep the tokenizer files byte-identical to the source (the converter re-saves them
        # through transformers, which reorders tokenizer.json and rewrites the config).
        for name in ("tokenizer.json",) + _TOKENIZER_FILES:
            if (hf / name).is_file():
                shutil.copyfile(hf / name, out / name)
        if not (out / "generation_config.json").is_file() and (hf / "generation_config.json").is_file():
            shutil.copyfile(hf / "generation_config.json", out / "generation_config.json")
        _check_mlx_quantization(out, p, q_bits, q_group_size)
    finally:
        if tmp_hf is not None:
            shutil.rmtree(tmp_hf, ignore_errors=True)
    return out


def default_cache_dir() -> Path:
    """Where :func:`cached_checkpoint` keeps converted checkpoints: ``$LILY_TEST_CACHE``,
    else ``~/.cache/lily/test-checkpoints`` (``lily cache list`` shows it)."""
    env = os.environ.get("LILY_TEST_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "lily" / "test-checkpoints"


def _mlx_lm_version() -> str:
    try:
        from importlib.metadata import version

        return version("mlx-lm")
    except Exception:  # pragma: no cover - mlx_lm missing; conversion will fail anyway
        return "unknown"


def cached_checkpoint(
    preset: Union[str, Preset],
    *,
    tokenizer_dir: Union[str, os.PathLike, None] = None,
    cache_dir: Union[str, os.PathLike, None] = None,
    seed: int = 0,
    q_bits: int = Q_BITS,
    q_group_size: int = Q_GROUP_SIZE,
) -> Path:
    """Return the directory of an MLX 4-bit checkpoint of ``preset``, converting it once
    (``q_bits`` / ``q_group_size``: another quantization, as :func:`make_mlx_checkpoint`).

    The cache directory (``cache_dir``, else ``$LILY_TEST_CACHE``, else
    ``~/.cache/lily/test-checkpoints``) holds one subdirectory per
    ``<name>-s<seed>-<hash>``, the hash covering the preset's fields, the factory
    version, the tokenizer files and the mlx-lm version. A checkpoint is built in a
    temporary sibling directory and renamed into place, so concurrent callers never see
    a partial checkpoint; the loser of a race discards its copy. Errors as
    :func:`make_mlx_checkpoint`.
    """
    p = _resolve_preset(preset)
    tok_fp = _tokenizer_fingerprint(tokenizer_dir)
    key = hashlib.sha256(
        f"{p.content_hash()}|{tok_fp}|{_mlx_lm_version()}".encode()
    ).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    quant = "" if (q_bits, q_group_size) == (Q_BITS, Q_GROUP_SIZE) else f"-q{q_bits}g{q_group_size}"
    final = root / f"{p.name}{quant}-s{seed}-{key}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{p.name}-", dir=root))
    try:
        built = make_mlx_checkpoint(p, work / "mlx", seed=seed, tokenizer_dir=tokenizer_dir, q_bits=q_bits,
                                    q_group_size=q_group_size)
        try:
            os.rename(built, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------
# MLX 4-bit checkpoints written directly (no bf16 intermediate, no MLX-LM)
# --------------------------------------------------------------------------------------

#: mlx_lm.utils.MAX_FILE_SIZE_GB: the converter starts a new shard past 5 GiB.
MLX_SHARD_BYTES = 5 << 30
#: Bytes of packed codes one writer job generates (a block of whole rows).
_BLOCK_BYTES = 16 << 20
#: Tensors MLX-LM's sanitize stores as 1 + the HF offset (mlx_lm/models/qwen3_5.py).
_OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")
#: Relative spread of the random scales around the one that gives the HF init's std.
_SCALE_SPREAD = 0.2


def mlx_config(preset: Union[str, Preset]) -> dict:
    """The ``config.json`` that ``mlx_lm convert -q --q-bits 4 --q-group-size 64`` writes for
    a checkpoint of ``preset`` made by :func:`make_hf_checkpoint`: :meth:`Preset.config`
    without ``vision_config``, ``rope_type`` renamed ``type`` (MLX-LM's qwen3_5 args do it
    in place), the generation config's ``eos_token_id`` at the top level, and
    ``quantization`` (= ``quantization_config``): 4 bits, group 64, affine, with an 8-bit
    override for every ``mlp.gate`` and ``mlp.shared_expert_gate``; keys sorted."""
    p = _resolve_preset(preset)
    cfg = p.config()
    cfg.pop("vision_config")
    rope = cfg["text_config"]["rope_parameters"]
    rope["type"] = rope.pop("rope_type")
    cfg["eos_token_id"] = list(EOS_TOKEN_IDS)
    quant: Dict[str, object] = {"group_size": Q_GROUP_SIZE, "bits": Q_BITS, "mode": "affine"}
    for i in range(p.num_hidden_layers):
        for m in ("gate", "shared_expert_gate"):
            quant[f"language_model.model.layers.{i}.mlp.{m}"] = {"group_size": Q_GROUP_SIZE, "bits": ROUTER_BITS}
    cfg["quantization"] = quant
    cfg["quantization_config"] = quant
    return dict(sorted(cfg.items()))


def _module_bits(module: str) -> int:
    return ROUTER_BITS if module.endswith((".mlp.gate", ".shared_expert_gate")) else Q_BITS


@dataclass(frozen=True)
class _Stored:
    """One tensor of the MLX checkpoint: stored ``name``, safetensors ``dtype``, ``shape``."""

    name: str
    dtype: str
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        size = {"U32": 4, "F32": 4, "BF16": 2}[self.dtype]
        return int(np.prod(self.shape, dtype=np.int64)) * size


def _mlx_layout(p: Preset) -> Tuple[List[Tuple[str, str, Tuple[int, ...]]], List[_Stored]]:
    """``(modules, tensors)``: :func:`lily.checkpoint.expected_tensors` of the preset (kind,
    canonical name, logical shape), and every stored tensor in that order (quantized linears
    as ``.weight`` U32, ``.scales`` and ``.biases`` BF16, the ``language_model.`` prefix)."""
    from lily.checkpoint import expected_tensors, parse_config
    modules = list(expected_tensors(parse_config(p.config())))
    tensors: List[_Stored] = []
    for kind, name, shape in modules:
        stored = "language_model." + name
        if kind == "linear":
            *lead, out_f, in_f = shape
            bits = _module_bits(name)
            tensors.append(_Stored(stored + ".weight", "U32", (*lead, out_f, in_f * bits // 32)))
            for part in ("scales", "biases"):
                tensors.append(_Stored(f"{stored}.{part}", "BF16", (*lead, out_f, in_f // Q_GROUP_SIZE)))
        else:
            tensors.append(_Stored(stored, "F32" if kind == "f32" else "BF16", tuple(shape)))
    return modules, tensors


def _hf_name(name: str) -> str:
    """The HF-layout tensor (:func:`hf_tensor_specs`) a canonical MLX name comes from."""
    if name == "lm_head":
        return "lm_head.weight"
    base = "model.language_model." + name[len("model."):]
    if ".switch_mlp." in base:
        return base.replace("switch_mlp.down_proj", "experts.down_proj").replace(
            "switch_mlp.gate_proj", "experts.gate_up_proj").replace("switch_mlp.up_proj", "experts.gate_up_proj")
    return base if base.endswith(("weight", "A_log", "dt_bias")) else base + ".weight"


def _float_tensor(spec: TensorSpec, name: str, seed: int) -> np.ndarray:
    """An unquantized tensor as MLX-LM's sanitize leaves it: the HF values with the norm
    offsets folded (1 + w) and the conv weight's axes moved ([C, 1, K] -> [C, K, 1])."""
    v = _tensor_values(spec, seed)
    if name.endswith(_OFFSET_NORMS):
        v = v + np.float32(1.0)
    if name.endswith("conv1d.weight"):
        v = np.ascontiguousarray(np.moveaxis(v, 2, 1))
    return v


def _shard_plan(tensors: List[_Stored], shard_bytes: int) -> List[List[_Stored]]:
    """MLX-LM's sharding (:func:`_split_shards`), then within each shard the tensors whose
    size is a multiple of 16 bytes first: with the header padded to 64 bytes, every tensor of
    the full-size model then starts 16-byte aligned and the native devices map the files in
    place (lily.weight_cache copies unaligned ones)."""
    return [sorted(s, key=lambda t: t.nbytes % 16 != 0) for s in _split_shards(tensors, shard_bytes)]


def _safetensors_header(tensors: List[_Stored]) -> Tuple[bytes, Dict[str, int]]:
    """The header bytes (length prefix included, JSON padded with spaces so the data starts
    at a multiple of 64) and each tensor's absolute file offset."""
    header: Dict[str, object] = {"__metadata__": {"format": "mlx"}}
    rel, at = {}, 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        rel[t.name] = at
        at += t.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-(8 + len(hb)) % 64)
    start = 8 + len(hb)
    return struct.pack("<Q", len(hb)) + hb, {n: start + o for n, o in rel.items()}


def _generator(seed: int, name: str, block: int) -> np.random.Generator:
    # SFC64: ~10x PCG64's throughput for raw words (measured), and a block's stream is
    # independent of how the blocks are spread over processes
    return np.random.Generator(np.random.SFC64([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode()), block]))


def _quantized_block(job: dict) -> List[Tuple[str, int, bytes]]:
    """Rows ``[r0, r1)`` (over the flattened leading axes) of one quantized linear: uniform
    random codes, and per group of 64 a scale drawn around ``std / code_std`` (+-20%) with
    the bias ``-scale * (2**bits - 1) / 2``, so the dequantized weights have mean ~0 and the
    HF init's std (uniform codes have std ``sqrt((4**bits - 1) / 12)``). Rows from
    ``pad_from`` on get 1/100 of it, as lm_head's padding rows do in the HF init."""
    r0, r1, bits = job["r0"], job["r1"], job["bits"]
    rows = r1 - r0
    words, groups = job["words"], job["groups"]
    rng = _generator(job["seed"], job["module"], job["block"])
    n = rows * words
    codes = rng.bit_generator.random_raw((n + 1) // 2).view(np.uint32)[:n]
    code_std = math.sqrt((4 ** bits - 1) / 12.0)
    u = rng.random((rows, groups), dtype=np.float32)
    scale = np.float32(job["std"] / code_std) * (np.float32(1 - _SCALE_SPREAD) + np.float32(2 * _SCALE_SPREAD) * u)
    if job["pad_from"] < r1:
        scale[max(job["pad_from"] - r0, 0):] *= np.float32(_PAD_ROW_SCALE)
    sbits = f32_to_bf16(scale)
    bias = (sbits.astype(np.uint32) << 16).view(np.float32) * np.float32(-((1 << bits) - 1) / 2)
    return [(job["files"][0], job["offsets"][0] + r0 * words * 4, codes.astype("<u4", copy=False).tobytes()),
            (job["files"][1], job["offsets"][1] + r0 * groups * 2, sbits.astype("<u2").tobytes()),
            (job["files"][2], job["offsets"][2] + r0 * groups * 2, f32_to_bf16(bias).astype("<u2").tobytes())]


_FDS: Dict[str, int] = {}  # a writer process's open shard files


def _run_job(job: dict) -> int:
    if job["kind"] == "quantized":
        parts = _quantized_block(job)
    else:
        v = job["values"]
        data = f32_to_bf16(v).astype("<u2").tobytes() if job["dtype"] == "BF16" else v.astype("<f4").tobytes()
        parts = [(job["file"], job["offset"], data)]
    written = 0
    for path, offset, data in parts:
        fd = _FDS.get(path)
        if fd is None:
            fd = _FDS[path] = os.open(path, os.O_WRONLY)
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset, written = view[n:], offset + n, written + n
    return written


def _writer_jobs(p: Preset, seed: int, modules, where: Dict[str, Tuple[str, int]]) -> List[dict]:
    """One job per float tensor and per block of about :data:`_BLOCK_BYTES` of codes."""
    specs = {s.name: s for s in hf_tensor_specs(p)}
    jobs: List[dict] = []
    for kind, name, shape in modules:
        stored = "language_model." + name
        spec = specs[_hf_name(name)]
        if kind != "linear":
            file, offset = where[stored]
            jobs.append({"kind": "float", "dtype": "F32" if kind == "f32" else "BF16", "file": file,
                         "offset": offset, "values": _float_tensor(spec, name, seed)})
            continue
        *lead, out_f, in_f = shape
        bits = _module_bits(name)
        words, groups = in_f * bits // 32, in_f // Q_GROUP_SIZE
        rows = int(np.prod(lead, dtype=np.int64)) * out_f
        per = max(1, _BLOCK_BYTES // (words * 4))
        parts = [where[f"{stored}.{s}"] for s in ("weight", "scales", "biases")]
        for block, r0 in enumerate(range(0, rows, per)):
            jobs.append({"kind": "quantized", "module": stored, "seed": seed, "block": block, "bits": bits,
                         "r0": r0, "r1": min(rows, r0 + per), "words": words, "groups": groups,
                         "std": spec.init.std(spec.shape),
                         "pad_from": TOKENIZER_VOCAB_SIZE if name == "lm_head" else rows,
                         "files": [f for f, _ in parts], "offsets": [o for _, o in parts]})
    return jobs


def write_mlx_checkpoint(
    preset: Union[str, Preset],
    out_dir: Union[str, os.PathLike],
    *,
    seed: int = 0,
    tokenizer_dir: Union[str, os.PathLike, None] = None,
    workers: Optional[int] = None,
    shard_bytes: int = MLX_SHARD_BYTES,
    progress: Optional[Callable[[int, int], None]] = None,
) -> Path:
    """Write a random-weight MLX 4-bit checkpoint of ``preset`` into ``out_dir`` directly:
    no Hugging Face bf16 intermediate and no MLX-LM, streaming block by block (the full-size
    preset, 19.5 GB, takes minutes and about 100 MB of memory per worker).

    The result has the tensor table (names, shapes, dtypes), ``config.json``
    (:func:`mlx_config`), ``model.safetensors.index.json`` (``total_size``,
    ``total_parameters``, sorted ``weight_map``), shard names and tokenizer files of what
    :func:`make_mlx_checkpoint` gets from the converter for the same preset
    (tests/test_testing_factory.py compares them), but other weights:

    * quantized linears (4 bits, the router and shared-expert gate 8, groups of 64): uniform
      random codes, scales drawn +-20% around the value that gives the dequantized weights
      the HF init's std (:func:`hf_tensor_specs`: fan-in, so activations stay O(1) and
      the logits are not degenerate), biases centring them on 0; lm_head's rows past the
      tokenizer get 1/100 of it, as in the HF init;
    * the unquantized tensors (norms, conv, ``A_log``, ``dt_bias``): the HF checkpoint's
      values of the same seed as MLX-LM stores them (norm offsets folded, conv axes moved).

    Within a shard the tensors whose byte size is a multiple of 16 come first and the data
    starts at a multiple of 64, so the full-size model's tensors are all 16-byte aligned and
    the native devices map the files without lily.weight_cache's aligned copy.

    Parameters
    ----------
    workers : int | None
        Processes generating and writing blocks (default: the CPU count). The bytes do not
        depend on it: every block's random stream is seeded by (seed, tensor, block).
    shard_bytes : int
        Bytes per ``model-0000k-of-0000n.safetensors`` shard (MLX-LM's 5 GiB by default;
        one shard is named ``model.safetensors``).
    progress : callable(done_bytes, total_bytes) | None
        Called after each block.

    Returns ``Path(out_dir)``. Raises :class:`ValueError` (unknown preset, no
    ``tokenizer_dir``, workers < 1), :class:`FileExistsError` (non-empty ``out_dir``),
    :class:`FileNotFoundError` (tokenizer files missing) or :class:`OSError` (disk full: the
    files are sized before any data is written, so a full disk fails early).
    """
    p = _resolve_preset(preset)
    if tokenizer_dir is None:
        copy_tokenizer_files(None, ".")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    out = Path(out_dir)
    _prepare_empty_dir(out)
    modules, tensors = _mlx_layout(p)
    shards = _shard_plan(tensors, shard_bytes)
    n = len(shards)
    where: Dict[str, Tuple[str, int]] = {}
    weight_map: Dict[str, str] = {}
    for k, group in enumerate(shards, start=1):
        fname = "model.safetensors" if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
        header, offsets = _safetensors_header(group)
        path = out / fname
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(t.nbytes for t in group))
        for t in group:
            where[t.name] = (str(path), offsets[t.name])
            weight_map[t.name] = fname
    total = sum(t.nbytes for t in tensors)
    jobs = _writer_jobs(p, seed, modules, where)
    done = 0
    if workers == 1:
        results = map(_run_job, jobs)
        pool = None
    else:
        import multiprocessing
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        pool = ctx.Pool(workers)
        results = pool.imap_unordered(_run_job, jobs, chunksize=1)
    try:
        for nbytes in results:
            done += nbytes
            if progress is not None:
                progress(done, total)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        for fd in _FDS.values():
            os.close(fd)
        _FDS.clear()
    # mlx_lm.utils.get_total_parameters counts leaf modules only: the GDN mixer's own A_log
    # and dt_bias are not counted
    params = sum(int(np.prod(s, dtype=np.int64)) for _, n, s in modules if not n.endswith((".A_log", ".dt_bias")))
    index = {"metadata": {"total_size": total, "total_parameters": params},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    (out / "config.json").write_text(json.dumps(mlx_config(p), indent=4))
    (out / "generation_config.json").write_text(json.dumps(_GENERATION_CONFIG, indent=2) + "\n")
    copy_tokenizer_files(tokenizer_dir, out)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m lily.lab.testing write --preset full --out DIR --tokenizer-dir TOK``: write a
    random-weight MLX 4-bit checkpoint directly (:func:`write_mlx_checkpoint`)."""
    import argparse
    import time
    ap = argparse.ArgumentParser(prog="python -m lily.lab.testing",
                                 description="Random-weight qwen3_5_moe test checkpoints.")
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write an MLX 4-bit checkpoint directly (no bf16 intermediate, no MLX-LM)")
    w.add_argument("--preset", default="full", choices=sorted(PRESETS),
                   help="dimensions (default: full, the real model's: about 19.5 GB)")
    w.add_argument("--out", required=True, help="directory to create (must not exist or be empty)")
    w.add_argument("--tokenizer-dir", required=True,
                   help="folder with tokenizer.json[.xz], tokenizer_config.json, chat_template.jinja "
                        "(the repository's tests/data/qwen3.5-moe-tokenizer)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--workers", type=int, default=None, help="processes (default: the CPU count)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    last = [0.0]

    def show(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] > 5 or done == total:
            last[0] = now
            print(f"  {done / 2**30:6.2f} / {total / 2**30:.2f} GiB", file=sys.stderr, flush=True)

    try:
        out = write_mlx_checkpoint(args.preset, args.out, seed=args.seed, tokenizer_dir=args.tokenizer_dir,
                                   workers=args.workers, progress=show)
    except (ValueError, OSError) as e:
        print(f"python -m lily.lab.testing write: {e}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({args.preset}, {size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def amplify_shared_expert(
    model_dir: Union[str, os.PathLike],
    out_dir: Union[str, os.PathLike],
    *,
    log2_factor: int,
    group: int = 0,
) -> Path:
    """Copy the MLX checkpoint ``model_dir`` to ``out_dir`` with every layer's shared expert
    made to feed its down projection values far beyond the half range (+-65504), the
    documented overflow of Qwen-family FFN down-projection inputs (llama.cpp issue 26044).

    With ``s = 2**log2_factor``, the ``gate_proj`` and ``up_proj`` rows of the channels
    ``[64 group, 64 group + 64)`` are multiplied by ``s`` and ``down_proj``'s weights on
    those input channels (one quantization group per row) by ``s**-2``: the down
    projection's input ``silu(g) * u`` on those channels grows about ``s**2``-fold where
    ``g > 0`` while the layer's output changes only through silu's curvature
    (``silu(s g) s u / s**2 -> max(g, 0) u``). The factors act on the affine quantization's
    bf16 scales and biases, which a power of two multiplies exactly (the codes are
    unchanged), so reference and native engines read the same weights.

    Returns ``Path(out_dir)``. Raises :class:`ValueError` if ``group`` is past the shared
    expert's channels or a scaled value leaves the bf16 range, :class:`FileExistsError` for
    an existing ``out_dir``.
    """
    from lily.checkpoint import open_checkpoint

    out = Path(out_dir)
    shutil.copytree(model_dir, out)  # raises FileExistsError
    ckpt = open_checkpoint(out)
    cfg = ckpt.config
    channels = cfg.shared_expert_intermediate_size
    if not 0 <= group < channels // Q_GROUP_SIZE:
        raise ValueError(f"group {group}: the shared expert has {channels // Q_GROUP_SIZE} groups of {Q_GROUP_SIZE} channels")
    rows = slice(group * Q_GROUP_SIZE, (group + 1) * Q_GROUP_SIZE)
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp.shared_expert"
        for proj, index, exponent in (("gate_proj", (rows, slice(None)), log2_factor),
                                      ("up_proj", (rows, slice(None)), log2_factor),
                                      ("down_proj", (slice(None), slice(group, group + 1)), -2 * log2_factor)):
            for part in ("scales", "biases"):
                t = ckpt.tensors[f"{prefix}.{proj}.{part}"]
                if t.dtype != "BF16":
                    raise ValueError(f"{prefix}.{proj}.{part}: {t.dtype}, expected BF16")
                count = int(np.prod(t.shape))
                with open(t.file, "r+b") as f:
                    f.seek(t.start)
                    v = bf16_to_f32(np.frombuffer(f.read(2 * count), np.uint16)).reshape(t.shape).copy()
                    before = v[index].copy()
                    v[index] = bf16_to_f32(f32_to_bf16(np.ldexp(before, exponent)))
                    if not np.array_equal(np.ldexp(v[index], -exponent), before):  # inf, or below bf16's range
                        raise ValueError(f"{prefix}.{proj}.{part}: 2**{exponent} leaves the bf16 range")
                    f.seek(t.start)
                    f.write(f32_to_bf16(v).tobytes())
    return out
