"""Checkpoint loading: ``config.json`` parsing and validation, safetensors discovery, and the
MLX affine-quantized layout of ``qwen3_5_moe`` (docs/model.md), memory-mapped.

Layouts
-------
* **MLX** (what ``mlx_lm convert -q`` writes): keys ``language_model.model.layers.N.*`` (or
  without the ``language_model.`` prefix), quantized linears as ``X.weight`` uint32
  ``[out, in*bits/32]`` plus ``X.scales`` / ``X.biases`` bf16 ``[out, in/group]``.
  This is the only layout Lily runs.
* **Hugging Face original (bf16)**: detected (``model.language_model.*`` keys, fused
  ``mlp.experts.gate_up_proj``) and refused with a :class:`CheckpointError` that gives the
  conversion command. Lily's kernels are built for the 4-bit format; converting with the
  peer's converter keeps both engines on identical bytes.

Tensors are read through ``numpy.memmap``: nothing is copied into RAM until a consumer
dequantizes it. Floating tensors (bf16 scales and biases, norm and conv weights, ``A_log``,
``dt_bias``) are scanned for NaN and Inf by :func:`check_finite` wherever a loader reads
them (docs/usage.md, "Corrupt weights: NaN and Inf"). The safetensors header is parsed here rather than through
``safetensors.safe_open`` because its numpy front end cannot represent bf16.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np

from lily.errors import CheckpointError, ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")

# Keys of text_config that Lily reads, plus keys known to be irrelevant to text inference.
_READ_KEYS = {
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "rms_norm_eps", "full_attention_interval", "layer_types", "max_position_embeddings",
    "attn_output_gate", "tie_word_embeddings", "rope_parameters", "rope_theta",
    "partial_rotary_factor", "rope_scaling", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "attention_bias", "eos_token_id", "bos_token_id", "pad_token_id",
}
_TOP_KEYS = {"model_type", "text_config", "architectures", "transformers_version",
             "tie_word_embeddings", "quantization", "quantization_config"}
_IGNORED_KEYS = {
    "router_aux_loss_coef", "output_router_logits", "hidden_act", "initializer_range",
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "attention_dropout", "dtype",
    "torch_dtype", "use_cache", "architectures", "transformers_version", "intermediate_size",
    "_name_or_path", "layer_norm_epsilon", "output_attentions", "output_hidden_states",
    "return_dict", "use_sliding_window", "sliding_window", "max_window_layers",
    "chunk_size_feed_forward", "is_encoder_decoder", "tie_encoder_decoder", "id2label",
    "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params",
    "torchscript", "pruned_heads", "add_cross_attention", "cross_attention_hidden_size",
    "is_decoder", "finetuning_task", "num_labels", "sep_token_id", "decoder_start_token_id",
}


# --------------------------------------------------------------------------- config


def gdn_state_floats(Hv: int, Dv: int, Dk: int) -> int:
    """float32 values of a native device's Gated DeltaNet recurrent state per layer: S' [Hv,
    Dv, Dk] and then the pending decay c [Hv, Dv] (S = c S' per row; docs/prefill.md, "Lazy
    decay"; csrc/runtime ``ModelDims::gdn_state_floats``)."""
    return Hv * Dv * (Dk + 1)


@dataclass(frozen=True)
class ModelConfig:
    """Text-model hyperparameters of a ``qwen3_5_moe`` checkpoint (docs/model.md, "Config").

    All sizes are element counts. ``layer_types[i]`` is ``"linear_attention"`` (Gated
    DeltaNet) or ``"full_attention"``.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    max_position_embeddings: int
    rope_theta: float
    partial_rotary_factor: float
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = True
    model_type: str = "qwen3_5_moe"
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dimensions that get RoPE (64 for the real model)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_state_floats(self) -> int:
        """float32 values of one Gated DeltaNet layer's recurrent state on a native device
        (:func:`gdn_state_floats`)."""
        return gdn_state_floats(self.linear_num_value_heads, self.linear_value_head_dim, self.linear_key_head_dim)

    @property
    def conv_dim(self) -> int:
        """Gated DeltaNet conv channels: q | k | v = 2*Hk*Dk + Hv*Dv."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")


def _require(d: Mapping, key: str, where: str):
    if key not in d:
        raise ConfigError(f"{where}: missing required key {key!r}")
    return d[key]


def token_ids(value, what: str, vocab_size: int | None = None) -> tuple[int, ...]:
    """A token id or list of ids from a config file (``None``: none). Raises
    :class:`ConfigError` naming ``what`` for anything else or an id outside the vocabulary."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ConfigError(f"{what} must be a token id or a list of token ids, got {value!r}")
        if vocab_size is not None and i >= vocab_size:
            raise ConfigError(f"{what}: token id {i} is outside the vocabulary [0, {vocab_size})")
    return tuple(ids)


def parse_config(raw: Mapping, *, where: str = "config.json", strict: bool = False) -> ModelConfig:
    """Build a :class:`ModelConfig` from a parsed ``config.json``.

    Accepts the nested form (``text_config``) and a flat text config. The hybrid layout
    comes from ``layer_types`` or, if absent, ``full_attention_interval`` (layer i is full
    attention iff ``(i + 1) % interval == 0``, as in MLX-LM).

    Raises
    ------
    ConfigError
        Unknown ``model_type``, a missing key, inconsistent sizes, or a feature Lily does
        not implement (named in the message). With ``strict=True`` unknown keys are errors
        too; otherwise they produce a warning.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    top_type = raw.get("model_type")
    text = raw.get("text_config", raw)
    if not isinstance(text, Mapping):
        raise ConfigError(f"{where}: 'text_config' must be an object")
    mtype = text.get("model_type", top_type)
    if mtype not in SUPPORTED_MODEL_TYPES or (top_type is not None and top_type not in SUPPORTED_MODEL_TYPES):
        raise ConfigError(
            f"{where}: unsupported architecture model_type="
            f"{top_type if top_type not in SUPPORTED_MODEL_TYPES + (None,) else mtype!r}; "
            f"Lily runs {', '.join(SUPPORTED_MODEL_TYPES)} (Qwen3.5/3.6-35B-A3B) only")

    unknown = sorted(k for k in text if k not in _READ_KEYS and k not in _IGNORED_KEYS
                     and not k.endswith("_config") and k not in ("quantization", "quantization_config"))
    if text is not raw:  # the wrapper of a nested config: the multimodal model's own keys
        unknown += sorted(f"(top level) {k}" for k in raw if k not in _TOP_KEYS and k not in _IGNORED_KEYS
                          and not k.endswith(("_config", "_token_id")))
    if unknown:
        msg = f"{where}: unknown config keys {unknown}"
        if strict:
            raise ConfigError(msg)
        warnings.warn(msg + " (ignored)", stacklevel=3)

    def get(key, default=None):
        if key in text and text[key] is not None:
            return text[key]
        if default is None:
            return _require(text, key, where)
        return default

    def integer(key, default=None):
        v = get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{where}: {key} must be an integer, got {v!r}")
        return v

    def number(key, default=None):
        v = get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{where}: {key} must be a number, got {v!r}")
        return float(v)

    n_layers = integer("num_hidden_layers")
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = integer("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(n_layers)]
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers:
        raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries but "
                          f"num_hidden_layers is {n_layers}")
    bad = sorted(set(layer_types) - {"full_attention", "linear_attention"})
    if bad:
        raise ConfigError(f"{where}: unknown layer_types {bad}")

    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    prf = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    rope_type = rope.get("type", rope.get("rope_type", "default"))
    if rope_type not in ("default", "mrope", None):
        raise ConfigError(f"{where}: rope type {rope_type!r} is not supported (only 'default')")

    for key, ok in (("attention_bias", False), ("tie_word_embeddings", False)):
        if bool(text.get(key, raw.get(key, ok))) != ok:
            raise ConfigError(f"{where}: {key}={not ok} is not supported by Lily")
    if int(text.get("decoder_sparse_step", 1)) != 1 or text.get("mlp_only_layers"):
        raise ConfigError(f"{where}: dense MLP layers (decoder_sparse_step/mlp_only_layers) "
                          "are not supported; every layer must be MoE")
    if text.get("attn_output_gate", True) is not True:
        raise ConfigError(f"{where}: attn_output_gate=false is not supported")

    vocab_size = integer("vocab_size")
    eos_ids = token_ids(text.get("eos_token_id", raw.get("eos_token_id")), f"{where}: eos_token_id", vocab_size)

    n_heads = integer("num_attention_heads")
    hidden = integer("hidden_size")
    cfg = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=integer("num_key_value_heads"),
        head_dim=integer("head_dim", hidden // n_heads),
        linear_num_key_heads=integer("linear_num_key_heads"),
        linear_num_value_heads=integer("linear_num_value_heads"),
        linear_key_head_dim=integer("linear_key_head_dim"),
        linear_value_head_dim=integer("linear_value_head_dim"),
        linear_conv_kernel_dim=integer("linear_conv_kernel_dim", 4),
        num_experts=integer("num_experts"),
        num_experts_per_tok=integer("num_experts_per_tok"),
        moe_intermediate_size=integer("moe_intermediate_size"),
        shared_expert_intermediate_size=integer("shared_expert_intermediate_size"),
        rms_norm_eps=number("rms_norm_eps", 1e-6),
        layer_types=layer_types,
        max_position_embeddings=integer("max_position_embeddings", 262144),
        rope_theta=rope_theta,
        partial_rotary_factor=prf,
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        model_type=str(mtype or top_type),
        eos_token_ids=eos_ids,
    )
    _check_consistency(cfg, where)
    return cfg


def _check_consistency(c: ModelConfig, where: str) -> None:
    checks = [
        (c.num_attention_heads % c.num_key_value_heads == 0,
         f"num_attention_heads={c.num_attention_heads} is not a multiple of "
         f"num_key_value_heads={c.num_key_value_heads}"),
        (c.linear_num_value_heads % c.linear_num_key_heads == 0,
         f"linear_num_value_heads={c.linear_num_value_heads} is not a multiple of "
         f"linear_num_key_heads={c.linear_num_key_heads}"),
        (0 < c.num_experts_per_tok <= c.num_experts,
         f"num_experts_per_tok={c.num_experts_per_tok} must be in 1..num_experts={c.num_experts}"),
        (c.rotary_dim % 2 == 0 and 0 < c.rotary_dim <= c.head_dim,
         f"partial_rotary_factor={c.partial_rotary_factor} gives an invalid rotary dim "
         f"{c.rotary_dim} for head_dim={c.head_dim}"),
        (c.linear_conv_kernel_dim >= 1, "linear_conv_kernel_dim must be >= 1"),
        (all(v > 0 for v in (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.head_dim,
                             c.moe_intermediate_size, c.shared_expert_intermediate_size)),
         "sizes must be positive"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(f"{where}: {msg}")


def load_config(model_dir: str | Path, *, strict: bool = False) -> tuple[ModelConfig, dict]:
    """Read ``<model_dir>/config.json``; returns ``(ModelConfig, raw dict)``.

    Raises :class:`ConfigError` if the file is missing, not JSON, or not a supported model.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found (is {model_dir} a model directory?)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: unreadable JSON ({e})") from None
    return parse_config(raw, where=str(path), strict=strict), raw


# --------------------------------------------------------------------------- quantization


#: MLX's default affine quantization (``mlx.nn.quantize``): what a config's ``quantization``
#: block means when it leaves ``bits`` or ``group_size`` out.
MLX_DEFAULT_BITS = 4
MLX_DEFAULT_GROUP_SIZE = 64


@dataclass(frozen=True)
class QuantSpec:
    """Affine quantization of one linear module: ``w = scale * q + bias`` per group."""

    bits: int
    group_size: int


def quantization_for(raw_config: Mapping, module_path: str, *, where: str = "config.json") -> QuantSpec | None:
    """The :class:`QuantSpec` MLX used for ``module_path`` (e.g.
    ``language_model.model.layers.0.mlp.gate``), honouring per-module overrides; ``None``
    when the checkpoint is not quantized or the module was left unquantized."""
    q = raw_config.get("quantization", raw_config.get("quantization_config"))
    if not q:
        return None
    override = q.get(module_path)
    if override is None and module_path.startswith("language_model."):
        override = q.get(module_path[len("language_model."):])
    if override is False:
        return None
    src = override if isinstance(override, Mapping) else q
    mode = src.get("mode", q.get("mode", "affine"))
    if mode != "affine":
        raise ConfigError(f"{where}: quantization mode {mode!r} for {module_path} is not "
                          "supported (only MLX 'affine')")
    bits = int(src.get("bits", q.get("bits", MLX_DEFAULT_BITS)))
    group = int(src.get("group_size", q.get("group_size", MLX_DEFAULT_GROUP_SIZE)))
    if bits not in (4, 8):
        raise ConfigError(f"{where}: {bits}-bit quantization of {module_path} is not "
                          "supported (4 and 8 bits are)")
    return QuantSpec(bits=bits, group_size=group)


# --------------------------------------------------------------------------- safetensors

_ST_DTYPES = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "F64": np.dtype("<f8"), "I64": np.dtype("<i8"), "U16": np.dtype("<u2"), "I16": np.dtype("<i2"),
    "BOOL": np.dtype("?"),
}


@dataclass
class TensorInfo:
    """Where one tensor lives: file, safetensors dtype string, shape, byte range."""

    name: str  # as stored in the file (the checkpoint's own prefix, e.g. ``language_model.``, kept)
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def where(self) -> str:
        """The file's absolute path (symlinks kept), as error messages name it."""
        return os.path.abspath(self.file)


# A float is NaN or Inf iff its exponent bits are all ones (IEEE 754; bf16 is the top half
# of a float32): its bit pattern with the sign cleared is >= that of +Inf.
_NON_FINITE = {  # safetensors dtype -> (unsigned view, sign-clearing mask, bits of +Inf)
    "BF16": (np.dtype("<u2"), 0x7FFF, 0x7F80),
    "F16": (np.dtype("<u2"), 0x7FFF, 0x7C00),
    "F32": (np.dtype("<u4"), 0x7FFF_FFFF, 0x7F80_0000),
    "F64": (np.dtype("<u8"), 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
}
_SCAN_CHUNK = 1 << 18  # elements per vectorised pass: the temporaries stay in the CPU cache


def check_finite(name: str, dtype: str, data, shape: tuple[int, ...], *, byte_offset: int = 0,
                 where: str = "") -> None:
    """Refuse a NaN or Inf in (part of) a stored floating tensor.

    Parameters
    ----------
    name, dtype, shape
        The tensor's name, safetensors dtype (``"BF16"``, ``"F16"``, ``"F32"``, ``"F64"``;
        any other dtype, e.g. the ``U32`` packed codes, cannot be non-finite and returns at
        once) and full shape (for the index in the message).
    data : bytes-like or numpy array
        The stored little-endian bytes of the tensor, or of the contiguous part of it that
        starts ``byte_offset`` bytes into the tensor (a multiple of the element size).
    where : str
        Prefix of the message (e.g. the file's path).

    Works on the bit patterns in chunks of 2**18 elements (no float conversion), which
    keeps the temporaries in the CPU cache: measured ~10 GB/s, less than a memory copy of
    ``data`` (docs/usage.md, "Corrupt weights: NaN and Inf").

    Raises
    ------
    CheckpointError
        Naming the tensor, NaN or Inf, and the index (in ``shape``) of the first one.
    """
    spec = _NON_FINITE.get(dtype)
    if spec is None:
        return
    udt, mask, inf = spec
    a = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    words = a.reshape(-1).view(np.uint8).view(udt)
    scratch = np.empty(min(_SCAN_CHUNK, words.size), dtype=udt)
    for i in range(0, words.size, _SCAN_CHUNK):
        chunk = words[i:i + _SCAN_CHUNK]
        m = np.bitwise_and(chunk, udt.type(mask), out=scratch[:chunk.size])
        if m.max() < inf:
            continue
        j = int(np.flatnonzero(m >= inf)[0])
        what = "NaN" if int(m[j]) > inf else "Inf"
        flat = byte_offset // udt.itemsize + i + j
        index = [int(k) for k in np.unravel_index(flat, shape)] if shape else []
        raise CheckpointError(f"{where}tensor {name} ({dtype} {_shape_str(shape)}) holds {what} at index "
                              f"{index}: the checkpoint is corrupt (a damaged download or a bad "
                              "conversion); download or convert it again")


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header and check every tensor's byte range.

    Raises :class:`CheckpointError` naming the file (and tensor) when the header is
    corrupt or the file is shorter than its header claims (a truncated download).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise CheckpointError(f"{path}: corrupt safetensors header (length {n}, file {size} bytes)")
            header = json.loads(f.read(n))
    except CheckpointError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b0, b1) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}") from None
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        expect = math.prod(shape) * _ST_DTYPES[dtype].itemsize
        if b1 - b0 != expect or b0 < 0:
            raise CheckpointError(f"{path}: tensor {name!r} byte range {b0}..{b1} does not match "
                                  f"dtype {dtype} shape {list(shape)}")
        if base + b1 > size:
            raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {base + b1} "
                                  f"but the file has {size} bytes")
        out[name] = TensorInfo(name, path, dtype, shape, base + b0, b1 - b0)
    return out


def discover_weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors shards: from ``model.safetensors.index.json`` when
    present, otherwise ``model*.safetensors``. Raises :class:`CheckpointError` if none
    or if the index names a missing shard."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: names shard {f.name}, which does not exist")
        return files
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no model*.safetensors weight files found")
    return files


# --------------------------------------------------------------------------- the weights table


def bf16_to_f32(a: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(a) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounded to nearest even; a NaN stays a (quiet)
    NaN. The inverse of :func:`bf16_to_f32` on bf16 values."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(a, dtype=np.float32))
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), bits)


@dataclass
class QuantizedTensor:
    """An MLX affine-quantized weight ``[..., out, in]`` kept in packed form (memory-mapped).

    ``weight`` uint32 ``[..., out, in*bits/32]`` (codes low bits first), ``scales`` and
    ``biases`` bf16 bit patterns (uint16) ``[..., out, in/group_size]``.
    """

    name: str
    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (dequantized) shape ``[..., out, in]``."""
        *lead, packed = self.weight.shape
        return (*lead, packed * 32 // self.bits)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes

    def dequantize(self, index=None, rows: slice | None = None) -> np.ndarray:
        """float32 weights ``[..., out, in]``: ``scale * code + bias`` per group (a product
        then a sum, each rounded to float32). ``index`` selects along the leading (expert)
        axis first and ``rows`` (a slice) along the output axis, so only the selected part
        is read and unpacked: a consumer can go through a large weight block by block."""
        w, s, b = self.weight, self.scales, self.biases
        if index is not None:
            w, s, b = w[index], s[index], b[index]
        if rows is not None:
            w, s, b = w[..., rows, :], s[..., rows, :], b[..., rows, :]
        q = unpack_codes(w, self.bits)
        groups = q.reshape(*q.shape[:-1], -1, self.group_size)
        groups *= bf16_to_f32(s)[..., None]
        groups += bf16_to_f32(b)[..., None]
        return q


def _code_table(bits: int) -> np.ndarray:
    """The codes of every byte value as float32, lowest bits first: ``[256]`` float32 for
    8 bits; for 4 bits the two codes of a byte as one uint64 (two float32 side by side)."""
    if bits == 8:
        return np.arange(256, dtype=np.float32)
    v = np.arange(256)
    pairs = np.stack([v & 15, v >> 4], axis=1).astype(np.float32)  # [256, 2]
    return pairs.view(np.uint64).reshape(256)


_CODE_TABLES = {bits: _code_table(bits) for bits in (4, 8)}


def unpack_codes(words, bits: int) -> np.ndarray:
    """MLX packed codes (uint32 words ``[..., n]``, lowest bits first) as float32
    ``[..., n * 32 // bits]``. 4 and 8 bits look each byte up in a table (one pass, about
    5x faster than shifting and masking, the same values); other widths shift and mask."""
    w = np.ascontiguousarray(words, dtype=np.uint32)
    n = w.shape[-1] * 32 // bits
    if bits in _CODE_TABLES and sys.byteorder == "little":
        q = np.take(_CODE_TABLES[bits], w.view(np.uint8).reshape(-1))
        return q.view(np.float32).reshape(*w.shape[:-1], n)
    shifts = np.arange(32 // bits, dtype=np.uint32) * bits
    q = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return q.reshape(*w.shape[:-1], n).astype(np.float32)


class Checkpoint:
    """A validated, memory-mapped MLX checkpoint directory.

    Attributes
    ----------
    path : Path
    config : ModelConfig
    raw_config : dict
        The parsed ``config.json``.
    tensors : dict[str, TensorInfo]
        Every tensor of the text model by its canonical name (``model.layers.N...``,
        ``lm_head``; the ``language_model.`` prefix removed).
    """

    def __init__(self, path: Path, config: ModelConfig, raw_config: dict,
                 tensors: dict[str, TensorInfo]):
        self.path = path
        self.config = config
        self.raw_config = raw_config
        self.tensors = tensors
        self._maps: dict[Path, np.memmap] = {}
        self._finite: set[str] = set()  # tensors check_floats has scanned

    # ---- access

    def _map(self, f: Path) -> np.memmap:
        m = self._maps.get(f)
        if m is None:
            m = self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
        return m

    def raw(self, name: str) -> np.ndarray:
        """The stored array for ``name`` (bf16 as uint16 bit patterns), memory-mapped."""
        t = self.tensors[name]
        buf = self._map(t.file)[t.start:t.start + t.nbytes]
        return buf.view(_ST_DTYPES[t.dtype]).reshape(t.shape)

    def float(self, name: str) -> np.ndarray:
        """``name`` as float32 (bf16 converted exactly)."""
        t = self.tensors[name]
        a = self.raw(name)
        return bf16_to_f32(a) if t.dtype == "BF16" else np.asarray(a, dtype=np.float32)

    def check_finite(self, name: str, data, byte_offset: int = 0) -> None:
        """:func:`check_finite` on ``data``, a part of tensor ``name``'s (canonical name)
        stored bytes that starts ``byte_offset`` bytes into it (the weight cache passes the
        blocks it copies). Raises :class:`CheckpointError` naming the file by its path, the
        tensor as the file stores it (e.g. ``language_model.model.layers.1...``: what
        ``safetensors`` tools show) and the first bad index."""
        t = self.tensors[name]
        check_finite(t.name, t.dtype, data, t.shape, byte_offset=byte_offset, where=f"{t.where}: ")

    def check_floats(self, names: Iterable[str] | None = None) -> None:
        """Scan the floating tensors among ``names`` (default: all) for NaN and Inf, reading
        them through the memory map; each tensor is scanned once per :class:`Checkpoint`.
        Raises :class:`CheckpointError` as :meth:`check_finite` does."""
        for name in self.tensors if names is None else names:
            if name not in self._finite:
                if self.tensors[name].dtype in _NON_FINITE:
                    self.check_finite(name, self.raw(name))
                self._finite.add(name)

    def quantized(self, module: str) -> QuantizedTensor:
        """The packed quantized weight of linear ``module`` (e.g. ``model.layers.0.mlp.gate``)."""
        spec = self.quant_spec(module)
        return QuantizedTensor(module, self.raw(module + ".weight"), self.raw(module + ".scales"),
                               self.raw(module + ".biases"), spec.bits, spec.group_size)

    def quant_spec(self, module: str) -> QuantSpec:
        spec = quantization_for(self.raw_config, "language_model." + module)
        if spec is None:
            raise CheckpointError(f"{self.path}: module {module} is not quantized; Lily needs "
                                  "an MLX affine-quantized checkpoint")
        return spec

    @property
    def nbytes(self) -> int:
        """Total bytes of the text model's tensors (the resident weight footprint)."""
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def dequantized_nbytes(self) -> int:
        """Bytes of every quantized linear as float32 (what a full dequantized copy takes:
        0.6 GB for the ``dims`` test preset, 140 GB for the real model)."""
        total = 0
        for name, t in self.tensors.items():
            if name.endswith(".weight") and t.dtype == "U32":
                total += 4 * math.prod(t.shape) * 32 // self.quant_spec(name[:-len(".weight")]).bits
        return total

    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})


# --------------------------------------------------------------------------- expected tensors


def expected_tensors(cfg: ModelConfig) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """Every text-model tensor an MLX checkpoint must hold, as ``(kind, name, shape)``.

    ``kind`` is ``"linear"`` for a quantized linear module (``shape`` is its logical
    ``[..., out, in]``), ``"bf16"`` or ``"f32"`` for a plain tensor.
    """
    H = cfg.hidden_size
    yield "linear", "model.embed_tokens", (cfg.vocab_size, H)
    yield "bf16", "model.norm.weight", (H,)
    yield "linear", "lm_head", (cfg.vocab_size, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        yield "bf16", f"{p}.input_layernorm.weight", (H,)
        yield "bf16", f"{p}.post_attention_layernorm.weight", (H,)
        if cfg.is_full_attention(i):
            D, Hq, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
            a = f"{p}.self_attn"
            yield "linear", f"{a}.q_proj", (Hq * D * 2, H)
            yield "linear", f"{a}.k_proj", (Hkv * D, H)
            yield "linear", f"{a}.v_proj", (Hkv * D, H)
            yield "linear", f"{a}.o_proj", (H, Hq * D)
            yield "bf16", f"{a}.q_norm.weight", (D,)
            yield "bf16", f"{a}.k_norm.weight", (D,)
        else:
            g = f"{p}.linear_attn"
            Hv, Dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
            yield "linear", f"{g}.in_proj_qkv", (cfg.conv_dim, H)
            yield "linear", f"{g}.in_proj_z", (Hv * Dv, H)
            yield "linear", f"{g}.in_proj_b", (Hv, H)
            yield "linear", f"{g}.in_proj_a", (Hv, H)
            yield "bf16", f"{g}.conv1d.weight", (cfg.conv_dim, cfg.linear_conv_kernel_dim, 1)
            yield "bf16", f"{g}.dt_bias", (Hv,)
            yield "f32", f"{g}.A_log", (Hv,)
            yield "bf16", f"{g}.norm.weight", (Dv,)
            yield "linear", f"{g}.out_proj", (H, Hv * Dv)
        m = f"{p}.mlp"
        E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        yield "linear", f"{m}.gate", (E, H)
        yield "linear", f"{m}.switch_mlp.gate_proj", (E, I, H)
        yield "linear", f"{m}.switch_mlp.up_proj", (E, I, H)
        yield "linear", f"{m}.switch_mlp.down_proj", (E, H, I)
        yield "linear", f"{m}.shared_expert.gate_proj", (Is, H)
        yield "linear", f"{m}.shared_expert.up_proj", (Is, H)
        yield "linear", f"{m}.shared_expert.down_proj", (H, Is)
        yield "linear", f"{m}.shared_expert_gate", (1, H)


_HF_CONVERT_HINT = (
    "convert it to MLX 4-bit first:\n"
    "    python -m mlx_lm convert --hf-path {src} --mlx-path {src}-mlx-4bit -q --q-bits 4 --q-group-size 64\n"
    "(pip install mlx-lm; the converter keeps the router and shared-expert gate at 8 bits)")


def _canonical_names(all_names: Iterable[str], model_dir: Path) -> dict[str, str]:
    """Map stored names to canonical text-model names; refuse the Hugging Face layout."""
    names = list(all_names)
    if any(n.startswith("model.language_model.") or ".mlp.experts.gate_up_proj" in n for n in names):
        raise CheckpointError(f"{model_dir}: this is a Hugging Face bf16 checkpoint "
                              "(model.language_model.* / fused experts.gate_up_proj); Lily loads "
                              "MLX affine-quantized checkpoints; " + _HF_CONVERT_HINT.format(src=model_dir))
    out = {}
    for n in names:
        if n.startswith(("vision_tower.", "model.visual.", "language_model.model.visual.")) or ".mtp." in n or n.startswith("mtp."):
            continue
        c = n[len("language_model."):] if n.startswith("language_model.") else n
        out[c] = n
    return out


def _shape_str(s) -> str:
    return "[" + ", ".join(str(x) for x in s) + "]"


def open_checkpoint(model_dir: str | Path, *, strict_config: bool = False) -> Checkpoint:
    """Open, validate and memory-map an MLX ``qwen3_5_moe`` checkpoint directory.

    Every tensor the config implies is checked for presence, dtype and shape (quantized
    linears: packed weight, scales and biases, with per-module bit widths from the
    ``quantization`` section). Nothing is read beyond the headers.

    Raises
    ------
    ConfigError
        ``config.json`` missing, unreadable, or not ``qwen3_5_moe``.
    CheckpointError
        No weight files, a truncated or corrupt file, a Hugging Face bf16 layout (with the
        conversion command), or a missing/mis-typed/mis-shaped tensor (file, tensor,
        expected and actual shape in the message).
    """
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise CheckpointError(f"{model_dir}: the path does not exist")  # the CLI's words too
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    cfg, raw = load_config(model_dir, strict=strict_config)
    stored: dict[str, TensorInfo] = {}
    for f in discover_weight_files(model_dir):
        stored.update(read_safetensors_header(f))
    canon = _canonical_names(stored, model_dir)
    if not (raw.get("quantization") or raw.get("quantization_config")):
        raise CheckpointError(f"{model_dir / 'config.json'}: no 'quantization' section: this is not an "
                              "MLX quantized checkpoint; " + _HF_CONVERT_HINT.format(src=model_dir))

    tensors: dict[str, TensorInfo] = {}

    def take(name: str) -> TensorInfo:
        if name not in canon:
            raise CheckpointError(f"{model_dir}: missing tensor {name} (expected by config.json: "
                                  f"{cfg.num_hidden_layers} layers, {cfg.num_experts} experts)")
        t = stored[canon[name]]
        tensors[name] = t
        return t

    def check(t: TensorInfo, dtypes: tuple[str, ...], shape: tuple[int, ...]) -> None:
        if t.dtype not in dtypes:
            raise CheckpointError(f"{t.where}: tensor {t.name} has dtype {t.dtype}, expected "
                                  f"{' or '.join(dtypes)}")
        if t.shape != tuple(shape):
            raise CheckpointError(f"{t.where}: tensor {t.name} has shape {_shape_str(t.shape)}, "
                                  f"expected {_shape_str(shape)}")

    for kind, name, shape in expected_tensors(cfg):
        if kind == "linear":
            spec = quantization_for(raw, "language_model." + name, where=str(model_dir / "config.json"))
            if spec is None:
                raise CheckpointError(f"{model_dir}: linear {name} is not quantized in config.json; "
                                      "Lily needs every linear quantized (MLX affine)")
            *lead, out_f, in_f = shape
            if in_f % spec.group_size or (in_f * spec.bits) % 32:
                raise CheckpointError(f"{model_dir}: {name} input dim {in_f} is not a multiple of "
                                      f"the quantization group {spec.group_size}")
            check(take(name + ".weight"), ("U32",), (*lead, out_f, in_f * spec.bits // 32))
            for part in ("scales", "biases"):
                check(take(f"{name}.{part}"), ("BF16",),
                      (*lead, out_f, in_f // spec.group_size))
        elif kind == "bf16":
            check(take(name), ("BF16", "F32"), shape)
        else:
            check(take(name), ("F32", "BF16"), shape)

    return Checkpoint(model_dir, cfg, raw, tensors)


def read_generation_config(model_dir: str | Path) -> dict:
    """``generation_config.json`` as a dict (empty when absent).

    Raises :class:`CheckpointError` when the file exists but is not a JSON object."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


__all__ = [
    "Checkpoint", "ModelConfig", "QuantSpec", "QuantizedTensor", "TensorInfo",
    "bf16_to_f32", "check_finite", "discover_weight_files", "expected_tensors", "load_config",
    "open_checkpoint", "parse_config", "quantization_for", "read_generation_config",
    "read_safetensors_header", "unpack_codes",
]
