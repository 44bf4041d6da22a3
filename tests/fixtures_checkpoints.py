"""Session fixtures for random-weight test checkpoints (import them from conftest.py).

Usage in ``tests/conftest.py``::

    from fixtures_checkpoints import (  # noqa: F401
        tokenizer_dir, checkpoint_cache_dir, tiny_checkpoint, dims_checkpoint,
        tiny_hf_checkpoint,
    )

* ``tokenizer_dir``: ``tests/data/qwen3.5-moe-tokenizer`` (tokenizer.json.xz,
  tokenizer_config.json, chat_template.jinja).
* ``checkpoint_cache_dir``: ``$LILY_TEST_CACHE`` if set, else ``~/.cache/lily/test-checkpoints``;
  converted checkpoints persist there across sessions (keyed by preset content hash).
* ``tiny_checkpoint`` / ``dims_checkpoint``: MLX 4-bit checkpoint directories (converted
  by ``python -m mlx_lm convert``; ~7 s / ~11 s on first use, instant afterwards). Treat
  them as read-only.
* ``tiny_hf_checkpoint``: the Hugging Face original-layout (bf16) checkpoint of the tiny
  preset, written fresh into a session temp dir (~2 s).
* ``poison_tensor(model_dir, name, index, bits)``: overwrite one element of a stored tensor
  in place (a corrupt download), e.g. a bf16 NaN in a scale; on a private copy only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lily.checkpoint import open_checkpoint
from lily.lab.testing import cached_checkpoint, default_cache_dir, make_hf_checkpoint

TESTS_DIR = Path(__file__).resolve().parent
TOKENIZER_DIR = TESTS_DIR / "data" / "qwen3.5-moe-tokenizer"


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    if not (TOKENIZER_DIR / "tokenizer_config.json").is_file():
        pytest.skip(f"tokenizer fixture missing: {TOKENIZER_DIR}")
    return TOKENIZER_DIR


@pytest.fixture(scope="session")
def checkpoint_cache_dir() -> Path:
    return default_cache_dir()


def _need_mlx_lm() -> None:
    pytest.importorskip("mlx_lm", reason="mlx-lm is needed to convert test checkpoints")


@pytest.fixture(scope="session")
def tiny_checkpoint(tokenizer_dir, checkpoint_cache_dir) -> Path:
    _need_mlx_lm()
    return cached_checkpoint("tiny", tokenizer_dir=tokenizer_dir, cache_dir=checkpoint_cache_dir)


@pytest.fixture(scope="session")
def dims_checkpoint(tokenizer_dir, checkpoint_cache_dir) -> Path:
    _need_mlx_lm()
    return cached_checkpoint("dims", tokenizer_dir=tokenizer_dir, cache_dir=checkpoint_cache_dir)


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tokenizer_dir, tmp_path_factory) -> Path:
    return make_hf_checkpoint(
        "tiny", tmp_path_factory.mktemp("hf") / "tiny-hf", tokenizer_dir=tokenizer_dir
    )


BF16_NAN, BF16_INF, BF16_NEG_INF = 0x7FC0, 0x7F80, 0xFF80
DEMO_SCALE = "model.layers.1.mlp.switch_mlp.up_proj.scales"  # bf16 [32, 128, 4] in the demo model
DEMO_NORM = "model.layers.2.input_layernorm.weight"          # bf16 [256]


def poison_tensor(model_dir: Path, name: str, index: tuple[int, ...], bits: int) -> None:
    """Write the bit pattern ``bits`` over element ``index`` of tensor ``name`` (canonical
    name) in its safetensors file."""
    t = open_checkpoint(model_dir).tensors[name]
    size = {"BF16": 2, "F16": 2, "F32": 4}[t.dtype]
    flat = int(np.ravel_multi_index(index, t.shape))
    with open(t.file, "r+b") as f:
        f.seek(t.start + flat * size)
        f.write(int(bits).to_bytes(size, "little"))
