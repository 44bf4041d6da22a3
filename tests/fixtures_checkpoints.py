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
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lily.testing import cached_checkpoint, make_hf_checkpoint

TESTS_DIR = Path(__file__).resolve().parent
TOKENIZER_DIR = TESTS_DIR / "data" / "qwen3.5-moe-tokenizer"


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    if not (TOKENIZER_DIR / "tokenizer_config.json").is_file():
        pytest.skip(f"tokenizer fixture missing: {TOKENIZER_DIR}")
    return TOKENIZER_DIR


@pytest.fixture(scope="session")
def checkpoint_cache_dir() -> Path:
    env = os.environ.get("LILY_TEST_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lily" / "test-checkpoints"


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
