"""Time the host-side work a constrained request adds per token on the Qwen3.5/3.6
vocabulary: the llguidance mask (``allowed()``), consuming the token (``advance()``), and
masking the logits (``np.where`` over the padded 248,320-entry vocabulary).

The reply is scripted (thinking, then a JSON answer; or a tool call), so no model runs:
this measures the constraint alone. Usage::

    python tools/bench_constraint_mask.py [path/to/qwen-tokenizer-dir]

Without a path it unpacks tests/data/qwen3.5-moe-tokenizer into a temporary directory.
Wall-clock figures of this machine, for docs/server.md; nothing asserts them.
"""

from __future__ import annotations

import json
import lzma
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lily.structured import Grammar
from lily.tokenizer import Tokenizer

VOCAB = 248320  # the model's logits (config.vocab_size), past the tokenizer's 248,077


def load_tokenizer(arg: str | None) -> Tokenizer:
    if arg:
        return Tokenizer.from_dir(arg)
    src = Path(__file__).resolve().parents[1] / "tests" / "data" / "qwen3.5-moe-tokenizer"
    d = Path(tempfile.mkdtemp())
    with lzma.open(src / "tokenizer.json.xz") as fin, open(d / "tokenizer.json", "wb") as fout:
        shutil.copyfileobj(fin, fout)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, d / name)
    return Tokenizer.from_dir(d)


def run(tok: Tokenizer, grammar: Grammar, reply: str, thinking: bool) -> dict:
    c = grammar.constraint(tok, vocab_size=VOCAB, thinking=thinking)
    logits = np.random.default_rng(0).standard_normal(VOCAB).astype(np.float32)
    mask_t, adv_t, apply_t = [], [], []
    for t in tok.encode(reply):
        t0 = time.perf_counter()
        m = c.allowed()
        t1 = time.perf_counter()
        np.where(m, logits, np.float32(-np.inf))
        t2 = time.perf_counter()
        assert m[t], tok.decode([t])
        c.advance(t)
        t3 = time.perf_counter()
        mask_t.append(t1 - t0)
        apply_t.append(t2 - t1)
        adv_t.append(t3 - t2)

    def us(xs):
        a = np.array(xs) * 1e6
        return {"median_us": round(float(np.median(a)), 1), "p99_us": round(float(np.percentile(a, 99)), 1),
                "max_us": round(float(a.max()), 1)}
    return {"tokens": len(mask_t), "mask": us(mask_t), "apply": us(apply_t), "advance": us(adv_t)}


def main() -> None:
    tok = load_tokenizer(sys.argv[1] if len(sys.argv) > 1 else None)
    t0 = time.perf_counter()
    Grammar.json_object().constraint(tok, vocab_size=VOCAB)
    print(f"vocabulary wrapped for llguidance once per tokenizer: {time.perf_counter() - t0:.2f} s")
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "home": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        "required": ["name", "age", "tags", "home"]}
    answer = json.dumps({"name": "Juliet Capulet", "age": 13, "tags": ["a", "c"],
                         "home": {"city": "Verona"}}, ensure_ascii=False)
    t0 = time.perf_counter()
    g = Grammar.json_schema(schema)
    print(f"schema checked and compiled: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    cases = {
        "thinking + JSON schema": (g, "The user wants a person record; Verona fits.\n</think>\n\n" + answer, True),
        "JSON schema": (g, answer, False),
        "tool call": (Grammar.tool_calls([{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"]}}}], "get_weather"),
            ("<tool_call>\n<function=get_weather>\n<parameter=city>\nVerona\n</parameter>\n<parameter=days>\n3\n"
             "</parameter>\n</function>\n</tool_call>"), False),
    }
    for name, (grammar, reply, thinking) in cases.items():
        print(f"{name}: {json.dumps(run(tok, grammar, reply, thinking))}")


if __name__ == "__main__":
    main()
