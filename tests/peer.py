"""The MLX-LM peer on the CPU (docs/verification.md): load a checkpoint and get its logits.

``float32=True`` casts every bf16 parameter (scales, biases, norms) to float32 so MLX-LM
runs the same affine-dequantized weights with float32 activations: the reference must then
agree to float32 rounding. With the stock bf16 activations the comparison is statistical.
"""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
from mlx.utils import tree_map  # noqa: E402

from lily.lab.bench import teacher_forced  # noqa: E402,F401 (the statistic lives with the benchmark)

_cache: dict = {}


def load_peer(path, *, float32: bool = False):
    key = (str(path), float32)
    if key not in _cache:
        model, tok = mlx_lm.load(str(path))
        if float32:
            model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a,
                                  model.parameters()))
        _cache[key] = (model, tok)
    return _cache[key]


def peer_logits(model, ids) -> np.ndarray:
    """float32 logits ``[len(ids), vocab]`` from one forward pass over ``ids``."""
    out = model(mx.array([list(ids)]))
    return np.array(out[0].astype(mx.float32))


def peer_greedy(model, ids, n: int) -> list[int]:
    """``n`` greedy tokens with MLX-LM's own KV/recurrent cache (its generation path)."""
    from mlx_lm.models.cache import make_prompt_cache
    cache = make_prompt_cache(model)
    logits = model(mx.array([list(ids)]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        t = int(mx.argmax(logits).item())
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    return out


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
