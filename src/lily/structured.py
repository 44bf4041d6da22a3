"""Structured output: JSON schemas and forced tool calls enforced while decoding.

A :class:`Grammar` describes what the answer must be - a JSON value matching a schema
(:meth:`Grammar.json_schema`), any JSON object (:meth:`Grammar.json_object`) or one or
more tool calls in the model's own tool-call syntax (:meth:`Grammar.tool_calls`). It is
checked and compiled when it is made (an invalid schema raises
:class:`~lily.errors.InvalidParameterError` before anything runs) and does not depend on
the tokenizer. :meth:`Grammar.constraint` binds it to a tokenizer and returns a fresh
:class:`GrammarConstraint`, the per-request object the engine's decoding-constraint hook
drives (``allowed()`` before each token, ``advance(token)`` after it, ``is_finished()``).

The grammar engine is `llguidance <https://github.com/guidance-ai/llguidance>`_: an
Earley parser over a lazily built lexer that computes each step's token mask from a
Hugging Face-style vocabulary without precomputing anything per schema. It was chosen over
XGrammar and outlines-core (see docs/server.md, "Structured output") because it compiles a
schema in milliseconds where the others build per-schema indexes, supports nearly all of
JSON Schema (``$ref``, ``anyOf``, string ``pattern``/``format``, numeric bounds), lets a
grammar name special tokens such as ``</think>`` and ``<tool_call>`` (what thinking and
Qwen's XML tool calls need), and installs as one wheel with no Python dependencies.

Thinking: when the prompt leaves a ``<think>`` block open (``thinking=True``), the
grammar first allows any text up to the ``</think>`` token, then a little whitespace,
then the constrained answer; EOS is allowed only where the whole grammar is complete.

Tool calls use the Qwen3.5/3.6 chat template's XML form (what
:class:`lily.chat_output.ChatOutputParser` reads)::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Parameters come in the order of the schema's ``properties``; required ones must appear,
optional ones may; no other names are allowed when ``properties`` is given. A value whose
schema allows only strings is raw text (with ``enum``/``const``, ``minLength``/
``maxLength`` and ``pattern`` enforced); other values are JSON text matching their
sub-schema, which the parser types back (:func:`lily.chat_output.convert_value`).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from lily.chat_output import schema_types  # the parser's reading of a schema's types
from lily.errors import InvalidParameterError, LilyError, ToolError

#: llguidance's JSON layout options: one line, separated as ``json.dumps`` does. Free
#: whitespace lets a model pad the answer with blank lines until max_tokens (the
#: Shakespeare demo model does exactly that); one layout keeps every answer short.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Whitespace allowed before the answer (e.g. the model's "\n\n" after ``</think>``).
LEADING_WHITESPACE = r"/[\x20\x0A\x0D\x09]{0,4}/"

_PARAM_END = r"\n<\/parameter>"
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated",
                "readOnly", "writeOnly", "$schema", "$id"}


def _llg():
    try:
        import llguidance
    except ImportError as e:  # a dependency, but say what to do if it is missing
        raise LilyError("structured output needs llguidance: pip install 'llguidance>=1.0'") from e
    return llguidance


def _lark_str(text: str) -> str:
    """A Lark string literal for ``text`` (JSON escapes are valid Lark escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema: Any) -> str:
    """``%json {...}`` with Lily's JSON layout (``x-guidance`` options)."""
    s = copy.deepcopy(schema) if isinstance(schema, dict) else ({} if schema is True else schema)
    if isinstance(s, dict):
        s["x-guidance"] = dict(JSON_LAYOUT)
    return "%json " + json.dumps(s, ensure_ascii=False)


def check_schema(schema: Any, what: str = "JSON schema") -> dict | bool:
    """``schema`` (a dict, ``True`` or JSON text) parsed and checked against the JSON Schema
    metaschema it names with ``$schema`` (draft 2020-12 when it names none), before any
    grammar is compiled; returns the parsed schema. The one check of every schema a request
    carries: ``response_format``, tool parameters (used even when no grammar is built).

    Raises :class:`InvalidParameterError` starting with ``what`` (``"JSON schema"``, or e.g.
    which tool's parameters) and naming the keyword at fault (e.g. ``"type": "strng"``,
    ``"required": "a"``, a schema that is not an object).
    String formats (``"format": "regex"`` on ``pattern``) are not checked here: Python's
    ``re`` is not ECMA 262 (it rejects ``\\p{L}``); llguidance checks patterns it compiles.
    """
    parsed, problem = _schema_problem(schema)
    if problem is not None:
        raise InvalidParameterError(f"{what}: {problem}")
    return parsed


def _schema_problem(schema: Any) -> tuple[Any, str | None]:
    """``(parsed schema, None)``, or ``(None, what is wrong)`` (see :func:`check_schema`)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            return None, f"not valid JSON: {e}"
    if not isinstance(schema, (dict, bool)):
        return None, f"a JSON schema must be an object, got {type(schema).__name__}"
    if schema is False:
        return None, "the JSON schema `false` accepts no value"
    try:
        import jsonschema
    except ImportError as e:  # a dependency, but say what to do if it is missing
        raise LilyError("checking JSON schemas needs jsonschema: pip install 'jsonschema>=4.18'") from e
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return None, f"invalid JSON schema: {e.message}" + (f" (at {where})" if where else "")
    return schema, None


# Tool names: OpenAI's function-definition reference ("a-z, A-Z, 0-9, underscores and
# dashes, at most 64") and Anthropic's tool reference (the regex ^[a-zA-Z0-9_-]{1,64}$) agree
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def check_tools(tools: Any, param: Callable[[int, str], str] | None = None) -> None:
    """The check of every tool list before it is rendered or compiled, whatever the tool
    choice (the server's three APIs and ``lily cache-prompt --tools``): ``tools`` (None: no
    tools) must be a list of OpenAI chat-form tools ``{"type": "function", "function":
    {"name", "description", "parameters"}}``, each name 1 to 64 letters, digits, ``_`` or
    ``-`` (:data:`TOOL_NAME`) and used by no other tool (a call names its tool: two of one
    name would leave the call's schema ambiguous), each description a string, each
    ``parameters`` a valid JSON Schema (:func:`check_schema`, the check ``response_format``
    gets).

    Raises :class:`InvalidParameterError` when ``tools`` is not a list, and
    :class:`~lily.errors.ToolError` for the first tool at fault, its ``param`` spelled by
    ``param(i, field)`` (e.g. ``tools.0.input_schema``; default ``tools[i].function.field``).
    Unsatisfiable schemas pass: only a forced call compiles them (:meth:`Grammar.tool_calls`).
    """
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidParameterError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    spell = param or (lambda i, field: f"tools[{i}].function.{field}")
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise ToolError(i, None, "", 'a tool must be an object {"type": "function", "function": '
                                         '{"name": ..., "description": ..., "parameters": {...}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ToolError(i, None, "name", f"tool name {name!r} is invalid: it must be 1 to 64 letters, digits, "
                                             "underscores or dashes", spell(i, "name"))
        if name in seen:
            raise ToolError(i, None, "name", f"tool name {name!r} is already used by {spell(seen[name], 'name')}: "
                                             "tool names must be unique", spell(i, "name"))
        seen[name] = i
        if not isinstance(fn.get("description", ""), (str, type(None))):
            raise ToolError(i, name, "description", "the description must be a string", spell(i, "description"))
        params = fn.get("parameters")
        _, problem = _schema_problem({} if params is None else params)
        if problem is not None:
            raise ToolError(i, name, "parameters", problem, spell(i, "parameters"))


def template_tools(tools: list[dict] | None) -> list[dict] | None:
    """OpenAI chat-form tools (as :func:`check_tools` accepts them) in the one layout the
    chat template renders, whatever the key order and ``null`` fields of the input:
    ``{"type": "function", "function": {"name", "description", "parameters", then the
    function's other fields in their order}}`` followed by the tool's other fields, with
    ``null`` fields left out. The chat completions API and ``lily cache-prompt --tools``
    both render through it, so the tokens of a cache file written from a tools file are
    those of a chat request carrying the same tools (reuse is decided by token equality)."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        fn = tool["function"]
        f = {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}
        f.update((k, v) for k, v in fn.items() if k not in f and v is not None)
        rest = {k: v for k, v in tool.items() if k not in ("type", "function") and v is not None}
        out.append({"type": "function", "function": f, **rest})
    return out


_LISTING = re.compile(r"\s*\d+ \| ")  # a line of the grammar listing in llguidance's errors


def short_reason(message: str) -> str:
    """llguidance's error ``message`` as one line: without its position (``at 5(11):``), its
    "failed to compile JSON schema" preamble, the regex carets and the listing of the whole
    generated grammar that follows (our Lark rules, of no use to whoever sent the schema)."""
    parts = []
    for line in message.splitlines():
        if _LISTING.match(line):
            break
        line = line.strip()
        if line and set(line) != {"^"}:
            parts.append(line)
    text = re.sub(r"^at \d+\(\d+\):\s*", "", " ".join(parts))
    return text.removeprefix("failed to compile JSON schema: ") or "invalid grammar"


_LOOKAROUND = re.compile(r"\(\?<?[=!]")  # (?=  (?!  (?<=  (?<!


def _has_lookaround(pattern: str) -> bool:
    """Whether the regular expression ``pattern`` opens a look-around group (outside escapes
    and character classes)."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            if pattern[j:j + 1] == "]":  # "[]...]" and "[^]...]": that "]" is a member
                i = j
        elif c == "(" and _LOOKAROUND.match(pattern, i):
            return True
        i += 1
    return False


def _lookaround_at(schema: Any, path: str = "") -> tuple[str, str] | None:
    """``(where, pattern)`` of the first ``pattern`` in ``schema`` with look-around
    (``where`` its dotted path, e.g. ``properties.code.pattern``), or None."""
    items = schema.items() if isinstance(schema, dict) else enumerate(schema) if isinstance(schema, list) else ()
    for key, v in items:
        where = f"{path}.{key}" if path else str(key)
        if key == "pattern" and isinstance(v, str) and _has_lookaround(v):
            return where, v
        found = _lookaround_at(v, where)
        if found is not None:
            return found
    return None


def _explained(reason: str, *places: tuple[Any, str]) -> str:
    """llguidance's ``reason`` for refusing a schema; for look-around (its regular
    expressions have none) the pattern and its place instead of the regex parser's
    listing, in which a tool's pattern appears wrapped in our own rules. ``places``:
    ``(schema, its path)`` pairs searched in turn for the pattern."""
    found = None
    for schema, path in places if "look-around" in reason else ():
        found = _lookaround_at(schema, path)
        if found is not None:
            break
    if found is None:
        return reason
    where, pattern = found
    return (f"the pattern {json.dumps(pattern)} at {where} uses look-around, which is not supported (the grammar "
            "engine's regular expressions have no look-ahead (?= (?! or look-behind (?<= (?<!): rewrite the pattern "
            "without it")


def _grammar_error(lark: str) -> str | None:
    """The short reason (:func:`short_reason`) why the Lark grammar ``lark`` (start symbol
    ``start``) does not compile, or None when it does."""
    llg = _llg()
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(llg.LLMatcher.grammar_from_lark(lark), None)
    if not is_error:
        return None
    return short_reason(messages[0]) if messages else "invalid grammar"


class Grammar:
    """What a constrained answer must look like; make with the class methods.

    ``kind`` is ``"json_schema"``, ``"json_object"`` or ``"tool_calls"``; ``body`` the
    llguidance Lark rules of the answer (start symbol ``body``).
    """

    def __init__(self, kind: str, body: str):
        self.kind = kind
        self.body = body

    def __repr__(self) -> str:
        return f"Grammar({self.kind!r})"

    # -- construction ------------------------------------------------------------------

    @classmethod
    def json_schema(cls, schema: Any) -> Grammar:
        """A JSON value valid against ``schema`` (a dict, ``True``, or JSON text).

        Raises :class:`InvalidParameterError` when the schema is malformed (e.g. ``"type":
        "strng"``, ``"required": "a"``: :func:`check_schema`), unsatisfiable (``minimum`` >
        ``maximum``) or uses what llguidance cannot enforce (look-around in ``pattern``,
        unknown ``format``, remote ``$ref``); the message then starts "JSON schema cannot be
        enforced" and gives llguidance's reason in one line (:func:`short_reason`; for
        look-around, the pattern and its path in the schema).
        """
        schema = check_schema(schema)
        body = "body: " + _json_rule(schema) + "\n"
        err = _grammar_error(body.replace("body:", "start:", 1))
        if err is not None:
            raise InvalidParameterError(f"JSON schema cannot be enforced: {_explained(err, (schema, ''))}")
        return cls("json_schema", body)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_object", "body: " + _json_rule({"type": "object"}) + "\n")

    @classmethod
    def tool_calls(cls, tools: Iterable[dict], name: str | None = None, *, parallel: bool = True) -> Grammar:
        """At least one tool call (``tool_choice: "required"``; exactly one when not
        ``parallel``), or exactly one call of the function ``name`` (a named
        ``tool_choice``), in Qwen's XML tool-call syntax.

        ``tools`` are OpenAI tool definitions (``{"type": "function", "function": {"name",
        "parameters"}}``) or bare functions (``{"name", "parameters"}``). Raises
        :class:`InvalidParameterError` when there is no tool, ``name`` is not one of them,
        or a parameter schema is invalid; :class:`~lily.errors.ToolError` (naming the tool,
        ``field`` ``"parameters"``) when a forced tool's valid schema cannot be enforced.
        """
        fns = _functions(tools)
        if not fns:
            raise InvalidParameterError("a forced tool call needs at least one tool")
        if name is not None:
            if name not in fns:
                raise InvalidParameterError(f"tool_choice names a function that is not in tools: {name!r}")
            fns = {name: fns[name]}
        rules: list[str] = []
        alts = []
        per_tool: list[tuple[int, str, list[str], list[tuple[str, str, list[str]]]]] = []
        for k, (fname, (index, params)) in enumerate(fns.items()):
            alts.append(f"fn{k}")
            try:
                fn_rules, values = _function_rules(f"fn{k}", fname, params)
            except InvalidParameterError as exc:
                raise _unenforceable(index, fname, str(exc)) from None
            per_tool.append((index, fname, fn_rules, values))
            rules.extend(fn_rules)
        rules.append("call: <tool_call> \"\\n\" (" + " | ".join(alts) + ") </tool_call>")
        first = "body: call" if name is not None or not parallel else "body: call (\"\\n\" call)*"
        body = "\n".join([first, *rules]) + "\n"
        err = _grammar_error(body.replace("body:", "start:", 1).replace("<tool_call>", '"<tool_call>"')
                             .replace("</tool_call>", '"</tool_call>"'))
        if err is not None:
            # compile each tool alone, then its parameters, to say which one cannot be
            # enforced (only on failure: one compilation when all is well)
            for k, (index, fname, fn_rules, values) in enumerate(per_tool):
                alone = _grammar_error("\n".join([f"start: fn{k}", *fn_rules]) + "\n")
                if alone is None:
                    continue
                for key, v, value_rules in values:
                    err = _grammar_error("\n".join([f"start: {v}", *value_rules]) + "\n")
                    if err is not None:
                        params = fns[fname][1]  # the parameter's own schema first, then the whole ($ref)
                        prop = (params.get("properties") or {}).get(key)
                        err = _explained(err, (prop, f"properties.{key}"), (params, ""))
                        raise _unenforceable(index, fname, f"parameter {key!r}: {err}")
                raise _unenforceable(index, fname, alone)
            raise InvalidParameterError(f"the tool-call grammar cannot be built: {err}")
        return cls("tool_calls", body)

    # -- binding -----------------------------------------------------------------------

    def lark(self, tokenizer, *, thinking: bool = False, leading_whitespace: bool = True) -> str:
        """The whole grammar for ``tokenizer``: the answer, after the thinking block when
        ``thinking``, after up to four whitespace characters (:data:`LEADING_WHITESPACE`)
        unless not ``leading_whitespace``. Special tokens are used where the tokenizer has
        them."""
        ws = f"{LEADING_WHITESPACE} " if leading_whitespace or thinking else ""
        specials = {t: _special(tokenizer, t) for t in ("</think>", "<tool_call>", "</tool_call>")}
        body = self.body
        for tag in ("<tool_call>", "</tool_call>"):
            if not specials[tag]:
                body = body.replace(tag, _lark_str(tag))
        if thinking:
            close = "</think>" if specials["</think>"] else _lark_str("</think>")
            think = f"THINK: /(?s:.*)/\nstart: THINK {close} {LEADING_WHITESPACE} body\n"
            if not specials["</think>"]:
                think = f"think[lazy]: /(?s:.*)<\\/think>/\nstart: think {LEADING_WHITESPACE} body\n"
        else:
            think = f"start: {ws}body\n"
        return think + body

    def for_prompt(self, engine, prompt_ids) -> GrammarConstraint:
        """The constraint for a generation by ``engine`` after ``prompt_ids``: thinking
        first when the prompt's last turn leaves a ``<think>`` block open (what the engine
        does with a :class:`Grammar` passed as ``constraint=``)."""
        thinking = engine.prompt_opens_thinking(prompt_ids)
        # a generation prompt with thinking off ends with the closed block and its blank line:
        # the answer starts right there, as the template renders it in later turns
        closed = not thinking and engine.tokenizer.decode_lenient(prompt_ids[-8:]).endswith("</think>\n\n")
        return self.constraint(engine.tokenizer, vocab_size=engine.config.vocab_size,
                               eos_token_ids=engine.eos_token_ids, thinking=thinking, leading_whitespace=not closed)

    def constraint(self, tokenizer, *, vocab_size: int | None = None,
                   eos_token_ids: Iterable[int] | None = None, thinking: bool = False,
                   leading_whitespace: bool = True) -> GrammarConstraint:
        """A fresh per-request constraint enforcing this grammar.

        Parameters
        ----------
        tokenizer : lily.tokenizer.Tokenizer
            The model's tokenizer (its vocabulary is wrapped once and cached).
        vocab_size : int | None
            Length of the masks (the model's logits; may exceed the tokenizer's vocabulary,
            padding ids are never allowed). Default: the tokenizer's.
        eos_token_ids : iterable of int | None
            Tokens that end the answer (allowed only once the grammar is complete).
            Default: the tokenizer's EOS.
        thinking : bool
            The prompt leaves a ``<think>`` block open: free text until ``</think>`` first.
        leading_whitespace : bool
            Allow up to four whitespace characters before the answer (always after a thinking
            block, where the model writes them; :meth:`for_prompt` turns them off after a
            closed thinking block, whose blank line the prompt already holds).
        """
        eos = tuple(sorted(int(e) for e in (tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids)))
        ll_tok = _ll_tokenizer(tokenizer, eos)
        n = tokenizer.vocab_size if vocab_size is None else int(vocab_size)
        if n < tokenizer.vocab_size:
            raise InvalidParameterError(f"vocab_size {n} is smaller than the tokenizer's {tokenizer.vocab_size}")
        llg = _llg()
        matcher = llg.LLMatcher(ll_tok, llg.LLMatcher.grammar_from_lark(
            self.lark(tokenizer, thinking=thinking, leading_whitespace=leading_whitespace)),
                                log_level=0)
        if matcher.is_error():
            raise InvalidParameterError(f"cannot build the {self.kind} constraint: {matcher.get_error()}")
        return GrammarConstraint(matcher, tokenizer.vocab_size, n, self.kind)


class GrammarConstraint:
    """One request's constraint (the engine's decoding-constraint protocol).

    ``allowed()`` returns a bool mask ``[vocab_size]`` of the tokens that keep the output
    a prefix of the grammar (EOS only when it is complete); ``advance(token)`` consumes the
    chosen token; ``is_finished()`` is true once nothing but EOS may follow.
    ``mask_steps`` counts the masks computed.
    """

    def __init__(self, matcher, n_tokens: int, vocab_size: int, kind: str):
        self._m = matcher
        self._n = n_tokens
        self.vocab_size = vocab_size
        self.kind = kind
        self.mask_steps = 0

    def _fail(self, what: str):
        raise LilyError(f"{self.kind} constraint: {what}: {self._m.get_error() or self._m.stop_reason()}")

    def allowed(self) -> np.ndarray:
        bits = self._m.compute_bitmask()
        if self._m.is_error():
            self._fail("the grammar failed")
        self.mask_steps += 1
        mask = np.zeros(self.vocab_size, dtype=bool)
        mask[:self._n] = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")[:self._n]
        return mask

    def advance(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            self._fail(f"token {int(token)} is not allowed here")

    def is_finished(self) -> bool:
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        """The output so far is a complete answer (EOS would be allowed)."""
        return self._m.is_accepting()


# ----------------------------------------------------------------------------------------
# Tokenizer wrapping (cached: about a second per 100k tokens)
# ----------------------------------------------------------------------------------------

_cache: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def _special(tokenizer, text: str) -> bool:
    tid = tokenizer.token_to_id(text)
    return tid is not None and tid in tokenizer.special_token_ids


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: every token's bytes, the special ids,
    and an encoder."""

    def __init__(self, tokenizer, eos: tuple[int, ...]):
        self._tok = tokenizer
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text)


def _ll_tokenizer(tokenizer, eos: tuple[int, ...]):
    llg = _llg()
    with _cache_lock:
        per = _cache.setdefault(tokenizer, {})
        if eos not in per:
            per[eos] = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer, eos)),
                                       eos_token=list(eos) or None)
        return per[eos]


# ----------------------------------------------------------------------------------------
# Tool-call grammar
# ----------------------------------------------------------------------------------------


def _unenforceable(index: int, name: str, reason: str) -> ToolError:
    return ToolError(index, name, "parameters", f"the schema is valid but a forced call of this tool cannot be "
                                                f"enforced: {reason}")


def _functions(tools: Iterable[dict] | None) -> dict[str, tuple[int, dict]]:
    """name -> (position in ``tools``, parameters schema ({} when absent)), in the order given."""
    out: dict[str, tuple[int, dict]] = {}
    if tools is None or isinstance(tools, (str, bytes, dict)):
        raise InvalidParameterError("tools must be a list of tool definitions")
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidParameterError(f"tools[{i}] has no function name")
        params = fn.get("parameters", fn.get("input_schema"))
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise InvalidParameterError(f"tools[{i}] ({fn['name']}): parameters must be a JSON schema object")
        out[fn["name"]] = (i, check_schema(params, f"tools[{i}] ({fn['name']}): parameters"))
    return out


def _resolve(schema: Any, root: dict) -> Any:
    """Follow a local ``$ref`` (``#/$defs/X``, ``#/definitions/X``) at the top of ``schema``."""
    seen = 0
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and seen < 16:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            return schema
        node: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise InvalidParameterError(f"unresolvable $ref {ref!r} in tool parameters")
            node = node[part]
        extra = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**node, **extra} if isinstance(node, dict) else node
        seen += 1
    return schema


def _with_defs(schema: Any, root: dict) -> Any:
    """``schema`` carrying the root's ``$defs``/``definitions`` so its ``$ref``s resolve."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("$defs", "definitions"):
        if key in root and key not in out:
            out[key] = root[key]
    return out


def _string_branch(schema: Any) -> dict | None:
    """The string-typed part of a (sub)schema, or None when it allows no string."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if t == "string" or (isinstance(t, list) and "string" in t):
        return schema
    for key in ("anyOf", "oneOf"):
        for alt in schema.get(key) or []:
            if "string" in schema_types(alt):
                return alt if isinstance(alt, dict) else {}
    if "string" in schema_types(schema):  # e.g. an enum of strings without "type"
        return schema
    return None


def _string_rules(rule: str, s: dict) -> list[str]:
    """Rules for a raw string value named ``rule``, its closing tag included."""
    end = f"/{_PARAM_END}/"
    choices = s.get("enum") if isinstance(s.get("enum"), list) else (
        [s["const"]] if "const" in s else None)
    if choices is not None:
        words = [c for c in choices if isinstance(c, str)]
        if not words:
            raise InvalidParameterError("a string parameter's enum has no string value")
        return [f"{rule}: (" + " | ".join(_lark_str(w) for w in words) + f") {end}"]
    lo, hi, pattern = s.get("minLength"), s.get("maxLength"), s.get("pattern")
    if lo is None and hi is None and pattern is None:
        # lazy: the value ends at the first closing tag
        return [f"{rule}[lazy]: /(?s:.*){_PARAM_END}/"]
    parts = []
    if lo is not None or hi is not None:
        parts.append(f"/(?s:.{{{int(lo or 0)},{'' if hi is None else int(hi)}}})/")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise InvalidParameterError("a string parameter's pattern must be a string")
        # JSON Schema patterns match anywhere unless anchored
        head = "" if pattern.startswith("^") else "(?s:.*)"
        tail = "" if pattern.endswith("$") and not pattern.endswith("\\$") else "(?s:.*)"
        core = pattern[1 if not head else 0:len(pattern) - (0 if tail else 1)]
        parts.append("/" + head + "(?:" + core.replace("/", "\\/") + ")" + tail + "/")
    # lazy: the shortest value (meeting the bounds) that the closing tag ends; a greedy
    # lexeme would run past the tag into the next line's text
    term = rule.upper()
    expr = parts[0] if len(parts) == 1 else "(" + " & ".join(parts) + ")"
    return [f"{term}: {expr} {end}", f"{rule}[lazy]: {term}"]


def _value_rules(rule: str, schema: Any, root: dict) -> list[str]:
    """Rules for one parameter value named ``rule`` (closing tag included): raw text where
    the schema allows strings, JSON text for the other types."""
    s = _resolve(schema, root)
    if s is True or s is None:
        s = {}
    if not isinstance(s, dict):
        raise InvalidParameterError(f"a parameter schema must be an object, got {s!r}")
    if not schema_types(s) and not (set(s) - _ANNOTATIONS):
        return _string_rules(rule, {})  # {}: any value; free text is one
    sbranch = _string_branch(s)
    if sbranch is None:
        json_part = s
    elif sbranch is s and s.get("type") in ("string", None):
        json_part = None
    elif sbranch is s:  # "type": [..., "string", ...]
        others = [t for t in s["type"] if t != "string"]
        json_part = {**s, "type": others} if others else None
    else:  # a string branch of anyOf/oneOf
        key = "anyOf" if "anyOf" in s else "oneOf"
        rest = [a for a in s[key] if a is not sbranch]
        json_part = {**{k: v for k, v in s.items() if k != key}, "anyOf": rest} if rest else None
    rules: list[str] = []
    alts: list[str] = []
    if sbranch is not None:
        rules += _string_rules(f"{rule}_s", _resolve(sbranch, root))
        alts.append(f"{rule}_s")
    if json_part is not None:
        rules.append(f"{rule}_j: " + _json_rule(_with_defs(json_part, root)) + f" /{_PARAM_END}/")
        alts.append(f"{rule}_j")
    return [f"{rule}: " + " | ".join(alts), *rules]


def _function_rules(rule: str, name: str, params: dict) -> tuple[list[str], list[tuple[str, str, list[str]]]]:
    """The rules of one function's call named ``rule``, and per parameter ``(name, value
    rule, its rules)`` (to compile a parameter alone when the whole fails)."""
    props = params.get("properties")
    if props is not None and not isinstance(props, dict):
        raise InvalidParameterError(f"function {name!r}: parameters.properties must be an object")
    required = params.get("required") or []
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise InvalidParameterError(f"function {name!r}: parameters.required must be a list of names")
    if "\n" in name or ">" in name:
        raise InvalidParameterError(f"function name {name!r} cannot appear in a tool call")
    rules: list[str] = []
    values: list[tuple[str, str, list[str]]] = []
    seq: list[str] = []
    names = list(props or {}) + [r for r in required if r not in (props or {})]
    for j, key in enumerate(names):
        if "\n" in key or ">" in key:
            raise InvalidParameterError(f"function {name!r}: parameter name {key!r} cannot appear in a tool call")
        p = f"{rule}_p{j}"
        v = f"{rule}_v{j}"
        rules.append(f"{p}: " + _lark_str(f"<parameter={key}>\n") + f" {v} \"\\n\"")
        try:
            value_rules = _value_rules(v, (props or {}).get(key, {}), params)
        except InvalidParameterError as exc:
            raise InvalidParameterError(f"parameter {key!r}: {exc}") from None
        rules.extend(value_rules)
        values.append((key, v, value_rules))
        seq.append(p if key in required else f"{p}?")
    if props is None and params.get("additionalProperties", True) is not False:
        # no declared parameters: any names, free values
        rules.append(f"{rule}_any: \"<parameter=\" /[^>\\n]+/ \">\\n\" {rule}_anyv \"\\n\"")
        rules.append(f"{rule}_anyv[lazy]: /(?s:.*){_PARAM_END}/")
        seq.append(f"{rule}_any*")
    head = _lark_str(f"<function={name}>\n")
    rules.insert(0, f"{rule}: {head} {' '.join(seq)} \"</function>\\n\"")
    return rules, values


# ----------------------------------------------------------------------------------------
# From API requests
# ----------------------------------------------------------------------------------------


def grammar_for_request(*, format: dict | None = None, tool_choice: str | None = None,
                        tools: list[dict] | None = None, parallel: bool = True) -> Grammar | None:
    """The grammar an API request asks for, or None (free text).

    ``format`` is OpenAI's ``response_format`` (``{"type": "text" | "json_object" |
    "json_schema", "json_schema": {"name", "schema", "strict"}}``; other APIs convert to
    it); ``tool_choice`` is ``"required"`` or the name of the function to call when the
    request forces a tool call (``tools`` in OpenAI's chat form). A forced tool call wins
    over a format (the reply is then the call). Raises :class:`InvalidParameterError`
    naming what is wrong (an unknown format type, a missing or invalid schema).
    """
    if tool_choice is not None:
        name = None if tool_choice == "required" else tool_choice
        return Grammar.tool_calls(tools or [], name, parallel=parallel)
    if format is None:
        return None
    if not isinstance(format, dict):
        raise InvalidParameterError("response_format must be an object")
    kind = format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        spec = format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidParameterError("response_format.json_schema must be an object with the schema")
        if "schema" not in spec:
            raise InvalidParameterError("response_format.json_schema.schema is missing")
        return Grammar.json_schema(spec["schema"])
    raise InvalidParameterError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                                f"got {kind!r}")
