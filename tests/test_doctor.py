"""lily doctor and lily.kernel_check on the simulator: every shipped kernel has a check (or
is listed as pending), the checks pass on the shipped kernels and fail on a wrong one, and
the CLI reports text and JSON."""

from __future__ import annotations

import json

import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily import kernel_check
from lily._device import sim_device
from lily.cli import main
from lily.errors import InvalidParameterError


@pytest.fixture(scope="module")
def dev():
    # apple10: the library as an M5 sees it, Metal 4 tensor-op kernels included
    return sim_device(gpu_family="apple10", verify_writes=True)


def test_every_shipped_kernel_has_a_check(dev):
    shipped = set(kernel_check.shipped_kernels(dev))
    unchecked = shipped - set(kernel_check.CHECKS)
    assert unchecked == kernel_check.PENDING, (
        f"kernels without a check: {sorted(unchecked - kernel_check.PENDING)} (add one to lily/kernel_check.py); "
        f"checked now but still listed as pending: {sorted(kernel_check.PENDING - unchecked)}")
    assert set(kernel_check.CHECKS) <= shipped, f"checks of kernels not in the library: {set(kernel_check.CHECKS) - shipped}"


def test_checks_pass_on_the_shipped_kernels(dev):
    results = kernel_check.run_checks(dev)
    bad = [(r.kernel, r.status, r.detail) for r in results if r.status not in ("PASS", "NO CHECK")]
    assert not bad, bad
    assert sum(r.status == "PASS" for r in results) == len(kernel_check.CHECKS)
    assert all(0 <= r.error <= 1 for r in results if r.status == "PASS")


class SwappedKernel:
    """A device whose dispatches of one kernel run another: a check must notice."""

    def __init__(self, dev, swap):
        self._dev, self._swap = dev, swap

    def __getattr__(self, name):
        return getattr(self._dev, name)

    def command_buffer(self):
        cb = self._dev.command_buffer()
        swap = self._swap

        class Pass:
            def __init__(self, p):
                self._p = p

            def __getattr__(self, name):
                return getattr(self._p, name)

            def dispatch(self, kernel, *a, **kw):
                return self._p.dispatch(swap.get(kernel, kernel), *a, **kw)

        class CB:
            def __getattr__(self, name):
                return getattr(cb, name)

            def compute_pass(self):
                return Pass(cb.compute_pass())
        return CB()


@pytest.mark.parametrize("kernel,other", [("gemv_q4", "gemv_q4_add"), ("attn_decode_d64_g4", "attn_decode_d64_g2"),
                                          ("gemm_q4", "gemm_q8")])
def test_a_wrong_kernel_fails_its_check(dev, kernel, other):
    wrong = SwappedKernel(dev, {kernel: other})
    [r] = kernel_check.run_checks(wrong, [kernel], seed=3)
    assert r.status in ("FAIL", "ERROR"), r


def test_kernel_without_a_check_is_reported(dev, monkeypatch):
    monkeypatch.delitem(kernel_check.CHECKS, "rms_norm")
    [r] = kernel_check.run_checks(dev, ["rms_norm"])
    assert r.status == "NO CHECK" and r.error is None


def test_unknown_kernel_is_refused(dev):
    with pytest.raises(InvalidParameterError, match="unknown kernel"):
        kernel_check.run_checks(dev, ["no_such_kernel"])


def test_doctor_json(capsys):
    assert main(["doctor", "--device", "sim", "--json", "--kernels", "gemv_q4,rms_norm,embed_rows_q4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {k["kernel"]: k["status"] for k in report["kernels"]} == {
        "gemv_q4": "PASS", "rms_norm": "PASS", "embed_rows_q4": "PASS"}
    assert report["device"]["name"] == "sim" and report["device"]["tensor_ops"] is True
    assert report["summary"]["ok"] is True
    assert report["model"]["weights"] > 0 and report["model"]["kv_cache"] > 0


def test_doctor_text_report(capsys):
    assert main(["doctor", "--kernels", "sample_greedy", "--max-context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "PASS     sample_greedy" in out and "at max_context 4096" in out
    assert "--- paste this into a bug report ---" in out and "kernels: 1 PASS" in out


def test_doctor_unknown_kernel_is_an_error(capsys):
    assert main(["doctor", "--kernels", "nope"]) == 1
    assert "unknown kernel(s) nope" in capsys.readouterr().err


def test_pipeline_report_names_a_failing_pipeline():
    from lily.doctor import _pipeline

    class Fake:
        def pipeline_info(self, name):
            if name == "bad":
                raise RuntimeError("Compiler encountered an internal error")
            return {"kernel": name, "max_threads_per_threadgroup": 896, "thread_execution_width": 32,
                    "static_threadgroup_memory": 4096}

    assert _pipeline(Fake(), "good") == {"kernel": "good", "built": True, "max_threads_per_threadgroup": 896,
                                         "thread_execution_width": 32, "static_threadgroup_memory": 4096}
    bad = _pipeline(Fake(), "bad")
    assert bad["built"] is False and "internal error" in bad["error"]
