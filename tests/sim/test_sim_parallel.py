"""The parallel simulator (docs/device-layer.md, "Execution model and guarantees"): the
threadgroups of a dispatch, and the dispatches of a barrier stage, on a pool of OS threads
(``sim_device(threads=N)``).

* the option and ``$LILY_SIM_THREADS`` are validated;
* every shipped kernel gives the same bytes with ``threads=1`` and ``threads=4``, on
  lily.lab.kernels' inputs (the twin checks ``lily doctor`` runs), and so do a prefill and
  a decode step of the ``tiny`` preset through the runtime;
* threadgroups and dispatches of one stage really run at the same time, atomics are atomic
  across OS threads, and a race between threadgroups that the serial simulator cannot show
  (a read-modify-write of device memory without atomics) is caught;
* the checks keep working with several threads: hazards, write and read verification, guard
  zones, poisoning, thread orders, and a kernel fault reports the same threadgroup and thread
  whichever OS thread finds it first.

The suite runs the other simulator tests with one thread per pytest worker (tests/simdev.py);
these name their thread counts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from harness import run  # noqa: E402
from lily.errors import InvalidParameterError  # noqa: E402
from lily.lab.device import constant, download, sim_device, upload  # noqa: E402
from lily.lab.kernels.registry import run_checks, shipped_kernels  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
N = 4  # OS threads of the parallel devices: more than CI's 2 cores, so they are also preempted


# ----------------------------------------------------------------------------- the option


@pytest.mark.parametrize("bad", [0, -1, 1025, 2**70, 1.5, "2", True])
def test_threads_option_is_validated(bad):
    with pytest.raises(ValueError, match=r"threads must be a whole number of OS threads, 1\.\.1024 .*not "):
        sim_device(threads=bad)
    from lily.native_backend import make_device
    with pytest.raises(InvalidParameterError, match="sim device options: threads must be"):
        make_device("sim", threads=bad)


def test_engine_takes_threads_as_a_sim_option(demo_path):
    from lily.engine import Engine
    with pytest.raises(InvalidParameterError, match="threads must be a whole number"):
        Engine.load(demo_path, device="sim", max_context=16, device_options={"device_options": {"threads": 0}})


def test_default_threads(monkeypatch):
    monkeypatch.delenv("LILY_SIM_THREADS", raising=False)
    assert _core.sim_default_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("LILY_SIM_THREADS", "")  # empty: unset
    assert _core.sim_default_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("LILY_SIM_THREADS", "3")
    assert _core.sim_default_threads() == 3
    for bad in ("0", "x", "2.5", "4097"):
        monkeypatch.setenv("LILY_SIM_THREADS", bad)
        with pytest.raises(ValueError, match=f"LILY_SIM_THREADS must be a whole number of threads, 1..1024, not '{bad}'"):
            _core.sim_default_threads()
        with pytest.raises(ValueError, match="LILY_SIM_THREADS"):
            sim_device()
    sim_device(threads=2)  # an explicit count does not read it


# ----------------------------------------------------------------------------- bit identity


class _Recording:
    """A device whose new buffers are remembered, so a check's every input, scratch and
    output can be compared byte for byte afterwards."""

    def __init__(self, dev):
        self._dev, self.buffers = dev, []

    def buffer(self, *args, **kwargs):
        b = self._dev.buffer(*args, **kwargs)
        self.buffers.append(b)
        return b

    def __getattr__(self, name):
        return getattr(self._dev, name)


def _families() -> dict[str, list[str]]:
    """The shipped kernels by the metal/*.metal file that defines them (host names of
    template instantiations and plain kernel functions)."""
    names = set(shipped_kernels(sim_device(gpu_family="apple10", threads=1)))
    fam: dict[str, list[str]] = {}
    for src in sorted((ROOT / "metal").glob("*.metal")):
        text = src.read_text()
        found = set(re.findall(r'host_name\("(\w+)"\)', text)) | set(re.findall(r"kernel\s+void\s+(\w+)\s*\(", text))
        if found & names:
            fam[src.stem] = sorted(found & names)
    missing = names - {k for ks in fam.values() for k in ks}
    assert not missing, f"kernels defined in no metal/*.metal file: {sorted(missing)}"
    return fam


FAMILIES = _families() if "sim" in _core.compiled_devices() else {}


def _run_family(kernels, inputs, **options):
    out = {}
    for k in kernels:
        dev = _Recording(sim_device(gpu_family="apple10", **options))
        (res,) = run_checks(dev, [k], seed=inputs)
        assert res.status == "PASS", (k, options, res.detail)
        out[k] = [b.read(0, -1) for b in dev.buffers]
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_kernel_is_bit_identical_on_several_threads(family):
    """Each kernel's doctor check (random inputs from one seed) on the serial simulator and on
    4 threads, barrier stages overlapping (forward order, no verification): every buffer the
    check made (inputs, scratch, outputs) holds the same bytes. The random orders and the
    verification modes draw each threadgroup's thread order from its own seed, so they are
    independent of the thread count too."""
    kernels = FAMILIES[family]
    assert _run_family(kernels, 11, threads=1) == _run_family(kernels, 11, threads=N)
    checked = dict(thread_order="random", order="random", seed=5, verify_writes=True, verify_reads=True)
    sub = kernels[:1]
    assert _run_family(sub, 12, threads=1, **checked) == _run_family(sub, 12, threads=N, **checked)


def test_generation_is_bit_identical_on_two_threads(tiny_checkpoint):
    """The whole runtime on the ``tiny`` preset: a prefill in two chunks and a decode step give
    the same logits, bit for bit, on one thread and on two. (Through the engine's backend: an
    Engine would also parse the 248K-entry tokenizer, seconds per load; every position's
    logits would add the vocabulary projection of each row, 3 s per run.)"""
    from lily.checkpoint import open_checkpoint
    from lily.native_backend import NativeBackend
    ck = open_checkpoint(tiny_checkpoint)
    ids = np.array([9707, 11, 1052, 525, 279, 3405], np.uint32)  # any in-vocabulary ids
    runs = []
    for threads in (1, 2):
        b = NativeBackend(ck, 16, "sim", prefill_chunk=4, device_options={"threads": threads})
        logits = b.forward(ids)
        step = b.forward(np.array([logits.argmax()], np.uint32))
        runs.append([x.view(np.uint32) for x in (logits, step)])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- real concurrency


def test_atomics_are_atomic_across_os_threads():
    """4M atomic adds to one counter from 32 threadgroups on 4 OS threads, ten times: none is
    lost. (A plain add loses some in most runs of this test, whenever two OS threads happen
    to run at once.)"""
    groups, tg, rounds = 32, 64, 2000
    dev = sim_device(threads=N)
    ones = upload(dev, np.ones(32, np.uint32))
    for _ in range(10):
        counter = upload(dev, np.zeros(1, np.uint32))
        run(dev, "st_count_atomic", groups, tg, buffers=[(0, counter), (2, ones)], constants=[(1, constant(rounds))],
            reads=[ones], writes=[counter])
        assert download(counter, np.uint32)[0] == groups * tg * rounds


def test_threadgroups_of_a_dispatch_run_at_the_same_time():
    """Two threadgroups, each waiting for the other: on one thread the first gives up (the
    second sees it); on two they meet."""
    for threads, bound, want in ((1, 1 << 12, [0, 1]), (2, 1 << 31, [1, 1])):
        dev = sim_device(threads=threads)
        flags, seen = upload(dev, np.zeros(2, np.uint32)), upload(dev, np.full(2, 7, np.uint32))
        run(dev, "st_meet", 2, 1, buffers=[(0, flags), (1, seen)], constants=[(2, constant(0, bound))],
            writes=[flags, seen])
        assert download(seen, np.uint32).tolist() == want, threads


@pytest.mark.parametrize("options, want", [
    (dict(threads=2), [1, 1]),                   # one stage, both dispatches at once
    (dict(threads=1), [0, 1]),                   # one after another
    (dict(threads=2, verify_writes=True), [0, 1]),  # verification attributes bytes per dispatch
    (dict(threads=2, order="reverse"), [1, 0]),  # the stage orders are orders
])
def test_dispatches_of_one_stage_run_at_the_same_time(options, want):
    """Two one-threadgroup dispatches in one barrier stage (each declares only its own flag
    and slot), each waiting for the other. They overlap, as on a GPU, unless a check needs
    them one by one."""
    dev = sim_device(**options)
    flags, seen = upload(dev, np.zeros(2, np.uint32)), upload(dev, np.full(2, 7, np.uint32))
    cb = dev.command_buffer()
    p = cb.compute_pass()
    for i in (0, 1):
        p.dispatch("st_meet", 1, 1, buffers=[(0, flags), (1, seen)],
                   constants=[(2, constant(i, 1 << 31 if want == [1, 1] else 1 << 12))],
                   writes=[(flags, 4 * i, 4), (seen, 4 * i, 4)], label=f"meet{i}")
    cb.commit()
    cb.wait()
    assert cb.counters["barrier_stages"] == 1
    assert download(seen, np.uint32).tolist() == want


def test_race_between_threadgroups_is_caught_only_in_parallel():
    """A read-modify-write of device memory without atomics, across threadgroups: one after
    another, in any order, the count is exact (the serial simulator cannot see the race);
    with threadgroups on several OS threads updates are lost, as on a GPU. Whether they are
    depends on two OS threads running at once, i.e. on the OS scheduler, so the parallel
    dispatch (~10 ms) is repeated until an update is lost (on the shared 2-core development
    machine, within 20 runs in practice; the bound is far above it)."""
    groups, tg, rounds = 16, 64, 32
    want = groups * rounds

    def count(dev):
        counter = upload(dev, np.zeros(1, np.uint32))
        run(dev, "st_race_rmw", groups, tg, buffers=[(0, counter)], constants=[(1, constant(rounds))],
            writes=[counter])
        return int(download(counter, np.uint32)[0])

    for order in ("forward", "reverse", "random"):
        assert count(sim_device(threads=1, thread_order=order, seed=3)) == want
    dev = sim_device(threads=N)
    runs = 0
    while runs < 300 and count(dev) == want:
        runs += 1
    assert runs < 300, f"no update lost in {runs} parallel runs"


# ----------------------------------------------------------------------------- the checks, on several threads


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_first_fault_is_reported_whichever_thread_finds_it(order):
    """Every threadgroup faults, threadgroup 0 last: the error names the threadgroup that
    starts first in the order (and the same thread) on one thread and on four."""
    msgs = []
    for threads in (1, N, N):
        dev = sim_device(threads=threads, thread_order=order, seed=9)
        sink = upload(dev, np.zeros(1, np.uint32))
        cb = dev.command_buffer()
        cb.compute_pass().dispatch("st_fault_late", 32 * 16, 32, buffers=[(0, sink)], constants=[(1, constant(1 << 22))])
        cb.commit()
        with pytest.raises(RuntimeError, match="st_fault_late") as e:
            cb.wait()
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] == msgs[2], msgs
    first = {"forward": "(0,0,0)", "reverse": "(15,0,0)"}.get(order)
    assert re.search(r"threadgroup \(\d+,0,0\) thread \(\d+,0,0\)", msgs[0]), msgs[0]
    if first:
        assert f"threadgroup {first}" in msgs[0], msgs[0]


def test_hazards_and_verification_on_several_threads():
    n = 1000
    x = np.arange(n, dtype=np.float32)

    def add(p, a, b, out, reads, writes, label):
        p.dispatch("st_add_f32", n, 32, buffers=[(0, a), (1, b), (2, out)], constants=[(3, constant(n))],
                   reads=reads, writes=writes, label=label)

    def one(dev, *args):
        cb = dev.command_buffer()
        add(cb.compute_pass(), *args)
        cb.commit()
        return cb

    # a conflict inside one stage of a manual-barrier pass (found when encoded)
    dev = sim_device(threads=N)
    A, B = upload(dev, x), upload(dev, x)
    cb = dev.command_buffer()
    p = cb.compute_pass(manual_barriers=True)
    add(p, A, A, B, [A], [B], "producer")
    with pytest.raises(_core.HazardError, match="read-after-write.*producer"):
        add(p, B, B, A, [B], [A], "consumer")
    # a write outside the declared ranges
    dev = sim_device(threads=N, verify_writes=True)
    A, C = upload(dev, x), dev.buffer(4 * n)
    cb = one(dev, A, A, C, [A], [(C, 0, 4 * (n - 1))], "short_declaration")
    with pytest.raises(_core.HazardError, match=r"short_declaration.*wrote byte 3996"):
        cb.wait()
    # a read outside the declared ranges
    dev = sim_device(threads=N, verify_writes=True, verify_reads=True)
    A, C = upload(dev, x), dev.buffer(4 * n)
    cb = one(dev, A, A, C, [(A, 0, 4 * (n - 1))], [C], "short_read")
    with pytest.raises(_core.HazardError, match=r"short_read.*reads outside its declared read ranges.*byte 399[6-9] "):
        cb.wait()
    # poison: half of A never written
    dev = sim_device(threads=N)
    A, C = dev.buffer(4 * n), dev.buffer(4 * n)
    A.write(np.ones(n // 2, np.float32))
    one(dev, A, A, C, [A], [C], "poisoned").wait()
    out = download(C, np.float32)
    assert (out[: n // 2] == 2).all() and np.isnan(out[n // 2:]).all()


def test_missing_barrier_still_shows_on_several_threads():
    n, tg = 96 * 8, 48
    x = np.arange(n, dtype=np.float32)
    want = np.concatenate([np.roll(x[g:g + tg], -1) for g in range(0, n, tg)])
    results = {}
    for use_barrier in (1, 0):
        for order in ("forward", "reverse", "random"):
            dev = sim_device(threads=N, thread_order=order, seed=1)
            X, O = upload(dev, x), dev.buffer(4 * n)
            run(dev, "st_neighbour", n, tg, buffers=[(0, X), (1, O)], constants=[(2, constant(use_barrier))],
                threadgroups=False)
            results[use_barrier, order] = download(O, np.float32)
    for order in ("forward", "reverse", "random"):
        np.testing.assert_array_equal(results[1, order], want)
    assert any(np.isnan(results[0, o]).any() for o in ("forward", "reverse", "random"))
    assert not np.array_equal(results[0, "forward"], results[0, "reverse"], equal_nan=True)


@pytest.mark.skipif(bool(os.environ.get("LILY_IN_ASAN")), reason="AddressSanitizer reports these itself (and aborts)")
def test_guard_zone_in_an_overlapping_stage_names_every_candidate():
    """Two dispatches of one stage bind a buffer and one writes past its end: they ran at
    the same time, so the error names both (one dispatch alone is named as before)."""
    dev = sim_device(threads=N)
    x = np.arange(64 * 4, dtype=np.float32)
    a, out = upload(dev, x), dev.buffer(x.nbytes)
    small = upload(dev, np.zeros(16, np.float32))  # the first kernel writes 64 float4 = 1 KiB
    cb = dev.command_buffer()
    p = cb.compute_pass()
    p.dispatch("st_tg_reverse", 64, 64, buffers=[(0, a), (1, small)], threadgroup_memory=[(0, 1024)],
               reads=[a], writes=[small], label="overrun")
    p.dispatch("st_add_f32", 16, 16, buffers=[(0, a), (1, small), (2, out)], constants=[(3, constant(16))],
               reads=[a], writes=[out], label="bystander")  # reads `small` undeclared
    cb.commit()
    with pytest.raises(RuntimeError, match=r"one barrier stage wrote past the end of buffer #\d+ \(64 bytes\).*"
                                           r"'overrun \(#0\)' \(buffer\(1\)\), 'bystander \(#1\)' \(buffer\(1\)\)"):
        cb.wait()
    assert cb.counters["barrier_stages"] == 1
