"""Property-based fuzzing of the server's OpenAPI schema with schemathesis: whatever the
request, the server answers without a 5xx. Runs in-process (ASGI) on a scripted engine, over
every API: OpenAI chat completions, completions and Responses, Anthropic Messages."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from lily.engine import Engine  # noqa: E402
from lily.server import create_app  # noqa: E402
from scripted import ScriptedBackend  # noqa: E402

pytestmark = pytest.mark.timeout(170)


class _Quick(Engine):
    """No model: every step forces one fixed short reply, then EOS."""

    @classmethod
    def load(cls, *args, **kw) -> "_Quick":
        engine = super().load(*args, **kw)
        engine.backend = ScriptedBackend(engine._on_prefill, engine._on_decode)
        engine.prompt_cache = None  # scripted answers: every request computes its prompt
        return engine

    def _logits(self):
        import numpy as np
        logits = np.full(self.config.vocab_size, -1e4, dtype=np.float32)
        ids = self._script
        logits[ids[self._pos] if self._pos < len(ids) else min(self.eos_token_ids)] = 10.0
        return logits

    def _on_prefill(self, tokens, all_logits):
        self._pos = 0
        if all_logits:  # the server scores an echoed prompt this way
            import numpy as np
            return np.stack([self._logits()] * len(tokens))
        return self._logits()

    def _on_decode(self):
        self._pos += 1
        return self._logits()


_engine = _Quick.load(max_context=4096)
_engine._script = _engine.tokenizer.encode(
    "ok</think>\n\nyes<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>")
_app = create_app(_engine, model_name="quick", max_queue=64)
schema = schemathesis.openapi.from_asgi("/openapi.json", _app)
# One test per API operation, each with its own id: schemathesis' own parametrize gives
# all operations one node id, and pytest-xdist (the suite runs with -n) keeps only one.
OPERATIONS = [r.ok() for r in schema.get_all_operations()]


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_no_server_errors(operation):
    @given(case=operation.as_strategy())
    @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call()
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)

    check()


def test_every_operation_is_fuzzed():
    assert {op.label for op in OPERATIONS} >= {
        "GET /health", "GET /v1/models", "GET /v1/models/{model_id}",
        "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages",
        "POST /v1/messages/count_tokens", "POST /v1/responses", "GET /v1/responses/{response_id}"}
