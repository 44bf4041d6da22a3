"""The device layer on the simulator: barriers derived from declared ranges, the hazard
checker, stage-order shuffling, poisoning, bounds checks, record-only mode, command
buffers in flight with token slots, and errors that surface as Python exceptions."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab.device import constant, download, sim_device, upload  # noqa: E402

N = 100


def add(p, a, b, out, n=N, declare=True, label=""):
    p.dispatch("st_add_f32", n, 32, buffers=[(0, a), (1, b), (2, out)], constants=[(3, constant(n))],
               reads=[a, b] if declare else [], writes=[out] if declare else [], label=label)


def vecs(dev, k, n=N, seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(k)]
    return xs, [upload(dev, x) for x in xs]


def test_compiled_devices_reports_sim():
    assert "sim" in _core.compiled_devices()
    assert "sim" in _core.build_info()["devices"]


def test_unknown_kernel_is_named():
    dev = sim_device()
    cb = dev.command_buffer()
    p = cb.compute_pass()
    with pytest.raises(ValueError, match="no_such_kernel"):
        p.dispatch("no_such_kernel", 1, 1)
    assert dev.has_kernel("st_add_f32") and not dev.has_kernel("no_such_kernel")


def test_barriers_derived_from_declared_ranges():
    dev = sim_device()
    (a, b), (A, B) = vecs(dev, 2)
    C, D, E = dev.buffer(4 * N), dev.buffer(4 * N), dev.buffer(4 * N)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    add(p, A, B, C)      # stage 1
    add(p, A, B, D)      # independent of the first: same stage
    add(p, C, D, E)      # reads C and D: new stage
    add(p, A, A, B)      # writes B, which stage 2 does not touch but stage 1 read: already ordered
    cb.commit()
    cb.wait()
    assert cb.counters == {"dispatches": 4, "barrier_stages": 2, "bytes_read": 8 * 4 * N,
                           "bytes_written": 4 * 4 * N, "passes": 1, "copies": 0, "bytes_copied": 0}
    np.testing.assert_allclose(download(E, np.float32), 2 * (a + b), rtol=1e-6)
    np.testing.assert_allclose(download(B, np.float32), 2 * a, rtol=1e-6)
    log = cb.dispatch_log
    assert [r["stage"] for r in log] == [0, 0, 1, 1]
    assert log[0]["label"] == "st_add_f32 (#0)" and log[3]["label"] == "st_add_f32 (#3)"
    assert all(r["bytes_read"] == 8 * N and r["bytes_written"] == 4 * N for r in log)


def test_dispatch_log_is_opt_in_and_counters_are_not():
    dev = sim_device()
    _, (A, B) = vecs(dev, 2)
    C, D = dev.buffer(4 * N), dev.buffer(4 * N)
    counted = []
    for keep in (True, False):
        cb = dev.command_buffer(dispatch_log=keep)
        p = cb.compute_pass()
        add(p, A, B, C)
        add(p, C, B, D)
        cb.commit()
        cb.wait()
        counted.append(cb.counters)
        assert len(cb.dispatch_log) == (2 if keep else 0)
    assert counted[0] == counted[1] and counted[1]["dispatches"] == 2 and counted[1]["barrier_stages"] == 2


def test_write_after_read_starts_a_stage():
    dev = sim_device()
    _, (A, B) = vecs(dev, 2)
    C = dev.buffer(4 * N)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    add(p, A, B, C)
    add(p, C, C, A)  # RAW on C
    add(p, B, B, C)  # WAR on C (read by the previous dispatch) and WAW
    assert cb.counters["barrier_stages"] == 3
    cb.commit()
    cb.wait()


def test_disjoint_ranges_of_one_buffer_do_not_conflict():
    dev = sim_device()
    (a,), (A,) = vecs(dev, 1, n=2 * N)
    O = dev.buffer(8 * N)
    cb = dev.command_buffer()
    p = cb.compute_pass(manual_barriers=True)
    for half in range(2):
        off = half * 4 * N
        p.dispatch("st_add_f32", N, 32, buffers=[(0, A, off), (1, A, off), (2, O, off)],
                   constants=[(3, constant(N))], reads=[(A, off, 4 * N)], writes=[(O, off, 4 * N)])
    cb.commit()
    cb.wait()
    assert cb.counters["barrier_stages"] == 1
    np.testing.assert_allclose(download(O, np.float32), 2 * a, rtol=1e-6)


def test_hazard_checker_catches_missing_barrier():
    dev = sim_device()
    _, (A, B) = vecs(dev, 2)
    C, D = dev.buffer(4 * N), dev.buffer(4 * N)
    cb = dev.command_buffer()
    p = cb.compute_pass(manual_barriers=True)
    C.label = "activations"
    add(p, A, B, C, label="producer")
    with pytest.raises(_core.HazardError,
                       match=r"read-after-write.*'consumer \(#1\)' buffer #\d+ 'activations' bytes \[0, 400\)"
                             r".*'producer \(#0\)' buffer #\d+ 'activations'"):
        add(p, C, B, D, label="consumer")


def test_hazard_names_dispatches_of_a_later_stage():
    # The tracker reuses its storage from stage to stage: a conflict in the third stage names
    # that stage's dispatch by its own label and index, not an earlier stage's.
    dev = sim_device()
    _, (A, B) = vecs(dev, 2)
    C, D, E = dev.buffer(4 * N), dev.buffer(4 * N), dev.buffer(4 * N)
    cb = dev.command_buffer()
    p = cb.compute_pass(manual_barriers=True)
    add(p, A, B, C, label="first")
    add(p, A, B, D, label="second")
    p.barrier()
    add(p, C, D, E)
    p.barrier()
    add(p, E, B, C, label="a long label that does not fit a small string")
    with pytest.raises(_core.HazardError,
                       match=r"write-after-read.*'overwriter \(#4\)' buffer #\d+ bytes \[0, 400\)"
                             r".*'a long label that does not fit a small string \(#3\)' buffer #\d+ bytes"):
        add(p, A, B, E, label="overwriter")


@pytest.mark.parametrize("kind", ["write-after-read", "write-after-write"])
def test_hazard_checker_war_waw(kind):
    dev = sim_device()
    _, (A, B) = vecs(dev, 2)
    C = dev.buffer(4 * N)
    cb = dev.command_buffer()
    p = cb.compute_pass(manual_barriers=True)
    add(p, A, B, C, label="first")
    with pytest.raises(_core.HazardError, match=kind):
        if kind == "write-after-read":
            add(p, B, B, A, label="second")  # writes A, which "first" reads
        else:
            add(p, B, B, C, label="second")


def test_disjoint_write_tag():
    """Writes to one range tagged alike (disjoint elements by construction, as the tile
    classes of a grouped GEMM) share a stage; another tag, an untagged write or a read of the
    range still conflicts."""
    dev = sim_device()
    (a, b), (A, B) = vecs(dev, 2, n=2 * N)
    O = dev.buffer(8 * N)

    def half(p, i, tag, label):  # writes half i of O, declaring all of O with the tag
        off = i * 4 * N
        p.dispatch("st_add_f32", N, 32, buffers=[(0, A, off), (1, B, off), (2, O, off)],
                   constants=[(3, constant(N))], reads=[(A, off, 4 * N), (B, off, 4 * N)],
                   writes=[(O, 0, 8 * N, tag)], label=label)

    cb = dev.command_buffer()
    p = cb.compute_pass(manual_barriers=True)
    half(p, 0, 5, "class 0")
    half(p, 1, 5, "class 1")
    cb.commit()
    cb.wait()
    assert cb.counters["barrier_stages"] == 1
    np.testing.assert_allclose(download(O, np.float32), a + b, rtol=1e-6)
    for tag in (6, 0):
        p = dev.command_buffer().compute_pass(manual_barriers=True)
        half(p, 0, 5, "class 0")
        with pytest.raises(_core.HazardError, match="write-after-write"):
            half(p, 1, tag, "other")
    p = dev.command_buffer().compute_pass(manual_barriers=True)
    half(p, 0, 5, "class 0")
    with pytest.raises(_core.HazardError, match="read-after-write"):
        p.dispatch("st_add_f32", N, 32, buffers=[(0, O), (1, O), (2, A)], constants=[(3, constant(N))],
                   reads=[(O, 0, 4 * N)], writes=[(A, 0, 4 * N)], label="reader")
    # verify_writes: a byte written twice under one tag in a stage is a hazard
    checked = sim_device(verify_writes=True)
    (_, _), (A, B) = vecs(checked, 2, n=2 * N)
    O = checked.buffer(8 * N)
    cb = checked.command_buffer()
    p = cb.compute_pass(manual_barriers=True)
    half(p, 0, 5, "class 0")
    p.dispatch("st_add_f32", N, 32, buffers=[(0, A, 4 * N), (1, B, 4 * N), (2, O)],  # other values, same bytes
               constants=[(3, constant(N))], reads=[A, B], writes=[(O, 0, 8 * N, 5)], label="class 0 again")
    cb.commit()
    with pytest.raises(_core.HazardError, match=r"'class 0 again.*which 'class 0.*wrote too \(declared disjoint\)"):
        cb.wait()


def test_hazard_checker_accepts_correct_barrier():
    dev = sim_device()
    (a, b), (A, B) = vecs(dev, 2)
    C, D = dev.buffer(4 * N), dev.buffer(4 * N)
    cb = dev.command_buffer()
    p = cb.compute_pass(manual_barriers=True)
    add(p, A, B, C)
    p.barrier()
    add(p, C, B, D)
    cb.commit()
    cb.wait()
    assert cb.counters["barrier_stages"] == 2
    np.testing.assert_allclose(download(D, np.float32), a + 2 * b, rtol=1e-6)


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_stage_order_does_not_change_a_correct_schedule(order):
    dev = sim_device(order=order, seed=7)
    xs, bufs = vecs(dev, 4)
    outs = [dev.buffer(4 * N) for _ in range(3)]
    cb = dev.command_buffer()
    p = cb.compute_pass()
    add(p, bufs[0], bufs[1], outs[0])
    add(p, bufs[2], bufs[3], outs[1])
    add(p, outs[0], outs[1], outs[2])
    cb.commit()
    cb.wait()
    np.testing.assert_allclose(download(outs[2], np.float32), sum(xs), rtol=1e-5)


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_stage_order_modes(order):
    """Eight dispatches in one stage (the shared counter is deliberately left undeclared);
    the tickets they draw show the order the simulator ran them in. One thread: on several,
    the dispatches of a stage in forward order run at the same time (test_sim_parallel.py)."""
    k = 8
    dev = sim_device(order=order, seed=3, threads=1)
    counter = upload(dev, np.zeros(1, np.uint32))
    tickets = upload(dev, np.zeros(k, np.uint32))
    cb = dev.command_buffer()
    p = cb.compute_pass()
    for slot in range(k):
        p.dispatch("st_ticket", 1, 1, buffers=[(0, counter), (1, tickets)], constants=[(2, constant(slot))],
                   writes=[(tickets, 4 * slot, 4)])
    cb.commit()
    cb.wait()
    assert cb.counters["barrier_stages"] == 1
    got = download(tickets, np.uint32)
    assert sorted(got) == list(range(k))
    if order == "forward":
        assert list(got) == list(range(k))
    elif order == "reverse":
        assert list(got) == list(range(k))[::-1]
    else:
        assert list(got) != list(range(k))


def test_reverse_order_exposes_a_wrong_declaration():
    """The consumer forgets to declare its read of C: no barrier is derived, and executing
    the stage in reverse order runs it before the producer (C still poisoned)."""
    results = {}
    for order in ("forward", "reverse"):
        dev = sim_device(order=order)
        _, (A, B) = vecs(dev, 2)
        C, D = dev.buffer(4 * N), dev.buffer(4 * N)
        cb = dev.command_buffer()
        p = cb.compute_pass()
        add(p, A, B, C)
        p.dispatch("st_add_f32", N, 32, buffers=[(0, C), (1, B), (2, D)], constants=[(3, constant(N))],
                   reads=[B], writes=[D])  # missing: reads C
        cb.commit()
        cb.wait()
        assert cb.counters["barrier_stages"] == 1
        results[order] = download(D, np.float32)
    assert np.isfinite(results["forward"]).all()
    assert np.isnan(results["reverse"]).all()


def test_verify_writes_catches_undeclared_write():
    dev = sim_device(verify_writes=True)
    _, (A, B) = vecs(dev, 2)
    C = dev.buffer(4 * N)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    p.dispatch("st_add_f32", N, 32, buffers=[(0, A), (1, B), (2, C)], constants=[(3, constant(N))],
               reads=[A, B], writes=[(C, 0, 4 * (N - 1))], label="short_declaration")
    cb.commit()
    with pytest.raises(_core.HazardError, match=r"short_declaration.*wrote byte 396"):
        cb.wait()


def test_verify_reads_catches_undeclared_read():
    dev = sim_device(verify_reads=True, verify_writes=True)
    (a, b), (A, B) = vecs(dev, 2)
    C, D = dev.buffer(4 * N), dev.buffer(4 * N)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    add(p, A, B, C, label="declared")  # correct declarations pass
    p.dispatch("st_add_f32", N, 32, buffers=[(0, C), (1, B), (2, D)], constants=[(3, constant(N))],
               reads=[C, (B, 0, 4 * (N - 1))], writes=[D], label="short_read")
    cb.commit()
    with pytest.raises(_core.HazardError, match=r"short_read.*reads outside its declared read ranges.*byte 396"):
        cb.wait()
    # the state after the failing check is the real execution's, not the zeroed re-run's
    np.testing.assert_allclose(download(C, np.float32), a + b, rtol=1e-6)


def test_verify_reads_accepts_correct_declarations():
    dev = sim_device(verify_reads=True, verify_writes=True, thread_order="random")
    (a,), (A,) = vecs(dev, 1, n=2 * N)
    O = dev.buffer(8 * N)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    for half in range(2):
        off = half * 4 * N
        p.dispatch("st_add_f32", N, 32, buffers=[(0, A, off), (1, A, off), (2, O, off)],
                   constants=[(3, constant(N))], reads=[(A, off, 4 * N)], writes=[(O, off, 4 * N)])
    X = upload(dev, np.arange(64, dtype=np.float32))
    R = dev.buffer(4)
    p.dispatch("st_row_sum", 1, 64, buffers=[(0, X), (1, R)], constants=[(2, constant(64))],
               reads=[X], writes=[R], threadgroups=True)
    cb.commit()
    cb.wait()
    np.testing.assert_allclose(download(O, np.float32), 2 * a, rtol=1e-6)
    assert download(R, np.float32)[0] == 64 * 63 / 2


def test_verify_reads_accepts_declared_but_unwritten_output():
    """A byte inside a declared write range that the dispatch leaves unwritten (an output
    slot it skips) is not an undeclared read."""
    dev = sim_device(verify_reads=True, verify_writes=True)
    (a, b), (A, B) = vecs(dev, 2)
    O = dev.buffer(8 * N)  # room for 2N outputs; the dispatch writes the first N
    cb = dev.command_buffer()
    p = cb.compute_pass()
    add(p, A, B, O, label="half_written")  # declares all of O as written
    p.dispatch("st_add_f32", N // 2, 32, buffers=[(0, A), (1, B), (2, O, 4 * N)], constants=[(3, constant(N // 2))],
               reads=[(A, 0, 2 * N), (B, 0, 2 * N)], writes=[(O, 4 * N, 4 * N)], label="quarter_written")
    cb.commit()
    cb.wait()
    out = download(O, np.float32)
    np.testing.assert_allclose(out[:N], a + b, rtol=1e-6)
    np.testing.assert_allclose(out[N:N + N // 2], (a + b)[:N // 2], rtol=1e-6)
    assert np.isnan(out[N + N // 2:]).all()  # never written: still the poison
    # a read outside every declared range is still caught
    cb = dev.command_buffer()
    p = cb.compute_pass()
    p.dispatch("st_add_f32", N, 32, buffers=[(0, A), (1, B), (2, O)], constants=[(3, constant(N))],
               reads=[A, (B, 0, 4 * (N - 1))], writes=[O], label="short_read")
    cb.commit()
    with pytest.raises(_core.HazardError, match=r"short_read.*reads outside its declared read ranges.*byte 396"):
        cb.wait()


def test_poisoning_exposes_read_of_unwritten_buffer():
    dev = sim_device()
    A = dev.buffer(4 * N)
    A.write(np.ones(N // 2, np.float32))  # only the first half is written
    O = dev.buffer(4 * N)
    cb = dev.command_buffer()
    add(cb.compute_pass(), A, A, O)
    cb.commit()
    cb.wait()
    out = download(O, np.float32)
    assert (out[: N // 2] == 2).all() and np.isnan(out[N // 2:]).all()


@pytest.mark.parametrize("poison", [True, False])
def test_poisoning_exposes_read_of_unwritten_threadgroup_memory(poison):
    dev = sim_device(poison=poison)
    O = dev.buffer(4 * 64)
    cb = dev.command_buffer()
    cb.compute_pass().dispatch("st_tg_uninit", 64, 64, buffers=[(0, O)])
    cb.commit()
    cb.wait()
    out = download(O, np.float32)
    assert (out[0::2] == 1).all()
    assert np.isnan(out[1::2]).all() if poison else (out[1::2] == 0).all()


@pytest.mark.parametrize("grid,tg,msg", [
    (N, 0, "zero dimension"),
    (0, 32, "zero dimension"),
    (N, 1025, "exceeds the pipeline's maximum"),
    (N, (32, 32, 2), "exceeds the pipeline's maximum"),
    (N, (1, 2, 3, 4), "1 to 3 ints"),
    (-1, 32, "out of range"),
])
def test_bad_geometry_is_a_value_error(grid, tg, msg):
    dev = sim_device()
    _, (A, B) = vecs(dev, 2)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    with pytest.raises(ValueError, match=msg):
        p.dispatch("st_add_f32", grid, tg, buffers=[(0, A), (1, B), (2, B)], constants=[(3, constant(N))])


def test_bad_bindings_are_value_errors():
    dev = sim_device()
    _, (A, B) = vecs(dev, 2)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    with pytest.raises(ValueError, match=r"\[\[buffer\(2\)\]\] is not bound"):
        p.dispatch("st_add_f32", N, 32, buffers=[(0, A), (1, B)], constants=[(3, constant(N))])
    with pytest.raises(ValueError, match=r"needs 4 bytes but only 2"):
        p.dispatch("st_add_f32", N, 32, buffers=[(0, A), (1, B), (2, B)], constants=[(3, b"\0\0")])
    with pytest.raises(ValueError, match="past the end"):
        p.dispatch("st_add_f32", N, 32, buffers=[(0, A, 10**6), (1, B), (2, B)], constants=[(3, constant(N))])
    with pytest.raises(ValueError, match="exceeds buffer"):
        p.dispatch("st_add_f32", N, 32, buffers=[(0, A), (1, B), (2, B)], constants=[(3, constant(N))],
                   reads=[(A, 0, 10**6)])
    with pytest.raises(ValueError, match="not a multiple of 16"):
        p.dispatch("st_tg_reverse", 32, 32, buffers=[(0, A), (1, B)], threadgroup_memory=[(0, 10)])
    with pytest.raises(ValueError, match=r"\[\[threadgroup\(0\)\]\] memory length is not set"):
        p.dispatch("st_tg_reverse", 32, 32, buffers=[(0, A), (1, B)])
    with pytest.raises(ValueError, match="limit is 32768"):
        p.dispatch("st_tg_reverse", 32, 32, buffers=[(0, A), (1, B)], threadgroup_memory=[(0, 65536)])
    # rejected dispatches leave no trace in the pass
    assert cb.counters["dispatches"] == 0 and cb.counters["barrier_stages"] == 0


@pytest.mark.parametrize("record_only", [False, True])
def test_misaligned_buffer_offset_is_a_value_error(record_only):
    """A buffer bound at an offset that is not a multiple of the parameter's pointee
    alignment (Metal requires it) is rejected at encode time instead of crashing the
    process on a misaligned vector access."""
    dev = sim_device(record_only=record_only)
    n = 8
    A, B = dev.buffer(16 * n + 64), dev.buffer(16 * n + 64)
    O, BITS, H = dev.buffer(16 * n + 64), dev.buffer(4 * n + 64), dev.buffer(8 * n + 64)
    cb = dev.command_buffer()
    p = cb.compute_pass()

    def vec_math(a_off=0, o_off=0, bits_off=0, h_off=0):
        p.dispatch("st_vec_math", n, 32, buffers=[(0, A, a_off), (1, B), (2, O, o_off), (3, BITS, bits_off), (4, H, h_off)],
                   constants=[(5, constant(n))], label="vm")

    with pytest.raises(ValueError, match=r"kernel 'st_vec_math'.*buffer\(0\) is bound at offset 8, which is not a "
                                         r"multiple of 16.*'device const float4\* a'"):
        vec_math(a_off=8)
    with pytest.raises(ValueError, match=r"buffer\(2\) is bound at offset 4, which is not a multiple of 16"):
        vec_math(o_off=4)
    with pytest.raises(ValueError, match=r"buffer\(3\) is bound at offset 2, which is not a multiple of 4"):
        vec_math(bits_off=2)
    with pytest.raises(ValueError, match=r"buffer\(4\) is bound at offset 12, which is not a multiple of 8"):
        vec_math(h_off=12)
    assert cb.counters["dispatches"] == 0  # rejected dispatches leave no trace
    vec_math(a_off=16, o_off=32, bits_off=4, h_off=8)  # aligned offsets are fine
    p.dispatch("st_add_f16", 3, 32, buffers=[(0, A, 2), (1, B, 6), (2, O, 10)], constants=[(3, constant(3))])
    cb.commit()
    cb.wait()
    assert cb.counters["dispatches"] == 2


def test_kernel_fault_is_an_exception_and_device_survives():
    dev = sim_device()
    O = dev.buffer(4 * 32)
    cb = dev.command_buffer()
    cb.compute_pass().dispatch("st_bad_barrier", 32, 32, buffers=[(0, O)])
    cb.commit()
    with pytest.raises(RuntimeError, match="st_bad_barrier.*threadgroup_barrier"):
        cb.wait()
    assert cb.status == "error"
    # the device keeps working
    (a, b), (A, B) = vecs(dev, 2)
    C = dev.buffer(4 * N)
    cb = dev.command_buffer()
    add(cb.compute_pass(), A, B, C)
    assert math.isnan(cb.gpu_seconds)  # device time exists once the buffer ran
    cb.commit()
    cb.wait()
    assert 0 < cb.gpu_seconds < 60
    np.testing.assert_allclose(download(C, np.float32), a + b, rtol=1e-6)


def test_record_only_counts_without_executing():
    dev = sim_device(record_only=True)
    A, B, C = dev.buffer(4 * N), dev.buffer(4 * N), dev.buffer(4 * N)
    cb = dev.command_buffer()
    p = cb.compute_pass()
    add(p, A, B, C)
    add(p, C, B, A)
    add(p, A, C, B)
    cb.copy(B, 0, C, 0, 4 * N)  # checked and counted, not executed
    cb.commit()
    cb.wait()
    assert cb.status == "completed"
    assert cb.counters == {"dispatches": 3, "barrier_stages": 3, "bytes_read": 6 * 4 * N,
                           "bytes_written": 3 * 4 * N, "passes": 1, "copies": 1, "bytes_copied": 4 * N}
    with pytest.raises(ValueError, match="record-only"):
        C.read()
    big = dev.buffer(1 << 40)  # 1 TiB: nothing is allocated
    assert big.size == 1 << 40


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_copy_runs_in_encoding_order_between_passes(order):
    """CommandBuffer.copy (a blit on Metal) ends the compute pass and runs after the work
    encoded before it and before the work after it, under the hazard checker's modes."""
    from simdev import THREAD_ORDERS
    dev = sim_device(**THREAD_ORDERS[order])
    (a, b), (A, B) = vecs(dev, 2)
    C, D, E = dev.buffer(4 * N), dev.buffer(8 * N), dev.buffer(4 * N)
    D.write(np.zeros(2 * N, np.float32).view(np.uint8))
    other = sim_device()  # a buffer of another simulator device
    (z,), (Z,) = vecs(other, 1, seed=3)
    cb = dev.command_buffer()
    add(cb.compute_pass(), A, B, C)
    cb.copy(C, 0, D, 4 * N, 4 * N)  # D[N:] = a + b
    cb.copy(Z, 8, D, 0, 8)          # D[0:2] = z[2:4]
    p = cb.compute_pass()
    p.dispatch("st_add_f32", N, 32, buffers=[(0, D, 4 * N), (1, A), (2, E)], constants=[(3, constant(N))],
               reads=[(D, 4 * N, 4 * N), A], writes=[E])
    cb.copy(E, 0, E, 4 * N - 8, 0)  # size 0: nothing
    cb.commit()
    cb.wait()
    assert cb.counters["copies"] == 2 and cb.counters["bytes_copied"] == 4 * N + 8
    assert cb.counters["passes"] == 2
    np.testing.assert_allclose(download(E, np.float32), (a + b) + a, rtol=1e-6)
    d = download(D, np.float32)
    np.testing.assert_array_equal(d[:2], z[2:4])
    np.testing.assert_array_equal(d[2:N], 0)


def test_bad_copies_are_value_errors():
    dev = sim_device()
    A, B = dev.buffer(64), dev.buffer(32)
    cb = dev.command_buffer()
    for args, msg in [((A, 0, B, 0, 64), "destination range"), ((A, 48, B, 0, 32), "source range"),
                      ((A, 2, B, 0, 8), "multiples of 4"), ((A, 0, B, 0, 6), "multiples of 4"),
                      ((A, 0, A, 8, 16), "overlap")]:
        with pytest.raises(ValueError, match=msg):
            cb.copy(*args)
    assert cb.counters["copies"] == 0
    cb.copy(A, 0, A, 32, 32)  # disjoint ranges of one buffer are fine
    cb.commit()
    cb.wait()
    with pytest.raises(ValueError, match="committed"):
        cb.copy(A, 0, B, 0, 4)


def test_two_command_buffers_in_flight_with_token_slots():
    """Decode-style double buffering: step i reads token slot i % 2 and writes slot
    (i + 1) % 2; at most two command buffers are outstanding."""
    dev = sim_device()
    slots = [upload(dev, np.array([1], np.uint32)), dev.buffer(4)]
    inflight, done = [], []
    want = 1
    for step in range(12):
        if len(inflight) == 2:
            inflight.pop(0).wait()
        cb = dev.command_buffer()
        cb.on_completed(lambda status, err, step=step: done.append((step, status)))
        prev, nxt = slots[step % 2], slots[(step + 1) % 2]
        cb.compute_pass().dispatch("st_token_step", 1, 1, buffers=[(0, prev), (1, nxt)],
                                   reads=[prev], writes=[nxt])
        cb.commit()
        inflight.append(cb)
        want = (want * 3 + 1) % 2**32
    for cb in inflight:
        cb.wait()
    assert download(slots[12 % 2], np.uint32)[0] == want
    assert [s for s, _ in sorted(done)] == list(range(12))
    assert all(status == "completed" for _, status in done)


def test_in_flight_limit():
    dev = sim_device()
    cb1, cb2 = dev.command_buffer(), dev.command_buffer()
    with pytest.raises(ValueError, match="outstanding"):
        dev.command_buffer()
    cb1.commit()
    cb3 = dev.command_buffer()  # waits for cb1 to complete
    assert cb1.status == "completed"
    del cb2, cb3


def test_command_buffer_misuse():
    dev = sim_device()
    cb = dev.command_buffer()
    with pytest.raises(ValueError, match="not committed"):
        cb.wait()
    p = cb.compute_pass()
    cb.commit()
    with pytest.raises(ValueError, match="already committed"):
        cb.commit()
    with pytest.raises(ValueError, match="ended"):
        p.dispatch("st_token_step", 1, 1)
    cb.wait()


def test_map_file_no_copy(tmp_path):
    page = os.sysconf("SC_PAGESIZE")
    x = np.arange(3 * page // 4, dtype=np.float32)  # 3 pages of floats
    path = tmp_path / "weights.bin"
    x.tofile(path)
    dev = sim_device()
    W = dev.map_file(str(path), page, 0)  # skip the first page
    assert W.size == 2 * page and W.label == str(path)
    n = page // 4
    O = dev.buffer(4 * n)
    cb = dev.command_buffer()
    cb.compute_pass().dispatch("st_add_f32", n, 64, buffers=[(0, W), (1, W, 4 * n), (2, O)],
                               constants=[(3, constant(n))], reads=[W], writes=[O])
    cb.commit()
    cb.wait()
    np.testing.assert_array_equal(download(O, np.float32), x[n:2 * n] + x[2 * n:3 * n])
    with pytest.raises(ValueError, match="page size"):
        dev.map_file(str(path), 1)
    with pytest.raises(RuntimeError, match="No such file"):
        dev.map_file(str(tmp_path / "missing.bin"))


@pytest.mark.parametrize("use_barrier", [1, 0])
def test_thread_order_modes_expose_a_missing_barrier(use_barrier):
    n, tg = 96, 48
    x = np.arange(n, dtype=np.float32)
    want = np.concatenate([np.roll(x[g:g + tg], -1) for g in range(0, n, tg)])
    results = {}
    for order in ("forward", "reverse", "random"):
        dev = sim_device(thread_order=order, seed=1)
        X, O = upload(dev, x), dev.buffer(4 * n)
        cb = dev.command_buffer()
        cb.compute_pass().dispatch("st_neighbour", n, tg, buffers=[(0, X), (1, O)],
                                   constants=[(2, constant(use_barrier))])
        cb.commit()
        cb.wait()
        results[order] = download(O, np.float32)
    if use_barrier:
        for got in results.values():
            np.testing.assert_array_equal(got, want)
    else:  # the race shows: poison (NaN) reads, and the orders disagree
        assert any(np.isnan(r).any() for r in results.values())
        assert not np.array_equal(results["forward"], results["reverse"], equal_nan=True)


@pytest.mark.skipif(bool(os.environ.get("LILY_IN_ASAN")), reason="AddressSanitizer reports these itself (and aborts)")
@pytest.mark.parametrize("where", ["buffer", "threadgroup"])
def test_kernel_writing_past_an_allocation_fails_cleanly(where):
    # the guard zone after every allocation turns a kernel's out-of-bounds write into an
    # error naming the allocation instead of a corrupted host heap
    dev = sim_device()
    x = np.arange(64 * 4, dtype=np.float32)
    a = upload(dev, x)
    out = dev.buffer(x.nbytes)
    small = dev.buffer(64)  # the kernel writes 64 float4 = 1 KiB
    cb = dev.command_buffer()
    p = cb.compute_pass()
    if where == "buffer":
        p.dispatch("st_tg_reverse", 64, 64, buffers=[(0, a), (1, small)], threadgroup_memory=[(0, 1024)],
                   reads=[a], writes=[small])
        match = r"wrote past the end of buffer\(1\).*64 bytes"
    else:
        p.dispatch("st_tg_reverse", 64, 64, buffers=[(0, a), (1, out)], threadgroup_memory=[(0, 16)],
                   reads=[a], writes=[out])
        match = r"wrote past the end of \[\[threadgroup\(0\)\]\] memory \(16 bytes\)"
    cb.commit()
    with pytest.raises(RuntimeError, match=match):
        cb.wait()
    # the device is still usable
    cb = dev.command_buffer()
    cb.compute_pass().dispatch("st_tg_reverse", 64, 64, buffers=[(0, a), (1, out)],
                               threadgroup_memory=[(0, 1024)], reads=[a], writes=[out])
    cb.commit()
    cb.wait()
    np.testing.assert_array_equal(download(out, np.float32).reshape(64, 4), x.reshape(64, 4)[::-1])


@pytest.mark.skipif(not os.environ.get("LILY_IN_ASAN"),
                    reason="only the sanitizer build (tools/run_sim_asan.sh: -fsanitize=address,alignment) "
                           "reports a misaligned access; a plain build may crash or read garbage")
def test_underaligned_threadgroup_vector_access_is_reported():
    """Threadgroup variables are aligned only as declared: a `threadgroup float a[8]` read as
    float4 is misaligned in the simulator, as it may be on a GPU, and the sanitizer says so."""
    import subprocess
    import sys
    code = ("from lily.lab.device import sim_device; d = sim_device(); o = d.buffer(16); cb = d.command_buffer(); "
            "cb.compute_pass().dispatch('st_tg_underaligned', 8, 8, buffers=[(0, o)], writes=[o]); "
            "cb.commit(); cb.wait()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    # UBSan's report, or (an aligned vector load on x86-64) ASan's fault report in the kernel
    assert r.returncode != 0, r.stderr[-2000:]
    assert "misaligned address" in r.stderr or ("SEGV" in r.stderr and "st_tg_underaligned" in r.stderr), \
        r.stderr[-2000:]
