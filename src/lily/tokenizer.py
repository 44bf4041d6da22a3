"""The tokenizer: encoding, decoding and chat rendering of a checkpoint.

Encoding and decoding run on the Hugging Face ``tokenizers`` library, loaded from a
checkpoint's ``tokenizer.json`` exactly as written (normaliser, pre-tokeniser regex, added
tokens), so ids match ``PreTrainedTokenizerFast(tokenizer_file=...)``.

The chat template is rendered with jinja2 the way ``transformers``' ``apply_chat_template(...,
tokenize=False)`` renders it (the environment and the message clean-up:
:mod:`lily.chat_template`), with the named special tokens of ``tokenizer_config.json`` as
variables.

:class:`~lily.detokenizer.IncrementalDetokenizer` (:mod:`lily.detokenizer`) turns a stream of
token ids into text one token at a time, from each token's raw bytes
(:meth:`Tokenizer.token_bytes`).
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
import tokenizers.decoders

from lily.chat_template import compile_template, plain, prepare_messages, template_variables, tool_call_arguments
from lily.detokenizer import IncrementalDetokenizer
from lily.errors import TokenizerError

# The names this module has always exported (its parts now live in lily.chat_template and
# lily.detokenizer).
_compile_template = compile_template

__all__ = ["IncrementalDetokenizer", "Tokenizer", "tool_call_arguments"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON_FILE = "chat_template.json"

# Named special tokens a tokenizer config may define; each defined one becomes a template
# variable of the same name, as in transformers.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)



# --------------------------------------------------------------------------------------
# Byte-level BPE alphabet
# --------------------------------------------------------------------------------------


def _byte_level_alphabet() -> dict[str, int]:
    """Return the GPT-2 byte-level alphabet as ``{printable character: byte value}``.

    Bytes that are printable Latin-1 characters stand for themselves; the 68 others
    (controls, space, soft hyphen, ...) are mapped in order onto U+0100 upwards.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
        *range(ord("\N{REGISTERED SIGN}"), 0x100),
    ]
    alphabet: dict[str, int] = {chr(b): b for b in printable}
    shifted = 0x100
    for b in range(0x100):
        if b not in printable:
            alphabet[chr(shifted)] = b
            shifted += 1
    return alphabet


_CHAR_TO_BYTE = _byte_level_alphabet()


def _byte_level_token_bytes(token: str) -> bytes:
    """Raw bytes of one byte-level token string, as the ``tokenizers`` ByteLevel decoder sees it.

    The decoder maps every character through the byte alphabet; a token with any character
    outside the alphabet (e.g. an added token containing a newline) contributes its own UTF-8
    encoding instead.
    """
    try:
        return bytes([_CHAR_TO_BYTE[c] for c in token])
    except KeyError:
        return token.encode("utf-8")


def _token_content(value: Any) -> str | None:
    """A special-token entry of a tokenizer config: a string, ``{"content": ...}`` or null."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json_object(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


class Tokenizer:
    """A checkpoint's tokenizer: ids, special tokens, chat template and token bytes.

    Build one with :meth:`from_dir`. Instances are immutable after construction and safe to
    share between threads (``tokenizers`` encoding is thread-safe; the token-bytes cache only
    ever gains entries).

    Parameters
    ----------
    backend : tokenizers.Tokenizer
        The loaded ``tokenizer.json``.
    config : dict
        Contents of ``tokenizer_config.json`` (may be empty).
    chat_template : str | dict[str, str] | None
        The template source, or named templates (``"default"``, ``"tool_use"``, ...), or
        ``None`` when the checkpoint has none.
    source : str
        Where the tokenizer came from; used in error messages.
    template_source : str
        Where the chat template came from; used in error messages.

    Raises
    ------
    TokenizerError
        If the config names a special token (``eos_token``, ``pad_token``, ...) that is not in
        the vocabulary, or the chat template does not compile.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        *,
        source: str = "<memory>",
        template_source: str = "<chat template>",
    ) -> None:
        self._backend = backend
        self._config = dict(config or {})
        self._source = source
        self._template_source = template_source
        self._vocab_size = int(backend.get_vocab_size(with_added_tokens=True))

        named: dict[str, str] = {}
        for name in NAMED_SPECIAL_TOKENS:
            content = _token_content(self._config.get(name))
            if content is not None:
                named[name] = content
        self._named_special = named

        ids: dict[str, int] = {}
        for name, content in named.items():
            token_id = backend.token_to_id(content)
            if token_id is None:
                raise TokenizerError(
                    f"{source}: {name} {content!r} is not a token of the vocabulary"
                )
            ids[name] = token_id
        self._eos_ids = frozenset([ids["eos_token"]] if "eos_token" in ids else [])
        self._pad_id = ids.get("pad_token")

        added = backend.get_added_tokens_decoder()
        special = {i for i, tok in added.items() if tok.special}
        special.update(ids.values())
        self._special_ids = frozenset(special)

        self._byte_level = isinstance(backend.decoder, tokenizers.decoders.ByteLevel)
        self._bytes_cache: list[bytes | None] = [None] * self._vocab_size

        if isinstance(chat_template, Mapping):
            templates = {str(k): str(v) for k, v in chat_template.items()}
        elif chat_template is not None:
            templates = {"default": str(chat_template)}
        else:
            templates = {}
        self._templates = templates
        for name, text in templates.items():
            self._compiled(text, name)  # compile now so a broken template fails at load

    # -- construction ------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load the tokenizer of a checkpoint or tokenizer directory.

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (optional: without it
        there are no named special tokens and no EOS), ``special_tokens_map.json`` (optional,
        only for special tokens the config lacks) and the chat template: ``chat_template.jinja``
        if present, else the config's ``"chat_template"`` field (a string or a list of
        ``{"name", "template"}``), else ``chat_template.json``'s ``"chat_template"`` field.

        Parameters
        ----------
        path : str | os.PathLike
            The directory.

        Returns
        -------
        Tokenizer

        Raises
        ------
        TokenizerError
            If the directory or ``tokenizer.json`` is missing, a file cannot be read or parsed
            (the message names the file), a named special token is not in the vocabulary, or
            the chat template has a syntax error.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise TokenizerError(f"{directory}: tokenizer directory not found")

        tokenizer_file = directory / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{tokenizer_file}: {TOKENIZER_FILE} not found")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"{tokenizer_file}: cannot load {TOKENIZER_FILE}: {exc}") from exc

        config_file = directory / TOKENIZER_CONFIG_FILE
        config = _read_json_object(config_file) if config_file.is_file() else {}

        map_file = directory / SPECIAL_TOKENS_MAP_FILE
        if map_file.is_file():
            special_map = _read_json_object(map_file)
            for name in NAMED_SPECIAL_TOKENS:
                if name not in config and name in special_map:
                    config[name] = special_map[name]

        template: str | dict[str, str] | None = None
        template_source = f"{directory / CHAT_TEMPLATE_FILE}"
        jinja_file = directory / CHAT_TEMPLATE_FILE
        json_template_file = directory / CHAT_TEMPLATE_JSON_FILE
        if jinja_file.is_file():
            try:
                template = jinja_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"{jinja_file}: cannot read chat template: {exc}") from exc
        elif config.get("chat_template") is not None:
            template_source = f"{config_file} (chat_template)"
            template = cls._template_field(config["chat_template"], template_source)
        elif json_template_file.is_file():
            template_source = f"{json_template_file} (chat_template)"
            field = _read_json_object(json_template_file).get("chat_template")
            if field is not None:
                template = cls._template_field(field, template_source)

        return cls(
            backend,
            config,
            template,
            source=str(directory),
            template_source=template_source,
        )

    @staticmethod
    def _template_field(field: Any, where: str) -> str | dict[str, str]:
        if isinstance(field, str):
            return field
        if isinstance(field, list):
            named: dict[str, str] = {}
            for entry in field:
                if not (
                    isinstance(entry, Mapping)
                    and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)
                ):
                    raise TokenizerError(
                        f"{where}: each named chat template needs string 'name' and 'template'"
                    )
                named[entry["name"]] = entry["template"]
            return named
        raise TokenizerError(f"{where}: chat_template must be a string or a list of templates")

    # -- vocabulary --------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """int: number of ids, added and special tokens included (``len()`` of HF's tokenizer)."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """frozenset[int]: the id of the config's ``eos_token`` (empty if it has none)."""
        return self._eos_ids

    @property
    def pad_token_id(self) -> int | None:
        """int | None: the id of the config's ``pad_token``."""
        return self._pad_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        """frozenset[int]: ids of added tokens flagged special plus the config's named tokens.

        These are the ids ``decode(..., skip_special_tokens=True)`` drops.
        """
        return self._special_ids

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """dict[str, str]: the config's named special tokens (``eos_token``, ...) by name."""
        return dict(self._named_special)

    def token_to_id(self, token: str) -> int | None:
        """Return the id of the token string ``token`` (byte-level form), or ``None``."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Return the token string (byte-level form) of ``token_id``, or ``None`` if unknown."""
        if not 0 <= token_id < self._vocab_size:
            return None
        return self._backend.id_to_token(int(token_id))

    # -- encode / decode ---------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Encode ``text`` to ids.

        Special tokens written in the text (``"<|im_start|>"``) are matched as single special
        ids, as in transformers. ``add_special_tokens`` applies the tokenizer's
        post-processor (for Qwen it adds nothing).

        Raises
        ------
        TypeError
            If ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _checked_ids(self, ids: Iterable[int]) -> list[int]:
        out = [int(i) for i in ids]
        if out and (min(out) < 0 or max(out) >= self._vocab_size):
            bad = next(i for i in out if not 0 <= i < self._vocab_size)
            raise TokenizerError(f"token id {bad} is out of range [0, {self._vocab_size})")
        return out

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Decode ids to text; bytes that are not valid UTF-8 become U+FFFD.

        Parameters
        ----------
        ids : Iterable[int]
            Token ids (a list, tuple or 1-D integer array).
        skip_special_tokens : bool
            Drop the ids in :attr:`special_token_ids`.

        Raises
        ------
        TokenizerError
            If an id is outside ``[0, vocab_size)``.
        """
        checked = self._checked_ids(ids)
        if skip_special_tokens:
            special = self._special_ids
            checked = [i for i in checked if i not in special]
        return self._backend.decode(checked, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """Return the raw bytes one token contributes to decoded text.

        For byte-level BPE these are the token's bytes before UTF-8 decoding, so a token may
        hold part of a character; special tokens give their text's UTF-8. Concatenating the
        bytes of a sequence and decoding with ``errors="replace"`` gives :meth:`decode`.

        Raises
        ------
        TokenizerError
            If ``token_id`` is outside ``[0, vocab_size)`` or has no token.
        """
        try:
            index = operator.index(token_id)
        except TypeError:
            raise TokenizerError(
                f"token id must be an int, got {type(token_id).__name__}"
            ) from None
        if not 0 <= index < self._vocab_size:
            raise TokenizerError(f"token id {index} is out of range [0, {self._vocab_size})")
        cached = self._bytes_cache[index]
        if cached is not None:
            return cached
        token_id = index
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise TokenizerError(f"token id {token_id} has no token in {self._source}")
        if self._byte_level:
            data = _byte_level_token_bytes(token)
        else:
            # Not a byte-level vocabulary: fall back to the token's own decoded text.
            data = self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")
        self._bytes_cache[token_id] = data
        return data

    def piece_bytes(self, token_id: int) -> bytes:
        """:meth:`token_bytes`, or ``b""`` for an id this tokenizer has no token for.

        A model's embedding may have more rows than the tokenizer has ids (Qwen3.5/3.6:
        248,320 rows, 248,077 ids; the rest is padding). Lily's samplers never choose such
        an id (:attr:`lily.sampling.SamplingParams.vocab_limit`); should one reach the text
        anyway it decodes to nothing, as llama.cpp's unused padding tokens and vLLM's
        detokenizer do, instead of failing the generation. Raises :class:`TokenizerError`
        only for a value that is not an integer."""
        try:
            index = operator.index(token_id)
        except TypeError:
            raise TokenizerError(f"token id must be an int, got {type(token_id).__name__}") from None
        if not 0 <= index < self._vocab_size:
            return b""
        cached = self._bytes_cache[index]
        if cached is not None:
            return cached
        try:
            return self.token_bytes(index)
        except TokenizerError:  # an id in a gap of the vocabulary
            return b""

    def decode_lenient(self, ids: Iterable[int]) -> str:
        """:meth:`decode` where ids without a token (:meth:`piece_bytes`) give no text."""
        return b"".join(self.piece_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def detokenizer(self, *, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        """Return a new :class:`IncrementalDetokenizer` over this tokenizer."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # -- chat template -----------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        """bool: whether the checkpoint provides a chat template."""
        return bool(self._templates)

    @property
    def chat_template(self) -> str | None:
        """str | None: the default chat template's source text."""
        return self._templates.get("default") or next(iter(self._templates.values()), None)

    def _compiled(self, text: str, name: str = "default") -> jinja2.Template:
        try:
            return compile_template(text)
        except jinja2.TemplateSyntaxError as exc:
            where = self._template_source
            if name != "default":
                where += f" [{name}]"
            raise TokenizerError(
                f"{where}: chat template syntax error at line {exc.lineno}: {exc.message}"
            ) from exc
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"{self._template_source}: bad chat template: {exc}") from exc

    def _select_template(self, tools: Any) -> str:
        if not self._templates:
            raise TokenizerError(
                f"{self._source}: no chat template ({CHAT_TEMPLATE_FILE} or a 'chat_template' "
                f"field in {TOKENIZER_CONFIG_FILE})"
            )
        if tools and "tool_use" in self._templates:
            return "tool_use"
        if "default" in self._templates:
            return "default"
        if len(self._templates) == 1:
            return next(iter(self._templates))
        raise TokenizerError(
            f"{self._template_source}: several chat templates "
            f"({', '.join(sorted(self._templates))}) and none named 'default'"
        )

    def chat_kwargs(self, template_kwargs: Mapping[str, Any] | None, tools: Any = None) -> dict:
        """``template_kwargs`` as Lily renders a chat with them (the engine's and the
        server's chats; :meth:`apply_chat_template` itself renders as transformers does).

        With thinking off (``enable_thinking=False``), a template with Qwen3.6's
        ``preserve_thinking`` switch that the caller left unset gets ``preserve_thinking=True``:
        earlier assistant turns are then rendered as they were generated, after the empty
        ``<think>\n\n</think>\n\n`` block that the generation prompt put before them, where the
        template's default renders them without it. A conversation's next request then
        extends the previous one token for token through the previous reply, so the prompt
        cache reuses the reply instead of computing it again every turn (QwenLM/Qwen3 issue
        1826; Qwen3.8's template keeps the blocks by default). With thinking on, the
        template's default stands (earlier turns' reasoning is dropped, as Qwen trained it).
        """
        kwargs = dict(template_kwargs or {})
        if kwargs.get("enable_thinking") is False and "preserve_thinking" not in kwargs and self._templates:
            if "preserve_thinking" in template_variables(self._templates[self._select_template(tools)]):
                kwargs["preserve_thinking"] = True
        return kwargs

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation with the chat template, exactly as transformers would.

        The output equals transformers' ``apply_chat_template(..., tokenize=False)``.

        Parameters
        ----------
        messages : list[dict]
            Messages with ``role`` and ``content`` (a string or a list of content parts) and
            optionally ``tool_calls`` (arguments as a dict, or a JSON string as OpenAI
            clients send them), ``reasoning_content`` (or
            ``thinking`` / ``reasoning``), ... Fields set to ``None`` are dropped.
        tools : list[dict] | None
            JSON-schema tool definitions, passed to the template as ``tools``.
        add_generation_prompt : bool
            Append the opening of an assistant turn.
        **template_kwargs
            Extra template variables, e.g. ``enable_thinking=False``; they override the
            config's special-token variables (``bos_token``, ``eos_token``, ...).

        Returns
        -------
        str

        Raises
        ------
        TokenizerError
            If there is no chat template, ``messages`` is not a list of dicts, a tool is not a
            dict, or the template fails (the message carries the template's own text, e.g.
            ``raise_exception('No user query found in messages.')``).
        """
        name = self._select_template(tools)
        template = self._compiled(self._templates[name], name)
        prepared = prepare_messages(messages)
        if tools is not None:
            if isinstance(tools, Mapping) or not isinstance(tools, Iterable):
                raise TokenizerError(f"tools must be a list of dicts, got {type(tools).__name__}")
            tools = list(tools)
            for index, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise TokenizerError(
                        f"tools[{index}] must be a dict, got {type(tool).__name__}"
                    )
            tools = plain(tools)
        context: dict[str, Any] = {"documents": None}
        context.update(self._named_special)
        context.update(plain(template_kwargs))
        context["messages"] = prepared
        context["tools"] = tools
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return template.render(**context)
        except jinja2.TemplateError as exc:
            message = exc.message if exc.message is not None else str(exc)
            raise TokenizerError(f"chat template error: {message}") from exc
        except Exception as exc:  # the template is untrusted code; report, don't crash
            raise TokenizerError(
                f"chat template failed to render: {type(exc).__name__}: {exc}"
            ) from exc

    def encode_chat(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render with :meth:`apply_chat_template` and :meth:`encode` the result.

        Raises
        ------
        TokenizerError
            As :meth:`apply_chat_template`.
        """
        text = self.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self._source!r}, vocab_size={self._vocab_size}, "
            f"eos={sorted(self._eos_ids)}, chat_template={self.has_chat_template})"
        )
