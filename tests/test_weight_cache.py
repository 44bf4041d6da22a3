"""The aligned weight cache (lily.weight_cache): native devices map MLX checkpoints without
copying them, the cache follows its source, and no cache problem stops a load."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import threading

import numpy as np
import pytest

import lily.checkpoint
from fixtures_checkpoints import BF16_INF, BF16_NAN, DEMO_NORM, DEMO_SCALE, poison_tensor
from lily import Engine, _core
from lily.checkpoint import open_checkpoint
from lily.errors import CheckpointError, InvalidParameterError
from lily.native_backend import tensor_table
from lily.weight_cache import ALIGN, MAGIC, aligned_table, prune, scan

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")


def _sim(path, cache, **opts):
    return Engine.load(path, device="sim", max_context=64, device_options={"weight_cache": cache, **opts})


@pytest.fixture
def demo_copy(tmp_path, demo_path):
    """A private copy of the demo checkpoint (its file times are this test's own)."""
    dst = tmp_path / "demo"
    shutil.copytree(demo_path, dst)
    return dst


def _unaligned_files(engine):
    return {f for _, f, o, _ in tensor_table(engine.checkpoint) if o % ALIGN}


def test_demo_checkpoint_is_unaligned_so_the_cache_is_needed(demo_engine):
    # the premise of the cache: MLX's safetensors put tensors at 2 mod 16
    assert _unaligned_files(demo_engine)


def test_cache_maps_without_copy_and_matches_the_in_memory_copy(tmp_path, demo_copy):
    tokens = [785, 11, 220, 16, 17, 18, 13]
    cached = _sim(demo_copy, str(tmp_path / "wc"))
    files = list((tmp_path / "wc").glob("*.lilywc"))
    assert len(files) == 1 and [c.path for c in scan(tmp_path / "wc")] == files
    assert cached.backend.runtime.repacked_bytes == 0
    copied = _sim(demo_copy, False)
    assert copied.backend.runtime.repacked_bytes >= copied.checkpoint.nbytes
    a = cached.prefill(tokens, all_logits=True)
    b = copied.prefill(tokens, all_logits=True)
    np.testing.assert_array_equal(a, b)


def test_cache_holds_every_tensor_byte_for_byte(tmp_path, demo_copy):
    table = tensor_table(open_checkpoint(demo_copy))
    out = aligned_table(table, tmp_path / "wc", notice=lambda m: None)
    assert [(n, nb) for n, _, _, nb in out] == [(n, nb) for n, _, _, nb in table]
    for (name, src, so, nb), (_, dst, do, _) in zip(table, out):
        assert do % 64 == 0 and dst != src
        with open(src, "rb") as f1, open(dst, "rb") as f2:
            f1.seek(so)
            f2.seek(do)
            assert f1.read(nb) == f2.read(nb), name


def test_cache_is_written_once_and_reused(tmp_path, demo_copy):
    table = tensor_table(open_checkpoint(demo_copy))
    said = []
    first = aligned_table(table, tmp_path, notice=said.append)
    # what is written, how large, where, and how to list, clear or avoid it
    assert len(said) == 1 and re.fullmatch(
        rf"lily: writing an aligned copy of model.safetensors \(\d+ MiB\) to {re.escape(first[0][1])}, once .*"
        r"`lily cache list` .*`lily cache clear` .*--no-weight-cache \(weight_cache=False\) copies into memory .*",
        said[0]), said[0]
    mtime = os.stat(first[0][1]).st_mtime_ns
    again = aligned_table(table, tmp_path, notice=said.append)
    assert again == first and len(said) == 1 and os.stat(first[0][1]).st_mtime_ns == mtime


def _moved(table, src, dst):
    return [(n, f.replace(str(src), str(dst)), o, nb) for n, f, o, nb in table]


def test_a_moved_or_reinstalled_checkpoint_reuses_its_copy(tmp_path, demo_copy):
    """The cache is keyed by content: the demo model inside a reinstalled package (another
    path, newer file times) or a renamed model directory maps the copy written before."""
    table = tensor_table(open_checkpoint(demo_copy))
    first = aligned_table(table, tmp_path / "wc", notice=lambda m: None)
    moved = tmp_path / "site-packages-2" / "demo_model"
    shutil.copytree(demo_copy, moved)  # new path, new modification times
    shutil.rmtree(demo_copy)           # pip uninstall removed the old one
    said = []
    again = aligned_table(_moved(table, demo_copy, moved), tmp_path / "wc", notice=said.append)
    assert said == [] and [e[1:] for e in again] == [e[1:] for e in first]
    assert [c.sources for c in scan(tmp_path / "wc")] == [[str(moved / "model.safetensors")]]


def test_changed_checkpoint_gets_a_new_cache_and_the_old_one_goes(tmp_path, demo_copy):
    table = tensor_table(open_checkpoint(demo_copy))
    first = aligned_table(table, tmp_path, notice=lambda m: None)
    shard = table[0][1]
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, same bytes: the same copy
    assert aligned_table(table, tmp_path, notice=pytest.fail) == first
    with open(shard, "r+b") as f:  # re-converted: other bytes in a tensor
        f.seek(table[0][2])
        byte = f.read(1)
        f.seek(table[0][2])
        f.write(bytes([byte[0] ^ 1]))
    said = []
    second = aligned_table(table, tmp_path, notice=said.append)
    assert len(said) == 1 and second[0][1] != first[0][1]
    assert not os.path.exists(first[0][1])  # stale: removed when the new copy was written
    assert [c.path.name for c in scan(tmp_path)] == [os.path.basename(second[0][1])]


def test_stale_copies_are_listed_and_pruned(tmp_path, demo_copy):
    """A copy whose checkpoint file is gone is stale; so is a file of the first format
    (keyed by path). prune (run whenever a copy is written) deletes them, not a live copy."""
    table = tensor_table(open_checkpoint(demo_copy))
    live = aligned_table(table, tmp_path / "wc", notice=lambda m: None)[0][1]
    other = tmp_path / "other"
    shutil.copytree(demo_copy, other)
    with open(other / "model.safetensors", "r+b") as f:
        f.seek(table[0][2])
        f.write(b"\x00\x01")
    gone = aligned_table(_moved(table, demo_copy, other), tmp_path / "wc", notice=lambda m: None)[0][1]
    old = tmp_path / "wc" / "model-0a56b57de0d6facecf40.lilywc"
    old.write_bytes(b"LILYWC01" + struct.pack("<Q", 2) + b"{}")
    shutil.rmtree(other)
    listed = {c.path.name: c for c in scan(tmp_path / "wc")}
    assert not listed[os.path.basename(live)].stale and listed[os.path.basename(gone)].stale and listed[old.name].stale
    assert {c.path.name for c in prune(tmp_path / "wc")} == {os.path.basename(gone), old.name}
    assert [c.path.name for c in scan(tmp_path / "wc")] == [os.path.basename(live)]
    assert len(list((tmp_path / "wc" / "sources").iterdir())) == 1  # the gone checkpoint's record too


def test_lily_cache_list_and_clear(tmp_path, demo_copy, monkeypatch, capsys):
    from lily.cli import main
    monkeypatch.setenv("LILY_CACHE_DIR", str(tmp_path / "wc"))
    monkeypatch.setenv("LILY_TEST_CACHE", str(tmp_path / "tc"))
    (tmp_path / "tc" / "tiny-s0-0123").mkdir(parents=True)
    (tmp_path / "tc" / "tiny-s0-0123" / "config.json").write_text("{}")
    (tmp_path / "tc" / "unrelated").mkdir()  # not a test checkpoint: left alone
    copy = aligned_table(tensor_table(open_checkpoint(demo_copy)), None, notice=lambda m: None)[0][1]
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert f"weight cache: {tmp_path / 'wc'}" in out and f"{os.path.basename(copy)}  <- {demo_copy}" in out
    assert "tiny-s0-0123" in out and "unrelated" not in out and "prompt cache files" in out
    assert main(["cache", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [f["path"] for f in listed["weight_cache"]["files"]] == [copy]
    assert main(["cache", "clear", "--stale"]) == 0 and os.path.exists(copy)
    assert "removed 0 stale weight cache files" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert "removed the weight cache" in out and "removed 1 test checkpoint" in out
    assert not os.path.exists(copy) and not (tmp_path / "tc" / "tiny-s0-0123").exists()
    assert (tmp_path / "tc" / "unrelated").is_dir()


@pytest.mark.parametrize("damage", ["truncate", "magic", "header", "empty"])
def test_damaged_cache_is_rewritten(tmp_path, demo_copy, damage):
    table = tensor_table(open_checkpoint(demo_copy))
    first = aligned_table(table, tmp_path, notice=lambda m: None)
    cache = first[0][1]
    size = os.path.getsize(cache)
    with open(cache, "r+b") as f:
        if damage == "truncate":
            f.truncate(size // 2)
        elif damage == "magic":
            f.write(b"NOTACACHE")
        elif damage == "header":
            f.seek(8)
            f.write(struct.pack("<Q", 1 << 40))
        else:
            f.truncate(0)
    said = []
    again = aligned_table(table, tmp_path, notice=said.append)
    assert len(said) == 1 and again == first and os.path.getsize(cache) == size
    # and the engine over the rewritten cache computes what the in-memory copy computes
    np.testing.assert_array_equal(_sim(demo_copy, str(tmp_path)).prefill([1, 2, 3]),
                                  _sim(demo_copy, False).prefill([1, 2, 3]))


def test_unusable_cache_dir_falls_back_to_copying(tmp_path, demo_copy):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    table = tensor_table(open_checkpoint(demo_copy))
    said = []
    assert aligned_table(table, blocker / "wc", notice=said.append) == table
    assert len(said) == 1 and "copying its tensors into memory" in said[0]
    engine = _sim(demo_copy, str(blocker / "wc"))  # loads, with the runtime's copy
    assert engine.backend.runtime.repacked_bytes > 0
    assert engine.generate("ROMEO.", max_tokens=4).text


def test_aligned_files_are_mapped_as_they_are(tmp_path):
    src = tmp_path / "aligned.bin"
    src.write_bytes(bytes(range(256)) * 4)
    table = [("a", str(src), 0, 64), ("b", str(src), 128, 512)]
    said = []
    assert aligned_table(table, tmp_path / "wc", notice=said.append) == table
    assert not said and not (tmp_path / "wc").exists()


def test_only_the_unaligned_file_is_cached(tmp_path):
    good, bad = tmp_path / "good.bin", tmp_path / "bad.bin"
    good.write_bytes(b"g" * 256)
    bad.write_bytes(bytes(range(200)))
    table = [("g", str(good), 16, 32), ("b1", str(bad), 2, 100), ("b2", str(bad), 102, 98)]
    out = aligned_table(table, tmp_path / "wc", notice=lambda m: None)
    assert out[0] == table[0]
    assert out[1][1] == out[2][1] != str(bad)
    data = open(out[1][1], "rb").read()
    assert data[:8] == MAGIC
    assert data[out[1][2]:out[1][2] + 100] == bytes(range(2, 102))
    assert data[out[2][2]:out[2][2] + 98] == bytes(range(102, 200))


def test_concurrent_loads_agree(tmp_path, demo_copy):
    table = tensor_table(open_checkpoint(demo_copy))
    results = [None] * 4

    def run(i):
        results[i] = aligned_table(table, tmp_path, notice=lambda m: None)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == results[0] for r in results)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    assert aligned_table(table, tmp_path, notice=pytest.fail) == results[0]


@pytest.mark.parametrize("bad", [1, 2.5, ["dir"], None])
def test_weight_cache_option_is_validated(demo_path, bad):
    with pytest.raises(InvalidParameterError, match="weight_cache"):
        _sim(demo_path, bad)


# --------------------------------------------------------------------------- NaN / Inf

@pytest.fixture
def scans(monkeypatch):
    """The names lily.checkpoint.check_finite is called with (every loader's one check)."""
    seen = []
    real = lily.checkpoint.check_finite
    monkeypatch.setattr(lily.checkpoint, "check_finite", lambda name, *a, **k: (seen.append(name), real(name, *a, **k)))
    return seen


@pytest.mark.parametrize("cache", ["dir", False])
@pytest.mark.parametrize("name, index, bits, what", [(DEMO_SCALE, (17, 100, 3), BF16_NAN, "NaN"),
                                                      (DEMO_NORM, (200,), BF16_INF, "Inf")])
def test_non_finite_weights_are_refused_on_the_sim_device(tmp_path, demo_copy, cache, name, index, bits, what):
    poison_tensor(demo_copy, name, index, bits)
    wc = tmp_path / "wc"
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(demo_copy))}/model.safetensors: tensor "
                                              rf"language_model.{name} \(BF16 .*\) holds {what} "
                                              rf"at index \[{', '.join(map(str, index))}\]"):
        _sim(demo_copy, str(wc) if cache else False)
    assert not wc.exists() or [p for p in wc.rglob("*") if p.is_file()] == []  # no cache of corrupt data, no temporary file


def test_a_written_cache_is_not_scanned_again(tmp_path, demo_copy, scans):
    _sim(demo_copy, str(tmp_path))
    ck = open_checkpoint(demo_copy)
    floats = {t.name for t in ck.tensors.values() if t.dtype in ("BF16", "F32")}  # as stored
    assert floats <= set(scans)  # every floating tensor (and the codes: no-ops), while the cache was written
    scans.clear()
    engine = _sim(demo_copy, str(tmp_path))
    assert scans == [] and engine.backend.runtime.repacked_bytes == 0  # mapped, not read
    scans.clear()
    _sim(demo_copy, False)  # no cache: the runtime copies from the checkpoint, checked first
    assert sorted(scans) == sorted(floats)


def test_a_cache_written_without_the_check_is_rewritten_with_it(tmp_path, demo_copy, scans):
    table = tensor_table(open_checkpoint(demo_copy))
    first = aligned_table(table, tmp_path, notice=lambda m: None)  # no check given
    assert scans == []
    said = []
    ck = open_checkpoint(demo_copy)
    again = aligned_table(table, tmp_path, notice=said.append, check=ck.check_finite)
    assert again == first and len(said) == 1 and "writing" in said[0] and scans
    assert aligned_table(table, tmp_path, notice=pytest.fail, check=pytest.fail) == first


def test_the_check_sees_every_byte_of_every_tensor(tmp_path):
    src = tmp_path / "bad.bin"
    src.write_bytes(bytes(range(256)) * 2)
    table = [("a", str(src), 2, 100), ("b", str(src), 102, 300)]
    got = {}
    aligned_table(table, tmp_path / "wc", notice=lambda m: None,
                  check=lambda name, block, at: got.setdefault(name, []).append((at, bytes(block))))
    data = src.read_bytes()
    for name, _, offset, nbytes in table:
        assert b"".join(b for _, b in got[name]) == data[offset:offset + nbytes] and got[name][0][0] == 0
