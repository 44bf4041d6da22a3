"""``lily bench --kernels``: each hot kernel timed alone at the model's shapes, against its own
roofline from the cost table (docs/performance.md, "Calibrating on a Mac run").

Every case builds its inputs and encodes its dispatches with the kernel checks' harness
(lily.lab.kernels: the layer classes and ``enc_*`` encoders over the runtime's own
``_core.encode_*`` builders), at the real model's dimensions: decode GEMVs, decode attention
at 4K / 32K / 128K context (the runtime's split blocks, _core.decode_split_rows), the Gated
DeltaNet decode step at a few pending write-back counts, the decode MoE (routing + gate/up,
down), the final norm + lm_head, the prefill GEMMs on each path (64-row simdgroup_matrix and
tensor-op tiles), the grouped expert GEMMs, the prefill attention, the Gated DeltaNet scan. Each
command buffer holds one case; its GPU time (Metal's GPU timestamps) is taken over ``reps``
runs after a warm-up, and the cost table prices what it recorded (``_core.dispatch_costs``):
the bytes and flops per path, so the report gives each kernel's roofline on the chip's
machine (lily.estimate.MACHINES, 100% of bandwidth and of each path's peak) and the fraction of
it the kernel reached. ``lily estimate --fit`` takes the JSON (lily.estimate.fit_kernels).

On the simulator the shapes are small and the timings mean nothing about a GPU (the report
says so): the run checks the harness.
"""

from __future__ import annotations

import datetime
import statistics
from dataclasses import dataclass
from typing import Callable

import numpy as np

from lily import _core
from lily.errors import InvalidParameterError
from lily.lab import estimate
from lily.lab.device import upload
from lily.lab.kernels.attention import AttnLayer
from lily.lab.kernels.attention_prefill import PrefillAttnLayer, chunk_inputs, pack_bf16_q, tensor_attention_path
from lily.lab.kernels.gdn import GDN_DECODE_SPLITS, GdnLayer, gdn_decode_dispatch, gdn_ring_entry
from lily.lab.kernels.gdn_prefill import GDN_K, GdnPrefillLayer
from lily.lab.kernels.gemm import enc_gemm
from lily.lab.kernels.gemv import LM_HEAD_THREADS, enc_gemv_add, enc_norm_gemv
from lily.lab.kernels.harness import bf16_bits, f32, rand_quant, upload_bf16, upload_q
from lily.lab.kernels.moe import MoeWeights, enc_down, enc_route_gate_up, logits_for
from lily.lab.kernels.moe_prefill import (
    class_base, class_capacity, enc_moe_gemm_down, enc_moe_gemm_gate_up, make_routing, max_tiles, tile_buffers, tiles_ref,
)
from lily.lab.system import system_info
from lily.native_backend import default_state_window, make_device

#: The report's ``kind`` (lily.estimate.fit_kernels reads it).
KIND = estimate.KERNELS_KIND
#: Timed runs per case after the warm-up: metal, sim.
REPS = {"metal": 20, "sim": 1}
#: Decode contexts of the attention cases (model scale; small: 256, 512, 1024).
CONTEXTS = (4096, 32768, 131072)


@dataclass
class Case:
    """One timed case: ``name``, the ``kernel`` it times (the record priced as the case's
    kernel; a case may encode a helper dispatch too: the split attention's combine, the scan's
    norm scale), and ``build(dev, rng, small) -> encode(pass)``."""

    name: str
    kernel: str
    build: Callable


def _dims(small: bool) -> dict:
    """The shapes: the real model's (Qwen3.6-35B-A3B) or the small ones the simulator runs."""
    c = estimate.model_config()
    window = default_state_window()
    if small:
        return dict(H=256, I=64, Is=64, E=16, k=4, M=32, conv=1024, z=512, Hq=16, Hkv=2, D=256,
                    contexts=(256, 512, 1024), p0=64, gdn="real", vocab=4096, gdn_heads=(2, 4, 128), window=window)
    return dict(H=c.hidden_size, I=c.moe_intermediate_size, Is=c.shared_expert_intermediate_size, E=c.num_experts,
                k=c.num_experts_per_tok, M=4096,
                conv=2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads
                * c.linear_value_head_dim, z=c.linear_num_value_heads * c.linear_value_head_dim,
                Hq=c.num_attention_heads, Hkv=c.num_key_value_heads, D=c.head_dim, contexts=CONTEXTS, p0=28672,
                gdn="real", vocab=c.vocab_size,
                gdn_heads=(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim), window=window)


def _gemv(kernel: str, rows_key: str, cols_key: str) -> Callable:
    def build(dev, rng, small):
        d = _dims(small)
        rows = d[rows_key] if rows_key in d else d["H"]
        cols = d["Hq"] * d["D"] if cols_key == "attn" else d[cols_key]
        W, S, B = upload_q(dev, rand_quant(rng, (), rows, cols, 4))
        X, Y = upload(dev, rng.standard_normal(cols).astype(np.float32)), upload(dev, np.zeros(rows, np.float32))

        return lambda p: enc_gemv_add(p, _core.kernel_params(kernel)["q"], W, S, B, X, Y, rows, cols)
    return build


def _norm_gemv(dev, rng, small):
    """The decode DeltaNet layer's input norm + in_proj (qkv | z | b | a), norm_gemv_q4."""
    d = _dims(small)
    H, rows = d["H"], (d["conv"], d["z"], 32, 32)
    mats = []
    for r in rows:
        wsb = upload_q(dev, rand_quant(rng, (), r, H, 4))
        mats.append((r, wsb, dev.buffer(4 * r)))
    X = upload(dev, rng.standard_normal(H).astype(np.float32))
    NW, XN = upload(dev, bf16_bits(1 + 0.1 * rng.standard_normal(H))), dev.buffer(4 * H)
    return lambda p: enc_norm_gemv(p, 4, X, NW, XN, mats, H, write_xn=False)


def _lm_head(dev, rng, small):
    """The final norm + lm_head over the vocabulary (norm_gemv_q4 at kLmHeadThreads)."""
    d = _dims(small)
    H, V = d["H"], d["vocab"]
    X = upload(dev, rng.standard_normal(H).astype(np.float32))
    NW, XN = upload(dev, bf16_bits(1 + 0.1 * rng.standard_normal(H))), dev.buffer(4 * H)
    mats = [(V, upload_q(dev, rand_quant(rng, (), V, H, 4)), dev.buffer(4 * V))]
    return lambda p: enc_norm_gemv(p, 4, X, NW, XN, mats, H, write_xn=False, tg=LM_HEAD_THREADS)


def _decode_moe(down: bool) -> Callable:
    """The decode step's MoE after the router: the routing fused with the selected and shared
    experts' gate/up SwiGLU (moe_route_gate_up_swiglu_q4), or their weighted down projections
    (moe_down_q4), through the step's own encoders."""
    def build(dev, rng, small):
        d = _dims(small)
        k = d["k"]
        W = MoeWeights(rng, d["E"], d["H"], d["I"], d["Is"])
        bufs = W.upload(dev)
        ids = rng.choice(W.E, k, replace=False).astype(np.uint32)
        h_rows = k * W.inter + W.inter_shared
        if down:
            Hb = upload(dev, (rng.standard_normal(h_rows) * 0.1).astype(np.float32))
            ID, WT = upload(dev, ids), upload(dev, rng.random(k + 1).astype(np.float32))
            R = upload(dev, rng.standard_normal(W.hidden).astype(np.float32))
            return lambda p: enc_down(p, W, bufs, Hb, ID, WT, R, k)
        X, L = upload(dev, rng.standard_normal(W.hidden).astype(np.float32)), upload(dev, logits_for(rng, W.E, ids))
        Hb, ID, WT = dev.buffer(4 * h_rows), dev.buffer(4 * k), dev.buffer(4 * (k + 1))
        return lambda p: enc_route_gate_up(p, W, bufs, X, L, Hb, ID, WT, k)
    return build


def _gdn_decode(pending: int) -> Callable:
    """gdn_decode_step replaying ``pending`` ring entries (the write-back window,
    docs/decode.md); at the window's last step (pending = state_window - 1) it writes the state
    back, else it appends its entry."""
    def build(dev, rng, small):
        d = _dims(small)
        Hk, Hv, Dk = d["gdn_heads"]
        L = GdnLayer(dev, Hk, Hv, Dk, Dk, rng=rng, window=d["window"])
        L.ring.write(np.zeros((d["window"] - 1) * gdn_ring_entry(Hk, Hv, Dk, Dk), np.float32).view(np.uint8))
        Q, Z, B, A = (upload(dev, x) for x in L.random_inputs())
        out, ssq = dev.buffer(4 * Hv * Dk), dev.buffer(4 * Hv * GDN_DECODE_SPLITS)
        return lambda p: gdn_decode_dispatch(p, Hk, Hv, Dk, Dk, L.K, Q, B, A, L.w[:3], L.conv[0], L.conv[1], L.state,
                                             out, ssq, L.ring, pending=pending,
                                             write_back=pending == d["window"] - 1)
    return build


def _decode_attention(ctx_index: int) -> Callable:
    def build(dev, rng, small):
        d = _dims(small)
        pos = d["contexts"][ctx_index]
        L = AttnLayer(dev, d["Hq"], d["Hkv"], d["D"], 64, pos + 1, rng=rng)
        L.set_position(pos)
        QG = upload(dev, rng.standard_normal(d["Hq"] * 2 * d["D"]).astype(np.float32))
        K = upload(dev, rng.standard_normal(d["Hkv"] * d["D"]).astype(np.float32))
        V = upload(dev, rng.standard_normal(d["Hkv"] * d["D"]).astype(np.float32))
        block = _core.decode_split_rows(pos + 1, d["Hq"], d["Hkv"])  # the runtime's (DecodePlan::split_rows)
        return lambda p: L.encode_fused(p, QG, K, V, L.POS, pos, block_rows=block)
    return build


def _gemm(kernel: str) -> Callable:
    def build(dev, rng, small):
        d = _dims(small)
        m, n, k = d["M"], d["conv"], d["H"]
        W, S, B = upload_q(dev, rand_quant(rng, (), n, k, 4))
        X = upload_bf16(dev, rng.standard_normal((m, k)))
        Y = dev.buffer(4 * m * n)
        return lambda p: enc_gemm(p, kernel, (W, S, B), X, Y, m, n, k, label=kernel)
    return build


def _experts(kernel: str, T: int, gate_up: bool) -> Callable:
    def build(dev, rng, small):
        d = _dims(small)
        M, E, k, H, I = d["M"], d["E"], d["k"], d["H"], d["I"]
        _ids, perm, tiles = make_routing(rng, M, E, k, T, False)
        TL, TC, max_tiles = tile_buffers(dev, tiles, len(tiles), M, E, k, T)
        P = upload(dev, perm)
        if gate_up:
            X = upload_bf16(dev, rng.standard_normal((M, H)))
            gb = list(upload_q(dev, rand_quant(rng, (E,), I, H, 4)))
            ub = list(upload_q(dev, rand_quant(rng, (E,), I, H, 4)))
            HX = dev.buffer(2 * M * k * I)
            return lambda p: enc_moe_gemm_gate_up(p, T, X, P, TL, TC, max_tiles, gb, ub, HX, M, k, E, H, I,
                                                     kernel=kernel)
        HX = upload_bf16(dev, rng.standard_normal((M * k, I)) * 0.1)
        db = list(upload_q(dev, rand_quant(rng, (E,), H, I, 4)))
        YX = dev.buffer(2 * M * k * H)
        return lambda p: enc_moe_gemm_down(p, T, HX, P, TL, TC, max_tiles, db, YX, M, k, E, H, I, kernel=kernel)
    return build


def _expert_tails(gate_up: bool, cls: int, T: int = 64) -> Callable:
    """The simdgroup path's tail class ``cls`` of a height-``T`` tiling, as the prefill chunk
    dispatches it (csrc/runtime/prefill.cpp): the t(T >> cls) kernel over that class's map
    (the experts' remainders of its heights) at its base in the tile-map buffer, its grid
    sized for the class's capacity (surplus threadgroups exit)."""
    def build(dev, rng, small):
        d = _dims(small)
        M, E, k, H, I = d["M"], d["E"], d["k"], d["H"], d["I"]
        ids, perm, _tiles = make_routing(rng, M, E, k, T, False)
        maps = tiles_ref(np.bincount(ids.reshape(-1), minlength=E), T)
        n = M * k
        tl = np.zeros((max_tiles(M, k, E, T), 4), np.uint32)
        for c, mp in enumerate(maps):
            tl[class_base(n, E, T, c):class_base(n, E, T, c) + len(mp)] = mp
        TL, TC, P = upload(dev, tl), upload(dev, np.array([len(mp) for mp in maps], np.uint32)), upload(dev, perm)
        Tc, cap, where = T >> cls, class_capacity(n, E, T, cls), (cls, class_base(n, E, T, cls))
        kernel = _core.kernel_name(f"moe_gemm_{'gate_up' if gate_up else 'down'}", q=4, t=Tc)
        if gate_up:
            X = upload_bf16(dev, rng.standard_normal((M, H)))
            gb = list(upload_q(dev, rand_quant(rng, (E,), I, H, 4)))
            ub = list(upload_q(dev, rand_quant(rng, (E,), I, H, 4)))
            HX = dev.buffer(2 * M * k * I)
            return lambda p: enc_moe_gemm_gate_up(p, Tc, X, P, TL, TC, cap, gb, ub, HX, M, k, E, H, I, kernel=kernel,
                                                     cls=where, tile_rows=T)
        HX = upload_bf16(dev, rng.standard_normal((M * k, I)) * 0.1)
        db = list(upload_q(dev, rand_quant(rng, (E,), H, I, 4)))
        YX = dev.buffer(2 * M * k * H)
        return lambda p: enc_moe_gemm_down(p, Tc, HX, P, TL, TC, cap, db, YX, M, k, E, H, I, kernel=kernel, cls=where,
                                           tile_rows=T)
    return build


def _prefill_attention(tensor: bool) -> Callable:
    def build(dev, rng, small):
        d = _dims(small)
        M, p0 = d["M"], d["p0"]
        L = PrefillAttnLayer(dev, "real", p0 + M + 1, rng=rng, tensor=tensor)
        q = f32(rng.standard_normal((M, L.Hq, L.D)))
        qg = chunk_inputs(rng, M, L.Hq, L.Hkv, L.D)[0]
        Q = upload(dev, pack_bf16_q(q, L.G) if tensor else q)
        QG = upload_bf16(dev, qg)
        return lambda p: L.encode_attn(p, Q, QG, p0, M)
    return build


def _gdn_scan(dev, rng, small):
    d = _dims(small)
    L = GdnPrefillLayer(dev, d["gdn"], rng=rng)
    M = d["M"]
    bufs = L.input_buffers(*L.inputs(M))
    outs = L.out_buffers(M)
    cin = upload(dev, np.zeros((GDN_K - 1, L.C), np.float32))
    return lambda p: L.encode_scan(p, bufs[0], cin, bufs[1], bufs[2], bufs[3], outs, M)


def gdn_pending_counts() -> list[int]:
    """The pending ring entries of the DeltaNet decode cases: none, half the write-back window,
    and the window's last step (which writes the state back)."""
    window = default_state_window()
    return sorted({0, window // 2, window - 1})


def cases() -> list[Case]:
    """The hot kernels, in the order of a decode step and a prefill chunk."""
    out = [Case("decode GEMV o_proj", "gemv_q4_add", _gemv("gemv_q4_add", "H", "attn")),
           Case("decode norm + in_proj (GDN layer)", "norm_gemv_q4", _norm_gemv)]
    out += [Case(f"decode attention, context #{i + 1}", "attn_decode_split_fused_d256_g8", _decode_attention(i))
            for i in range(len(CONTEXTS))]
    window = default_state_window()
    out += [Case(f"decode Gated DeltaNet step, {n} pending" + (" + write-back" if n == window - 1 else ""),
                 "gdn_decode_step_k128_v128", _gdn_decode(n)) for n in gdn_pending_counts()]
    out += [Case("decode MoE routing + gate/up SwiGLU", "moe_route_gate_up_swiglu_q4", _decode_moe(False)),
            Case("decode MoE down + shared expert", "moe_down_q4", _decode_moe(True)),
            Case("decode final norm + lm_head", "norm_gemv_q4", _lm_head)]
    out += [Case("prefill GEMM in_proj, 64-row simdgroup tiles", "gemm_q4", _gemm("gemm_q4")),
            Case("prefill GEMM in_proj, 64-row tensor tiles", "gemm_q4_tensor", _gemm("gemm_q4_tensor")),
            Case("experts gate/up, 64-row simdgroup tiles", "moe_gemm_gate_up_q4_t64",
                 _experts("moe_gemm_gate_up_q4_t64", 64, True)),
            Case("experts down, 64-row simdgroup tiles", "moe_gemm_down_q4_t64", _experts("moe_gemm_down_q4_t64", 64, False)),
            # the simdgroup path's tail classes as the chunk dispatches them (classes 1, 2 of a 64-row tiling)
            *[Case(f"experts {'gate/up' if up else 'down'}, {64 >> c}-row simdgroup tail tiles (class {c})",
                   _core.kernel_name(f"moe_gemm_{'gate_up' if up else 'down'}", q=4, t=64 >> c), _expert_tails(up, c))
              for up in (True, False) for c in (1, 2)],
            Case("experts gate/up, 128-row tensor tiles", "moe_gemm_gate_up_q4_t128_tensor",
                 _experts("moe_gemm_gate_up_q4_t128_tensor", 128, True)),
            Case("experts down, 128-row tensor tiles", "moe_gemm_down_q4_t128_tensor",
                 _experts("moe_gemm_down_q4_t128_tensor", 128, False)),
            Case("prefill attention (tensor ops)", "attn_prefill_d256_g8_tensor", _prefill_attention(True)),
            Case("prefill attention (simdgroup_matrix)", "attn_prefill_d256_g8", _prefill_attention(False)),
            Case("Gated DeltaNet scan", "gdn_scan_k128_v128_r32", _gdn_scan)]
    return out


def _roofline(m: estimate.Machine | None, records: list) -> dict | None:
    """The records' time at 100% of ``m``'s bandwidth and of each path's peak, and what bounds
    it (None without a machine)."""
    if m is None:
        return None
    mem = sum(r["work"]["bytes"] for r in records) / m.bandwidth
    flops: dict = {}
    for r in records:
        for p, f in r["work"]["flops"].items():
            flops[p] = flops.get(p, 0.0) + f
    comp = {p: f / m.rates[p] for p, f in flops.items() if f and p in m.rates}
    bound, secs = max([("bandwidth", mem), *comp.items()], key=lambda kv: kv[1])
    return {"seconds": secs, "bound": bound, "bandwidth_s": mem, "compute_s": comp}


def run(device: str = "auto", *, reps: int | None = None, small: bool | None = None, only=None,
        log: Callable[[str], None] = lambda s: None) -> dict:
    """Time every case of :func:`cases` (or the kernels named in ``only``) on ``device``
    ('auto': metal when compiled in, else sim). ``small``: the simulator's shapes (default on
    sim); ``reps``: timed runs per case (default :data:`REPS`). Returns the report (JSON-ready):
    ``kind``, ``machine`` (chip, device, GPU family, tensor-op support), ``notice`` (off a Mac
    GPU: the timings mean nothing), and per case ``case``, ``kernel``, ``records`` (the
    recorded dispatches with the cost table's entries), ``seconds`` (every timed run),
    ``median_s``, ``roofline`` (on the chip's machine) and ``fraction_of_peak``. Raises
    :class:`InvalidParameterError` for an unknown device or kernel, or reps below 1."""
    name = ("metal" if "metal" in _core.compiled_devices() else "sim") if device == "auto" else device
    if name not in ("metal", "sim"):
        raise InvalidParameterError(f"--kernels times a native device (metal or sim), not {device!r}")
    # the simulator as an M5 (apple10): the tensor-op cases run too
    dev = make_device(name, **({"gpu_family": "apple10"} if name == "sim" else {}))
    small = name == "sim" if small is None else small
    reps = REPS[name] if reps is None else reps
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise InvalidParameterError(f"reps must be a positive integer, got {reps!r}")
    todo = cases()
    if only:
        unknown = sorted(set(only) - {c.kernel for c in todo})
        if unknown:
            raise InvalidParameterError(f"no kernel case for {unknown} (known: {sorted({c.kernel for c in todo})})")
        todo = [c for c in todo if c.kernel in only]
    sysi = system_info()
    info = {k: sysi.get(k) for k in ("chip", "arch", "memory_bytes", "os")}
    info.update(device=name, device_name=dev.name, gpu_family=dev.gpu_family,
                tensor_ops=bool(dev.supports_tensor_ops), bfloat_tensor_ops=bool(dev.supports_bfloat_tensor_ops))
    # the design the tensor-op attention cases (the model's head dim, tensor_attention_path's default) time here
    info["tensor_attention_path"] = tensor_attention_path(dev)
    key = estimate.machine_for_chip(info.get("chip")) if name == "metal" else None
    m = estimate.machine(key) if key else None
    notice = None if name == "metal" else (
        "device=sim at small shapes: these timings test the harness; only device=metal on a Mac times the kernels")
    rng = np.random.default_rng(0)
    rows = []
    for c in todo:
        if c.kernel.endswith("_tensor") and not dev.supports_tensor_ops:
            log(f"{c.name}: skipped (no tensor ops on this device)")
            continue
        enc = c.build(dev, rng, small)
        times, records = [], None
        for i in range(reps + (1 if name == "metal" else 0)):  # a warm-up run on the GPU
            cb = dev.command_buffer()
            enc(cb.compute_pass())
            cb.commit()
            cb.wait()
            if records is None:
                records = _core.dispatch_costs(cb)
            if name != "metal" or i > 0:
                times.append(float(cb.gpu_seconds))
        median = statistics.median(times)
        roof = _roofline(m, records)
        rows.append({"case": c.name, "kernel": c.kernel, "records": records, "seconds": times, "median_s": median,
                     "roofline": roof, "fraction_of_peak": roof["seconds"] / median if roof and median > 0 else None})
        log(f"{c.name}: {1e6 * median:,.1f} us" + (f", {100 * rows[-1]['fraction_of_peak']:.0f}% of its roofline "
                                                    f"({roof['bound']})" if roof else ""))
    return {"kind": KIND, "notice": notice, "machine": info, "small_shapes": small, "reps": reps,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "kernels": rows}


def format_report(rep: dict) -> str:
    """The report as a table: each case's median time, its roofline and the fraction reached."""
    m = rep["machine"]
    out = [f"lily bench --kernels: {m.get('device')} ({m.get('chip') or 'unknown chip'}), {rep['reps']} timed "
           f"run{'s' if rep['reps'] != 1 else ''} per case" + (", small shapes" if rep["small_shapes"] else
                                                                 ", the model's shapes")]
    if rep.get("notice"):
        out.append(f"  NOTE: {rep['notice']}")
    if m.get("tensor_attention_path"):
        out.append(f"  prefill attention (the attn_prefill cases): {m['tensor_attention_path']['detail']}")
    out += ["", f"{'case':48s} {'kernel':34s} {'median us':>11} {'roofline us':>12} {'of peak':>8}  bound"]
    for r in rep["kernels"]:
        roof = r["roofline"]
        out.append(f"{r['case']:48s} {r['kernel']:34s} {1e6 * r['median_s']:>11,.1f} "
                   + (f"{1e6 * roof['seconds']:>12,.1f} {100 * r['fraction_of_peak']:>7.0f}%  {roof['bound']}"
                      if roof else f"{'':>12} {'':>8}"))
    return "\n".join(out)

