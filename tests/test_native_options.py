"""Engine.load's device options on the native devices: every unknown or invalid option is
an InvalidParameterError naming it, before anything is allocated."""

from __future__ import annotations

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
