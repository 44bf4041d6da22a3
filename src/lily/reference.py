"""The numpy reference model: docs/model.md's forward pass, written for readability (the oracle).

One function per block, no fusion, no tiling. Weights are dequantized from the checkpoint's
packed 4/8-bit form to float32; activations are float32 throughout. With
``activation_dtype="bfloat16"`` the values MLX-LM stores as bf16 (every linear's output,
norms, residual stream, conv state, KV cache) are rounded to bf16 at the same points, which
brings the oracle's numbers closer to the peer's; the arithmetic itself stays float32.

The model is incremental: :meth:`ReferenceModel.forward` consumes any number of new tokens
against a :class:`ReferenceState` (KV cache, conv state, recurrent state), so a prompt can
be prefilled in one call or in pieces and then decoded token by token with identical math.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lily.checkpoint import Checkpoint, ModelConfig, QuantizedTensor
from lily.backend import HostBatch, HostGeneration
from lily.errors import InvalidParameterError


def round_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bf16 (round-to-nearest-even), kept as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) & np.uint32(0xFFFF0000))
    out = rounded.view(np.float32)
    return np.where(np.isnan(x), x, out)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x).astype(np.float32)


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """``x * rsqrt(mean(x^2, -1) + eps) * w`` over the last axis, in float32."""
    x = x.astype(np.float32)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y


def l2_norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (eps on the sum, as docs/model.md)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def rope(x: np.ndarray, positions: np.ndarray, rotary_dim: int, theta: float) -> np.ndarray:
    """Non-traditional (rotate-halves) RoPE on the first ``rotary_dim`` dims of the last axis.

    ``x`` is ``[T, heads, head_dim]``, ``positions`` ``[T]`` absolute positions. Dim ``i``
    pairs with ``i + rotary_dim/2``; frequency ``theta ** (-2i / rotary_dim)``.
    """
    half = rotary_dim // 2
    inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / rotary_dim)
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    cos = np.cos(ang).astype(np.float32)[:, None, :]
    sin = np.sin(ang).astype(np.float32)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rotary_dim] = x2 * cos + x1 * sin
    return out


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


@dataclass
class ReferenceState:
    """Session state of the reference model.

    Attributes
    ----------
    position : int
        Tokens consumed so far (the next token's absolute position).
    keys, values : dict[int, np.ndarray]
        Per full-attention layer, float32 ``[num_key_value_heads, capacity, head_dim]``;
        rows ``[0, position)`` are valid.
    conv : dict[int, np.ndarray]
        Per Gated DeltaNet layer, the last ``kernel-1`` conv inputs ``[kernel-1, conv_dim]``.
    recurrent : dict[int, np.ndarray]
        Per Gated DeltaNet layer, float32 ``[Hv, Dv, Dk]``.
    max_context : int
        Capacity limit in tokens.
    """

    max_context: int
    position: int = 0
    keys: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)
    conv: dict = field(default_factory=dict)
    recurrent: dict = field(default_factory=dict)

    def copy(self) -> "ReferenceState":
        """A deep snapshot (multi-turn reuse, the prompt cache): the KV rows in use only
        (the attention grows the arrays again as needed)."""
        n = self.position
        return ReferenceState(self.max_context, n,
                              {i: a[:, :n].copy() for i, a in self.keys.items()},
                              {i: a[:, :n].copy() for i, a in self.values.items()},
                              {i: a.copy() for i, a in self.conv.items()},
                              {i: a.copy() for i, a in self.recurrent.items()})

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays."""
        return sum(a.nbytes for d in (self.keys, self.values, self.conv, self.recurrent) for a in d.values())


class ReferenceModel:
    """The numpy forward pass of ``qwen3_5_moe`` over a memory-mapped MLX checkpoint.

    Parameters
    ----------
    checkpoint : Checkpoint
        An opened, validated checkpoint (:func:`lily.checkpoint.open_checkpoint`).
    activation_dtype : {"float32", "bfloat16"}
        ``"bfloat16"`` rounds stored activations to bf16 where MLX-LM does (see module doc).
    cache_bytes : int
        Budget for dequantized float32 weights kept between uses (default 3 GiB). A model
        whose dequantized weights all fit (every test preset: the ``dims`` preset needs
        0.6 GB) keeps each weight once dequantized, experts included. A larger one (the
        real model needs 140 GB) keeps the non-expert weights, which every token uses, until
        the budget is spent, and dequantizes the selected experts at each use; a weight
        that is not kept and is larger than ``block_bytes`` is applied in blocks of rows,
        never whole. Peak memory is then about the budget plus one block per worker, plus
        the checkpoint's pages the OS maps in.
    block_bytes : int
        float32 bytes of one block of rows of a large weight applied piecewise (default
        64 MiB: lm_head's 248,320 x 2048 weights, 2 GB as float32, in 32 blocks).
    threads : int
        Threads computing the routed experts of a layer (default 1). Each expert's output
        is computed alone and the outputs are summed in the same order as with one thread,
        so the results do not depend on it; numpy releases the GIL in the dequantization
        and the products, so a long prompt's hundreds of experts per layer spread over cores.

    Raises :class:`InvalidParameterError` for an unknown ``activation_dtype``, a negative
    ``cache_bytes`` or a non-positive ``block_bytes`` or ``threads``.
    """

    def __init__(self, checkpoint: Checkpoint, *, activation_dtype: str = "float32",
                 cache_bytes: int = 3 << 30, block_bytes: int = 64 << 20, threads: int = 1):
        if activation_dtype not in ("float32", "bfloat16"):
            raise InvalidParameterError(f"activation_dtype must be 'float32' or 'bfloat16', got {activation_dtype!r}")
        for name, v, low in (("cache_bytes", cache_bytes, 0), ("block_bytes", block_bytes, 1), ("threads", threads, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InvalidParameterError(f"{name} must be an integer >= {low}, got {v!r}")
        self.ck = checkpoint
        self.cfg: ModelConfig = checkpoint.config
        self._act = round_bf16 if activation_dtype == "bfloat16" else (lambda a: a.astype(np.float32, copy=False))
        self.activation_dtype = activation_dtype
        self._cache_budget = cache_bytes
        self._cache_used = 0
        self._block_bytes = block_bytes
        self.threads = threads
        self._pool = None
        total = getattr(checkpoint, "dequantized_nbytes", None)  # None: a duck-typed test checkpoint
        self._cache_experts = total is None or total <= cache_bytes
        self._dense: dict[str, np.ndarray] = {}
        self._experts: dict[tuple[str, int], np.ndarray] = {}
        self._qt: dict[str, QuantizedTensor] = {}
        self._floats: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ weights

    def _q(self, module: str) -> QuantizedTensor:
        qt = self._qt.get(module)
        if qt is None:
            qt = self._qt[module] = self.ck.quantized(module)
        return qt

    def _fits(self, nbytes: int) -> bool:
        return self._cache_used + nbytes <= self._cache_budget

    def _remember(self, store: dict, key, value: np.ndarray) -> np.ndarray:
        if self._fits(value.nbytes):
            store[key] = value
            self._cache_used += value.nbytes
        return value

    def weight(self, module: str) -> np.ndarray:
        """Dequantized float32 ``[out, in]`` weight of a (non-expert) linear module."""
        w = self._dense.get(module)
        if w is None:
            w = self._remember(self._dense, module, self._q(module).dequantize())
        return w

    def expert_weight(self, module: str, expert: int) -> np.ndarray:
        """Dequantized float32 ``[out, in]`` weight of one expert of a stacked module."""
        w = self._experts.get((module, expert))
        if w is None:
            w = self._q(module).dequantize(expert)
            if self._cache_experts:
                self._remember(self._experts, (module, expert), w)
        return w

    def matmul_t(self, x: np.ndarray, module: str) -> np.ndarray:
        """``x @ W.T`` (float32 ``[T, out]``) for ``x`` ``[T, in]`` and a (non-expert) linear
        module: with the kept weight (:meth:`weight`) when it is or can be kept, otherwise
        block by block of ``block_bytes`` of its rows when it is larger than that."""
        w = self._dense.get(module)
        if w is not None:
            return x @ w.T
        qt = self._q(module)
        out_f, in_f = qt.shape
        if self._fits(4 * out_f * in_f) or 4 * out_f * in_f <= self._block_bytes:
            return x @ self.weight(module).T
        step = max(1, self._block_bytes // (4 * in_f))
        y = np.empty((x.shape[0], out_f), np.float32)
        for r0 in range(0, out_f, step):
            y[:, r0:r0 + step] = x @ qt.dequantize(rows=slice(r0, r0 + step)).T
        return y

    def param(self, name: str) -> np.ndarray:
        """An unquantized tensor as float32 (norm weights, conv, A_log, dt_bias)."""
        a = self._floats.get(name)
        if a is None:
            a = self._floats[name] = self.ck.float(name)
        return a

    def linear(self, x: np.ndarray, module: str) -> np.ndarray:
        """``x @ W.T`` for ``x`` ``[T, in]``; output rounded like a stored activation."""
        return self._act(self.matmul_t(x, module))

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Dequantize the embedding rows of ``tokens`` -> ``[T, hidden]``."""
        qt = self._q("model.embed_tokens")
        return self._act(qt.dequantize(np.asarray(tokens, dtype=np.int64)))

    def _map(self, fn, items: list) -> list:
        """``[fn(i) for i in items]``, on ``threads`` threads when there is more than one."""
        if self.threads == 1 or len(items) < 2:
            return [fn(i) for i in items]
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="lily-reference")
        return list(self._pool.map(fn, items))

    # ------------------------------------------------------------------ state

    def new_state(self, max_context: int) -> ReferenceState:
        """Zeroed session state for up to ``max_context`` tokens."""
        c = self.cfg
        st = ReferenceState(max_context=max_context)
        for i in range(c.num_hidden_layers):
            if c.is_full_attention(i):
                shape = (c.num_key_value_heads, min(max_context, 256), c.head_dim)
                st.keys[i] = np.zeros(shape, np.float32)
                st.values[i] = np.zeros(shape, np.float32)
            else:
                st.conv[i] = np.zeros((c.linear_conv_kernel_dim - 1, c.conv_dim), np.float32)
                st.recurrent[i] = np.zeros((c.linear_num_value_heads, c.linear_value_head_dim,
                                            c.linear_key_head_dim), np.float32)
        return st

    # ------------------------------------------------------------------ blocks

    def gated_deltanet(self, i: int, x: np.ndarray, st: ReferenceState) -> np.ndarray:
        """Gated DeltaNet mixer of layer ``i`` on normalised input ``x`` ``[T, hidden]``."""
        c, p = self.cfg, f"model.layers.{i}.linear_attn"
        T = x.shape[0]
        Hk, Hv, Dk, Dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        qkv = self.linear(x, f"{p}.in_proj_qkv")                       # [T, conv_dim]
        z = self.linear(x, f"{p}.in_proj_z").reshape(T, Hv, Dv)
        b = self.linear(x, f"{p}.in_proj_b")                           # [T, Hv]
        a = self.linear(x, f"{p}.in_proj_a")

        # Causal depthwise conv over [conv state | new inputs]; the state keeps the last K-1 inputs.
        w = self.param(f"{p}.conv1d.weight")[:, :, 0]                  # [conv_dim, K]
        K = w.shape[1]
        seq = np.concatenate([st.conv[i], qkv], axis=0)                # [K-1+T, conv_dim]
        st.conv[i] = seq[-(K - 1):].copy() if K > 1 else st.conv[i]
        conv = np.zeros_like(qkv)
        for k in range(K):
            conv += seq[k:k + T] * w[:, k]
        conv = self._act(silu(self._act(conv)))

        q = conv[:, :Hk * Dk].reshape(T, Hk, Dk)
        kk = conv[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk)
        v = conv[:, 2 * Hk * Dk:].reshape(T, Hv, Dv)
        q = self._act(l2_norm(q) / np.sqrt(Dk))
        kk = self._act(l2_norm(kk))
        rep = Hv // Hk                                                 # value head h uses key head h // rep
        q = np.repeat(q, rep, axis=1)
        kk = np.repeat(kk, rep, axis=1)

        beta = sigmoid(b)                                              # [T, Hv]
        g = np.exp(-np.exp(self.param(f"{p}.A_log")) * softplus(a + self.param(f"{p}.dt_bias")))

        S = st.recurrent[i]                                            # [Hv, Dv, Dk] fp32
        y = np.empty((T, Hv, Dv), np.float32)
        for t in range(T):
            S = S * g[t][:, None, None]
            kv_mem = np.einsum("hvk,hk->hv", S, kk[t])
            delta = (v[t] - kv_mem) * beta[t][:, None]
            S = S + delta[:, :, None] * kk[t][:, None, :]
            y[t] = np.einsum("hvk,hk->hv", S, q[t])
        st.recurrent[i] = S.astype(np.float32)
        y = self._act(y)

        o = rms_norm(y, self.param(f"{p}.norm.weight"), c.rms_norm_eps) * silu(z)
        o = self._act(o)
        return self.linear(o.reshape(T, Hv * Dv), f"{p}.out_proj")

    def attention(self, i: int, x: np.ndarray, st: ReferenceState) -> np.ndarray:
        """Full-attention mixer of layer ``i`` (GQA, q/k norm, partial RoPE, sigmoid gate)."""
        c, p = self.cfg, f"model.layers.{i}.self_attn"
        T = x.shape[0]
        Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qg = self.linear(x, f"{p}.q_proj").reshape(T, Hq, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, Hq * D)
        k = self.linear(x, f"{p}.k_proj").reshape(T, Hkv, D)
        v = self.linear(x, f"{p}.v_proj").reshape(T, Hkv, D)
        q = self._act(rms_norm(q, self.param(f"{p}.q_norm.weight"), c.rms_norm_eps))
        k = self._act(rms_norm(k, self.param(f"{p}.k_norm.weight"), c.rms_norm_eps))
        pos = np.arange(st.position, st.position + T)
        q = self._act(rope(q, pos, c.rotary_dim, c.rope_theta))
        k = self._act(rope(k, pos, c.rotary_dim, c.rope_theta))

        end = st.position + T
        if end > st.keys[i].shape[1]:
            cap = min(st.max_context, max(end, 2 * st.keys[i].shape[1]))
            for cache in (st.keys, st.values):
                grown = np.zeros((Hkv, cap, D), np.float32)
                grown[:, :st.position] = cache[i][:, :st.position]
                cache[i] = grown
        st.keys[i][:, st.position:end] = k.transpose(1, 0, 2)
        st.values[i][:, st.position:end] = v.transpose(1, 0, 2)
        K, V = st.keys[i][:, :end], st.values[i][:, :end]               # [Hkv, S, D]

        group = Hq // Hkv
        qh = q.transpose(1, 0, 2).reshape(Hkv, group * T, D)            # query heads of a KV head together
        scores = (qh @ K.transpose(0, 2, 1)) * (D ** -0.5)              # [Hkv, group*T, S]
        causal = pos[:, None] >= np.arange(end)[None, :]                # [T, S]
        scores = np.where(np.tile(causal, (group, 1))[None], scores, -np.inf)
        out = softmax(scores) @ V                                       # [Hkv, group*T, D]
        out = out.reshape(Hq, T, D).transpose(1, 0, 2).reshape(T, Hq * D)
        out = self._act(self._act(out) * sigmoid(gate))
        return self.linear(out, f"{p}.o_proj")

    def route(self, i: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The router of layer ``i`` on ``x`` ``[T, hidden]``: the softmax probabilities
        ``[T, experts]`` (fp32), the top-k experts ``[T, k]`` (ties to the lower index) and
        their weights ``[T, k]`` (renormalised when ``norm_topk_prob``)."""
        c = self.cfg
        probs = softmax(self.matmul_t(x, f"model.layers.{i}.mlp.gate"))
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :c.num_experts_per_tok]
        w = np.take_along_axis(probs, top, axis=-1)
        if c.norm_topk_prob:
            w = w / w.sum(axis=-1, keepdims=True)
        return probs, top, w

    def moe(self, i: int, x: np.ndarray) -> np.ndarray:
        """Sparse MoE of layer ``i``: softmax router, top-k renormalised, SwiGLU experts,
        plus the sigmoid-gated shared expert. ``x`` is ``[T, hidden]``."""
        return self.moe_rows(i, [x])[0]

    def moe_rows(self, i: int, xs: list[np.ndarray]) -> list[np.ndarray]:
        """:meth:`moe` of each ``[T_r, hidden]`` input of ``xs`` (the rows of a batched step),
        each with the arithmetic it gets alone; every expert the inputs route to is fetched
        once (the union of their choices) and applied to each input that chose it, experts
        in ascending id order for every input as alone."""
        c, p = self.cfg, f"model.layers.{i}.mlp"
        routes = [self.route(i, x)[1:] for x in xs]

        def expert(e: int) -> list:
            wg, wu, wd = (self.expert_weight(f"{p}.switch_mlp.{m}", e) for m in ("gate_proj", "up_proj", "down_proj"))
            parts = []
            for j, (x, (top, w)) in enumerate(zip(xs, routes)):
                rows, slot = np.nonzero(top == e)
                if rows.size:
                    xe = x[rows]
                    g_ = self._act(xe @ wg.T)
                    u_ = self._act(xe @ wu.T)
                    h = self._act(silu(g_) * u_)
                    d = self._act(h @ wd.T)
                    parts.append((j, rows, d * w[rows, slot][:, None]))
            return parts

        ys = [np.zeros((x.shape[0], c.hidden_size), np.float32) for x in xs]
        experts = [int(e) for e in np.unique(np.concatenate([top.ravel() for top, _ in routes]))]
        for parts in self._map(expert, experts):  # summed in expert order, for every input
            for j, rows, contribution in parts:
                np.add.at(ys[j], rows, contribution)
        out = []
        for x, y in zip(xs, ys):
            y = self._act(y)
            sg = self.linear(x, f"{p}.shared_expert.gate_proj")
            su = self.linear(x, f"{p}.shared_expert.up_proj")
            sh = self.linear(self._act(silu(sg) * su), f"{p}.shared_expert.down_proj")
            gate = sigmoid(self.linear(x, f"{p}.shared_expert_gate"))
            out.append(self._act(y + self._act(gate * sh)))
        return out

    # ------------------------------------------------------------------ model

    def forward(self, tokens, st: ReferenceState, *, all_logits: bool = False) -> np.ndarray:
        """Consume ``tokens`` (ints, ``[T]``) at ``st.position`` and advance the state.

        Returns float32 logits ``[vocab]`` for the last token, or ``[T, vocab]`` with
        ``all_logits=True``. The tokens are not checked here: at least one id in
        ``[0, vocab_size)``, and ``st.position + T <= st.max_context`` (the engine checks
        its input once, :meth:`lily.engine.Engine.prefill`).
        """
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        logits = self._layers([tokens], [st], all_logits)[0]
        return logits if all_logits else logits[0]

    def forward_rows(self, tokens, states: list[ReferenceState]) -> np.ndarray:
        """One decode step of several sequences: ``tokens[r]`` at ``states[r]`` for each row
        ``r``, layer by layer over all rows (each expert fetched once for the rows that
        chose it, :meth:`moe_rows`). Each row's arithmetic is the one :meth:`forward` gives
        it alone, so its logits are bit-identical to a lone step's. Returns float32
        ``[rows, vocab]``."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        return np.stack([lg[0] for lg in self._layers([tokens[r:r + 1] for r in range(len(states))], states, False)])

    def _layers(self, tokens: list[np.ndarray], states: list[ReferenceState], all_logits: bool) -> list[np.ndarray]:
        """The forward pass of each row (``tokens[r]`` at ``states[r]``), layer by layer;
        float32 logits ``[T_r or 1, vocab]`` per row."""
        c = self.cfg
        hs = [self.embed(t) for t in tokens]
        for i in range(c.num_hidden_layers):
            mixer = self.attention if c.is_full_attention(i) else self.gated_deltanet
            norm_in = self.param(f"model.layers.{i}.input_layernorm.weight")
            norm_post = self.param(f"model.layers.{i}.post_attention_layernorm.weight")
            for r, st in enumerate(states):
                xn = self._act(rms_norm(hs[r], norm_in, c.rms_norm_eps))
                hs[r] = self._act(hs[r] + mixer(i, xn, st))
            xns = [self._act(rms_norm(h, norm_post, c.rms_norm_eps)) for h in hs]
            hs = [self._act(h + m) for h, m in zip(hs, self.moe_rows(i, xns))]
        out = []
        for t, st, h in zip(tokens, states, hs):
            st.position += t.shape[0]
            if not all_logits:
                h = h[-1:]
            hn = self._act(rms_norm(h, self.param("model.norm.weight"), c.rms_norm_eps))
            out.append(self.matmul_t(hn, "lm_head").astype(np.float32, copy=False))
        return out


class ReferenceBackend(HostBatch):
    """The numpy oracle as an engine backend (:class:`lily.backend.Backend`); it samples on
    the host (:class:`lily.backend.HostGeneration`). Its sequences are
    :class:`ReferenceState` objects; a batched step runs :meth:`ReferenceModel.forward_rows`."""

    name = "reference"
    prefill_chunk = 128  # no device limit: the engine's cancellation granularity here

    def __init__(self, ck: Checkpoint, max_context: int, **kw):
        """Raises :class:`CheckpointError` for a NaN or Inf in a floating tensor: the model
        reads weights lazily, so the floats (about 6% of an MLX 4-bit checkpoint) are
        scanned here, where a refusal is a load error rather than a failure mid-forward."""
        ck.check_floats()
        self.model = ReferenceModel(ck, **kw)
        self.max_context = max_context
        self._init_sequences(self._new_state())
        self._gen: HostGeneration | None = None

    def _new_state(self) -> ReferenceState:
        return self.model.new_state(self.max_context)

    def _forward_rows(self, seqs: list[int], tokens: np.ndarray) -> np.ndarray:
        return self.model.forward_rows(tokens, [self._state(seq) for seq in seqs])

    @property
    def state(self) -> ReferenceState:
        """The session's state (sequence 0)."""
        return self.states[0]

    @property
    def position(self) -> int:
        return self.states[0].position

    def reset(self, seq: int = 0) -> None:
        self._state(seq)
        self.states[seq] = self._new_state()

    def forward(self, tokens: np.ndarray, *, all_logits: bool = False, seq: int = 0) -> np.ndarray:
        return self.model.forward(tokens, self._state(seq), all_logits=all_logits)

    def prefill(self, tokens: np.ndarray, seq: int = 0) -> None:
        self.model.forward(tokens, self._state(seq))

    def start(self, feed, steps, history, params, constraint=None) -> None:
        self._gen = HostGeneration(self.forward, feed, steps, history, params, constraint)

    def next(self):
        return self._gen.next()

    def finish(self) -> None:
        self._gen = None

    def snapshot(self, seq: int = 0) -> ReferenceState:
        return self._state(seq).copy()

    def restore(self, snap: ReferenceState, seq: int = 0) -> None:
        if not isinstance(snap, ReferenceState):
            raise InvalidParameterError(f"not a snapshot of a 'reference' session: {type(snap).__name__}")
        self._state(seq)
        self.states[seq] = snap.copy()

    def snapshot_arrays(self, snap: ReferenceState) -> tuple[dict[str, np.ndarray], dict]:
        arrays = {f"{kind}.{layer}": np.ascontiguousarray(a)
                  for kind in ("keys", "values", "conv", "recurrent") for layer, a in getattr(snap, kind).items()}
        return arrays, {"kind": "reference", "position": snap.position}

    def snapshot_from_arrays(self, arrays: dict[str, np.ndarray], meta: dict) -> ReferenceState:
        if meta["kind"] != "reference":
            raise ValueError(f"a {meta['kind']!r} snapshot, not a reference one")
        st = ReferenceState(max_context=self.max_context, position=int(meta["position"]))
        for name, a in arrays.items():
            kind, layer = name.split(".")
            getattr(st, kind)[int(layer)] = np.array(a, dtype=np.float32)
        return st
