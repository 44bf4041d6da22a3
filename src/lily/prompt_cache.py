"""The multi-turn prompt cache: session snapshots keyed by the tokens they hold.

An agent calls the model again and again on a growing conversation. 30 of the model's 40
layers are Gated DeltaNet, whose conv and recurrent state cannot be rewound, only restored
from a snapshot taken at a position; so reuse needs snapshots taken where the next request's
tokens will still agree. :class:`PromptCache` keeps such snapshots; the engine
(:meth:`lily.engine.Engine._start`) looks up the longest cached prefix of each prompt,
restores it and prefills only the rest, taking new snapshots at the positions chosen by
:func:`snapshot_points` and at the end of the generated text.

Memory of one entry (exact, :attr:`Entry.nbytes`): the snapshot's arrays plus 4 bytes per
key token. On the native devices a snapshot is one buffer in device memory (copied there and
back on the device) holding, per attention layer, the K and V rows in use (bf16) and, per
Gated DeltaNet layer, the conv and recurrent state::

    kv    = tokens * attention_layers * 2 * num_key_value_heads * head_dim * 2 bytes
    state = deltanet_layers * (Hv * Dv * (Dk + 1) * 4 + (conv_kernel - 1) * conv_dim * 4) bytes

(the recurrent state is S' [Hv, Dv, Dk] plus the scan's pending decay c per row, S = c S':
metal/gdn_prefill.metal, "Lazy decay"). For Qwen3.6-35B-A3B (10 attention layers, 2 KV
heads of 256; 30 DeltaNet layers with 32 value heads of 128 x 128 and conv_dim 8192) that
is 20 KiB per token plus 30 x (2 MiB + 16 KiB + 96 KiB) = 66.4 MB. The reference device
keeps float32 KV (twice the bytes per token) and S itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lily.errors import InvalidParameterError, LilyError

DEFAULT_MAX_BYTES = 4 << 30  # 4 GiB: about 28 snapshots of a 4K-token prompt on the full model
FORMAT = "lily-prompt-cache"
# 2: native snapshots carry the recurrent state's pending decay (Hv * Dv floats more per
# DeltaNet layer); a version-1 file is refused by its version, never restored as garbage.
FORMAT_VERSION = 2


class PromptCacheError(LilyError):
    """A prompt cache file is unreadable, damaged, or was written for another model,
    quantization or device; the message names what differs."""


@dataclass
class Entry:
    """One cached session: ``tokens`` (int32 ``[n]``) whose effect is in ``state`` (the
    backend's snapshot). ``pinned`` entries (loaded from a file) are never evicted. ``key``
    is the ``prompt_cache_key`` of the request that stored it; ``shared`` is set once a
    request with another key (or none) reused it; ``superseded`` once a later entry of the
    same key extends it (see :meth:`PromptCache.insert`)."""

    tokens: np.ndarray
    state: object
    nbytes: int
    pinned: bool = False
    key: str | None = None
    hits: int = 0
    shared: bool = False
    superseded: bool = False

    @property
    def length(self) -> int:
        return int(self.tokens.size)


def state_nbytes(state) -> int:
    """Bytes held by a backend snapshot: ``nbytes`` of a native ``SessionSnapshot`` or of
    a :class:`lily.reference.ReferenceState`."""
    n = getattr(state, "nbytes", None)
    if n is None:
        raise InvalidParameterError(f"cannot size a snapshot of type {type(state).__name__}")
    return int(n)


def native_snapshot_bytes(config, tokens: int) -> int:
    """Bytes of a native device's snapshot of ``tokens`` tokens for ``config`` (a
    :class:`lily.checkpoint.ModelConfig`): the formula of the module doc (bf16 KV rows, float32
    conv and recurrent state; csrc/runtime/runtime.cpp ``for_each_state_run``)."""
    attn = sum(config.is_full_attention(i) for i in range(config.num_hidden_layers))
    gdn = config.num_hidden_layers - attn
    kv = tokens * attn * 2 * config.num_key_value_heads * config.head_dim * 2
    state = (config.gdn_state_floats + (config.linear_conv_kernel_dim - 1) * config.conv_dim) * 4
    return kv + gdn * state


@dataclass
class CacheStats:
    """Counters since the cache was created (``requests``, ``hits``: requests that reused
    at least one token; ``cached_tokens`` and ``computed_tokens`` over all requests;
    ``evictions``, ``snapshots`` taken)."""

    requests: int = 0
    hits: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    snapshots: int = 0
    evictions: int = 0


class PromptCache:
    """Session snapshots keyed by token sequences, LRU-evicted under a byte budget.

    Parameters
    ----------
    max_bytes : int
        Budget for the snapshots' memory (see the module doc for the formula); 0 disables
        the cache (nothing is stored).

    Thread safety: the engine uses it from its one generation thread; :meth:`info` may be
    called from any thread.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidParameterError(f"max_bytes must be a non-negative integer, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.nbytes = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        """The entries, least recently used first."""
        with self._lock:
            return list(self._entries.values())

    def clear(self) -> None:
        """Drop every entry (pinned ones too)."""
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    # ------------------------------------------------------------------ lookup and insert

    def lookup(self, prompt: Sequence[int], limit: int, key: str | None = None) -> Entry | None:
        """The entry with the most tokens (at most ``limit``) that are a prefix of
        ``prompt``, marked most recently used; None if no entry is a prefix. ``key`` (the
        request's ``prompt_cache_key``) never changes the choice: token equality alone
        decides."""
        p = np.asarray(prompt, dtype=np.int32)
        best = None
        with self._lock:
            for e in self._entries.values():
                n = e.length
                if n <= limit and n <= p.size and (best is None or n > best.length) \
                        and np.array_equal(p[:n], e.tokens):
                    best = e
            if best is not None:
                self._entries.move_to_end(best.tokens.tobytes())
                best.hits += 1
                best.shared = best.shared or best.key != key
                best.superseded = False  # in use again
        return best

    def insert(self, tokens: Sequence[int], state, *, pinned: bool = False, key: str | None = None) -> bool:
        """Store ``state`` (a backend snapshot holding exactly ``tokens``) as the most recently
        used entry, evicting unpinned entries to stay within the budget: superseded ones
        first, then the least recently used. Returns False when the entry alone does not fit
        (nothing is evicted then).

        ``key`` is the request's ``prompt_cache_key`` hint: the conversation's older entries
        of the same key that the new one extends, and that no other conversation has
        reused, are marked superseded (evicted first; still found by :meth:`lookup`)."""
        t = np.asarray(tokens, dtype=np.int32)
        nbytes = state_nbytes(state) + t.nbytes
        k = t.tobytes()
        with self._lock:
            old = self._entries.pop(k, None)
            if old is not None:
                self.nbytes -= old.nbytes
                pinned = pinned or old.pinned
            pinned_bytes = sum(e.nbytes for e in self._entries.values() if e.pinned)
            if nbytes + pinned_bytes > self.max_bytes:
                if old is not None:  # keep what was there
                    self._entries[k] = old
                    self.nbytes += old.nbytes
                return False
            if key is not None:
                for e in self._entries.values():
                    if e.key == key and not (e.shared or e.pinned) and e.length < t.size \
                            and np.array_equal(t[:e.length], e.tokens):
                        e.superseded = True
            self._evict(self.max_bytes - nbytes)
            self._entries[k] = Entry(t, state, nbytes, pinned, key, old.hits if old else 0)
            self.nbytes += nbytes
            self.stats.snapshots += 1
        return True

    def _evict(self, room: int) -> None:
        order = sorted((k for k, e in self._entries.items() if not e.pinned),
                       key=lambda k: not self._entries[k].superseded)  # stable: LRU within each group
        for k in order:
            if self.nbytes <= room:
                return
            self.nbytes -= self._entries.pop(k).nbytes
            self.stats.evictions += 1

    def discard(self, entry: Entry) -> None:
        """Remove ``entry`` (e.g. one whose restore failed)."""
        with self._lock:
            e = self._entries.pop(entry.tokens.tobytes(), None)
            if e is not None:
                self.nbytes -= e.nbytes

    def record(self, cached: int, computed: int) -> None:
        """Count one request that reused ``cached`` tokens and computed ``computed``."""
        with self._lock:
            s = self.stats
            s.requests += 1
            s.hits += cached > 0
            s.cached_tokens += cached
            s.computed_tokens += computed

    def info(self) -> dict:
        """Entries, bytes, budget and counters, JSON-ready (the server's ``/health``)."""
        with self._lock:
            s = self.stats
            return {"entries": len(self._entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                    "pinned_entries": sum(e.pinned for e in self._entries.values()),
                    "requests": s.requests, "hits": s.hits, "cached_tokens": s.cached_tokens,
                    "computed_tokens": s.computed_tokens, "snapshots": s.snapshots, "evictions": s.evictions}


def snapshot_points(prompt: Sequence[int], start: int, im_start: int | None) -> list[int]:
    """Positions in ``(start, len(prompt))`` at which to snapshot the session while
    prefilling ``prompt[start:]`` (ascending).

    * the end of the first message (before the second ``<|im_start|>``): a new chat with
      the same system prompt and tools reuses it;
    * the start of the last message, which in a chat prompt is the generation prompt
      (``<|im_start|>assistant\\n<think>\\n`` or its thinking-off variant): Qwen's template
      re-renders the previous assistant turn without its thinking, so the next turn of the
      conversation agrees with this prompt up to here and no further;
    * ``len(prompt) - 1``: the same prompt again computes only its last token (whose
      logits select the first output token).

    ``im_start`` is the id of ``<|im_start|>`` (None for a tokenizer without one: raw
    prompts get only the last point).
    """
    n = len(prompt)
    points = {n - 1}
    if im_start is not None:
        starts = [i for i, t in enumerate(prompt) if t == im_start]
        if len(starts) >= 2:
            points.add(starts[1])
        if starts:
            points.add(starts[-1])
    return sorted(p for p in points if start < p < n)


# ---------------------------------------------------------------------- files

def model_identity(engine) -> dict:
    """What a cache file must match to be loaded into ``engine``: the model's config, its
    quantization, a fingerprint of the weights and the device kind (snapshots hold
    device-specific numbers and layouts)."""
    from dataclasses import asdict
    cfg = asdict(engine.config)
    raw = engine.checkpoint.raw_config
    quant = raw.get("quantization") or raw.get("quantization_config") or {}
    quant = {k: v for k, v in quant.items() if not isinstance(v, dict)}
    return {"model": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
            "quantization": quant, "weights": weights_fingerprint(engine.checkpoint),
            "device": engine.device}


def weights_fingerprint(ck) -> str:
    """SHA-256 over the tensor table (name, dtype, shape, size) and the first and last
    64 KiB of every weight file: tells checkpoints of the same shapes apart without
    reading gigabytes."""
    h = hashlib.sha256()
    for name in sorted(ck.tensors):
        t = ck.tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:{t.nbytes};".encode())
    for f in ck.files():
        size = os.path.getsize(f)
        with open(f, "rb") as fh:
            h.update(fh.read(65536))
            fh.seek(max(0, size - 65536))
            h.update(fh.read(65536))
        h.update(str(size).encode())
    return h.hexdigest()


def _differences(want: dict, got: dict) -> list[str]:
    out = []
    for key in ("model", "quantization", "weights", "device"):
        a, b = want.get(key), got.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            fields = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            detail = ", ".join(f"{k}={b.get(k)!r} (this engine: {a.get(k)!r})" for k in fields[:4])
            out.append(f"{key} differs: {detail}")
        elif key == "weights":
            out.append("the weights differ (another checkpoint of the same shapes)")
        else:
            out.append(f"{key} differs: the file has {b!r}, this engine {a!r}")
    return out


def save(cache: PromptCache, engine, path: str | os.PathLike) -> int:
    """Write every entry of ``cache`` (snapshots of ``engine``'s model and device) to
    ``path`` as one safetensors file with the model identity and a SHA-256 of the data in
    its metadata; written to a temporary file and renamed, so a reader never sees half a
    file. Returns the number of entries written."""
    from safetensors.numpy import save_file
    tensors, index = {}, []
    for i, e in enumerate(cache.entries()):
        arrays, meta = engine.backend.snapshot_arrays(e.state)
        tensors[f"{i}/tokens"] = e.tokens
        for name, a in arrays.items():
            tensors[f"{i}/{name}"] = a
        index.append({"names": sorted(arrays), **meta})
    digest = _digest(tensors)
    metadata = {"format": FORMAT, "version": str(FORMAT_VERSION),
                "identity": json.dumps(model_identity(engine), sort_keys=True),
                "entries": json.dumps(index), "sha256": digest}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return len(index)


def _digest(tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.view(np.uint8).reshape(-1).data)
    return h.hexdigest()


def load(cache: PromptCache, engine, path: str | os.PathLike) -> int:
    """Add the entries of the file at ``path`` (written by :func:`save`) to ``cache`` as
    pinned entries. The whole file is read and checked first (format, model identity,
    checksum, context window, budget): on any problem :class:`PromptCacheError` names it
    and the cache is left as it was. Returns the number of entries loaded."""
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import load_file
    path = Path(path)
    if not path.is_file():
        raise PromptCacheError(f"{path}: no such prompt cache file")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise PromptCacheError(f"{path}: not a readable prompt cache file ({e})") from None
    if meta.get("format") != FORMAT:
        raise PromptCacheError(f"{path}: not a Lily prompt cache file")
    if meta.get("version") != str(FORMAT_VERSION):
        raise PromptCacheError(f"{path}: prompt cache format version {meta.get('version')}, "
                               f"this Lily reads version {FORMAT_VERSION}: re-create it "
                               "(lily cache-prompt, or Engine.save_prompt_cache)")
    try:
        got = json.loads(meta["identity"])
        index = json.loads(meta["entries"])
    except (KeyError, ValueError):
        raise PromptCacheError(f"{path}: damaged prompt cache file (unreadable metadata)") from None
    diff = _differences(model_identity(engine), got)
    if diff:
        raise PromptCacheError(f"{path}: written for another model or device: " + "; ".join(diff))
    if _digest(tensors) != meta.get("sha256"):
        raise PromptCacheError(f"{path}: damaged prompt cache file (checksum mismatch)")
    entries = []
    try:
        for i, m in enumerate(index):
            tokens = tensors[f"{i}/tokens"]
            if tokens.size > engine.max_context:
                raise PromptCacheError(f"{path}: entry {i} holds {tokens.size} tokens, more than this "
                                       f"engine's context window of {engine.max_context}")
            arrays = {name: tensors[f"{i}/{name}"] for name in m["names"]}
            entries.append((tokens, engine.backend.snapshot_from_arrays(arrays, m)))
    except (KeyError, ValueError, TypeError) as e:
        raise PromptCacheError(f"{path}: damaged prompt cache file ({type(e).__name__}: {e})") from None
    need = sum(state_nbytes(s) + t.nbytes for t, s in entries)
    pinned = sum(e.nbytes for e in cache.entries() if e.pinned)
    if need + pinned > cache.max_bytes:
        raise PromptCacheError(f"{path}: its {len(entries)} entries need {need:,} bytes, more than the "
                               f"prompt cache budget of {cache.max_bytes:,} bytes"
                               + (f" ({pinned:,} already pinned)" if pinned else "")
                               + "; raise the budget (--prompt-cache-bytes)")
    for tokens, state in entries:
        cache.insert(tokens, state, pinned=True)
    return len(entries)
