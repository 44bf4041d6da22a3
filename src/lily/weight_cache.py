"""Aligned weight cache: lets the native devices map MLX checkpoints without copying them.

The kernels load weights in 16-byte words and a Metal no-copy buffer covers whole pages of
a file, so a tensor is usable in place only at a 16-byte aligned file offset. safetensors
packs tensor data back to back after an unpadded JSON header; in MLX's files tensors sit
at 2 or 10 mod 16. Such a shard is written once into a cache file holding the same bytes
with every tensor on a 64-byte boundary (a cache line), and later loads map the cache file
instead: no copy in memory, pages shared with the OS file cache. Without the cache the
runtime copies each unaligned shard into device memory at every load (the whole model).

What it costs and saves: the cache takes as much disk as the checkpoint's text-model
tensors (about 20 GB for Qwen3.6-35B-A3B at 4 bits) and its first load writes that once;
every load after that maps it instead of reading the checkpoint into freshly allocated
memory (20 GB read and copied, and held twice while the OS file cache keeps the source
pages), so the weights' resident memory is the page cache alone and a warm load does not
touch the bytes at all.

Cache directory layout (:func:`default_dir`)::

    <stem>-<content key>.lilywc      one aligned copy per distinct shard content
    sources/<source key>.json         where a checkpoint file was seen: its path, size and
                                      modification time, and the cache file of its content

A cache file is named by its source's *content* (a SHA-256 of the whole shard, plus the
tensor table), not by where the shard lives, so a checkpoint that moves (the demo model
inside a reinstalled package, a renamed model directory) reuses its copy. Finding the
content key reads the shard once; a ``sources/`` record remembers it for that path, size
and modification time, so later loads read nothing but the cache file's header. A cache
file no recorded source still refers to (the checkpoint was deleted or changed) is stale:
it is deleted whenever a cache file is written (and by ``lily cache clear --stale``), so
disk use follows the checkpoints in use. ``lily cache list`` shows every file.

Cache file layout (little endian)::

    b"LILYWC02"  uint64 header length  JSON header, space padded to a 4096 boundary
    tensor data at the offsets the header gives, each a multiple of 64

The header records the content key and, per tensor, its offset and size; a cache whose
header does not match (a damaged file) is rewritten. Writes go to a temporary file renamed
into place, so concurrent loads and interrupted writes never leave a partial cache behind.
Files of the first format (``LILYWC01``, keyed by the source's path) are stale by
definition and removed the same way.

Corruption check: the data is read once, when the cache file is written, so that is when
the caller's ``check`` (the native backend passes :meth:`lily.checkpoint.Checkpoint.check_finite`:
no NaN or Inf in a floating tensor) sees every block; the header then records
``"checked": true``. Later loads map a checked cache without reading it again: its bytes
were checked when written, and changed content gets another cache file. A cache written
without a check does not count as checked and is rewritten when a check is asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lily import errors

MAGIC = b"LILYWC02"
OLD_MAGICS = (b"LILYWC01",)  # earlier formats: stale, removed when pruning
ALIGN = 16          # what the kernels need
TENSOR_ALIGN = 64   # what the cache gives
HEADER_ALIGN = 4096
SUFFIX = ".lilywc"
SOURCES = "sources"
#: A temporary file younger than this is not pruned: another process may be writing it.
PRUNE_GRACE_S = 3600
#: Shards at least this large are announced before their content is hashed (a few seconds).
ANNOUNCE_HASH_BYTES = 1 << 30


def default_dir() -> Path:
    """``$LILY_CACHE_DIR``, else ``$XDG_CACHE_HOME/lily/weights``, else ``~/.cache/lily/weights``."""
    if os.environ.get("LILY_CACHE_DIR"):
        return Path(os.environ["LILY_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lily" / "weights"


Entry = tuple[str, str, int, int]  # (tensor name, file, byte offset, nbytes)
Check = Callable[[str, bytes, int], None]  # (tensor name, block of its bytes, block's byte offset)
Notice = Callable[[str], None]


def _source_record(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _layout(entries: list[Entry]) -> str:
    """The tensor table of one file (names, source offsets, sizes) as the keys cover it."""
    return json.dumps([[e[0], e[2], e[3]] for e in entries])


def _source_key(source: dict, entries: list[Entry]) -> str:
    return hashlib.sha256(json.dumps([source, _layout(entries)]).encode()).hexdigest()[:24]


def _content_key(path: Path, entries: list[Entry], notice: Notice) -> str:
    """SHA-256 of the shard's bytes and of the tensor table read from it (reads the file)."""
    size = path.stat().st_size
    if size >= ANNOUNCE_HASH_BYTES:
        notice(f"lily: identifying {path.name} ({size / 2**30:.1f} GiB) for the weight cache "
               "(once per checkpoint location)")
    h = hashlib.sha256(_layout(entries).encode())
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()[:24]


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _read_header(path: Path) -> tuple[bytes, dict] | None:
    """(magic, header) of a cache file of any format, None if it is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] not in (MAGIC, *OLD_MAGICS):
                return None
            (n,) = struct.unpack("<Q", head[8:])
            if n > 1 << 30:
                return None
            meta = json.loads(f.read(n))
        return (head[:8], meta) if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def _valid(path: Path, key: str, entries: list[Entry], checked: bool) -> dict[str, int] | None:
    """The cache's tensor offsets if ``path`` is a complete cache of content ``key`` holding
    exactly ``entries`` (and, if ``checked``, one whose data was checked when written)."""
    got = _read_header(path)
    if got is None or got[0] != MAGIC:
        return None
    meta = got[1]
    if meta.get("content") != key or (checked and meta.get("checked") is not True):
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


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write(path: Path, source_file: Path, key: str, entries: list[Entry],
           check: Check | None) -> dict[str, int]:
    # the header lists the offsets, which depend on the header's length: start with one page
    # and grow it until the header fits
    data_start = HEADER_ALIGN
    while True:
        offsets, at = {}, data_start
        for name, _, _, nbytes in entries:
            offsets[name] = at
            at += _round_up(nbytes, TENSOR_ALIGN)
        meta = json.dumps({"content": key, "source_name": source_file.name, "checked": check is not None,
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


def _cache_for(cache_dir: Path, source_file: Path, group: list[Entry], check: Check | None,
               notice: Notice) -> tuple[Path, dict[str, int], bool]:
    """(cache file, tensor offsets, whether it was written now) for one source file."""
    source = _source_record(source_file)
    record = cache_dir / SOURCES / f"{_source_key(source, group)}.json"
    try:
        known = json.loads(record.read_text())
        key, name = known["content"], known["cache"]
    except (OSError, ValueError, KeyError, TypeError):
        key = name = None
    if not isinstance(key, str) or not isinstance(name, str):
        key, name = _content_key(source_file, group, notice), None
    # a copy of this content under any name (another shard name, an earlier location), else a new one
    candidates = [cache_dir / name] if name else []
    candidates += sorted(cache_dir.glob(f"*-{key}{SUFFIX}")) + [cache_dir / f"{source_file.stem}-{key}{SUFFIX}"]
    path, offsets = candidates[-1], None
    for c in candidates:
        offsets = _valid(c, key, group, check is not None)
        if offsets is not None:
            path = c
            break
    recorded = name != path.name
    if recorded:  # the source record first: a cache file renamed into place always has one
        record.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(record, json.dumps({"source": source, "content": key, "cache": path.name}).encode())
    if offsets is not None:
        return path, offsets, False
    size = sum(e[3] for e in group)
    notice(f"lily: writing an aligned copy of {source_file.name} ({size / 2**20:.0f} MiB) to {path}, once for "
           "this content, so that later loads map it instead of copying the weights into memory; "
           "`lily cache list` shows the cache, `lily cache clear` empties it; --no-weight-cache "
           "(weight_cache=False) copies into memory at each load instead")
    try:
        return path, _write(path, source_file, key, group, check), True
    except BaseException:  # refused data, a full disk: no record of a copy that does not exist
        if recorded:
            record.unlink(missing_ok=True)
        raise


def aligned_table(entries: list[Entry], cache_dir: str | Path | None = None,
                  *, notice: Notice | None = None, check: Check | None = None) -> list[Entry]:
    """``entries`` with every tensor of an unaligned file redirected into its cache file.

    Parameters
    ----------
    entries : list of (name, file, byte offset, nbytes)
        The runtime's tensor table (:func:`lily.native_backend.tensor_table`).
    cache_dir : str | Path | None
        Where cache files live (default :func:`default_dir`); created if missing.
    notice : callable(str) | None
        Receives one line per cache file written, per large shard identified and per
        fallback (default: stderr).
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
    passed to ``check``. When a cache file was written, stale ones are deleted
    (:func:`prune`). Never raises OSError; what ``check`` raises propagates (no cache file
    is left behind).
    """
    if notice is None:
        notice = errors.notice  # above a loading progress bar, not on its line
    by_file: dict[str, list[Entry]] = {}
    for e in entries:
        by_file.setdefault(e[1], []).append(e)
    moved: dict[str, tuple[str, int]] = {}
    cache_dir = Path(cache_dir) if cache_dir is not None else default_dir()
    wrote = False
    for file, group in by_file.items():
        if all(e[2] % ALIGN == 0 for e in group):
            continue
        source_file = Path(file)
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            path, offsets, written = _cache_for(cache_dir, source_file, group, check, notice)
            wrote |= written
        except OSError as e:
            notice(f"lily: cannot use the weight cache in {cache_dir} for {source_file.name} ({e}); "
                   "copying its tensors into memory instead")
            continue
        for name, _, _, _ in group:
            moved[name] = (str(path), offsets[name])
    if wrote:
        prune(cache_dir)
    return [(n, *moved[n], nb) if n in moved else (n, f, o, nb) for n, f, o, nb in entries]


# --------------------------------------------------------------------------- listing and pruning


@dataclass
class CacheFile:
    """One file of the weight cache as :func:`scan` finds it: ``path``, ``size`` in bytes,
    ``sources`` (the checkpoint files it holds a copy of that still exist unchanged) and
    ``stale`` (no such source: its checkpoint was deleted or changed, or the file has an
    old format or is not a complete cache)."""

    path: Path
    size: int
    sources: list[str] = field(default_factory=list)
    stale: bool = False


def _live_records(cache_dir: Path) -> tuple[dict[str, list[str]], list[Path]]:
    """{cache file name: [live source paths]} and the records whose source is gone or changed."""
    live: dict[str, list[str]] = {}
    dead: list[Path] = []
    for rec in sorted((cache_dir / SOURCES).glob("*.json")):
        try:
            data = json.loads(rec.read_text())
            source, name = data["source"], data["cache"]
            alive = _source_record(Path(source["path"])) == source
        except (OSError, ValueError, KeyError, TypeError):
            alive, name = False, None
        if alive:
            live.setdefault(name, []).append(source["path"])
        else:
            dead.append(rec)
    return live, dead


def scan(cache_dir: str | Path | None = None) -> list[CacheFile]:
    """Every cache file in ``cache_dir`` (default :func:`default_dir`), largest first."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_dir()
    if not cache_dir.is_dir():
        return []
    live, _ = _live_records(cache_dir)
    out = []
    for p in cache_dir.glob(f"*{SUFFIX}"):
        try:
            size = p.stat().st_size
        except OSError:
            continue
        got = _read_header(p)
        current = got is not None and got[0] == MAGIC
        sources = live.get(p.name, []) if current else []
        out.append(CacheFile(p, size, sources, stale=not sources))
    return sorted(out, key=lambda c: (-c.size, c.path.name))


def prune(cache_dir: str | Path | None = None, *, grace_s: float = PRUNE_GRACE_S) -> list[CacheFile]:
    """Deletes the stale cache files of ``cache_dir`` (:func:`scan`), the source records
    whose checkpoint file is gone or changed, and temporary files older than ``grace_s``
    seconds (a write that was interrupted; a younger one may be in progress). Returns the
    cache files deleted. Never raises OSError.

    No live cache file can be taken for stale: its source record is written before the file
    is renamed into place."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_dir()
    if not cache_dir.is_dir():
        return []
    gone = []
    for c in scan(cache_dir):
        try:
            if c.stale:
                c.path.unlink()
                gone.append(c)
        except OSError:
            pass
    now = time.time()
    for tmp in cache_dir.glob(f"*{SUFFIX}.tmp-*"):
        try:
            if now - tmp.stat().st_mtime >= grace_s:
                tmp.unlink()
        except OSError:
            pass
    for rec in _live_records(cache_dir)[1]:
        rec.unlink(missing_ok=True)
    return gone


def clear(cache_dir: str | Path | None = None) -> int:
    """Deletes every cache file and source record of ``cache_dir``; returns the bytes freed.
    A process that has a cache file mapped keeps it until it exits (POSIX)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_dir()
    freed = 0
    for c in scan(cache_dir):
        try:
            c.path.unlink()
            freed += c.size
        except OSError:
            pass
    for p in [*cache_dir.glob(f"*{SUFFIX}.tmp-*"), *(cache_dir / SOURCES).glob("*.json")]:
        try:
            p.unlink()
        except OSError:
            pass
    return freed
