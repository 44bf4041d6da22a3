"""The kernel twins' harness: one dispatch on a device, random MLX-quantized tensors and the
bf16 operand models, and the error-ratio machinery every check reports (argument structs
are packed by field name: lily.lab.device.pack_args).

A check's result is the worst ratio of |got - exact| to the kernel's tolerance (PASS when <= 1;
exact kernels: 0 or 1). :func:`check` registers a family module's checks for
:mod:`lily.lab.kernels.registry`; tests/harness.py wraps :func:`run` and :func:`run_bound`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lily import _core
from lily.checkpoint import QuantizedTensor, bf16_to_f32, f32_to_bf16
from lily.lab.device import upload
from lily.reference import ReferenceModel

U = 2.0**-24          # fp32 unit roundoff
QUANT_GROUP = _core.CONSTANTS["kQuantGroup"]  # values per scale and bias (metal/decode_args.h)
DEPTH = 64            # accumulation depth bound of the GEMV-like kernels (tests/kernels/test_moe.py)
HALF_MAX = float(np.finfo(np.float16).max)  # 65504: the tests' inputs reach beyond it (nothing is clipped)
to_bf16_bits = bf16_bits = f32_to_bf16  # float32 -> bf16 bit patterns (lily.checkpoint); the tests' names


def rand_quant(rng, lead, rows, cols, bits, name="w") -> QuantizedTensor:
    """Random MLX-layout tensor [*lead, rows, cols]: uniform codes, realistic bf16 scales
    (weights ~ +-0.03) and biases (about -scale * 2**(bits-1), so w is centred)."""
    shape = (*lead, rows)
    words = rng.integers(0, 2**32, size=(*shape, cols * bits // 32), dtype=np.uint64).astype(np.uint32)
    g = (*shape, cols // QUANT_GROUP)
    s = (rng.random(g, dtype=np.float32) * 0.004 + 0.0005)
    b = -s * (2 ** (bits - 1) - 0.5) + rng.standard_normal(g, dtype=np.float32) * 0.002
    return QuantizedTensor(name, words, to_bf16_bits(s), to_bf16_bits(b), bits, QUANT_GROUP)


def _codes(qt: QuantizedTensor, index=None):
    """(q, s, b) as float64: codes [*, rows, groups, group_size], scales and biases [*, rows, groups, 1]."""
    w, s, b = qt.weight, qt.scales, qt.biases
    if index is not None:
        w, s, b = w[index], s[index], b[index]
    per = 32 // qt.bits
    q = (w[..., None] >> (np.arange(per, dtype=np.uint32) * qt.bits)) & np.uint32((1 << qt.bits) - 1)
    q = q.reshape(*w.shape[:-1], -1).astype(np.float64)
    qg = q.reshape(*q.shape[:-1], -1, qt.group_size)
    return qg, bf16_to_f32(s).astype(np.float64)[..., None], bf16_to_f32(b).astype(np.float64)[..., None]


def magnitude(qt: QuantizedTensor, index=None) -> np.ndarray:
    """(|s| q + |b|) as float64 [*, rows, cols]: the per-term magnitudes the kernels sum."""
    q, s, b = _codes(qt, index)
    return (q * np.abs(s) + np.abs(b)).reshape(*q.shape[:-2], -1)


def gemv_exact(qt: QuantizedTensor, x, block: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """(W x, |W| |x|) in float64 for a [rows, cols] quantized W, ``block`` rows at a time (the
    vocabulary's 248,320 rows would take 4 GB of float64 at once)."""
    x64 = np.asarray(x, np.float64)
    rows = qt.shape[-2]
    exact, mag = np.empty(rows), np.empty(rows)
    for a in range(0, rows, block):
        rs = slice(a, min(rows, a + block))
        exact[rs] = qt.dequantize(rs).astype(np.float64) @ x64
        mag[rs] = magnitude(qt, rs) @ np.abs(x64)
    return exact, mag


def bf16_round(x) -> np.ndarray:
    """float32 x rounded to the nearest bfloat16 (ties to even; NaN stays NaN), as float32:
    what a kernel's ``bfloat(v)`` stores. bf16 has fp32's range: nothing is clipped."""
    return from_bf16(f32_to_bf16(np.asarray(x, np.float32)))


def bf16_activations(x) -> np.ndarray:
    """x as the producers of the prefill GEMMs' inputs store it (rms_norm_bf16, the SwiGLU
    GEMMs, the scan, the attention: bfloat rounded from fp32, metal/common.h); float32 values
    exactly representable in bf16 (upload them with :func:`upload_bf16`)."""
    return bf16_round(x)


def bf16_operand(x) -> np.ndarray:
    """x as a bfloat matrix operand (the prefill GEMMs' and attention's), float64."""
    return bf16_round(x).astype(np.float64)


def upload_bf16(dev, x):
    """A buffer holding x (float) as bfloat16, rounded to nearest even."""
    return upload(dev, f32_to_bf16(np.asarray(x, np.float32)))


def bf16_stored(want, tol):
    """(want, tol) of an fp32 result within tol of want, stored as bfloat (nearest): the
    rounding adds at most 2**-8 of the stored magnitude, or 2**-134 for subnormals."""
    want = np.asarray(want, np.float64)
    return want, tol + 2.0**-8 * (np.abs(want) + tol) + 2.0**-134


def bf16_weights(qt: QuantizedTensor, index=None) -> np.ndarray:
    """float64 [*, rows, cols]: the dequantized weights as the prefill GEMMs stage them
    (GemmWItems::put, metal/gemm_tiles.h): bfloat(fma(q, s, b)) in fp32. q s is exact in fp32
    (8 x 8 significant bits at most), so the fma and the separate multiply-add round the same
    way: the fp32 sum, then bf16, both to nearest even; a GPU gives exactly these values."""
    q, s, b = _codes(qt, index)
    w32 = (q * s + b).astype(np.float32)  # q s + b is exact in float64; one fp32 rounding
    return bf16_round(w32).astype(np.float64).reshape(*q.shape[:-2], -1)


def upload_q(dev, qt: QuantizedTensor):
    """The weight, scales and biases of a quantized tensor as three device buffers."""
    return upload(dev, qt.weight), upload(dev, qt.scales), upload(dev, qt.biases)


def from_bf16(bits) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exact."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32(x) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32)


def run(dev, kernel, grid, tg, buffers=(), constants=(), reads=(), writes=(), threadgroups=True,
        tgmem=(), label=""):
    """One dispatch of ``kernel`` in its own command buffer, committed and waited for.

    ``buffers`` and ``constants`` are ``(index, buffer[, offset])`` / ``(index, bytes)``
    bindings, ``tgmem`` ``(index, bytes)`` of threadgroup memory; ``grid`` counts
    threadgroups when ``threadgroups`` else threads. Returns the command buffer."""
    cb = dev.command_buffer()
    p = cb.compute_pass()
    p.dispatch(kernel, grid, tg, buffers=list(buffers), constants=list(constants), threadgroup_memory=list(tgmem),
               reads=list(reads), writes=list(writes), threadgroups=threadgroups, label=label)
    cb.commit()
    cb.wait()
    return cb


def run_bound(dev, kernel, grid, tg, buffers, args, reads, writes, threadgroups=True, label=""):
    """:func:`run` with ``buffers`` bound at 0, 1, ... and the argument struct ``args`` (bytes,
    or None for none) at the next index."""
    return run(dev, kernel, grid, tg, list(enumerate(buffers)), [] if args is None else [(len(buffers), args)],
               reads, writes, threadgroups, label=label)


def run_encoder(dev, enc, *a, **kw):
    """``enc(compute_pass, *a, **kw)`` (an ``enc_*`` encoder of a family module) on a fresh
    command buffer, committed and waited for; returns the command buffer."""
    cb = dev.command_buffer()
    enc(cb.compute_pass(), *a, **kw)
    cb.commit()
    cb.wait()
    return cb


class StubOracle(ReferenceModel):
    """ReferenceModel whose linear layers return given projection outputs.

    ``linear(x, "<prefix>.<name>")`` returns ``proj[name]`` (``out_proj`` / ``o_proj``
    return their input, so a mixer returns what its output projection would consume);
    ``param("...linear_attn.<name>")`` returns ``params[<name>]``. The mixer math itself is the
    reference's own code (:meth:`ReferenceModel.gated_deltanet`, :meth:`.attention`).
    """

    def __init__(self, cfg, params):  # no checkpoint
        self.cfg = cfg
        self._act = lambda a: a.astype(np.float32, copy=False)
        self.params = params
        self.proj = {}

    def param(self, name):
        return self.params[name.split("_attn.", 1)[1]]

    def linear(self, x, module):
        name = module.rsplit(".", 1)[-1]
        if name in ("out_proj", "o_proj"):
            return x.astype(np.float32)
        return self.proj[name]


class Mismatch(Exception):
    """A kernel's output is outside its tolerance (the message says where and by how much)."""

    def __init__(self, message: str, error: float):
        super().__init__(message)
        self.error = error


@dataclass
class Result:
    """The outcome of one kernel's check.

    ``status``: PASS, FAIL (outputs outside tolerance), ERROR (the dispatch raised) or
    NO CHECK (the library has a kernel no family module checks). ``error``: worst
    |got - exact| / tolerance (None when not measured). ``seconds``: wall time of the check.
    """

    kernel: str
    status: str
    error: float | None = None
    detail: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"kernel": self.kernel, "status": self.status, "error": self.error, "detail": self.detail,
                "seconds": round(self.seconds, 3)}


def ratio(got, exact, tol, what: str) -> float:
    """Worst |got - exact| / tol; raises Mismatch on a non-finite output or a ratio > 1."""
    got = np.asarray(got, np.float64)
    if not np.isfinite(got).all():
        raise Mismatch(f"{what}: non-finite outputs at {np.argwhere(~np.isfinite(got))[:5].ravel().tolist()}",
                       float("inf"))
    err = np.abs(got - np.asarray(exact, np.float64))
    tol = np.broadcast_to(np.asarray(tol, np.float64), err.shape)
    r = np.divide(err, tol, out=np.where(err > 0, np.inf, 0.0), where=tol > 0)  # tol 0: exact
    worst = float(r.max()) if r.size else 0.0
    if worst > 1:
        raise Mismatch(f"{what}: {int((r > 1).sum())} of {r.size} outputs out of tolerance; worst err/tol "
                       f"{worst:.3g} at {np.unravel_index(int(np.argmax(r)), r.shape)}", worst)
    return worst


def close_ratio(got, want, rtol, atol, what):
    """Worst error ratio against numpy's allclose tolerance atol + rtol * |want|."""
    want = np.asarray(want, np.float64)
    return ratio(got, want, atol + rtol * np.abs(want), what)


@dataclass(frozen=True)
class Size:
    """The shapes a check draws. :data:`TOY`: small ones (every kernel in a few seconds:
    ``lily doctor --quick``, the test suite). A model size (:data:`MODEL`): the dimensions
    Qwen3.6-35B-A3B runs the kernel at (:func:`model`: hidden 2048, 256 experts top-8,
    vocabulary 248,320, attention head dim 256 with 16 query and 2 KV heads, DeltaNet head dims
    128 with 16 key and 32 value heads), prefill chunks of ``rows`` rows (the model's automatic
    chunk: 4096) and decode contexts past the split of the attention; kernels the model does
    not run (head dim 64, DeltaNet dims 32: the demo model's) at their own dims with the same
    rows and contexts."""

    model: bool = False
    rows: int = 4096

    def pick(self, toy, model):
        """``model`` at a model size, else ``toy`` (the check's small shape)."""
        return model if self.model else toy


TOY = Size()
MODEL = Size(model=True)

#: Decode context of the model-size attention checks: past the attention split (the runtime's
#: default split_threshold is 256) and past a 4096-row chunk.
MODEL_CONTEXT = 8192


def model():
    """Qwen3.6-35B-A3B's ModelConfig (lily.lab.estimate's built-in config: one home)."""
    from lily.lab.estimate import model_config
    return model_config()


CHECKS: dict[str, Callable] = {}


def check(*kernels: str):
    """Registers a check ``f(dev, rng, kernel, size=TOY) -> worst error ratio`` for
    ``kernels`` (``size``: :class:`Size`)."""
    def register(fn):
        for k in kernels:
            CHECKS[k] = fn
        return fn
    return register
