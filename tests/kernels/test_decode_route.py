"""The decode step's router and GEMV geometry (issue 11): norm_gemv_q* at every rows-per-
simdgroup setting against numpy on fresh random inputs, the router's logits unchanged by
the geometry, and structure pinned on the recorded plan of the real model (every
bandwidth-heavy decode dispatch fills an M5 Max; the router spans >= 3x its cores; the
fused gate/up kernel routes without threadgroup barriers).

The simulator runs with verify_writes (every byte written outside a dispatch's declared
ranges is an error) and its hazard checks; tolerances are those of
tests/kernels/test_gemv.py (64 u M per output, u = 2**-24)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from seeding import fresh_rng

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily._device import download, upload  # noqa: E402
from lily.kernel_check import (  # noqa: E402
    NORM_GEMV_ROWS_PER_SG, _norm_gemv_ratio, enc_norm_gemv, norm_gemv_grid, rand_quant, to_bf16_bits, upload_q)
from harness import forward_sim, run_encoder  # noqa: E402

METAL_SRC = Path(__file__).resolve().parents[2] / "metal"


@pytest.fixture(scope="module")
def dev():
    return forward_sim()


def run_norm_gemv(dev, bits, x, nw, qts, rps, tg=64):
    cols = x.size
    X, NW, XN = upload(dev, x), upload(dev, nw), dev.buffer(4 * cols)
    mats = [(qt.weight.shape[0], upload_q(dev, qt), dev.buffer(4 * qt.weight.shape[0])) for qt in qts]
    run_encoder(dev, enc_norm_gemv, bits, X, NW, XN, mats, cols, write_xn=True, tg=tg, rps=rps)
    return X, NW, XN, mats


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rps", [1, 2, 4, 8])
@pytest.mark.parametrize("tg", [32, 64, 256])
def test_norm_gemv_rows_per_simdgroup(dev, bits, rps, tg):
    """Router-shaped matrices (E rows plus the one-row shared gate) and a ragged third at
    every rows-per-simdgroup setting and threadgroup size: within 64 u M of float64."""
    rng = fresh_rng(bits * 100 + rps * 10 + tg)
    cols = 256
    x = (rng.standard_normal(cols) * 2).astype(np.float32)
    nw = to_bf16_bits(1 + 0.2 * rng.standard_normal(cols))
    qts = [rand_quant(rng, (), r, cols, bits) for r in (96, 1, 37)]
    _, _, XN, mats = run_norm_gemv(dev, bits, x, nw, qts, rps, tg)
    assert _norm_gemv_ratio(f"norm_gemv_q{bits} rps={rps} tg={tg}", x, nw, XN, qts, mats) <= 1.0


def test_router_logits_independent_of_rows_per_simdgroup(dev):
    """With >= 32 chunks per row every lane of a team strides the same chunks whatever the
    rows per simdgroup, so the router's logits (and the experts they pick) are bit-identical
    at 1 and at 8 rows per simdgroup."""
    rng = fresh_rng(257)
    cols = 512  # q8: 32 chunks of 16 bytes per row
    x = (rng.standard_normal(cols) * 2).astype(np.float32)
    nw = to_bf16_bits(1 + 0.2 * rng.standard_normal(cols))
    qts = [rand_quant(rng, (), 64, cols, 8), rand_quant(rng, (), 1, cols, 8)]
    outs = []
    for rps in (1, NORM_GEMV_ROWS_PER_SG):
        _, _, XN, mats = run_norm_gemv(dev, 8, x, nw, qts, rps)
        outs.append([download(XN, np.float32)] + [download(m[2], np.float32) for m in mats])
    for a, b in zip(*outs):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_norm_gemv_grid_follows_rows_per_simdgroup():
    assert norm_gemv_grid([256, 1], 64, 1) == 128 + 1
    assert norm_gemv_grid([256, 1], 64, 8) == 16 + 1
    assert norm_gemv_grid([300], 256, 4) == math.ceil(300 / 32)


# ----------------------------------------------------------------------------- structure


@pytest.fixture(scope="module")
def step():
    from lily.native import count_decode_step
    from lily.perf import model_config
    return count_decode_step(model_config(), 4096)["records"]


def occupancy_m5max(rec):
    from lily.perf import machine, occupancy
    return occupancy(machine("m5max"), math.prod(rec["groups"]), math.prod(rec["threads"]))


def test_router_dispatch_spans_the_gpu(step):
    """The router (norm_gemv_q8, 257 rows) runs one row per simdgroup: >= 3x the M5 Max's
    40 cores in threadgroups (17 at 8 rows per simdgroup)."""
    routers = [r for r in step if "router" in r["label"]]
    assert len(routers) == 40
    for r in routers:
        assert r["kernel"] == "norm_gemv_q8"
        assert math.prod(r["groups"]) >= 3 * 40
        assert occupancy_m5max(r) >= 0.8


def test_bandwidth_heavy_decode_dispatches_fill_an_m5max(step):
    """Every decode dispatch moving >= 1 MB keeps all 40 cores of an M5 Max at >= 256
    threads (lily.perf.occupancy 1.0), except the Gated DeltaNet recurrence: one
    threadgroup per value head (32) keeps its 64 KB state in registers."""
    for r in step:
        if r["work"]["bytes"] < 1e6 or r["kernel"].startswith("gdn_decode_step"):
            continue
        assert occupancy_m5max(r) == 1.0, (r["label"], r["groups"], r["threads"])


def _body(src: str, start: str) -> str:
    """The text of the braced body that follows `start` in `src`."""
    i = src.index("{", src.index(start))
    depth = 0
    for j in range(i, len(src)):
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        if depth == 0:
            return src[i:j + 1]
    raise AssertionError(f"unbalanced braces after {start!r}")


def test_fused_gate_up_routes_without_barriers():
    """Each simdgroup of moe_route_gate_up_swiglu_q4 computes its routing in registers
    (route_topk_simd): no threadgroup barrier or threadgroup array stands between a
    threadgroup's start and its first expert weight load."""
    moe = (METAL_SRC / "moe.metal").read_text()
    route = (METAL_SRC / "route.h").read_text()
    kernel = _body(moe, "kernel void moe_route_gate_up_swiglu_q4(")
    simd = _body(route, "inline RoutePicks route_topk_simd(")
    assert "route_topk_simd(" in kernel and not re.search(r"\broute_topk\(", kernel)
    for text in (kernel, simd, _body(moe, "inline void gate_up_slot(")):
        assert "threadgroup_barrier" not in text
        assert not re.search(r"\bthreadgroup\s+\w+\s*[\*\w]", text)
