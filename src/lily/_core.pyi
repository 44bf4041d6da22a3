"""Lily's native core (C++17; Objective-C++ for the Metal backend)."""

from collections.abc import Callable, Mapping, Sequence, Set
from typing import Annotated

import numpy
from numpy.typing import NDArray


def compiled_devices() -> list[str]:
    """
    Names of the native devices compiled into this build, e.g. ['sim'] or ['sim', 'metal'].
    """

def build_info() -> dict:
    """
    Build facts: version, compiler, platform, debug flag and compiled devices.
    """

class GpuError(RuntimeError):
    pass

class HazardError(GpuError):
    pass

class Buffer:
    """Device memory (shared storage)."""

    @property
    def size(self) -> int: ...

    @property
    def id(self) -> int: ...

    @property
    def label(self) -> str: ...

    @label.setter
    def label(self, arg: str, /) -> None: ...

    def write(self, array: Annotated[NDArray, dict(order='C', device='cpu', writable=False)], offset: int = 0) -> None:
        """Copies a C-contiguous array into the buffer at a byte offset."""

    def read(self, offset: int = 0, size: int = -1) -> bytes:
        """Copies bytes out of the buffer."""

class ComputePass:
    """A concurrent compute pass; barriers come from declared ranges."""

    def dispatch(self, kernel: str, grid: object, threadgroup: object, buffers: object | None = None, constants: object | None = None, threadgroup_memory: object | None = None, reads: object | None = None, writes: object | None = None, threadgroups: bool = False, label: str = '') -> None:
        """
        Encodes one dispatch of a kernel (by host name). grid counts threads, or threadgroups
        when threadgroups=True. buffers: [(index, Buffer[, offset])]; constants: [(index, bytes)];
        threadgroup_memory: [(index, length)]; reads/writes: [Buffer | (Buffer, offset, size)]; a write may
        carry a 4th item, a nonzero tag: writes with equal tags are disjoint by construction (no barrier).
        """

    def barrier(self) -> None: ...

    def end(self) -> None: ...

    @property
    def manual_barriers(self) -> bool: ...

class CommandBuffer:
    def compute_pass(self, manual_barriers: bool = False) -> ComputePass: ...

    def copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int, size: int) -> None:
        """
        Copies size bytes of src at src_offset to dst at dst_offset on the device, in encoding
        order (ends the current compute pass). Offsets and size: multiples of 4; ValueError
        for ranges outside their buffers or overlapping in one buffer.
        """

    def commit(self) -> None: ...

    def wait(self) -> None: ...

    def on_completed(self, fn: Callable) -> None:
        """
        fn(status: str, error: str) runs on the main thread after completion (by the next wait()).
        """

    @property
    def status(self) -> str: ...

    @property
    def gpu_seconds(self) -> float:
        """
        Seconds the device spent executing it, once completed (NaN before): Metal's GPUEndTime - GPUStartTime; the simulator's execution wall time.
        """

    @property
    def gpu_interval(self) -> tuple[float, float]:
        """
        (start, end) of its execution in seconds of a host clock shared by the device's command buffers, once completed ((nan, nan) before).
        """

    @property
    def counters(self) -> dict: ...

    @property
    def dispatch_log(self) -> list:
        """
        Per-dispatch counters: label, kernel, threadgroups, threads per threadgroup, dynamic threadgroup memory, pass, barrier stage, declared bytes read/written.
        """

class Device:
    """A Lily device: 'sim' (the Metal simulator) or 'metal'."""

    @property
    def name(self) -> str: ...

    def kernel_names(self) -> list[str]: ...

    def has_kernel(self, arg: str, /) -> bool: ...

    def buffer(self, nbytes: int) -> Buffer: ...

    def map_file(self, path: str, offset: int = 0, length: int = 0) -> Buffer: ...

    @property
    def gpu_family(self) -> str:
        """
        The GPU's Apple family: 'apple7' (M1) .. 'apple10' (M5); the simulator's is an option.
        """

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the buffers this device allocated that are still alive."""

    @property
    def supports_tensor_ops(self) -> bool:
        """
        Whether the Metal 4 tensor-op kernels (metal/*_tensor.metal) can be used on this device.
        """

    @property
    def tensor_ops_status(self) -> str:
        """Why supports_tensor_ops is False ('' when it is True)."""

    @property
    def supports_bfloat_tensor_ops(self) -> bool:
        """
        Whether the tensor-op kernels with bfloat operands (the prefill attention's) can be used too.
        """

    @property
    def bfloat_tensor_ops_status(self) -> str:
        """Why supports_bfloat_tensor_ops is False ('' when it is True)."""

    def pipeline_info(self, name: str) -> dict:
        """
        Builds kernel `name`'s pipeline: its maxTotalThreadsPerThreadgroup (on the simulator the
        kernel's [[max_total_threads_per_threadgroup]], default 1024), thread execution width,
        static threadgroup memory in bytes (0 on the simulator) and how many [[buffer(n)]]
        parameters reflection described (0: buffer alignment checks are off for it).
        """

    @property
    def memory_limits(self) -> dict:
        """
        Bytes: working_set (Metal recommendedMaxWorkingSetSize) and max_buffer (maxBufferLength);
        0 = no limit (the simulator's unless created with a budget).
        """

    def command_buffer(self, dispatch_log: bool = True) -> CommandBuffer:
        """
        A new command buffer; with dispatch_log (the default) it keeps the per-dispatch records
        CommandBuffer.dispatch_log reads (the scalar counters are always kept).
        """

def sim_device(record_only: bool = False, order: str = 'forward', thread_order: str = 'forward', seed: int = 0, poison: bool = True, verify_writes: bool = False, verify_reads: bool = False, gpu_family: str = 'apple9', working_set_bytes: int = 0, max_buffer_bytes: int = 0, pipeline_thread_limit: int = 0, bfloat_tensor_ops: bool = True, threads: int | None = None, faults: Mapping[str, str] = {}, tensor_layout: str = 'sim') -> Device:
    """
    The Metal simulator: runs metal/*.metal on the CPU with Metal's execution model.
    gpu_family ('apple7'..'apple10') is the family it reports; 'apple10' offers the Metal 4
    tensor-op kernels (metal/*_tensor.metal), as an M5 does; bfloat_tensor_ops=False leaves out
    those with bfloat operands (the prefill attention's), as a tensor library without them.
    tensor_layout: where cooperative-tensor elements lie: 'sim' (default), an adversarial layout
    that catches kernels assuming one; 'nax', the M5's 16 x 16 fragment layout of
    execution_simdgroup tiles with extents multiples of 16, which MLX's NAX kernels assume
    (other scopes and shapes keep 'sim'); accepted with every gpu_family, used by apple10's
    tensor-op kernels only. Another value is a ValueError.
    working_set_bytes / max_buffer_bytes: the memory budget it reports (Device.memory_limits;
    0 = none), as a Mac's GPU does.
    pipeline_thread_limit caps every pipeline's thread limit below the kernel's declared one, as
    register pressure may on a Mac (0 = none).
    threads: the OS threads running threadgroups (None: sim_default_threads(), i.e.
    $LILY_SIM_THREADS or every CPU; 1: one after another, the serial simulator).
    faults: {kernel: 'build' | 'wrong' | thread limit as a string} injects a pipeline that does not
    build, wrong results, or a lower thread limit into named kernels (tests of the fallbacks).
    """

def sim_default_threads() -> int:
    """
    The threads a sim_device() takes by default: $LILY_SIM_THREADS if set, else the CPUs this
    process may run on. A bad $LILY_SIM_THREADS is a ValueError naming it.
    """

def is_bfloat_tensor_kernel(name: str) -> bool:
    """
    Whether tensor-library kernel `name` runs tensor operations on bfloat operands (the naming rule the Metal device uses to leave them out when the system lacks them).
    """

def gpu_family(device: Device) -> str:
    """
    The device's GPU family, 'apple7' .. 'apple10' (same as Device.gpu_family).
    """

KERNEL_ARGS: dict[str, tuple[int, tuple[tuple[str, str, int, int], ...]]]

CONSTANTS: dict[str, int | float]

EXPERT_TILE_ROWS: tuple[int, ...]

def decode_split_rows(rows: int, num_q_heads: int, num_kv_heads: int) -> int:
    """
    KV rows per block of the split decode attention over `rows` cache rows, as the runtime picks them
    without the split_block option (DecodePlan::split_rows, csrc/runtime/decode.cpp). Raises ValueError
    for rows 0 or heads with no attention kernel grouping.
    """

def moe_tile_classes(tile_rows: int) -> int:
    """Tile classes of a height-T tiling (prefill_args.h moe_tile_classes)."""

def moe_tail_class(tile_rows: int, rows: int) -> int:
    """
    The class of an expert's last tile of `rows` rows, 1 <= rows <= T (prefill_args.h).
    """

def moe_class_capacity(assignments: int, experts: int, tile_rows: int, cls: int) -> int:
    """
    Tiles class `cls` can hold at most for `assignments` over `experts` (prefill_args.h).
    """

def moe_class_base(assignments: int, experts: int, tile_rows: int, cls: int) -> int:
    """
    First entry of class `cls`'s map in the tile-map buffer (prefill_args.h).
    """

def kernel_name(base: str, suffix: str = '', **params) -> str:
    """
    A templated kernel's host name (csrc/runtime/kernel_names.h): base, '_<key><value>' per keyword in
    order, then suffix: kernel_name('gdn_scan', k=128, v=128, r=32) == 'gdn_scan_k128_v128_r32'.
    """

def kernel_params(name: str) -> dict:
    """
    The template parameters in a kernel's host name, by key: kernel_params('attn_prefill_d256_g4_tensor')
    == {'d': 256, 'g': 4} (csrc/runtime/kernel_names.h).
    """

def gdn_ring_entry_floats(hk: int, hv: int, dk: int, dv: int) -> int:
    """
    Floats of one entry of a Gated DeltaNet layer's ring of pending decode-step updates (metal/mixer_args.h GdnRing: delta [hv*dv] | k [hk*dk] | g [hv]).
    """

COST_PATHS: tuple[str, ...]

LATENCY_KINDS: tuple[str, ...]

def dispatch_costs(command_buffer: CommandBuffer) -> list:
    """
    The dispatches a command buffer recorded (CommandBuffer.dispatch_log) with the cost table's entry
    of each (as the counting runtime's records: work = flops per path, bytes, latency chains; None
    for a kernel the table does not know): how `lily bench --kernels` prices what it timed.
    """

def native_quant_format(module: str) -> tuple[int, int]:
    """
    (bits, group_size) the native kernels read the linear `module` in (e.g. 'model.layers.0.mlp.gate' -> (8, 64)); csrc/runtime/model.h.
    """

class ModelDims:
    """
    The model's dimensions (lily.checkpoint.ModelConfig's fields of the same names, full_attention per layer); FIELDS lists the scalar ones.
    """

    def __init__(self) -> None: ...

    @property
    def vocab_size(self) -> int: ...

    @vocab_size.setter
    def vocab_size(self, arg: int, /) -> None: ...

    @property
    def hidden_size(self) -> int: ...

    @hidden_size.setter
    def hidden_size(self, arg: int, /) -> None: ...

    @property
    def num_hidden_layers(self) -> int: ...

    @num_hidden_layers.setter
    def num_hidden_layers(self, arg: int, /) -> None: ...

    @property
    def num_attention_heads(self) -> int: ...

    @num_attention_heads.setter
    def num_attention_heads(self, arg: int, /) -> None: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @num_key_value_heads.setter
    def num_key_value_heads(self, arg: int, /) -> None: ...

    @property
    def head_dim(self) -> int: ...

    @head_dim.setter
    def head_dim(self, arg: int, /) -> None: ...

    @property
    def rotary_dim(self) -> int: ...

    @rotary_dim.setter
    def rotary_dim(self, arg: int, /) -> None: ...

    @property
    def linear_num_key_heads(self) -> int: ...

    @linear_num_key_heads.setter
    def linear_num_key_heads(self, arg: int, /) -> None: ...

    @property
    def linear_num_value_heads(self) -> int: ...

    @linear_num_value_heads.setter
    def linear_num_value_heads(self, arg: int, /) -> None: ...

    @property
    def linear_key_head_dim(self) -> int: ...

    @linear_key_head_dim.setter
    def linear_key_head_dim(self, arg: int, /) -> None: ...

    @property
    def linear_value_head_dim(self) -> int: ...

    @linear_value_head_dim.setter
    def linear_value_head_dim(self, arg: int, /) -> None: ...

    @property
    def linear_conv_kernel_dim(self) -> int: ...

    @linear_conv_kernel_dim.setter
    def linear_conv_kernel_dim(self, arg: int, /) -> None: ...

    @property
    def num_experts(self) -> int: ...

    @num_experts.setter
    def num_experts(self, arg: int, /) -> None: ...

    @property
    def num_experts_per_tok(self) -> int: ...

    @num_experts_per_tok.setter
    def num_experts_per_tok(self, arg: int, /) -> None: ...

    @property
    def moe_intermediate_size(self) -> int: ...

    @moe_intermediate_size.setter
    def moe_intermediate_size(self, arg: int, /) -> None: ...

    @property
    def shared_expert_intermediate_size(self) -> int: ...

    @shared_expert_intermediate_size.setter
    def shared_expert_intermediate_size(self, arg: int, /) -> None: ...

    @property
    def rms_norm_eps(self) -> float: ...

    @rms_norm_eps.setter
    def rms_norm_eps(self, arg: float, /) -> None: ...

    @property
    def rope_theta(self) -> float: ...

    @rope_theta.setter
    def rope_theta(self, arg: float, /) -> None: ...

    @property
    def norm_topk_prob(self) -> bool: ...

    @norm_topk_prob.setter
    def norm_topk_prob(self, arg: bool, /) -> None: ...

    @property
    def full_attention(self) -> list[bool]: ...

    @full_attention.setter
    def full_attention(self, arg: Sequence[bool], /) -> None: ...

    FIELDS: tuple[str, ...]

class SamplingConfig:
    """
    Device sampling settings (lily.sampling.SamplingParams' fields of the same names, listed in FIELDS).
    """

    def __init__(self) -> None: ...

    @property
    def temperature(self) -> float: ...

    @temperature.setter
    def temperature(self, arg: float, /) -> None: ...

    @property
    def top_k(self) -> int: ...

    @top_k.setter
    def top_k(self, arg: int, /) -> None: ...

    @property
    def top_p(self) -> float: ...

    @top_p.setter
    def top_p(self, arg: float, /) -> None: ...

    @property
    def min_p(self) -> float: ...

    @min_p.setter
    def min_p(self, arg: float, /) -> None: ...

    @property
    def presence_penalty(self) -> float: ...

    @presence_penalty.setter
    def presence_penalty(self, arg: float, /) -> None: ...

    @property
    def frequency_penalty(self) -> float: ...

    @frequency_penalty.setter
    def frequency_penalty(self, arg: float, /) -> None: ...

    @property
    def repetition_penalty(self) -> float: ...

    @repetition_penalty.setter
    def repetition_penalty(self, arg: float, /) -> None: ...

    @property
    def seed(self) -> int: ...

    @seed.setter
    def seed(self, arg: int, /) -> None: ...

    @property
    def logprobs(self) -> bool: ...

    @logprobs.setter
    def logprobs(self, arg: bool, /) -> None: ...

    @property
    def top_logprobs(self) -> int: ...

    @top_logprobs.setter
    def top_logprobs(self, arg: int, /) -> None: ...

    @property
    def vocab_limit(self) -> int: ...

    @vocab_limit.setter
    def vocab_limit(self, arg: int, /) -> None: ...

    FIELDS: tuple[str, ...]

    @property
    def logit_bias(self) -> list[tuple[int, float]]:
        """
        lily.sampling.SamplingParams.logit_bias: (token id, bias) pairs, ids < vocab (not in FIELDS).
        """

    @logit_bias.setter
    def logit_bias(self, arg: Sequence[tuple[int, float]], /) -> None: ...

class SessionSnapshot:
    """
    A Runtime's session state in a buffer of its device (Runtime.snapshot / restore).
    """

    def __init__(self, position: int, parts: Sequence[bytes], device: Device) -> None:
        """
        A snapshot from the bytes of `parts()` (a prompt cache file), uploaded into a buffer of `device`; Runtime.restore checks the sizes. ValueError on a record-only device.
        """

    @property
    def position(self) -> int:
        """tokens in the session"""

    @property
    def nbytes(self) -> int:
        """bytes held (KV rows in use, conv and recurrent state)"""

    @property
    def device_bytes(self) -> int:
        """bytes of the device buffer holding the parts (nbytes; 0 when empty)"""

    def parts(self) -> list[bytes]:
        """
        The state as bytes (read from the device buffer), one item per attention layer's K or V rows or DeltaNet layer's conv or recurrent state.
        """

class RuntimeOptions:
    """
    A Runtime's options (csrc/runtime/runtime.h; FIELDS lists them but gemm_path). Setting a wrong type, an unknown gemm_path, or validate() on a zero max_context/split_threshold raises ValueError naming the option. prefill_chunk 0 (the default) is the automatic choice: the first of AUTO_PREFILL_CHUNKS, capped at max_context, that fits the device's memory.
    """

    def __init__(self) -> None: ...

    @property
    def max_context(self) -> int: ...

    @max_context.setter
    def max_context(self, arg: int, /) -> None: ...

    @property
    def split_threshold(self) -> int: ...

    @split_threshold.setter
    def split_threshold(self, arg: int, /) -> None: ...

    @property
    def split_block(self) -> int: ...

    @split_block.setter
    def split_block(self, arg: int, /) -> None: ...

    @property
    def prefill_chunk(self) -> int: ...

    @prefill_chunk.setter
    def prefill_chunk(self, arg: int, /) -> None: ...

    @property
    def state_window(self) -> int: ...

    @state_window.setter
    def state_window(self, arg: int, /) -> None: ...

    @property
    def command_buffer_rows(self) -> int: ...

    @command_buffer_rows.setter
    def command_buffer_rows(self, arg: int, /) -> None: ...

    @property
    def virtual_weights(self) -> bool: ...

    @virtual_weights.setter
    def virtual_weights(self, arg: bool, /) -> None: ...

    FIELDS: tuple[str, ...]

    MAX_STATE_WINDOW: int = 64

    AUTO_PREFILL_CHUNKS: tuple = (4096, 2048, 1024, 512)

    @property
    def gemm_path(self) -> str:
        """
        The prefill GEMM kernels: 'auto' (ask the device), 'simdgroup' or 'tensor'.
        """

    @gemm_path.setter
    def gemm_path(self, arg: str, /) -> None: ...

    def validate(self) -> None:
        """ValueError naming the first invalid option."""

class Runtime:
    """
    One session of the model on a device: chunked prefill and pipelined decode (csrc/runtime/runtime.h).
    """

    def __init__(self, device: Device, dims: ModelDims, tensors: Sequence[tuple[str, str, int, int]], options: RuntimeOptions) -> None:
        """
        tensors: [(name, safetensors path, byte offset, nbytes)]; dims: a ModelDims; options: a RuntimeOptions.
        """

    def reset(self, seq: int = 0) -> None:
        """Empties sequence `seq` (0: the session)."""

    def snapshot(self, seq: int = 0) -> SessionSnapshot:
        """A copy of sequence `seq`'s state (waits for its work in flight)."""

    def restore(self, snapshot: SessionSnapshot, seq: int = 0) -> None:
        """
        Makes `snapshot` sequence `seq`'s state; ValueError if it is from another model or exceeds the context.
        """

    @property
    def position(self) -> int:
        """The session's position."""

    def sequence_position(self, seq: int) -> int:
        """Tokens in sequence `seq`'s state."""

    def open_sequence(self) -> int:
        """
        A new sequence (its own KV cache at max_context and state), empty; its id. ValueError when it
        would take the runtime past the device's working set.
        """

    def close_sequence(self, seq: int) -> None:
        """Frees an opened sequence (waits for its work in flight)."""

    @property
    def sequence_bytes(self) -> int:
        """Device bytes one more sequence allocates."""

    @property
    def sequences_bytes(self) -> int:
        """
        Device bytes the opened sequences hold (the session's are in memory_use).
        """

    @property
    def sequence_room(self) -> int:
        """
        How many more sequences fit the device's working set (2**32 - 1 without a limit).
        """

    def sequences(self) -> list[int]:
        """The open sequences' ids, the session (0) first."""

    def begin(self, seq: int, sampling: SamplingConfig, prompt: Sequence[int]) -> None:
        """
        The device sampler's settings for sequence `seq`'s generation (token counts from `prompt`).
        """

    def submit_chunk(self, seq: int, tokens: Sequence[int], sample: bool = False, logits: bool = False) -> int:
        """
        Commits one prefill chunk of sequence `seq`; `sample`: its last row's sampler writes the first
        generated token on the device; `logits`: its last row's logits are kept. The ticket (0: none).
        """

    def submit_step(self, rows: Sequence[tuple[int, int, bool]]) -> int:
        """
        Commits one decode step of rows (seq, token: -1 for the device's, logits: keep them for the host);
        returns its ticket.
        """

    def take(self, ticket: int, timed: bool = True) -> tuple:
        """
        Waits for a ticket (taken in commit order): ([(seq, position, token, logprob, top, logits or None)],
        its device seconds, NaN when unknown).
        """

    def wait_all(self) -> None:
        """
        Waits for every committed command buffer (their outputs stay for take).
        """

    @property
    def weight_bytes(self) -> int: ...

    @property
    def repacked_bytes(self) -> int: ...

    @property
    def prefill_chunk(self) -> int: ...

    @property
    def prefill_scratch_bytes(self) -> int: ...

    @property
    def uses_tensor_ops(self) -> bool: ...

    @property
    def gpu_seconds(self) -> float:
        """
        Device seconds of the work whose results the host has taken since construction (prefill chunks, forward passes, generation steps whose token next() returned): a total, take differences.
        """

    @property
    def uses_tensor_attention(self) -> bool: ...

    @property
    def tensor_families(self) -> list[str]:
        """
        The families of Metal 4 tensor-op kernels prefill runs (gemm, moe_prefill, attention_prefill), after the load-time check against their simdgroup_matrix twins.
        """

    def prefill_command_buffers(self, position: int, rows: int) -> list[tuple[int, int]]:
        """
        The layers of a prefill chunk of `rows` rows at `position` as [begin, end) pairs, one command buffer each (the command_buffer_rows option bounds each one's work; docs/prefill.md).
        """

    @property
    def notices(self) -> list[str]:
        """
        One line per tensor-op family the load-time check took off the tensor path, saying why.
        """

    @property
    def memory_use(self) -> dict:
        """
        Device memory of the session in bytes (weights, kv_cache, state, scratch, total, largest buffer),
        checked against Device.memory_limits at load.
        """

    @property
    def kernel_table(self) -> list:
        """
        Every kernel the runtime dispatches (built and validated at load): the largest threadgroup it
        asks for and its pipeline's thread limit and static threadgroup memory.
        """

    def expert_histogram(self, layer: int) -> list[int]:
        """Assignments per expert of `layer` in the last completed prefill chunk."""

    def forward(self, tokens: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu', writable=False)], logits: str = 'last', decode_steps: bool = False, seq: int = 0) -> NDArray[numpy.float32]:
        """
        Runs tokens (uint32 numpy array) at sequence `seq`'s position (prefill chunks; one token or decode_steps=True: decode steps). float32 logits [n, vocab] ('all'), [vocab] ('last') or [0] ('none').
        """

    def generate_greedy(self, first: int, max_tokens: int, stop_ids: Set[int]) -> list[int]:
        """
        Pipelined greedy decode with the GPU token hand-off; returns the generated ids.
        """

    def start(self, feed: Sequence[int], max_steps: int, prompt: Sequence[int], sampling: SamplingConfig) -> None:
        """
        Starts pipelined generation: `feed` (>= 1 tokens) is fed at the current position; several tokens run as prefill chunks whose last one samples the first output on the device.
        """

    def next(self) -> object:
        """
        The next generated (token, logprob, [(id, logprob)]), or None when the steps are used up.
        """

    def finish(self) -> None:
        """Waits for the step in flight and commits the session position."""

    def count_step(self, position: int) -> dict:
        """Encodes (and on a real device runs) one step; counters and traffic."""

    def count_batch_step(self, positions: Sequence[int]) -> dict:
        """
        Encodes (and on a real device runs) one batched step of rows at `positions`; counters and
        traffic.
        """

    def count_chunk(self, position: int, rows: int) -> dict:
        """
        Encodes (and on a real device runs) one prefill chunk; counters and traffic.
        """

def encode_embed_rows(compute_pass: ComputePass, table: tuple[Buffer, Buffer, Buffer], tokens: Buffer, out: Buffer, rows: int, cols: int, vocab: int, label: str = '') -> None:
    """
    embed_rows_q4 as the prefill chunk encodes it (csrc/runtime/families/embed.h): out [rows, cols] fp32 =
    the rows of the 4-bit table (weight, scales, biases) [vocab, cols] of token ids tokens [rows] uint32.
    """

def encode_rms_norm(compute_pass: ComputePass, kernel: str, x: Buffer, w: Buffer, out: Buffer, rows: int, n: int, eps: float, out_bytes: int, threads: int = 256, label: str = '') -> None:
    """
    `kernel` (rms_norm: fp32 out, out_bytes 4; rms_norm_bf16: out_bytes 2) over `rows` rows of x [rows, n]
    fp32 with the bf16 weight w [n], as the prefill chunk encodes it (csrc/runtime/families/norm.h).
    """

def batch_size(rows: int) -> int:
    """
    The batched kernels' b (their _b<b> suffix) for `rows` rows: the smallest built size holding them
    (csrc/runtime/families/gemv.h batch_kernel). Raises ValueError for rows outside 1..kBatchMaxRows.
    """

def encode_gemv_add(compute_pass: ComputePass, weights: tuple[Buffer, Buffer, Buffer], x: Buffer, y: Buffer, rows: int, cols: int, bits: int = 4, gated: object | None = None, batch_rows: int = 0, x_stride: int = 0, y_stride: int = 0, ssq_stride: int = 0, threads: int = 64, label: str = '') -> None:
    """
    gemv_q<bits>_add as the decode step encodes it (csrc/runtime/families/gemv.h): y[rows] += W x[cols],
    W = weights (weight, scales, biases); with gated = (ssq, z, norm, head_dim, splits, eps)
    gemv_gated_q<bits>_add (x normalised on load); with batch_rows the batched kernel over that many
    rows, x and z rows x_stride floats apart, y rows y_stride, ssq rows ssq_stride.
    """

def encode_norm_gemv(compute_pass: ComputePass, x: Buffer, norm: Buffer, xn: Buffer, matrices: list, cols: int, eps: float, bits: int = 4, write_xn: bool = True, rows_per_simdgroup: int = 8, k_splits: int = 1, threads: int = 64, batch_rows: int = 0, x_stride: int = 0, x_at: int = 0, embed: object | None = None, extra_groups: int = 0, label: str = '') -> None:
    """
    norm_gemv_q<bits> as the decode step encodes it (csrc/runtime/families/gemv.h): the RMSNorm of x
    (cols fp32 from byte x_at; norm bf16 [cols]) into xn (with write_xn) and the GEMVs of `matrices`
    (1 to 4 of (weights, y, rows[, y_at[, y_stride]])); with batch_rows norm_gemv_batch over that many
    rows (x and xn rows x_stride floats apart, each y's y_stride); with embed = (table, tokens, vocab,
    token_at) embed_norm_gemv_q4, x the token's embedding row (written). extra_groups: surplus
    threadgroups (they exit).
    """

def encode_moe_route_gate_up(compute_pass: ComputePass, weights: tuple, xn: Buffer, logits: Buffer, h: Buffer, ids: Buffer, route_w: Buffer, hidden: int, inter: int, inter_shared: int, experts: int, top_k: int, norm_topk: bool = True, threads: int = 64, batch_rows: int = 0, x_stride: int = 0, logits_stride: int = 0, h_stride: int = 0, ids_stride: int = 0, w_stride: int = 0, label: str = '') -> None:
    """
    moe_route_gate_up_swiglu_q4 as the decode step encodes it (csrc/runtime/families/moe.h): weights =
    (gate, up, shared gate, shared up), each 4-bit (weight, scales, biases), the routed ones stacked
    [experts, inter, hidden]; the routing of xn [hidden] by logits [experts + 1] (the last the shared
    gate's), then h [top_k * inter + inter_shared], ids uint32 [top_k] and route_w [top_k + 1] out.
    With batch_rows moe_route_gate_up_batch_q4_b<batch_size(batch_rows)> over that many rows, row r of
    each buffer r times its stride (floats, uints) further (MoeBatchArgs).
    """

def encode_moe_down(compute_pass: ComputePass, weights: tuple, h: Buffer, ids: Buffer, route_w: Buffer, residual: Buffer, hidden: int, inter: int, inter_shared: int, experts: int, top_k: int, threads: int = 64, batch_rows: int = 0, x_stride: int = 0, h_stride: int = 0, ids_stride: int = 0, w_stride: int = 0, label: str = '') -> None:
    """
    moe_down_q4 as the decode step encodes it (csrc/runtime/families/moe.h): weights = (down, shared
    down), 4-bit (weight, scales, biases), the routed ones stacked [experts, hidden, inter]; residual
    [hidden] += the route_w-weighted down projections of h [top_k * inter + inter_shared] by the experts
    ids uint32 [top_k] and the shared expert. With batch_rows moe_down_batch_q4_b<batch_size(batch_rows)>
    over that many rows (x_stride: the residual's; MoeBatchArgs).
    """

def encode_gemm(compute_pass: ComputePass, weights: tuple[Buffer, Buffer, Buffer], x: Buffer, y: Buffer, m: int, n: int, k: int, bits: int = 4, add: bool = False, bf16_y: bool = False, x_scale: Buffer | None = None, x_shift: int = 0, tensor: bool = False, lda: int = 0, ldy: int = 0, x_at: int = 0, y_at: int = 0, disjoint: int = 0, label: str = '') -> None:
    """
    A dense prefill GEMM as the prefill chunk encodes it (csrc/runtime/families/gemm.h): y[m, n] (=|+=)
    x[m, k] W^T with W = weights (weight, scales, biases) of `bits`, x bfloat rows of lda (default k)
    elements from byte x_at, y rows of ldy (default n) from byte y_at: gemm_q<bits> (fp32 y), _bf16
    (bf16_y), _add_h (add), _add_hs (add with x_scale: half, one per 2^x_shift elements of x), each
    _tensor with `tensor`. disjoint: a nonzero tag for GEMMs writing disjoint columns of one y.
    """

def encode_gemm_swiglu(compute_pass: ComputePass, gate: tuple[Buffer, Buffer, Buffer], up: tuple[Buffer, Buffer, Buffer], x: Buffer, h: Buffer, m: int, n: int, k: int, scale: Buffer, scale_at: int, ldg: int, tensor: bool = False, lda: int = 0, ldy: int = 0, label: str = '') -> None:
    """
    gemm_swiglu_q4 (_tensor with `tensor`) as the prefill chunk encodes it (csrc/runtime/families/gemm.h):
    h[m, n] = bfloat(g * silu(x Wg^T) * (x Wu^T)), gate and up 4-bit (weight, scales, biases) [n, k], x and
    h bfloat rows of lda / ldy (defaults k, n), g fp32 at byte scale_at of `scale`, row stride ldg.
    """

def moe_geometry(tile_rows: int, tensor: bool) -> tuple:
    """
    (gate/up threads, gate/up output columns, down threads, down output columns) per threadgroup of the
    grouped expert GEMMs of tile height tile_rows, on the tensor-op path with `tensor`, as the prefill
    plan picks them (the kernels' moe_gemm_threads / moe_gemm_bn of metal/prefill_args.h).
    """

def encode_moe_gemm(compute_pass: ComputePass, kernel: str, weights: tuple, x: Buffer, perm: Buffer, tiles: Buffer, tile_count: Buffer, y: Buffer, args: bytes, tile_entries: int, tiles_at: int = 0, count_at: int = 0, disjoint: int = 0, label: str = '') -> None:
    """
    A grouped expert GEMM as the prefill chunk encodes it (csrc/runtime/families/moe_prefill.h): `kernel`
    moe_gemm_gate_up_q4_t<T>[_tensor] (weights = (gate, up)) or moe_gemm_down_q4_t<T>[_tensor] (weights =
    (down,)), each stacked 4-bit (weight, scales, biases); `args` the bytes of MoeGemmArgs; x bfloat rows
    of lda, perm uint32 [m * top_k], tile_entries MoeTile entries of `tiles` from byte tiles_at and their
    count (uint32 at count_at of tile_count), y bfloat rows of ldy written (disjoint: the write tag).
    """

def moe_route_threads(experts: int) -> int:
    """
    Threads per threadgroup of moe_route_topk / moe_route_scatter for `experts` experts, as the prefill
    plan dispatches them: one per expert, rounded up to whole simdgroups, at most 1024.
    """

def moe_map_entries(assignments: int, experts: int, tile_rows: int) -> int:
    """
    MoeTile entries of the tile maps of all tile classes of a height-tile_rows tiling of `assignments`
    (rows * top_k) over `experts` (what moe_route_scatter writes; metal/prefill_args.h).
    """

def encode_moe_route_clear(compute_pass: ComputePass, block_counts: Buffer, args: bytes, label: str = '') -> None:
    """
    moe_route_clear as the prefill chunk encodes it (csrc/runtime/families/moe_prefill.h): zeroes
    block_counts (uint32 [ceil(rows / block_rows), experts]); `args` the bytes of MoeRoutePrefillArgs.
    """

def encode_moe_route_topk(compute_pass: ComputePass, logits: Buffer, ids: Buffer, w: Buffer, block_counts: Buffer, args: bytes, threads: int = 0, label: str = '') -> None:
    """
    moe_route_topk as the prefill chunk encodes it (csrc/runtime/families/moe_prefill.h): logits fp32
    [rows, experts + 1] -> ids uint32 [rows, top_k], w fp32 [rows, top_k + 1], block_counts added to;
    one threadgroup per row of `threads` (0: moe_route_threads(experts)).
    """

def encode_moe_route_scatter(compute_pass: ComputePass, ids: Buffer, block_counts: Buffer, perm: Buffer, tiles: Buffer, tile_count: Buffer, hist: Buffer, args: bytes, threads: int = 0, label: str = '') -> None:
    """
    moe_route_scatter as the prefill chunk encodes it (csrc/runtime/families/moe_prefill.h): ids and
    block_counts -> perm uint32 [rows * top_k], the tile maps (moe_map_entries MoeTile entries), their
    counts (uint32 per tile class) and hist uint32 [experts]; one threadgroup per histogram block of
    `threads` (0: moe_route_threads(experts)).
    """

def encode_moe_combine(compute_pass: ComputePass, h: Buffer, yx: Buffer, w: Buffer, args: bytes, norm: Buffer | None = None, xn: Buffer | None = None, eps: float = 9.999999974752427e-07, threads: int = 0, label: str = '') -> None:
    """
    moe_combine as the prefill chunk encodes it (csrc/runtime/families/moe_prefill.h): h fp32 [rows,
    hidden] += yx (bfloat [rows * top_k, hidden]) weighted by w fp32 [rows, top_k + 1] (`args` the
    bytes of MoeCombineArgs), threads (0: 64) a threadgroup; with norm (bf16 [hidden]) and xn,
    moe_combine_norm, which also writes xn bfloat = RMSNorm(h, eps) * norm, one threadgroup of
    `threads` (0: 256) per row.
    """

def encode_argmax(compute_pass: ComputePass, logits: Buffer, partials: Buffer, token: Buffer, vocab: int, slice: int = 4096, bias: Buffer | None = None, rows: int = 0, combine_threads: int = 0, token_at: int = 0) -> None:
    """
    The decode step's greedy argmax (csrc/runtime/families/sample.h): argmax_partial (argmax_partial_bias
    with `bias` fp32 [rows]) over slices of `slice` of the first `vocab` of the fp32 logits [rows] (rows:
    the buffer's, unless given) into `partials` [ceil(vocab / slice), 2] uint32, then
    sample_greedy_combine (combine_threads: 0 = as the runtime picks) writing the token (uint32) at
    byte `token_at` of `token`.
    """

def encode_sample_token(compute_pass: ComputePass, args: bytes, logits: Buffer, counts: Buffer, positions: Buffer, tokens: Buffer, logprobs: Buffer, top_ids: Buffer, bias: Buffer | None = None, threads: int = 1024, position_at: int = 0, token_at: int = 0, logprobs_at: int = 0, logprobs_bytes: int = 0, top_ids_at: int = 0, top_ids_bytes: int = 0, rows: int = 0) -> None:
    """
    sample_token as the decode step encodes it (csrc/runtime/families/sample.h): `args` the bytes of
    SampleArgs (lily.lab.device.pack_args); the fp32 logits [rows] (rows: the buffer's, unless given),
    the counts uint32 [rows] (read and updated whole), the position (uint32 at position_at), the token
    written at token_at, the log-probabilities and alternatives' ids (`_bytes` from their `_at`; 0: the
    rest of the buffer) and the bias fp32 [rows] (read when SampleArgs.bias, else the logits are bound).
    """

def encode_attn_decode_fused(compute_pass: ComputePass, args: bytes, head_dim: int, qg: Buffer, k: Buffer, v: Buffer, q_norm: Buffer, k_norm: Buffer, positions: Buffer, k_cache: Buffer, v_cache: Buffer, position: int, out: Buffer | None = None, ml: Buffer | None = None, acc: Buffer | None = None, extra_blocks: int = 0, label: str = '') -> None:
    """
    The fused decode attention step as the decode step encodes it (csrc/runtime/families/attention.h):
    `args` the bytes of AttnFusedArgs (lily.lab.device.pack_args); q|gate qg [Hq, 2 head_dim], k and v
    [Hkv, head_dim] fp32, the bf16 q/k norms [head_dim], the position (uint32, the row appended) and the
    bf16 caches [Hkv, capacity, head_dim]. block_rows 0: attn_decode_fused_d<D>_g<G> into out
    [Hq, head_dim]; else attn_decode_split_fused over ceil((position + 1) / block_rows) blocks (plus
    extra_blocks surplus ones) into the partials ml [Hq, max_blocks, 2] and acc [Hq, max_blocks, D].
    """

def encode_attn_combine(compute_pass: ComputePass, args: bytes, head_dim: int, ml: Buffer, acc: Buffer, gate: Buffer, positions: Buffer, out: Buffer, gate_at: int = 0, label: str = '') -> None:
    """
    attn_combine_d<head_dim> as the decode step encodes it (csrc/runtime/families/attention.h): `args`
    the bytes of AttnCombineArgs; the split kernel's partials ml and acc, the gate (head h's values at
    float h * gate_stride from byte gate_at), the position (uint32) and out [Hq, head_dim] fp32.
    """

def encode_attn_prefill_prep(compute_pass: ComputePass, args: bytes, head_dim: int, qg: Buffer, k: Buffer, v: Buffer, q_norm: Buffer, k_norm: Buffer, k_cache: Buffer, v_cache: Buffer, q: Buffer, bf16_q: bool = False, label: str = '') -> None:
    """
    attn_prefill_prep_d<head_dim>[_qbf] as the prefill chunk encodes it
    (csrc/runtime/families/attention_prefill.h): `args` the bytes of AttnPrefillPrepArgs; the bf16
    projections qg [M, Hq, 2 head_dim], k and v [M, Hkv, head_dim], the bf16 q/k norms [head_dim] and
    caches [Hkv, capacity, head_dim] (rows [p0, p0 + M) written); q fp32 [M, Hq, head_dim], or with
    bf16_q the tensor-op attention's bf16 [Hq / G, M, G, head_dim].
    """

def encode_attn_prefill(compute_pass: ComputePass, args: bytes, head_dim: int, q_group: int, q: Buffer, qg: Buffer, k_cache: Buffer, v_cache: Buffer, out: Buffer | None = None, ml: Buffer | None = None, po: Buffer | None = None, tensor: bool = False, label: str = '') -> None:
    """
    The prefill chunk's causal attention as it encodes it (csrc/runtime/families/attention_prefill.h):
    `args` the bytes of AttnPrefillArgs; q as encode_attn_prefill_prep wrote it (bf16 with `tensor`, the
    *_tensor kernels'), qg the bf16 q|gate projection, the bf16 caches. num_splits 0:
    attn_prefill_d<D>_g<q_group>[_tensor] into out bf16 [M, Hq * head_dim]; else
    attn_prefill_split_d<D>_g<q_group>[_tensor] into the partials ml [splits, M, Hq, 2] and po
    [splits, M, Hq, head_dim] fp32.
    """

def encode_attn_prefill_combine(compute_pass: ComputePass, args: bytes, head_dim: int, ml: Buffer, po: Buffer, qg: Buffer, out: Buffer, label: str = '') -> None:
    """
    attn_prefill_combine_d<head_dim> as the prefill chunk encodes it
    (csrc/runtime/families/attention_prefill.h): merges the split partials ml and po of args.num_splits
    splits, gated by the bf16 q|gate qg, into out bf16 [M, Hq * head_dim].
    """

def encode_gdn_decode_step(compute_pass: ComputePass, hk: int, hv: int, dk: int, dv: int, k: int, weights: tuple[Buffer, Buffer, Buffer], qkv: Buffer, b: Buffer, a: Buffer, conv_in: Buffer, conv_out: Buffer, state: Buffer, ring: Buffer, y: Buffer, ssq: Buffer, splits: int = 4, pending: int = 0, write_back: bool = True, label: str = '') -> None:
    """
    gdn_decode_step_k<dk>_v<dv> as the decode step encodes it (csrc/runtime/families/gdn.h): weights =
    (conv1d, A_log, dt_bias); replays `pending` entries of `ring`, then writes `state` back or appends
    its entry; y [hv*dv] and the per-split sums of y^2 ssq [hv, splits] out.
    """

def encode_gdn_state_writeback(compute_pass: ComputePass, hk: int, hv: int, dk: int, dv: int, k: int, state: Buffer, ring: Buffer, pending: int, splits: int = 4, label: str = '') -> None:
    """
    gdn_state_writeback_k<dk>_v<dv> as the decode plan encodes it: `state` after `pending` entries of `ring`.
    """

def gdn_scan_rows(dv: int) -> int:
    """
    State rows per gdn_scan threadgroup for value head dim dv (the r of gdn_scan_k<dk>_v<dv>_r<r>; a
    head's splits: dv / r), as the prefill plan picks them (csrc/runtime/families/gdn_prefill.h).
    """

def encode_gdn_scan(compute_pass: ComputePass, hk: int, hv: int, dk: int, dv: int, k: int, weights: tuple[Buffer, Buffer, Buffer, Buffer], qkv: Buffer, b: Buffer, a: Buffer, z: Buffer, conv_in: Buffer, state: Buffer, u: Buffer, ss: Buffer, rows: int, norm_eps: float, label: str = '') -> None:
    """
    gdn_scan_k<dk>_v<dv>_r<gdn_scan_rows(dv)> over `rows` tokens as the prefill chunk encodes it
    (csrc/runtime/families/gdn_prefill.h): weights = (conv1d, A_log, dt_bias, norm); u and the splits'
    sums of y^2 ss out, state updated in place.
    """

def encode_gdn_norm_scale(compute_pass: ComputePass, hk: int, hv: int, dk: int, dv: int, k: int, ss: Buffer, f: Buffer, rows: int, norm_eps: float, threads: int = 256, label: str = '') -> None:
    """
    gdn_norm_scale_v<dv>_r<gdn_scan_rows(dv)> as the prefill chunk encodes it: the splits' factors f from
    the scan's sums ss.
    """

def encode_gdn_conv_state(compute_pass: ComputePass, hk: int, hv: int, dk: int, dv: int, k: int, qkv: Buffer, conv_in: Buffer, conv_out: Buffer, rows: int, threads: int = 256, label: str = '') -> None:
    """
    gdn_conv_state as the prefill chunk encodes it: the conv state after `rows` rows of qkv (conv_out may
    be conv_in).
    """


# Built on macOS only (LILY_HAVE_METAL).
def metal_device(metallib: str = '') -> Device:
    """The system's Metal GPU with lily.metallib (from beside this module by default)."""
