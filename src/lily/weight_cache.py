"""Aligned weight cache: lets the native devices map MLX checkpoints without copying them.

The kernels load weights in 16-byte words and a Metal no-copy buffer covers whole pages of
a file, so a tensor is usable in place only at a 16-byte aligned file offset. safetensors
packs tensor data back to back after an unpadded JSON header; in MLX's files tensors sit
at 2 or 10 mod 16. Such a shard is written once into a cache file holding the same bytes
with every tensor on a 64-byte boundary (a cache line), and later loads map the cache file
instead: no copy in memory, pages shared with the OS file cache. Without the cache the
runtime copies each unaligned shard into device memory at every load (the whole model).

Cache file layout (little endian)::

    b"LILYWC01"  uint64 header length  JSON header, space padded to a 4096 boundary
    tensor data at the offsets the header gives, each a multiple of 64

The header records the source file's resolved path, size and modification time; a cache
whose record does not match (the checkpoint changed) or whose size is wrong (a damaged
file) is rewritten. Writes go to a temporary file renamed into place, so concurrent loads
and interrupted writes never leave a partial cache behind.

Corruption check: the data is read once, when the cache file is written, so that is when
the caller's ``check`` (the native backend passes :meth:`lily.checkpoint.Checkpoint.check_finite`:
no NaN or Inf in a floating tensor) sees every block; the header then records
``"checked": true``. Later loads map a checked cache without reading it again: its bytes
were checked when written, and a changed source gets a new cache. A cache written without a
check does not count as checked and is rewritten when a check is asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Callable

MAGIC = b"LILYWC01"
ALIGN = 16          # what the kernels need
TENSOR_ALIGN = 64   # what the cache gives
HEADER_ALIGN = 4096


def default_dir() -> Path:
    """``$LILY_CACHE_DIR``, else ``$XDG_CACHE_HOME/lily/weights``, else ``~/.cache/lily/weights``."""
    if os.environ.get("LILY_CACHE_DIR"):
        return Path(os.environ["LILY_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lily" / "weights"


Entry = tuple[str, str, int, int]  # (tensor name, file, byte offset, nbytes)
Check = Callable[[str, bytes, int], None]  # (tensor name, block of its bytes, block's byte offset)


def _source_record(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _cache_path(cache_dir: Path, source: dict, entries: list[Entry]) -> Path:
    key = hashlib.sha256(json.dumps([source, [e[0] for e in entries], [e[2:] for e in entries]])
                         .encode()).hexdigest()[:20]
    return cache_dir / f"{Path(source['path']).stem}-{key}.lilywc"


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _read_header(path: Path) -> dict | None:
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                return None
            (n,) = struct.unpack("<Q", head[8:])
            if n > 1 << 30:
                return None
            meta = json.loads(f.read(n))
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def _valid(path: Path, source: dict, entries: list[Entry], checked: bool) -> dict[str, int] | None:
    """The cache's tensor offsets if ``path`` is a complete cache of exactly ``entries``
    (and, if ``checked``, one whose data was checked when written)."""
    meta = _read_header(path)
    if meta is None or meta.get("source") != source or (checked and meta.get("checked") is not True):
        return None
    tensors = meta.get("tensors")
    if not isinstance(tensors, dict) or set(tensors) != {e[0] for e in entries}:
        return None
    try:
        offsets = {name: int(tensors[name][0]) for name, _, _, _ in entries}
        ok = all(int(tensors[name][1]) == nbytes and offsets[name] % ALIGN == 0
                 for name, _, _, nbytes in entries)
        end = max(offsets[e[0]] + e[3] for e in entries)
        return offsets if ok and path.stat().st_size >= end else None
    except (OSError, TypeError, ValueError, IndexError):
        return None


def _write(path: Path, source_file: Path, source: dict, entries: list[Entry],
           check: Check | None) -> dict[str, int]:
    # the header lists the offsets, which depend on the header's length: start with one page
    # and grow it until the header fits
    data_start = HEADER_ALIGN
    while True:
        offsets, at = {}, data_start
        for name, _, _, nbytes in entries:
            offsets[name] = at
            at += _round_up(nbytes, TENSOR_ALIGN)
        meta = json.dumps({"source": source, "checked": check is not None,
                           "tensors": {n: [offsets[n], nb] for n, _, _, nb in entries}}).encode()
        if 16 + len(meta) <= data_start:
            break
        data_start = _round_up(16 + len(meta), HEADER_ALIGN)
    end = at
    need = end - data_start
    free = shutil.disk_usage(path.parent).free
    if free < need + (64 << 20):
        raise OSError(f"{need / 2**20:.0f} MiB needed, {free / 2**20:.0f} MiB free")
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with open(source_file, "rb") as src, open(tmp, "wb") as out:
            out.write(MAGIC + struct.pack("<Q", len(meta)) + meta.ljust(data_start - 16, b" "))
            for name, _, offset, nbytes in entries:
                out.seek(offsets[name])
                src.seek(offset)
                left = nbytes
                while left:
                    block = src.read(min(left, 64 << 20))
                    if not block:
                        raise OSError(f"{source_file} ended inside tensor {name}")
                    if check is not None:
                        check(name, block, nbytes - left)
                    out.write(block)
                    left -= len(block)
            out.truncate(end)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return offsets


def aligned_table(entries: list[Entry], cache_dir: str | Path | None = None,
                  *, notice=None, check: Check | None = None) -> list[Entry]:
    """``entries`` with every tensor of an unaligned file redirected into its cache file.

    Parameters
    ----------
    entries : list of (name, file, byte offset, nbytes)
        The runtime's tensor table (:func:`lily.native_backend.tensor_table`).
    cache_dir : str | Path | None
        Where cache files live (default :func:`default_dir`); created if missing.
    notice : callable(str) | None
        Receives one line per cache file written and per fallback (default: stderr).
    check : callable(name, block, byte offset) | None
        Called on every block of every tensor copied into a new cache file (the blocks of
        a tensor in order; ``byte offset`` into the tensor, a multiple of 64 MiB); it
        raises to refuse the data. Only a cache written with a check is reused when one is
        given; an existing checked cache is not read again.

    Returns
    -------
    The table to map. Files already aligned are left as they are. A file whose cache cannot
    be written (read-only or full disk) keeps its entries too, after a notice: the runtime
    then copies it into device memory at load, as without a cache: its entries are not
    passed to ``check``. Never raises OSError; what ``check`` raises propagates (no cache
    file is left behind).
    """
    if notice is None:
        from tqdm import tqdm

        def notice(msg: str) -> None:  # above a loading progress bar, not on its line
            tqdm.write(msg, file=sys.stderr)
    by_file: dict[str, list[Entry]] = {}
    for e in entries:
        by_file.setdefault(e[1], []).append(e)
    moved: dict[str, tuple[str, int]] = {}
    cache_dir = Path(cache_dir) if cache_dir is not None else default_dir()
    for file, group in by_file.items():
        if all(e[2] % ALIGN == 0 for e in group):
            continue
        source_file = Path(file)
        try:
            source = _source_record(source_file)
            path = _cache_path(cache_dir, source, group)
            offsets = _valid(path, source, group, check is not None)
            if offsets is None:
                cache_dir.mkdir(parents=True, exist_ok=True)
                size = sum(e[3] for e in group)
                notice(f"lily: writing an aligned copy of {source_file.name} ({size / 2**20:.0f} MiB) "
                       f"to {path} (once; weight_cache=False copies into memory at each load instead)")
                offsets = _write(path, source_file, source, group, check)
        except OSError as e:
            notice(f"lily: cannot use the weight cache in {cache_dir} for {source_file.name} ({e}); "
                   "copying its tensors into memory instead")
            continue
        for name, _, _, _ in group:
            moved[name] = (str(path), offsets[name])
    return [(n, *moved[n], nb) if n in moved else (n, f, o, nb) for n, f, o, nb in entries]
