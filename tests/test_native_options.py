"""Engine.load's device options on the native devices: every unknown or invalid option is
an InvalidParameterError naming it, before anything is allocated."""

from __future__ import annotations

import numpy as np
import pytest

from lily import Engine, _core
from lily.errors import ContextLengthError, InvalidParameterError

pytestmark = pytest.mark.skipif("sim" not in _core.compiled_devices(), reason="simulator not built")


@pytest.mark.parametrize("options, match", [
    ({"bogus": 1}, "unknown device option 'bogus'"),
    ({"device_options": {"bogus": 1}}, "unknown sim device option 'bogus'"),
    ({"device_options": {"order": "sideways"}}, "order must be"),
    ({"device_options": {"gpu_family": "apple3"}}, "gpu_family must be"),
    ({"device_options": {"record_only": True}}, "record-only simulator executes nothing"),
    ({"prefill_chunk": 0}, "prefill_chunk must be a positive integer"),
    ({"gemm_path": "fast"}, "gemm_path must be one of"),
    ({"weight_cache": 3}, "weight_cache must be"),
])
def test_invalid_native_options(demo_path, options, match):
    with pytest.raises(InvalidParameterError, match=match):
        Engine.load(demo_path, device="sim", device_options=options)


def test_reference_takes_no_device_options(demo_path):
    with pytest.raises(InvalidParameterError, match="apply only to the native devices"):
        Engine.load(demo_path, device="reference", device_options={"prefill_chunk": 4})


def test_context_full_in_decode_names_the_count(demo_path):
    e = Engine.load(demo_path, device="sim", max_context=8)
    e.prefill(list(range(1, 9)))
    with pytest.raises(ContextLengthError, match="1 more token does not fit: 8 tokens are already"):
        e.decode(1)
    assert e.position == 8


def test_native_devices_need_the_kernels_dtypes(tmp_path, demo_path):
    """A float32 norm weight is fine for the reference but not for the bf16-reading kernels."""
    import json
    import shutil
    import struct

    from lily.checkpoint import bf16_to_f32, read_safetensors_header
    from lily.errors import CheckpointError

    d = tmp_path / "f32norm"
    shutil.copytree(demo_path, d)
    src = d / "model.safetensors"
    infos = read_safetensors_header(src)
    blob = src.read_bytes()
    header, parts, at = {}, [], 0
    for name, t in infos.items():
        data = blob[t.start:t.start + t.nbytes]
        dtype = t.dtype
        if name.endswith("model.norm.weight"):
            data = bf16_to_f32(np.frombuffer(data, np.uint16)).astype("<f4").tobytes()
            dtype = "F32"
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [at, at + len(data)]}
        parts.append(data)
        at += len(data)
    head = json.dumps(header).encode()
    src.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(parts))
    (d / "model.safetensors.index.json").unlink(missing_ok=True)

    assert Engine.load(d, device="reference").generate("ROMEO.", max_tokens=3, temperature=0).token_ids  # the reference runs it
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight is F32; the native kernels read it as BF16"):
        Engine.load(d, device="sim")
