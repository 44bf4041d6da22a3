"""Native devices (``sim``, ``metal``) as engine backends: the C++ runtime
(``csrc/runtime``: chunked prefill and pipelined decode) over the device layer, fed from
the memory-mapped checkpoint (through the aligned weight cache, lily.weight_cache, when its
tensors are not 16-byte aligned). See docs/prefill.md and docs/decode.md.
"""

from __future__ import annotations

import os
import re

import numpy as np

from lily import _core
from lily.backend import HostGeneration, RowResult
from lily.checkpoint import Checkpoint, ModelConfig, expected_tensors
from lily.errors import CheckpointError, DeviceError, InvalidParameterError, QuantizationError, notice
from lily.sampling import TokenLogprob
from lily.weight_cache import aligned_table


def model_dims(c: ModelConfig):
    """The runtime's ``lily._core.ModelDims`` from a :class:`ModelConfig` (same field names)."""
    d = _core.ModelDims()
    for name in _core.ModelDims.FIELDS:
        setattr(d, name, getattr(c, name))
    d.full_attention = [c.is_full_attention(i) for i in range(c.num_hidden_layers)]
    return d


def sampling_config(params):
    """The device's ``lily._core.SamplingConfig`` from :class:`lily.sampling.SamplingParams`
    (same field names, and its ``logit_bias`` pairs); a seed of None becomes a fresh random
    one, any seed is taken mod 2**64."""
    s = _core.SamplingConfig()
    for name in _core.SamplingConfig.FIELDS:
        if name != "seed":
            setattr(s, name, getattr(params, name))
    seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy)
    s.seed = int(seed) % (1 << 64)
    s.logit_bias = list(params.logit_bias)  # uploaded once by Runtime.start (a dense [V] buffer)
    return s


def runtime_options(max_context: int, **options):
    """The runtime's ``lily._core.RuntimeOptions`` (csrc/runtime/runtime.h holds the fields,
    their defaults and their rules): ``max_context`` plus any of ``split_threshold``,
    ``split_block``, ``prefill_chunk``, ``state_window`` (ints; ``prefill_chunk`` 0 is the automatic
    choice; ``state_window`` >= 1, decode steps per Gated DeltaNet state write-back), ``gemm_path`` (``"auto"``, ``"simdgroup"``,
    ``"tensor"``) and ``virtual_weights``. Raises :class:`InvalidParameterError` naming an
    unknown or invalid option."""
    o = _core.RuntimeOptions()
    reject_unknown_options(options, [f for f in (*o.FIELDS, "gemm_path") if f != "max_context"], "runtime option")
    try:
        for name, value in {"max_context": max_context, **options}.items():
            setattr(o, name, value)
        o.validate()
    except ValueError as e:
        raise InvalidParameterError(str(e)) from None
    return o


#: The runtime options an engine takes (``RuntimeOptions.FIELDS`` and gemm_path, but
#: max_context, which Engine.load sets, and virtual_weights, record-only counting's).
RUNTIME_OPTIONS = tuple(f for f in (*_core.RuntimeOptions.FIELDS, "gemm_path") if f not in ("max_context", "virtual_weights"))


def tensor_table(ck: Checkpoint) -> list[tuple[str, str, int, int]]:
    """``(name, file, byte offset, nbytes)`` of every text-model tensor."""
    return [(name, str(t.file), t.start, t.nbytes) for name, t in ck.tensors.items()]


def check_kernel_dtypes(ck: Checkpoint) -> None:
    """The kernels read the unquantized tensors in the dtypes MLX writes: bf16, and float32
    for ``A_log`` (the reference accepts either). Raises :class:`CheckpointError` naming the
    first tensor stored otherwise."""
    for kind, name, _ in expected_tensors(ck.config):
        want = {"bf16": "BF16", "f32": "F32"}.get(kind)
        t = ck.tensors.get(name)
        if want and t is not None and t.dtype != want:
            raise CheckpointError(f"{t.where}: tensor {t.name} is {t.dtype}; the native kernels read it as "
                                  f"{want} (as mlx_lm convert writes it); use device='reference' or reconvert")


def check_native_quantization(ck: Checkpoint) -> None:
    """Every quantized linear of ``ck`` in the format the kernels read
    (``lily._core.native_quant_format``: 4-bit in groups of 64, the router and the
    shared-expert gate 8-bit). Raises :class:`QuantizationError` naming the first module
    that differs and how many do, before anything is mapped or copied; the runtime checks
    the tensors' sizes against the same format again when it binds them."""
    wrong = []
    for kind, name, _ in expected_tensors(ck.config):
        if kind == "linear":
            spec = ck.quant_spec(name)
            want = _core.native_quant_format(name)
            if (spec.bits, spec.group_size) != want:
                wrong.append((name, spec, want))
    if wrong:
        name, spec, (bits, group) = wrong[0]
        more = f" (and {len(wrong) - 1} more modules)" if len(wrong) > 1 else ""
        raise QuantizationError(
            f"{ck.path / 'config.json'}: {name} is quantized {spec.bits}-bit in groups of {spec.group_size}{more}; "
            f"the native kernels (devices sim, metal) read {bits}-bit weights in groups of {group} (the router and "
            "shared-expert gate 8-bit), as `mlx_lm convert -q --q-bits 4 --q-group-size 64` writes them: "
            "reconvert with those options, or use device='reference'")


def reject_unknown_options(options, known, what: str) -> None:
    """Raises :class:`InvalidParameterError` listing the keys of ``options`` not in ``known``."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise InvalidParameterError(f"unknown {what}{'s' if len(unknown) > 1 else ''} "
                                    f"{', '.join(map(repr, unknown))} (known: {', '.join(known) or 'none'})")


def _keywords(fn) -> tuple[str, ...]:
    """The parameter names of a bound native function, read from the signature nanobind gives
    it (``__nb_signature__``, which the stubs are generated from): the one list is the binding's."""
    text = fn.__nb_signature__[0][0]
    return tuple(re.findall(r"[(,]\s*(\w+):", text[text.index("("):]))


#: ``lily._core.sim_device``'s keywords (empty in a build without the simulator).
SIM_OPTIONS = _keywords(_core.sim_device) if hasattr(_core, "sim_device") else ()


def make_device(name: str, **options):
    """A native device by name. Raises :class:`DeviceError` if it is not in this build and
    :class:`InvalidParameterError` for an unknown or invalid option (``sim``: ``SIM_OPTIONS``;
    ``metal`` takes none). The simulator's ``faults`` ({kernel: "build" | "wrong" | a thread
    limit}) inject a failure into named kernels (lily._core.sim_device)."""
    if name not in _core.compiled_devices():
        raise DeviceError(f"device {name!r} is not compiled into this build of lily "
                          f"(available: {', '.join(_core.compiled_devices()) or 'none'})")
    reject_unknown_options(options, SIM_OPTIONS if name == "sim" else (), f"{name} device option")
    if name != "sim":
        return _core.metal_device()
    if isinstance(options.get("faults"), dict):
        options = {**options, "faults": {k: str(v) for k, v in options["faults"].items()}}
    try:
        return _core.sim_device(**options)
    except (TypeError, ValueError) as e:
        raise InvalidParameterError(f"sim device options: {e}") from None


class NativeBackend:
    """The engine backend (:class:`lily.backend.Backend`) over ``lily._core.Runtime``.

    Generation uses the GPU token hand-off (the device samples and feeds the next step);
    a constrained request samples on the host instead (:class:`lily.backend.HostGeneration`
    over :meth:`forward`)."""

    #: Engine.load's device options: the runtime's (:data:`RUNTIME_OPTIONS`), weight_cache, device_options.
    OPTIONS = (*RUNTIME_OPTIONS, "weight_cache", "device_options")

    def __init__(self, ck: Checkpoint, max_context: int, device: str = "sim", *,
                 weight_cache: bool | str = True, device_options: dict | None = None, **options):
        """``options``: the runtime's (:func:`runtime_options`) but ``virtual_weights``.

        Raises :class:`QuantizationError` for a checkpoint quantized otherwise than the
        kernels read (:func:`check_native_quantization`), before any file is mapped or
        cached; :class:`CheckpointError` for a NaN or Inf in a floating tensor, found while
        the weight cache is written or, for tensors used from the checkpoint file itself
        (no cache, or an aligned file), by a scan here; a cache reused from an earlier load
        was checked when written and is not read again."""
        reject_unknown_options(options, RUNTIME_OPTIONS, "device option")
        opts = runtime_options(max_context, **options)
        if not isinstance(weight_cache, (bool, str, os.PathLike)):
            raise InvalidParameterError(f"weight_cache must be True, False or a directory, got {weight_cache!r}")
        if (device_options or {}).get("record_only"):
            raise InvalidParameterError("a record-only simulator executes nothing, so an Engine cannot run on "
                                        "it; lily.native_backend.count_decode_step / count_prefill_chunk count with one")
        check_kernel_dtypes(ck)
        check_native_quantization(ck)
        self.name = device
        self.config = ck.config
        self.max_context = max_context
        self.device = make_device(device, **(device_options or {}))
        table = tensors = tensor_table(ck)
        if weight_cache is not False:
            # a cache file's floats are checked while it is written, never again when reused
            tensors = aligned_table(table, None if weight_cache is True else weight_cache, check=ck.check_finite)
        # what the runtime maps or copies from the checkpoint itself: checked here
        ck.check_floats(old[0] for old, new in zip(table, tensors) if new == old)
        try:
            self.runtime = _core.Runtime(self.device, model_dims(ck.config), tensors, opts)
        except ValueError as e:
            raise DeviceError(f"{device}: {e}") from None
        for line in self.runtime.notices:  # a family of tensor-op kernels that failed its load-time check
            notice(f"lily: {line}")
        self.prefill_chunk: int = self.runtime.prefill_chunk
        self.options = opts  # lily._core.RuntimeOptions (the bench report records the plan's)
        self._host: HostGeneration | None = None  # a constrained generation in progress

    samples_on_device = True
    chunk_invariant = True

    @property
    def position(self) -> int:
        return self.runtime.position

    @property
    def gpu_seconds(self) -> float:
        """Device seconds of the work whose results were taken so far (a total; ``Runtime.gpu_seconds``)."""
        return self.runtime.gpu_seconds

    def reset(self, seq: int = 0) -> None:
        self.runtime.reset(seq)

    def forward(self, tokens: np.ndarray, *, all_logits: bool = False, seq: int = 0) -> np.ndarray:
        return self.runtime.forward(np.asarray(tokens, dtype=np.uint32), "all" if all_logits else "last", seq=seq)

    def prefill(self, tokens: np.ndarray, seq: int = 0) -> None:
        self.runtime.forward(np.asarray(tokens, dtype=np.uint32), "none", seq=seq)

    # -- sequences and batched calls (lily.backend.Backend; csrc/runtime/runtime.h) ---------

    def open_sequence(self) -> int:
        """A new sequence (its KV cache at ``max_context`` and its state, in device memory).
        Raises :class:`DeviceError` when it does not fit the device's working set."""
        try:
            return self.runtime.open_sequence()
        except ValueError as e:
            raise DeviceError(f"{self.name}: {e}") from None

    def close_sequence(self, seq: int) -> None:
        self.runtime.close_sequence(seq)

    def sequence_position(self, seq: int) -> int:
        return self.runtime.sequence_position(seq)

    def sequence_room(self) -> int | None:
        room = self.runtime.sequence_room
        return None if room == 2**32 - 1 else room

    def sequence_bytes(self) -> int:
        return self.runtime.sequence_bytes

    def begin(self, seq: int, params, history) -> None:
        self.runtime.begin(seq, sampling_config(params), [int(t) for t in history])

    def submit_chunk(self, seq: int, tokens, *, sample: bool = False, logits: bool = False) -> int:
        return self.runtime.submit_chunk(seq, [int(t) for t in tokens], sample, logits)

    def submit_step(self, rows) -> int:
        return self.runtime.submit_step([(seq, -1 if tok is None else int(tok), bool(want)) for seq, tok, want in rows])

    def take(self, ticket: int) -> tuple[list[RowResult], float | None]:
        rows, gpu = self.runtime.take(ticket)
        out = []
        for seq, position, tok, lp, top, logits in rows:
            if logits is not None:
                out.append(RowResult(seq, position, None, None, logits))
            else:
                out.append(RowResult(seq, position, int(tok), TokenLogprob(
                    int(tok), float(lp), tuple((int(i), float(v)) for i, v in top)), None))
        return out, (None if gpu != gpu else gpu)

    def generate_greedy(self, first: int, max_tokens: int, stop_ids) -> list[int]:
        """Pipelined greedy decode on the device (GPU token hand-off); see Runtime."""
        return list(self.runtime.generate_greedy(int(first), int(max_tokens), set(int(s) for s in stop_ids)))

    def start(self, feed, steps: int, history, params, constraint=None) -> None:
        """Unconstrained: pipelined generation on the device; ``feed`` runs as prefill chunks
        whose last one samples the first output on the device. Constrained: on the host."""
        if constraint is not None:
            self._host = HostGeneration(self.forward, feed, steps, history, params, constraint)
            return
        self.runtime.start([int(t) for t in feed], int(steps), [int(t) for t in history], sampling_config(params))

    def next(self):
        """``(token id, TokenLogprob)`` of the next generated token, or None when done."""
        if self._host is not None:
            return self._host.next()
        step = self.runtime.next()
        if step is None:
            return None
        tok, lp, top = step
        return int(tok), TokenLogprob(int(tok), float(lp), tuple((int(i), float(v)) for i, v in top))

    def finish(self) -> None:
        self._host = None
        self.runtime.finish()

    def snapshot(self, seq: int = 0):
        """The sequence's state in a buffer of the device (``lily._core.SessionSnapshot``)."""
        return self.runtime.snapshot(seq)

    def restore(self, snap, seq: int = 0) -> None:
        """Makes ``snap`` (from :meth:`snapshot` of a backend of the same model) the sequence's
        state. Raises :class:`InvalidParameterError` for anything else, the state unchanged."""
        if not isinstance(snap, _core.SessionSnapshot):
            raise InvalidParameterError(f"not a snapshot of a {self.name!r} session: {type(snap).__name__}")
        try:
            self.runtime.restore(snap, seq)
        except ValueError as e:
            raise InvalidParameterError(str(e)) from None

    def snapshot_arrays(self, snap) -> tuple[dict[str, np.ndarray], dict]:
        """The snapshot's device buffer as byte arrays (its parts)."""
        parts = snap.parts()
        return ({f"part.{i}": np.frombuffer(p, dtype=np.uint8) for i, p in enumerate(parts)},
                {"kind": "native", "position": int(snap.position), "parts": len(parts)})

    def snapshot_from_arrays(self, arrays: dict[str, np.ndarray], meta: dict):
        """The parts uploaded into a buffer of this backend's device."""
        if meta["kind"] != "native":
            raise ValueError(f"a {meta['kind']!r} snapshot, not a native one")
        return _core.SessionSnapshot(int(meta["position"]),
                                     [arrays[f"part.{i}"].tobytes() for i in range(int(meta["parts"]))], self.device)


def memory_plan(ck: Checkpoint, max_context: int, working_set: int = 0) -> dict:
    """The device memory a native session of ``ck`` at ``max_context`` needs, as the runtime
    sizes it at load (``Runtime.memory_use``: ``weights``, ``kv_cache``, ``state``,
    ``scratch``, ``total`` in bytes) with the ``prefill_chunk`` its automatic choice takes
    under a ``working_set`` budget (bytes; 0: none, the largest chunk). Sized on a record-only
    simulator: nothing is read or allocated. Raises :class:`DeviceError` with the runtime's
    numbers when nothing fits the budget."""
    try:
        rt = _record_only_runtime(ck.config, _packed((n, f, b) for n, f, _, b in tensor_table(ck)), max_context,
                                  working_set_bytes=int(working_set))
    except ValueError as e:
        raise DeviceError(str(e)) from None
    return {**rt.memory_use, "prefill_chunk": rt.prefill_chunk}


def _record_only_runtime(config: ModelConfig, tensors, max_context: int, *, gpu_family: str | None = None,
                         working_set_bytes: int = 0, bfloat_tensor_ops: bool = True, **options):
    """A runtime of ``config`` over ``tensors`` (virtual weights: nothing is read) on a
    record-only simulator of ``gpu_family`` with a ``working_set_bytes`` budget (and
    ``bfloat_tensor_ops``, see ``sim_device``); ``options``: :func:`runtime_options`'."""
    dev = make_device("sim", record_only=True, working_set_bytes=working_set_bytes, bfloat_tensor_ops=bfloat_tensor_ops,
                      **({"gpu_family": gpu_family} if gpu_family else {}))
    return _core.Runtime(dev, model_dims(config), tensors, runtime_options(max_context, virtual_weights=True, **options))


def counting_runtime(config: ModelConfig, bits: int, router_bits: int, max_context: int, **options):
    """A record-only runtime over virtual weights (:func:`_virtual_tensors`); ``options``:
    :func:`runtime_options`', plus ``gpu_family`` for the device."""
    return _record_only_runtime(config, _virtual_tensors(config, bits, router_bits), max_context, **options)


def _virtual_tensors(config: ModelConfig, bits: int, router_bits: int):
    """The tensor table of a checkpoint that need not exist on disk (record-only counting):
    every tensor of ``config`` in the order MLX writes them, each at a 16-byte aligned offset
    (as the weight cache places them; small models' tensors are not aligned otherwise)."""
    tensors = []
    for kind, name, shape in expected_tensors(config):
        if kind == "linear":
            *lead, out_f, in_f = shape
            b = router_bits if name.endswith((".mlp.gate", ".shared_expert_gate")) else bits
            lead_n = int(np.prod(lead)) if lead else 1
            parts = {".weight": lead_n * out_f * in_f * b // 8,
                     ".scales": lead_n * out_f * (in_f // 64) * 2, ".biases": lead_n * out_f * (in_f // 64) * 2}
        else:
            parts = {"": int(np.prod(shape)) * (4 if kind == "f32" else 2)}
        tensors += [(name + suffix, "virtual.safetensors", nbytes) for suffix, nbytes in parts.items()]
    return _packed(tensors)


def _packed(entries) -> list[tuple[str, str, int, int]]:
    """(name, file, nbytes) entries laid out per file at 16-byte aligned offsets, in order:
    where the runtime's repacking (or the weight cache) puts unaligned files' tensors."""
    out, end = [], {}
    for name, file, nbytes in entries:
        offset = -(-end.get(file, 0) // 16) * 16
        out.append((name, file, offset, nbytes))
        end[file] = offset + nbytes
    return out


def count_decode_step(config: ModelConfig, context: int, *, bits: int = 4, router_bits: int = 8,
                      split_threshold: int | None = None, state_window: int | None = None) -> dict:
    """Simulator counters of one decode step at ``context`` tokens for a model that need not
    exist on disk (record-only device, virtual weights laid out as MLX writes them), with the
    steps since its write-back window began pending (``context % state_window``; the runtime
    option, default :func:`default_state_window`; 1: the state written back every step).

    Returns dispatches, barrier stages, declared bytes, and the bytes the step really moves
    (weights of the selected experts, KV rows, state)."""
    extra = _given(split_threshold=split_threshold, state_window=state_window)
    return counting_runtime(config, bits, router_bits, context + 1, prefill_chunk=1, **extra).count_step(context)


def _given(**options) -> dict:
    """The runtime ``options`` given (not None): the rest keep the runtime's defaults."""
    return {k: v for k, v in options.items() if v is not None}


def default_state_window() -> int:
    """Decode steps per write-back of the Gated DeltaNet state by default (the runtime option
    ``state_window``; docs/decode.md "The recurrent state's write-back window")."""
    return _core.RuntimeOptions().state_window


def count_decode_window(config: ModelConfig, context: int, *, bits: int = 4, router_bits: int = 8,
                        split_threshold: int | None = None, state_window: int | None = None,
                        split_block: int | None = None) -> list[dict]:
    """:func:`count_decode_step` for each step of one write-back window of steady decoding:
    the ``state_window`` steps (the runtime option; default :func:`default_state_window`)
    at ``context``, ``context + 1``, ..., each with the steps since its window began pending
    (one of them writes the state back). Their mean is a step's average cost. ``split_block``:
    the runtime option (None: its default)."""
    extra = _given(split_threshold=split_threshold, split_block=split_block, state_window=state_window)
    w = state_window or default_state_window()
    rt = counting_runtime(config, bits, router_bits, context + w, prefill_chunk=1, **extra)
    return [rt.count_step(context + i) for i in range(w)]


def count_batch_window(config: ModelConfig, context: int, rows: int, *, bits: int = 4, router_bits: int = 8,
                       state_window: int | None = None) -> list[dict]:
    """:func:`count_decode_window` for a batched step of ``rows`` sequences (each at
    ``context``, ``context + 1``, ... over the window, the steps of its window pending), as
    the scheduler's steps encode them (``Runtime.count_batch_step``). The bytes "moved" count
    each row's selected experts (the union of the rows' choices when rows share experts is
    smaller: the expected union of uniformly random choices is
    ``experts * (1 - (1 - k / experts) ** rows)``)."""
    extra = _given(state_window=state_window)
    w = state_window or default_state_window()
    rt = counting_runtime(config, bits, router_bits, context + w, prefill_chunk=1, **extra)
    return [rt.count_batch_step([context + i] * rows) for i in range(w)]


def count_prefill_chunk(config: ModelConfig, rows: int, position: int = 0, *, bits: int = 4,
                        router_bits: int = 8, split_threshold: int | None = None,
                        gemm_path: str = "simdgroup", tensor_attention: bool = True) -> dict:
    """Simulator counters of one prefill chunk of ``rows`` tokens starting at ``position``
    (record-only device, virtual weights), as :func:`count_decode_step`. ``gemm_path="tensor"``
    counts on a simulator of an apple10 (M5) GPU, the family that has them; there
    ``tensor_attention=False`` counts a system whose tensor ops take no bfloat operands (the
    prefill kernels' tensor-op twins need them: the GEMMs and the attention on
    simdgroup_matrix)."""
    extra = _given(split_threshold=split_threshold)
    rt = counting_runtime(config, bits, router_bits, position + rows, prefill_chunk=rows, gemm_path=gemm_path,
                           gpu_family="apple10" if gemm_path == "tensor" else None,
                           bfloat_tensor_ops=tensor_attention, **extra)
    return rt.count_chunk(position, rows)
