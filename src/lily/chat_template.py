"""The chat-template environment: jinja2 set up the way ``transformers``'
``apply_chat_template(..., tokenize=False)`` renders templates.

An immutable sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, the
loop-controls extension, a ``tojson`` filter that does not escape non-ASCII or HTML
characters, ``raise_exception``, ``strftime_now``, ``namespace`` and ``dict`` globals; and the
same clean-up of the messages (``None`` fields dropped, reasoning aliased to
``reasoning_content``, tool-call arguments decoded). :class:`lily.tokenizer.Tokenizer` adds
the named special tokens of ``tokenizer_config.json`` as variables and renders.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from lily.errors import TokenizerError

__all__ = ["compile_template", "plain", "prepare_messages", "template_variables", "tool_call_arguments"]

# Names under which a message's reasoning may arrive; the first is the one templates read.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: Any) -> None:
    """Template global: abort rendering with ``message``."""
    raise jinja2.exceptions.TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    """Template global: the current local time formatted with ``fmt``."""
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Template filter: JSON text of ``value``; non-ASCII and ``<>&'`` are written as-is."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _reject_private_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates may not set underscore-prefixed namespace attributes ({name!r})"
        )


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` for templates; refuses attribute names starting with ``_``."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        for key in dict(*args[1:], **kwargs):
            _reject_private_name(key)
        jinja2.utils.Namespace.__init__(*args, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _reject_private_name(name)
        super().__setitem__(name, value)


class _TemplateDictFactory:
    """``dict`` global for templates: builds plain dicts without exposing the ``dict`` type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Iterable[Any], value: Any = None) -> dict:
        return dict.fromkeys(keys, value)


class _GenerationBlock(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` and render its body unchanged.

    transformers uses the tag to mark assistant tokens; rendering is otherwise unaffected, so
    templates that contain it render identically here.
    """

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _make_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    env.globals["dict"] = _TemplateDictFactory()
    return env


ENVIRONMENT = _make_environment()


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once per distinct source text (raises jinja2 errors)."""
    return ENVIRONMENT.from_string(source)


@functools.lru_cache(maxsize=32)
def template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads from its context (jinja2's undeclared variables:
    ``messages``, ``enable_thinking``, ``preserve_thinking``, ...)."""
    return frozenset(jinja2.meta.find_undeclared_variables(ENVIRONMENT.parse(source)))


def plain(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON-like types before a template sees it.

    Mappings become dicts, lists and tuples are copied, ``str``/``int``/``float`` subclasses
    and NumPy scalars are reduced to the built-in type, dataclasses and pydantic models become
    dicts, and any other object becomes the inert placeholder ``"<TypeName>"`` (the same
    treatment transformers applies, so rendering matches and the sandbox sees no methods).
    """
    kind = type(value)
    if value is None or kind in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if kind.__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{kind.__name__}>"


def tool_call_arguments(args: Any, where: str) -> Any:
    """A tool call's ``arguments`` as a chat template needs them: a mapping. OpenAI clients
    send a JSON string (decoded here; empty or ``None`` is ``{}``); anything else passes.

    Raises :class:`TokenizerError` naming ``where`` for a string that is not a JSON object.
    """
    if args is None or (isinstance(args, str) and not args.strip()):
        return {}
    if not isinstance(args, str):
        return args
    try:
        value = json.loads(args)
    except ValueError as exc:
        raise TokenizerError(f"{where}: tool call arguments are not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{where}: tool call arguments must be a JSON object")
    return value


def prepare_messages(messages: Any) -> list[dict]:
    """Copy ``messages`` into the form transformers hands to a chat template.

    Raises
    ------
    TokenizerError
        If ``messages`` is not a list of mappings.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
        raise TokenizerError(f"messages must be a list of dicts, got {type(messages).__name__}")
    prepared: list[dict] = []
    for index, message in enumerate(messages):
        if dataclasses.is_dataclass(message) and not isinstance(message, type):
            message = plain(message)
        elif not isinstance(message, Mapping) and callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise TokenizerError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        cleaned = plain({k: v for k, v in message.items() if v is not None})
        reasoning = next(
            (cleaned[key] for key in _REASONING_KEYS if cleaned.get(key) is not None), None
        )
        if reasoning is not None:
            cleaned = {"thinking": reasoning, **cleaned, "reasoning_content": reasoning}
        calls = cleaned.get("tool_calls")
        if isinstance(calls, list):
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and "arguments" in fn:
                    fn["arguments"] = tool_call_arguments(
                        fn["arguments"], f"messages[{index}].tool_calls[{j}].function.arguments")
        prepared.append(cleaned)
    return prepared
