"""lily doctor and lily.lab.kernels on the simulator: every shipped kernel has a check (or
is listed as pending), the checks pass on the shipped kernels and fail on a wrong one, and
the CLI reports text and JSON."""

from __future__ import annotations

import json

import pytest

from lily import _core

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")

from lily.lab import doctor
from lily.lab.kernels import registry
from lily.lab.device import sim_device
from lily.cli import main
from lily.errors import InvalidParameterError


@pytest.fixture(scope="module")
def dev():
    # apple10: the library as an M5 sees it, Metal 4 tensor-op kernels included
    return sim_device(gpu_family="apple10", verify_writes=True)


def test_every_shipped_kernel_has_a_check(dev):
    shipped = set(registry.shipped_kernels(dev))
    unchecked = shipped - set(registry.CHECKS)
    assert unchecked == registry.PENDING, (
        f"kernels without a check: {sorted(unchecked - registry.PENDING)} (add one to its family's module in lily/lab/kernels/); "
        f"checked now but still listed as pending: {sorted(registry.PENDING - unchecked)}")
    assert set(registry.CHECKS) <= shipped, f"checks of kernels not in the library: {set(registry.CHECKS) - shipped}"


def test_checks_pass_on_the_shipped_kernels(dev):
    results = registry.run_checks(dev)
    bad = [(r.kernel, r.status, r.detail) for r in results if r.status not in ("PASS", "NO CHECK")]
    assert not bad, bad
    assert sum(r.status == "PASS" for r in results) == len(registry.CHECKS)
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
    [r] = registry.run_checks(wrong, [kernel], seed=3)
    assert r.status in ("FAIL", "ERROR"), r


def test_kernel_without_a_check_is_reported(dev, monkeypatch):
    monkeypatch.delitem(registry.CHECKS, "rms_norm")
    [r] = registry.run_checks(dev, ["rms_norm"])
    assert r.status == "NO CHECK" and r.error is None


def test_unknown_kernel_is_refused(dev):
    with pytest.raises(InvalidParameterError, match="unknown kernel"):
        registry.run_checks(dev, ["no_such_kernel"])


def test_doctor_json(capsys):
    assert main(["doctor", "--quick", "--device", "sim", "--json", "--kernels", "gemv_q4,rms_norm,embed_rows_q4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {k["kernel"]: k["status"] for k in report["kernels"]} == {
        "gemv_q4": "PASS", "rms_norm": "PASS", "embed_rows_q4": "PASS"}
    assert report["device"]["name"] == "sim" and report["device"]["tensor_ops"] is True
    assert report["device"]["bfloat_tensor_ops"] is True and report["device"]["bfloat_tensor_ops_status"] == ""
    attn = report["device"]["tensor_attention_path"]  # the simulator's own cooperative-tensor layout
    assert attn["path"] == "threadgroup memory" and attn["mismatch"]["tensor"] == "scores", attn
    assert report["device"]["threadgroup_memory"]["status"] == "not measured"  # no compiler allocation on sim
    pipes = report["pipelines"]
    assert len(pipes) == report["device"]["kernels"]
    assert all(p["built"] and 32 <= p["max_threads_per_threadgroup"] <= 1024 for p in pipes), pipes[:3]
    assert report["summary"]["ok"] is True
    assert report["model"]["weights"] > 0 and report["model"]["kv_cache"] > 0
    # sized as Engine.load sizes it: the prefill scratch is counted, with the chunk chosen (the
    # weights differ by the weight cache's layout of the unaligned demo files: < 1%)
    from lily import Engine
    use = Engine.load(device="sim").backend.runtime.memory_use
    m = report["model"]
    assert (m["kv_cache"], m["scratch"], m["prefill_chunk"]) == (use["kv_cache"] + use["state"], use["scratch"], 4096)
    assert abs(m["weights"] - use["weights"]) < 0.01 * use["weights"] and m["fits"]


def test_doctor_text_report(capsys):
    assert main(["doctor", "--quick", "--kernels", "sample_greedy", "--max-context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "PASS     sample_greedy" in out and "at max_context 4096" in out
    assert "--- paste this into a bug report ---" in out and "kernels: 1 PASS" in out


def test_doctor_unknown_kernel_is_an_error(capsys):
    assert main(["doctor", "--quick", "--kernels", "nope"]) == 1
    assert "unknown kernel(s) nope" in capsys.readouterr().err


def test_pipeline_report_names_a_failing_pipeline():
    from lily.lab.doctor import _pipeline

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


def test_a_kernel_draws_the_same_inputs_alone_or_with_others(dev):
    alone = {r.kernel: r.error for r in registry.run_checks(dev, ["rms_norm"], seed=11)}
    together = {r.kernel: r.error for r in registry.run_checks(dev, ["gemv_q4", "embed_rows_q4", "rms_norm"],
                                                                      seed=11)}
    other_seed = {r.kernel: r.error for r in registry.run_checks(dev, ["rms_norm"], seed=12)}
    assert alone["rms_norm"] == together["rms_norm"] > 0
    assert other_seed["rms_norm"] != alone["rms_norm"]


def test_doctor_draws_and_reports_a_seed(capsys):
    args = ["doctor", "--quick", "--device", "sim", "--json", "--kernels", "rms_norm"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    seed = first["seed"]
    assert isinstance(seed, int) and seed >= 0
    assert main([*args, "--seed", str(seed)]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["seed"] == seed and again["kernels"][0]["error"] == first["kernels"][0]["error"]
    assert main(["doctor", "--quick", "--kernels", "rms_norm", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert "--seed 7" in out and "seed: 7" in out.split("--- paste this into a bug report ---")[1]


@pytest.mark.parametrize("args", [["--seed", "-1"], ["--seed", "x"], ["--max-context", "0"], ["--max-context", "-1"]])
def test_doctor_refuses_bad_numbers_in_argparse(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--quick", "--kernels", "rms_norm", *args])
    assert e.value.code == 2 and "expected an integer" in capsys.readouterr().err


def test_doctor_refuses_a_context_beyond_the_model(capsys):
    from lily.checkpoint import open_checkpoint
    from lily.engine import default_model_path
    limit = open_checkpoint(default_model_path()).config.max_position_embeddings
    assert main(["doctor", "--quick", "--kernels", "rms_norm", "--max-context", str(limit + 1)]) == 1
    assert f"max_context must be an integer in [1, {limit}]" in capsys.readouterr().err


def test_doctor_fails_when_the_model_does_not_fit(capsys, monkeypatch):
    from lily.lab import system
    monkeypatch.setattr(system, "_physical_memory", lambda: 2**20)  # 1 MiB: nothing fits
    assert main(["doctor", "--quick", "--kernels", "rms_norm"]) == 1
    out = capsys.readouterr().out
    block = out.split("--- paste this into a bug report ---")[1]
    assert "TOO LARGE" in out and "memory:" in block and "TOO LARGE" in block and "weights" in block


def test_doctor_fails_on_a_missing_checkpoint(capsys, tmp_path):
    """A --model that does not exist is the one message every command gives (issue 29: the
    doctor said "not a directory" in its memory section where generate said this)."""
    nope = tmp_path / "nope"
    assert main(["doctor", "--quick", "--kernels", "rms_norm", "--model", str(nope)]) == 1
    out = capsys.readouterr()
    assert out.err == f"lily: error: --model {nope}: the path does not exist\n" and out.out == ""


def test_doctor_sim_report_details(capsys):
    assert main(["doctor", "--quick", "--device", "sim", "--kernels", "rms_norm"]) == 0
    out = capsys.readouterr().out
    block = out.split("--- paste this into a bug report ---")[1]
    assert "device sim (apple10): simulator, no GPU tested" in block
    assert "sim: sim" not in out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["rms_norm"])
    assert row.split()[-1] == "-"  # threadgroup memory unknown on the simulator, not 0
    assert ("no Metal GPU in this build" in out) == ("metal" not in _core.compiled_devices())
    assert "prefill attn    scores and P through threadgroup memory: the scores tensor's slot " in out
    assert "| prefill attention: scores and P through threadgroup memory: the scores tensor's" in block


def test_doctor_reports_the_register_attention(capsys, monkeypatch):
    """On a device with the M5's fragment layout the doctor says the attention keeps the
    scores and P in registers."""
    import lily.native_backend
    make = lily.native_backend.make_device
    monkeypatch.setattr(lily.native_backend, "make_device", lambda name, **o: make(name, **{**o, "tensor_layout": "nax"}))
    assert main(["doctor", "--quick", "--device", "sim", "--kernels", "rms_norm"]) == 0
    out = capsys.readouterr().out
    assert "prefill attn    scores and P in registers (the fragment layout holds)" in out


def test_doctor_reports_tensor_ops_without_bfloat(capsys, monkeypatch):
    """On a device whose tensor ops take no bfloat operands the doctor says why prefill does
    not use them (its tensor-op kernels take bfloat operands: text, bug-report line and JSON);
    the kernels it lists are the ones that device offers, so the report stays OK."""
    import lily.native_backend
    make = lily.native_backend.make_device
    monkeypatch.setattr(lily.native_backend, "make_device", lambda name, **o: make(name, **{**o, "bfloat_tensor_ops": False}))
    assert main(["doctor", "--quick", "--device", "sim", "--kernels", "rms_norm"]) == 0
    out = capsys.readouterr().out
    assert "tensor ops      yes" in out
    assert "tensor bfloat   no: the simulator was created with bfloat_tensor_ops=False" in out
    assert "the prefill GEMMs and attention run simdgroup_matrix" in out
    assert "prefill attn    simdgroup_matrix (no bfloat tensor ops: the simulator was created with" in out
    block = out.split("--- paste this into a bug report ---")[1]
    assert "tensor ops: yes | tensor bfloat: the simulator was created with bfloat_tensor_ops=False" in block
    assert main(["doctor", "--quick", "--device", "sim", "--json", "--kernels", "rms_norm"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"]["tensor_ops"] is True and report["device"]["bfloat_tensor_ops"] is False
    assert "bfloat_tensor_ops=False" in report["device"]["bfloat_tensor_ops_status"]
    assert report["summary"]["ok"] is True


def test_doctor_unknown_kernel_suggests_close_names(capsys):
    assert main(["doctor", "--quick", "--kernels", "rms_nrom"]) == 1
    err = capsys.readouterr().err
    assert "unknown kernel(s) rms_nrom; did you mean" in err and "rms_norm" in err


def test_doctor_on_a_mac_without_the_metal_device_says_how_to_build_it(capsys, monkeypatch):
    import sys

    from lily.lab import doctor
    monkeypatch.setattr(doctor, "_core_devices", lambda: ["sim"])
    monkeypatch.setattr(sys, "platform", "darwin")
    assert main(["doctor", "--quick", "--device", "sim", "--kernels", "rms_norm"]) == 0
    out = capsys.readouterr().out
    assert "no Metal GPU in this build" in out
    assert "xcodebuild -downloadComponent MetalToolchain" in out and "-Ccmake.define.LILY_METAL=ON" in out
    monkeypatch.setattr(doctor, "_core_devices", lambda: ["metal", "sim"])  # an explicit --device sim on a Mac
    assert main(["doctor", "--quick", "--device", "sim", "--kernels", "rms_norm"]) == 0
    assert "no Metal GPU in this build" not in capsys.readouterr().out


def test_doctor_checks_the_model_shapes(capsys):
    """Without --quick the kernels run a second time at the model's own shapes (a chunk of
    --rows rows; the simulator's default is smaller than the model's 4096)."""
    assert main(["doctor", "--device", "sim", "--json", "--seed", "3", "--rows", "64",
                 "--kernels", "moe_route,argmax_partial,rms_norm_bf16"]) == 0
    report = json.loads(capsys.readouterr().out)
    shapes = report["model_shapes"]
    assert shapes["rows"] == 64 and [k["status"] for k in shapes["kernels"]] == ["PASS"] * 3
    assert report["end_to_end"] == []  # not with --kernels
    assert main(["doctor", "--device", "sim", "--kernels", "moe_route"]) == 0
    out = capsys.readouterr().out
    assert "kernels at the model's shapes (hidden 2048, 256 experts top-8, vocabulary 248,320" in out
    assert f"prefill chunks of {doctor.SIM_MODEL_ROWS} rows" in out and "--rows 4096" in out


def test_model_shapes_are_the_models(dev, monkeypatch):
    """A model-size check draws the model's dimensions (lily.lab.estimate's config): the
    arguments moe_route and argmax_partial are dispatched with."""
    from lily.lab.device import pack_args
    from lily.lab.kernels import harness, moe
    seen = []
    monkeypatch.setattr(moe, "run_bound", lambda *a, **k: seen.append(a[5]) or harness.run_bound(*a, **k))
    registry.run_checks(dev, ["moe_route"], seed=1, size=harness.Size(model=True, rows=64))
    assert seen == [pack_args("RouteArgs", experts=256, top_k=8, hidden=2048, norm_topk=1)]
    assert harness.model().vocab_size == 248320


def test_end_to_end_on_the_simulator():
    """The demo model on sim against the reference: teacher-forced logits, then a prefill and
    16 sampled decode steps on the device."""
    results = doctor.end_to_end("sim", seed=5)
    assert [(r.kernel, r.status) for r in results] == [("teacher-forced", "PASS"), ("prefill + sampled decode", "PASS")], \
        [r.detail for r in results]
    assert "64 positions in prefill chunks of 16" in results[0].detail and "16 of 16 steps" in results[1].detail


class _Scaled:
    """An engine whose logits (prefill) or reported log-probabilities (generate) are off."""

    def __init__(self, engine, factor):
        self.engine, self.factor = engine, factor

    def reset(self):
        self.engine.reset()

    def prefill(self, ids, **kw):
        return self.engine.prefill(ids, **kw) * self.factor

    def generate(self, ids, **kw):
        import dataclasses
        r = self.engine.generate(ids, **kw)
        return dataclasses.replace(r, logprobs=[dataclasses.replace(lp, logprob=lp.logprob * self.factor)
                                               for lp in r.logprobs])


def test_end_to_end_fails_on_wrong_logits(demo_engine):
    """The comparisons pass a second reference engine and fail it with its logits scaled."""
    from lily import Engine
    other = Engine.load(device="reference")
    ids = demo_engine.tokenizer.encode(doctor.E2E_TEXT)[:24]
    assert doctor.compare_teacher_forced(_Scaled(other, 1.0), demo_engine, ids)["ok"]
    bad = doctor.compare_teacher_forced(_Scaled(other, 1.1), demo_engine, ids)
    assert not bad["ok"] and bad["rel_err"] > 0.05
    assert doctor.check_sampled_steps(_Scaled(other, 1.0), demo_engine, ids[:8], seed=2)["ok"]
    assert not doctor.check_sampled_steps(_Scaled(other, 1.5), demo_engine, ids[:8], seed=2)["ok"]


def test_threadgroup_memory_against_the_estimate():
    """lily doctor's tg memory line: a GPU compiler's static allocation per kernel against the
    figure the estimate's residency takes (estimate.declared_threadgroup_memory)."""
    from lily.lab import estimate
    from lily.lab.doctor import TG_MEMORY_SLACK, threadgroup_memory_check

    declared = estimate.declared_threadgroup_memory()
    # the figures the kernels' headers give (prefill_args.h, gemm_args.h)
    assert declared["attn_prefill_d256_g8_tensor"] == 13072
    assert declared["gdn_scan_k128_v128_r32"] == 8 * (2 * 128 + 2 * 32 + 2) * 4
    assert declared["gemm_q4_tensor"] == 9216 and declared["moe_route_topk"] == 0
    # both paths, the decode attention unsplit and split, a small chunk's expert tiles
    assert declared["attn_prefill_d256_g8"] == 31232 and declared["attn_decode_fused_d256_g8"] == 12032
    assert declared["attn_decode_split_fused_d256_g8"] == 12032 and declared["moe_gemm_gate_up_q4_t16_tensor"] == 9216

    def pipe(kernel, got, built=True):
        return {"kernel": kernel, "built": built, "static_threadgroup_memory": got}

    same = [pipe(k, v) for k, v in declared.items()]
    assert threadgroup_memory_check(same, declared) == {
        "status": "match", "kernels": sum(v > 0 for v in declared.values()), "differs": [], "undeclared": {}}
    padded = [pipe("gemm_q4_tensor", 9216 + TG_MEMORY_SLACK), pipe("moe_route_topk", 128),
              pipe("not_in_the_plan", 1 << 20), pipe("gdn_scan_k128_v128_r32", None),
              pipe("attn_prefill_d256_g8_tensor", 0, built=False)]
    got = threadgroup_memory_check(padded, declared)
    assert got == {"status": "match", "kernels": 1, "differs": [], "undeclared": {"moe_route_topk": 128}}
    more = [pipe("gemm_q4_tensor", 9216 + TG_MEMORY_SLACK + 16), pipe("attn_prefill_d256_g8_tensor", 13072 - 16)]
    got = threadgroup_memory_check(more, declared)
    assert got["status"] == "differs" and got["kernels"] == 2
    assert got["differs"] == [{"kernel": "gemm_q4_tensor", "declared": 9216, "compiled": 9216 + TG_MEMORY_SLACK + 16},
                              {"kernel": "attn_prefill_d256_g8_tensor", "declared": 13072, "compiled": 13072 - 16}]
    # the simulator reports no allocation (None): nothing to compare
    assert threadgroup_memory_check([pipe(k, None) for k in declared], declared)["status"] == "not measured"


def test_doctor_compares_a_gpu_s_threadgroup_memory(monkeypatch, capsys):
    """Where pipelines report the compiler's allocation (a GPU's; the simulator stands in,
    named "metal"), doctor prints the comparison and names a kernel that differs, in the
    report and the bug-report block."""
    from lily.lab import doctor, estimate

    declared = estimate.declared_threadgroup_memory()
    real_pipeline, real_open = doctor._pipeline, doctor.open_device

    def measured(dev, kernel):
        p = real_pipeline(dev, kernel)
        p["static_threadgroup_memory"] = declared.get(kernel, 0) + (4096 if kernel == "gemm_q4_tensor" else 0)
        return p

    monkeypatch.setattr(doctor, "_pipeline", measured)
    monkeypatch.setattr(doctor, "open_device", lambda name: ("metal", *real_open("sim")[1:]))
    doctor.run("sim", kernels=["rms_norm"], quick=True, seed=1)
    out = capsys.readouterr().out
    assert ("tg memory       differs from the estimate's residency for 1 of "
            f"{sum(v > 0 for v in declared.values())} kernels: gemm_q4_tensor 9216 B declared, 13312 B compiled") in out
    assert "tg memory differs: gemm_q4_tensor 9216/13312" in out.split("--- paste this into a bug report ---")[1]
