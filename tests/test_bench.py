"""lily bench: the protocol's bookkeeping (alternating order, medians, ratios) on scripted
engines, the arrival timing, and one real run of both engines on the demo model."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lily import Engine, _core
from lily.lab.bench import LengthResult, Sample, _timed, format_report, report, run_bench, teacher_forced
from lily.errors import InvalidParameterError


class Scripted:
    """An engine whose every request takes the times it is told to (no clock involved)."""

    def __init__(self, label, first_s, decode_s):
        self.label, self.first_s, self.decode_s = label, first_s, decode_s
        self.calls = []

    def run(self, prompt, n):
        self.calls.append((len(prompt), n))
        k = len(self.calls)
        return Sample(len(prompt), n, self.first_s(len(prompt), k), self.decode_s(len(prompt), k))

    def logits(self, ids):
        raise AssertionError("not used")


def test_run_bench_alternates_and_reports_median_ratios():
    calls = []

    def tokens_for(n):
        calls.append(n)
        return list(range(n))

    # lily: prefill 1000 tok/s, decode 100 tok/s, with an outlier in one round
    lily = Scripted("lily", lambda L, k: L / 1000 * (10 if k == 4 else 1), lambda L, k: 9 / 100)
    peer = Scripted("peer", lambda L, k: L / 500, lambda L, k: 9 / 50)
    res = run_bench(lily, peer, tokens_for, lengths=[64, 256], decode_tokens=10, rounds=3)
    assert lily.calls[0] == (16, 2) and peer.calls[0] == (16, 2)  # the warm-up
    assert [r.first for r in res] == [["lily", "peer", "lily"]] * 2
    for r in res:
        assert len(r.lily) == len(r.peer) == 3
        assert r.median("lily", "prefill_tps") == pytest.approx(1000)  # the outlier is not the median
        assert r.ratio("prefill_tps") == pytest.approx(2.0)
        assert r.ratio("decode_tps") == pytest.approx(2.0)
    rep = report(res, lily, peer, {"model": "m", "rounds": 3, "generated_tokens": 10, "decode_steps": 9, "notice": "n"}, None)
    assert rep["geomean_prefill_ratio"] == pytest.approx(2.0) and rep["geomean_decode_ratio"] == pytest.approx(2.0)
    text = format_report(rep)
    assert "2.00x" in text and "NOTE: n" in text and "    64" in text


def test_run_bench_rejects_bad_arguments():
    s = Scripted("x", lambda L, k: 1, lambda L, k: 1)
    for kw in (dict(rounds=0), dict(decode_tokens=1), dict(lengths=[])):
        args = dict(lengths=[8], decode_tokens=4, rounds=1) | kw
        with pytest.raises(InvalidParameterError):
            run_bench(s, s, lambda n: [0] * n, **args)


def test_timed_counts_arrivals():
    batches = iter([[], [7], [], [8, 9], [10], None])
    s = _timed(5, lambda: next(batches))
    assert (s.prompt_tokens, s.tokens, s.first_tokens) == (5, 4, 1)
    assert s.first_s >= 0 and s.decode_s >= 0
    with pytest.raises(RuntimeError, match="no tokens"):
        _timed(5, lambda: None)


def test_sample_rates():
    s = Sample(prompt_tokens=100, tokens=11, first_s=0.5, decode_s=2.0)
    assert s.prefill_tps == 200 and s.decode_tps == 5
    assert Sample(10, 1, 0.1, 0.0).decode_tps == 0.0
    assert s.gpu_prefill_tps is None and s.gpu_decode_tps is None  # no device time measured
    g = Sample(100, 11, 0.5, 2.0, gpu_first_s=0.25, gpu_decode_s=1.0)
    assert g.gpu_prefill_tps == 400 and g.gpu_decode_tps == 10
    res = LengthResult(100, lily=[g, Sample(100, 11, 0.5, 2.0, gpu_first_s=0.5, gpu_decode_s=0.5)])
    assert res.gpu_median("gpu_decode_tps") == 15
    res.lily.append(s)  # one sample without device time: no median
    assert res.gpu_median("gpu_decode_tps") is None


def test_teacher_forced_statistic():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((50, 30)).astype(np.float32)
    t = rng.integers(0, 30, 50)
    same = teacher_forced(a, a, t)
    assert same["top1_agreement"] == 1.0 and same["ppl_ratio"] == pytest.approx(1.0)
    b = a.copy()
    b[np.arange(50), t] += 1.0  # the peer is more confident in the targets
    st = teacher_forced(a, b, t)
    assert st["ppl_ratio"] > 1.0 and st["ppl"] == pytest.approx(same["ppl"])


def test_lily_bench_command_runs_both_engines(tmp_path):
    pytest.importorskip("mlx_lm")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "lily", "bench", "--device", "sim", "--lengths", "12,20",
                        "--decode-tokens", "4", "--rounds", "2", "--positions", "48", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert "teacher-forced consistency over 48 positions" in r.stdout
    assert "NOTE:" in r.stdout  # not a Mac GPU: the report says what the figures are worth
    rep = json.loads(out.read_text())
    assert [row["prompt_tokens"] for row in rep["lengths"]] == [12, 20]
    for row in rep["lengths"]:
        assert row["first"] == ["lily", "mlx_lm"]  # the order alternates
        for who in ("lily", "mlx_lm"):
            assert [s["tokens"] for s in row["samples"][who]] == [4, 4]  # EOS ignored: exactly n
        p = row["prefill_tps"]
        assert p["ratio"] == pytest.approx(p["lily"] / p["mlx_lm"])
        # the simulator's execution time of Lily's command buffers: never more than the wall time,
        # but for decode by about one step (step 1 runs while the host still takes token 0)
        assert row["lily_gpu_tps"]["prefill"] >= p["lily"] > 0 and row["lily_gpu_tps"]["decode"] > 0, row
        for s in row["samples"]["lily"]:
            steps = s["tokens"] - s["first_tokens"]
            assert 0 < s["gpu_first_s"] <= s["first_s"], s
            assert 0 < s["gpu_decode_s"] <= s["decode_s"] + 1.5 * s["gpu_decode_s"] / steps, s
    assert "lily per second of device time" in r.stdout
    assert rep["consistency"]["positions"] == 48
    assert rep["consistency"]["top1_agreement"] >= 0.6  # a trained model, same bytes (bf16 peer)


def test_lily_bench_agent_command(tmp_path, monkeypatch, capsys):
    """`lily bench --agent` shares the plain bench's device options, report and --json file.
    The scenario itself (agent_bench.run, minutes on a CPU) is tested in test_prompt_cache;
    here it is replaced by one that records what the command hands it."""
    from lily import cli
    from lily.lab import agent_bench
    from lily import engine as engine_mod
    loads, runs = [], []
    monkeypatch.setattr(engine_mod.Engine, "load", classmethod(lambda cls, model, **kw: loads.append(kw) or kw))
    monkeypatch.setattr(agent_bench, "run", lambda engine, cold, **kw: runs.append((engine, cold, kw)) or {"turns": []})
    monkeypatch.setattr(agent_bench, "format_report", lambda rep: "agent report")
    out = tmp_path / "agent.json"
    assert cli.main(["bench", "--agent", "--device", "sim", "--prefill-chunk", "16", "--state-window", "1",
                     "--split-block", "64", "--turns", "2", "--decode-tokens", "3", "--json", str(out)]) == 0
    assert [kw["device_options"] for kw in loads] == [{"prefill_chunk": 16, "state_window": 1, "split_block": 64}] * 2
    assert loads[1]["prompt_cache_bytes"] == 0  # the cold engine
    (engine, cold, kw), = runs
    assert (engine, cold) == (loads[0], loads[1]) and kw["turns"] == 2 and kw["max_tokens"] == 3
    assert json.loads(out.read_text()) == {"turns": []}
    captured = capsys.readouterr()
    assert "agent report" in captured.out and f"written: {out}" in captured.err


def test_lily_bench_argument_errors():
    r = subprocess.run([sys.executable, "-m", "lily", "bench", "--lengths", "0,5"], capture_output=True, text=True)
    assert r.returncode == 2 and "positive integers" in r.stderr
    r = subprocess.run([sys.executable, "-m", "lily", "bench", "--device", "reference", "--lengths", "99999999"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "exceeds the model's limit" in r.stderr


def test_mean_of_ratios_is_geometric():
    rows = [LengthResult(8, lily=[Sample(8, 4, 1.0, 1.0)], peer=[Sample(8, 4, f, 1.0)], first=["lily"])
            for f in (0.5, 2.0)]  # prefill ratios 0.5x and 2x
    rep = report(rows, Scripted("l", None, None), Scripted("p", None, None),
                 {"model": "m", "rounds": 1, "generated_tokens": 4, "decode_steps": 3, "notice": None}, None)
    assert rep["geomean_prefill_ratio"] == pytest.approx(1.0)
    assert "geomean" in format_report(rep)


def test_pplx_prompt_is_their_synthetic_sequence():
    from lily.lab.bench import pplx_prompt
    ids = pplx_prompt(5, 248320)
    assert ids == [0, 2654435761 % 248320, (2 * 2654435761 % 2**32) % 248320,
                   (3 * 2654435761 % 2**32) % 248320, (4 * 2654435761 % 2**32) % 248320]
    assert max(pplx_prompt(1000, 97)) < 97 and len(set(pplx_prompt(1000, 97))) > 90


def test_run_bench_exact_shape_warmup():
    lily = Scripted("lily", lambda L, k: 1.0, lambda L, k: 1.0)
    peer = Scripted("peer", lambda L, k: 1.0, lambda L, k: 1.0)
    run_bench(lily, peer, lambda n: [0] * n, lengths=[8, 32], decode_tokens=65, rounds=2, exact_warmup=True)
    # round 1: each engine warms up on the exact shape right before its timed run; round 2: timed only
    assert lily.calls == [(8, 65), (8, 65), (32, 65), (32, 65), (8, 65), (32, 65)]
    assert peer.calls == lily.calls


def test_lily_bench_pplx_protocol(tmp_path):
    pytest.importorskip("mlx_lm")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "lily", "bench", "--protocol", "pplx", "--device", "reference",
                        "--lengths", "8,99999999", "--rounds", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, env=dict(os.environ), check=False)
    assert r.returncode == 0, r.stderr
    assert "protocol pplx" in r.stdout and "NOTE:" in r.stdout  # off a Mac GPU: a harness test
    assert "99999999" in r.stderr and "dropped" in r.stderr
    rep = json.loads(out.read_text())
    assert rep["protocol"] == "pplx" and rep["decode_steps"] == 64 and rep["dropped_lengths"] == [99999999]
    assert rep["generated_tokens"] == 65
    m = rep["machine"]
    assert m["chip"] and m["memory_bytes"] > 0 and m["os"] and m["device"] == "reference" and "gpu_family" not in m
    assert datetime.datetime.fromisoformat(rep["date"]).utcoffset() == datetime.timedelta(0)
    assert [row["prompt_tokens"] for row in rep["lengths"]] == [8]
    for row in rep["lengths"]:
        for who in ("lily", "mlx_lm"):
            assert [s["tokens"] for s in row["samples"][who]] == [65]  # first token + exactly 64 steps
    assert rep["consistency"] is None
    assert rep["lengths"][0]["lily_gpu_tps"] == {"prefill": None, "decode": None}  # the reference: no device
    assert "device time" not in r.stdout
    r = subprocess.run([sys.executable, "-m", "lily", "bench", "--protocol", "pplx", "--decode-tokens", "8"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 1 and "exactly 64 decode steps" in r.stderr


def test_bench_refuses_an_unwritable_json_path_before_running(tmp_path, monkeypatch, capsys):
    """The --json file is checked before the run (hours on a Mac), not when the run is over."""
    from lily.lab import bench as bench_mod
    from lily import cli
    monkeypatch.setattr(bench_mod, "bench", lambda *a, **kw: pytest.fail("the bench ran"))
    for path, why in ((tmp_path / "missing" / "x.json", "no such directory"), (tmp_path, "a directory")):
        assert cli.main(["bench", "--device", "reference", "--json", str(path)]) == 1
        assert f"lily: error: --json {path}: cannot write there ({why})" in capsys.readouterr().err


def test_machine_info_names_the_native_device(demo_path):
    """The report names the device and the plan it ran (the chunk chosen at load, the GEMM
    path), so a Mac run's figures can be set against the estimate of the same plan."""
    from lily.lab.bench import machine_info
    engine = Engine.load(demo_path, device="sim", max_context=1000,
                         device_options={"device_options": {"gpu_family": "apple10"}, "state_window": 4})
    info = machine_info(engine)
    assert info["state_window"] == 4 and info["split_block"] == 0  # the decode plan --fit counts
    assert info["gpu_family"] == "apple10" and info["tensor_ops"] is True and info["device"] == "sim"
    assert info["prefill_chunk"] == 1000 and info["gemm_path"] == "tensor"  # automatic, capped at the context
    assert info["bfloat_tensor_ops"] is True and info["attention_path"] == "tensor"
    assert info["chip"] and info["memory_bytes"] > 0 and info["arch"]
    assert "prefill_chunk" not in machine_info(Engine.load(demo_path, device="reference"))


@pytest.mark.parametrize("kw", [{"rounds": 0}, {"decode_tokens": 1}])
def test_bench_refuses_bad_counts_before_loading(tmp_path, kw):
    """Bad counts are refused before any model loads (the path does not even exist)."""
    from lily.lab.bench import bench
    with pytest.raises(InvalidParameterError, match=r"rounds must be >= 1 and decode_tokens >= 2, got rounds="):
        bench(tmp_path / "no-such-model", **kw)


def test_lily_runner_times_a_whole_prefill_every_round():
    """The warm-up and every round run the same prompt: Lily's runner keeps no prompt cache,
    so each timed prefill computes every prompt token as MLX-LM's does (with a cache, the
    second round's "prefill" was a one-token lookup, ~30x the real rate); it refuses a
    sample whose prefill was served from a cache."""
    from lily.lab.bench import LilyRunner
    from lily.prompt_cache import PromptCache
    runner = LilyRunner(None, "reference", 256)
    assert runner.engine.prompt_cache is None
    prompt = list(range(3, 60))
    for _ in range(2):
        assert runner.run(prompt, 2).tokens == 2
    runner.engine.prompt_cache = PromptCache(1 << 26)
    runner.run(prompt, 2)
    with pytest.raises(RuntimeError, match="computed 1 of the prompt's 57 tokens"):
        runner.run(prompt, 2)


def test_kernel_bench_runs_every_case_on_the_simulator(tmp_path):
    """`lily bench --kernels --device sim` (the harness CI can run): every hot-kernel case at
    small shapes on the simulator as an M5 (the tensor-op cases too), each case's dispatches
    priced by the cost table, the notice that the timings test only the harness, no roofline
    without a chip of the machine table; on an M5 Max the same records give each case's
    roofline and what bounds it; `lily estimate --fit` refuses the file (not a Metal run)."""
    from lily.lab import estimate, kernel_bench
    out = tmp_path / "kernels.json"
    r = subprocess.run([sys.executable, "-m", "lily", "bench", "--kernels", "--device", "sim", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    assert "NOTE: device=sim at small shapes" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["kind"] == estimate.KERNELS_KIND and rep["machine"]["device"] == "sim" and rep["small_shapes"]
    assert [c["kernel"] for c in rep["kernels"]] == [c.kernel for c in kernel_bench.cases()]
    # the design the tensor-op attention cases timed (the simulator's own layout: threadgroup memory)
    assert rep["machine"]["tensor_attention_path"]["path"] == "threadgroup memory"
    assert "prefill attention (the attn_prefill cases): scores and P through threadgroup memory: the " in r.stdout
    m = estimate.machine("m5max")
    bounds: dict = {}
    for c in rep["kernels"]:
        assert c["median_s"] > 0 and c["roofline"] is None and c["fraction_of_peak"] is None
        assert c["kernel"] in [x["kernel"] for x in c["records"]] and all(x["work"] for x in c["records"]), c["case"]
        roof = kernel_bench._roofline(m, c["records"])
        assert roof["seconds"] == max(roof["bandwidth_s"], *roof["compute_s"].values())
        bounds[c["kernel"]] = roof
    assert bounds["gemv_q4_add"]["bound"] == "bandwidth"  # small shapes: the matrices' rows are few
    # the decode attention's blocks are the runtime's (DecodePlan::split_rows): at 4K of the
    # model 104 rows; at the small contexts kDecodeMinBlock (32), where the old formula gave 7
    d = kernel_bench._dims(True)
    attn = [c for c in rep["kernels"] if c["kernel"].startswith("attn_decode_split")]
    for ctx, c in zip(d["contexts"], attn, strict=True):
        rec = next(x for x in c["records"] if x["kernel"] == c["kernel"])
        assert rec["groups"][1] == -(-(ctx + 1) // _core.decode_split_rows(ctx + 1, d["Hq"], d["Hkv"])), c["case"]
    assert _core.decode_split_rows(4097, 16, 2) == 104  # 80 threadgroups of 2 heads' blocks, rounded up to 8 rows
    # the DeltaNet step replays its pending ring entries: more bytes the more are pending
    gdn = [sum(x["work"]["bytes"] for x in c["records"]) for c in rep["kernels"] if c["kernel"].startswith("gdn_decode")]
    assert len(gdn) == 3 and gdn == sorted(gdn) and gdn[0] < gdn[-1], gdn
    assert {"moe_route_gate_up_swiglu_q4", "moe_down_q4"} <= set(bounds) and any(
        "lm_head" in c["case"] for c in rep["kernels"])
    with pytest.raises(ValueError, match="decode_split_rows"):
        _core.decode_split_rows(0, 16, 2)
    for kernel, path in (("gemm_q4_tensor", "tensor_bf16"), ("gemm_q4", "sgmm_bf16"),
                         ("attn_prefill_d256_g8_tensor", "tensor_bf16"), ("gdn_scan_k128_v128_r32", "alu_f32")):
        assert bounds[kernel]["compute_s"][path] > 0, (kernel, bounds[kernel])
    r = subprocess.run([sys.executable, "-m", "lily", "estimate", "--fit", str(out)], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 1 and "only a run on the Metal device" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(InvalidParameterError, match="no kernel case"):
        kernel_bench.run("sim", only=["no_such_kernel"])
    with pytest.raises(InvalidParameterError, match="native device"):
        kernel_bench.run("reference")


def test_missing_bench_extra_fails_before_lily_loads(tmp_path, monkeypatch):
    """Without MLX-LM, lily bench stops with the extra to install before Lily's native load
    writes its aligned weight cache (20 GB for the real model)."""
    from lily.lab.bench import bench
    for name in ("mlx", "mlx.core", "mlx_lm", "mlx_lm.generate"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    monkeypatch.setenv("LILY_CACHE_DIR", str(tmp_path / "wc"))
    with pytest.raises(InvalidParameterError, match=r'lily bench needs MLX-LM: pip install "\.\[bench\]"'):
        bench(device="sim", lengths=[8], decode_tokens=2, rounds=1, positions=0)
    assert not (tmp_path / "wc").exists()
