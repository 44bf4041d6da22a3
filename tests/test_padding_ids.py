"""Issue 29, item 1: a generated id the tokenizer does not have failed the request.

Qwen3.5/3.6 checkpoints have 248,320 embedding and lm_head rows but 248,077 tokenizer ids;
the test checkpoints (tests/fixtures_checkpoints.py) keep that padding with the real
tokenizer. A logit bias of +100 on padding ids (given through the engine's generation
defaults, so that every API gets it, also those without ``logit_bias``) makes them the
likeliest tokens: every sampler (host, device argmax, device sample_token, constrained) must
still never choose one, logprobs must never list one, and every API must answer. With the
limit lifted, the same requests do produce padding ids (so the bias does force them) and
still succeed: such an id decodes to nothing.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from lily import _core
from lily.constraints import AllowedTokens
from lily.engine import Engine
from lily.server import create_app
from test_server import Server

pytestmark = pytest.mark.timeout(300)

DEVICES = ["reference"] + (["sim"] if "sim" in _core.compiled_devices() else [])


@pytest.fixture(scope="module", params=DEVICES)
def padded(request, tiny_checkpoint):
    engine = Engine.load(tiny_checkpoint, device=request.param, max_context=256, prompt_cache_bytes=0)
    n_tok, n_rows = engine.tokenizer.vocab_size, engine.config.vocab_size
    assert (n_tok, n_rows) == (248077, 248320) and engine.sample_vocab == n_tok
    pads = [n_tok, n_tok + 1, (n_tok + n_rows) // 2, n_rows - 1]
    engine.generation_defaults = engine.generation_defaults.replace(logit_bias={p: 100.0 for p in pads})
    return engine


def _ids_of(events) -> tuple[list[int], list[int], str]:
    """(generated ids, every id logprobs listed, text) of an engine stream."""
    ids, listed, text = [], [], ""
    for ev in events:
        ids += ev.token_ids
        text += ev.text
        for lp in ev.logprobs or ():
            listed += [lp.token_id] + [t for t, _ in lp.top]
    return ids, listed, text


# greedy: the device's two-stage argmax; greedy with logprobs and sampled: sample_token;
# constrained: the host sampler under a mask that allows every row (padding included)
SAMPLERS = {"greedy": {"temperature": 0.0}, "greedy_logprobs": {"temperature": 0.0, "logprobs": True, "top_logprobs": 5},
            "sampled": {"temperature": 1.0, "top_k": 0, "logprobs": True, "top_logprobs": 5, "seed": 3},
            "constrained": {"temperature": 1.0, "seed": 4}}


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_no_sampler_picks_an_id_the_tokenizer_lacks(padded, sampler):
    engine = padded
    n_tok = engine.tokenizer.vocab_size
    if engine.device == "sim" and sampler == "greedy_logprobs":
        pytest.skip("the same device kernel as 'sampled' (sample_token); the simulator is slow at 248K logits")

    def run(n):
        constraint = (AllowedTokens(engine.config.vocab_size, range(engine.config.vocab_size), n)
                      if sampler == "constrained" else None)
        engine.reset()
        return _ids_of(engine.stream("Hello", max_tokens=n, constraint=constraint, **SAMPLERS[sampler]))

    ids, listed, _ = run(2)
    assert len(ids) == 2 and max(ids) < n_tok, ids
    assert max(listed, default=0) < n_tok and (len(listed) == 12 or "logprobs" not in SAMPLERS[sampler]), listed
    engine.sample_vocab = engine.config.vocab_size  # the limit lifted: the bias wins ...
    try:
        ids, listed, text = run(1)
    finally:
        engine.sample_vocab = n_tok
    assert min(ids) >= n_tok, ids  # ... so the test above could fail; such ids give no text
    assert text == ""


@pytest.fixture(scope="module")
def padded_server(padded):
    s = Server(create_app(padded, model_name="padded"))
    yield s
    s.stop()


HI = [{"role": "user", "content": "Hi"}]
CALLS = [  # every API; the OpenAI ones with logprobs (each listed token carries its bytes)
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 3, "temperature": 1.0}),
    ("/v1/completions", {"prompt": "Hello", "logprobs": 3, "temperature": 1.0}),
    ("/v1/responses", {"input": "Hi", "temperature": 1.0}),
    ("/v1/messages", {"model": "m", "messages": HI}),
]


def _listed_bytes(path: str, obj: dict) -> list:
    """The token texts or bytes an OpenAI logprobs object lists (a padding id would list as
    an empty token)."""
    for c in obj.get("choices") or ():
        lp = c.get("logprobs") or {}
        if path == "/v1/completions":
            yield from lp.get("tokens") or ()
            for top in lp.get("top_logprobs") or ():
                yield from top
        for e in lp.get("content") or ():
            yield e["bytes"]
            yield from (t["bytes"] for t in e["top_logprobs"])


def _call_every_api(base: str, stream: bool, n: int) -> None:
    """Each API with ``n`` tokens: a 200 with a complete reply (no error event), and no
    listed token without bytes."""
    for path, body in CALLS:
        limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
        r = httpx.post(base + path, json={**body, limit: n, "stream": stream}, timeout=120)
        assert r.status_code == 200, (path, r.text)
        if stream:
            assert "error" not in r.text.replace('"error":null', ""), (path, r.text)
            objs = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        else:
            objs = [r.json()]
        done = {"/v1/chat/completions": '"finish_reason":"length"', "/v1/completions": '"finish_reason":"length"',
                "/v1/responses": '"max_output_tokens"', "/v1/messages": '"max_tokens"'}[path]
        assert done in r.text.replace(" ", ""), (path, r.text)  # the whole reply: cut by its limit
        listed = [b for o in objs for b in _listed_bytes(path, o)]
        assert all(listed) and (len(listed) >= n * 4 or path not in ("/v1/chat/completions", "/v1/completions")), \
            (path, listed)


@pytest.mark.parametrize("stream", [False, True])
def test_every_api_answers_and_never_reports_a_padding_id(padded, padded_server, stream, caplog):
    """Chat completions and completions (with logprobs), Responses and Messages, streamed or
    not, with a bias that makes padding ids the likeliest: all answer 200 with complete
    replies, none lists a padding id. On the reference (the defence is the detokenizer's,
    the same on every device), with the limit lifted they still answer."""
    engine = padded
    _call_every_api(padded_server.base, stream, 1 if engine.device == "sim" else 2)
    if engine.device == "sim":
        return
    engine.sample_vocab = engine.config.vocab_size
    try:
        with caplog.at_level("WARNING", logger="lily"):
            for path, body in CALLS:
                limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
                r = httpx.post(padded_server.base + path, json={**body, limit: 2, "stream": stream}, timeout=120)
                assert r.status_code == 200 and '"error":{' not in r.text.replace(" ", ""), (path, r.text)
    finally:
        engine.sample_vocab = engine.tokenizer.vocab_size
    assert "has no token in the tokenizer" in caplog.text  # padding ids were produced, and gave no text


def test_an_id_without_a_token_decodes_to_nothing(padded):
    """The detokenizer's defence (any id a sampler might still produce, e.g. a custom
    backend's): no text, one warning, the rest of the text unharmed."""
    tok = padded.tokenizer
    ids = tok.encode("Hello world")
    detok = tok.detokenizer()
    text = "".join(detok.add(i) for i in [ids[0], tok.vocab_size + 5, *ids[1:]]) + detok.flush()
    assert text == "Hello world" == tok.decode_lenient([tok.vocab_size, *ids])
    assert tok.piece_bytes(tok.vocab_size) == b"" and tok.piece_bytes(ids[0]) == tok.token_bytes(ids[0])
    assert np.int64(3) is not None  # numpy ids are accepted as ints
    assert tok.piece_bytes(np.int64(ids[0])) == tok.token_bytes(ids[0])
