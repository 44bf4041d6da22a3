"""The batched decode MoE kernels of metal/moe.metal (issue 31): ``moe_route_gate_up_batch_q4_b*``
(each row's routing, then each expert of the union of the rows' picks and the shared expert read
once for the rows that picked it) and ``moe_down_batch_q4_b*`` (the rows' down projections: the
shared expert's chunks loaded once, each row's routed experts its own), run in one pass as the
decode step runs them. Every row's ids, routing weights, expert hidden vector and residual
must be bit-identical to its batch-1 kernels' (moe_route_gate_up_swiglu_q4, moe_down_q4) on
that row alone, and within the float64 bounds of the batch-1 twins. Rows are strided (padding
between rows); their experts overlap at other slots (so a row's first pick can be an earlier
row's), are the same in the same order, or are disjoint; the row count is below the kernel's b
where it can be; every case runs in the simulator's three thread orders with its hazard checks
(tests/simdev.py: writes outside the declared ranges fail). The helpers are lily doctor's
checks (lily.lab.kernels.moe)."""

from __future__ import annotations

import pytest
from seeding import fresh_rng

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.kernels.moe import MoeWeights, batch_ids, moe_batch_ratio  # noqa: E402

# (experts, hidden, inter, inter_shared, top_k): the toy layer of lily doctor; one whose
# shared expert is wider than a routed one (its slot offset and row count differ) with 16
# chunks per gate/up row; and the model's expert sizes and top 8, whose 144 (slot, chunk)
# pairs per down row give each lane several to add in order
SHAPES = {"toy": (16, 128, 64, 64, 4), "wide-shared": (16, 512, 128, 192, 4), "model-slots": (32, 256, 512, 512, 8)}


# every row count and kind of overlap on the toy layer; the larger layers at the three kernels
CASES = [("toy", n, o) for n, o in [(1, True), (2, True), (2, False), (3, "same"), (4, False), (8, True)]] + \
        [(s, n, o) for s in ("wide-shared", "model-slots") for n, o in [(2, False), (3, "same"), (8, True)]]


@pytest.mark.parametrize("shape,n,overlap", CASES)
def test_moe_batch_rows_equal_batch_1(dev, shape, n, overlap):
    E, hidden, inter, inter_shared, k = SHAPES[shape]
    rng = fresh_rng(n * 10 + len(str(overlap)) + len(shape))
    W = MoeWeights(rng, E, hidden, inter, inter_shared)
    assert moe_batch_ratio(dev, rng, W, W.upload(dev), k, n, overlap) <= 1.0


def test_batch_ids_overlap_or_not():
    """Overlapping rows share k - 1 experts, none at the same slot; "same" rows are equal;
    disjoint rows share none."""
    rng = fresh_rng(5)
    shared = batch_ids(rng, 16, 4, 4, True).tolist()
    for a, b in zip(shared, shared[1:]):
        assert len(set(a)) == 4 and len(set(a) & set(b)) == 3
        assert not any(x == y for x, y in zip(a, b))
    same = batch_ids(rng, 16, 4, 3, "same")
    assert (same == same[0]).all() and len(set(same[0].tolist())) == 4
    disjoint = batch_ids(rng, 16, 4, 4, False)
    assert len(set(disjoint.ravel().tolist())) == 16
