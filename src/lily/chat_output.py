"""Incremental parser that maps Qwen3.5 chat output onto OpenAI message fields (the server) and onto thinking vs answer (the CLI).

The model's raw reply text (as the engine streams it, special tokens included) is split
into three channels:

* **reasoning** - everything inside ``<think> ... </think>``. The Qwen3.5 chat template
  usually opens ``<think>`` in the prompt, so generation starts *inside* the reasoning
  block and only the closing tag appears in the output. A ``<tool_call>`` also ends it.
* **content** - the visible answer.
* **tool calls** - blocks in Qwen's XML form::

      <tool_call>
      <function=NAME>
      <parameter=ARG>
      VALUE
      </parameter>
      </function>
      </tool_call>

  Each call becomes an OpenAI ``tool_calls`` entry whose ``arguments`` is a JSON object;
  a parameter's value is typed by the tool's JSON schema (strings stay verbatim).

:class:`ChatOutputParser` is fed text pieces of any size (tags may be split anywhere) and
returns :class:`Delta` events. Streaming sends each batch of events as it comes; the
non-streaming path feeds the same parser and concatenates (:class:`ChatAccumulator`), so
both modes produce the same message by construction.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
FUNC_OPEN = "<function="
FUNC_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"

_WS = " \t\r\n"


@dataclass
class Delta:
    """One parser output event.

    ``kind`` is ``"reasoning"`` or ``"content"`` (``text`` set), ``"tool_start"`` (``index``,
    ``call_id`` and ``name`` set) or ``"tool_args"`` (``index`` and ``text``: a fragment of
    the call's JSON arguments).
    """

    kind: str
    text: str = ""
    index: int = 0
    call_id: str = ""
    name: str = ""


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _partial_suffix(buf: str, tags: Iterable[str]) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best


def _skip_ws(s: str, i: int) -> int:
    """Index of the first non-whitespace character of ``s`` at or after ``i``."""
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    return i


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered chat prompt leaves a ``<think>`` block open for the model.

    Looks at the last turn only: a ``<think>`` after the last ``<|im_start|>`` with no
    ``</think>`` after it.
    """
    tail = prompt_text[prompt_text.rfind("<|im_start|>") + 1:]
    i = tail.rfind(THINK_OPEN)
    return i >= 0 and THINK_CLOSE not in tail[i:]


# ----------------------------------------------------------------------------------------
# Typing parameter values by the tool schema
# ----------------------------------------------------------------------------------------


def schema_types(schema: Any) -> list[str]:
    """The JSON types a (sub)schema allows, in a stable order; [] when unknown."""
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    out: list[str] = []
    if isinstance(t, str):
        out.append(t)
    elif isinstance(t, list):
        out.extend(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf"):
        alts = schema.get(key)
        if isinstance(alts, list):
            for alt in alts:
                out.extend(x for x in schema_types(alt) if x not in out)
    if not out:
        if "properties" in schema:
            out.append("object")
        elif "items" in schema:
            out.append("array")
        elif isinstance(schema.get("enum"), list):
            kinds = {type(v) for v in schema["enum"]}
            if kinds <= {str}:
                out.append("string")
    return out


def _convert_one(text: str, kind: str) -> tuple[bool, Any]:
    s = text.strip()
    if kind == "string":
        return True, text
    if kind in ("integer", "number"):
        if re.fullmatch(r"[+-]?\d+", s):
            return True, int(s)
        try:
            v = float(s)
        except ValueError:
            return False, None
        if kind == "integer":  # "3.0" is 3; inf and nan are not integers
            return (True, int(v)) if v.is_integer() else (False, None)
        if v != v or v in (float("inf"), float("-inf")):
            return False, None
        return True, v
    if kind == "boolean":
        low = s.lower()
        if low in ("true", "false"):
            return True, low == "true"
        return False, None
    if kind == "null":
        if s.lower() in ("null", "none", ""):
            return True, None
        return False, None
    if kind in ("object", "array"):
        try:
            v = json.loads(s)
        except ValueError:
            return False, None
        if (kind == "object" and isinstance(v, dict)) or (kind == "array" and isinstance(v, list)):
            return True, v
        return False, None
    return False, None


def convert_value(text: str, schema: Any) -> Any:
    """A parameter's raw text typed by its JSON schema.

    Non-string types are tried in the schema's order; if none fits (or the schema allows
    only strings) the text is kept verbatim as a string. Without type information a value
    that is valid JSON of a non-string type (number, boolean, object, array) is parsed.
    """
    kinds = schema_types(schema)
    if not kinds:
        try:
            v = json.loads(text.strip())
        except ValueError:
            return text
        return v if isinstance(v, (bool, int, float, dict, list)) else text
    for kind in kinds:
        if kind == "string":
            continue
        ok, v = _convert_one(text, kind)
        if ok:
            return v
    return text


def tool_param_schemas(tools: list[dict] | None) -> dict[str, dict | None]:
    """Map function name -> its ``parameters.properties`` (None when the tool has no schema)."""
    out: dict[str, dict | None] = {}
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if not isinstance(name, str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[name] = props if isinstance(props, dict) else None
    return out


# ----------------------------------------------------------------------------------------
# The incremental parser
# ----------------------------------------------------------------------------------------


class _ToolCallState:
    """Parse state of one ``<tool_call>`` block."""

    def __init__(self, index: int):
        self.index = index
        self.call_id = new_call_id()
        self.name: str | None = None
        self.nparams = 0
        self.raw = ""  # the block's text from just after <tool_call>, for recovery


class ChatOutputParser:
    """Split streamed Qwen3.5 output into reasoning, content and tool calls.

    Parameters
    ----------
    reasoning : bool
        Whether generation starts inside an open ``<think>`` block (see
        :func:`prompt_opens_reasoning`).
    tools : list[dict] | None
        OpenAI tool definitions, used to type parameter values. With ``parse_tools=False``
        tool-call markup is left in the content.
    parse_tools : bool
        Recognise ``<tool_call>`` blocks.
    """

    def __init__(self, *, reasoning: bool = False, tools: list[dict] | None = None,
                 parse_tools: bool = True):
        self.mode = "reasoning" if reasoning else "content"
        self.schemas = tool_param_schemas(tools)
        self.parse_tools = parse_tools
        self.buf = ""
        self.content_started = False   # any non-whitespace content emitted
        self.reasoning_started = False
        self.ws_pending = ""            # trailing whitespace held until more text follows
        self.ws_kind = "content"        # the channel ws_pending belongs to
        self.calls: list[_ToolCallState] = []
        # indices of calls the output ended inside (max tokens, a stop string): closed so the
        # stream stays valid JSON, but incomplete; whole-reply results leave them out
        self.truncated: set[int] = set()
        self.call: _ToolCallState | None = None
        self.finished = False
        self.tool_phase = "name"
        self._scan = 0  # where the search for a parameter's closing tag resumes

    # -- public --------------------------------------------------------------------------

    @property
    def n_tool_calls(self) -> int:
        """Tool calls begun so far (with a function name)."""
        return sum(1 for c in self.calls if c.name is not None)

    def feed(self, text: str) -> list[Delta]:
        """Parse the next piece of output; returns the events it makes certain."""
        if self.finished:
            raise RuntimeError("parser already finished")
        out: list[Delta] = []
        self.buf += text
        self._run(out, final=False)
        return _merge(out)

    def finish(self) -> list[Delta]:
        """End of output: release held text, close an unfinished tool call."""
        out: list[Delta] = []
        if not self.finished:
            self._run(out, final=True)
            self.finished = True
        return _merge(out)

    # -- machinery -----------------------------------------------------------------------

    def _emit_text(self, out: list[Delta], kind: str, text: str, final: bool) -> None:
        """Emit reasoning/content text, dropping leading whitespace of the channel and
        holding trailing whitespace until more text of the same channel follows (dropped
        before a tag, released at the end of the output)."""
        if not text:
            return
        started = self.content_started if kind == "content" else self.reasoning_started
        if not started:
            text = text.lstrip(_WS)
            if not text:
                return
        body = text.rstrip(_WS)
        tail = text[len(body):]
        if body:
            out.append(Delta(kind, self.ws_pending + body))
            self.ws_pending = ""
            if kind == "content":
                self.content_started = True
            else:
                self.reasoning_started = True
        if tail:
            self.ws_kind = kind
        self.ws_pending += tail

    def _drop_ws(self) -> None:
        self.ws_pending = ""

    def _run(self, out: list[Delta], final: bool) -> None:
        while True:
            before = (self.mode, len(self.buf))
            if self.mode == "reasoning":
                self._step_reasoning(out, final)
            elif self.mode == "content":
                self._step_content(out, final)
            else:
                self._step_tool(out, final)
            if (self.mode, len(self.buf)) == before:
                break
        if final:
            # the output ended inside a channel (stop string, max tokens): its trailing
            # whitespace is part of it, as Engine.chat returns it; before a tag it was dropped
            if self.ws_pending and self.mode != "tool":
                out.append(Delta(self.ws_kind, self.ws_pending))
            self.ws_pending = ""

    def _step_reasoning(self, out, final):
        buf = self.buf
        if not self.reasoning_started and not self.ws_pending:
            # the model may open the block itself
            stripped = buf.lstrip(_WS)
            if stripped.startswith(THINK_OPEN):
                self.buf = stripped[len(THINK_OPEN):]
                return
            if THINK_OPEN.startswith(stripped) and stripped and not final:
                return
        tags = [THINK_CLOSE] + ([TOOL_OPEN] if self.parse_tools else [])
        hits = [(buf.find(t), t) for t in tags]
        hits = [(i, t) for i, t in hits if i >= 0]
        if hits:
            i, tag = min(hits)
            self._emit_text(out, "reasoning", buf[:i], final)
            self._drop_ws()
            self.buf = buf[i + len(tag):]
            if tag == THINK_CLOSE:
                self.mode = "content"
            else:
                self._open_call()
            return
        keep = 0 if final else _partial_suffix(buf, tags)
        self._emit_text(out, "reasoning", buf[:len(buf) - keep], final)
        self.buf = buf[len(buf) - keep:]

    def _step_content(self, out, final):
        buf = self.buf
        if not self.content_started and not self.calls:
            stripped = buf.lstrip(_WS)
            if stripped.startswith(THINK_OPEN) and not self.reasoning_started:
                self.buf = stripped[len(THINK_OPEN):]
                self.mode = "reasoning"
                return
            if stripped and THINK_OPEN.startswith(stripped) and not final and not self.reasoning_started:
                return
        if not self.parse_tools:
            self._emit_text(out, "content", buf, final)
            self.buf = ""
            return
        i = buf.find(TOOL_OPEN)
        if i >= 0:
            self._emit_text(out, "content", buf[:i], final)
            self._drop_ws()
            self.buf = buf[i + len(TOOL_OPEN):]
            self._open_call()
            return
        keep = 0 if final else _partial_suffix(buf, [TOOL_OPEN])
        self._emit_text(out, "content", buf[:len(buf) - keep], final)
        self.buf = buf[len(buf) - keep:]

    def _open_call(self):
        self.call = _ToolCallState(len(self.calls))
        self.calls.append(self.call)
        self.mode = "tool"
        self.tool_phase = "name"
        self._scan = 0

    def _close_call(self, out):
        c = self.call
        if c is not None and c.name is not None:
            out.append(Delta("tool_args", "}" if c.nparams else "{}", index=c.index))
        self.call = None
        self.mode = "content"

    def _drop_call(self):
        """Output ended before the call had a name: nothing usable to report."""
        self.calls.pop()
        self.call = None
        self.buf = ""
        self.mode = "content"

    def _abandon_call(self, out, final):
        """The block is not a well-formed call: give its raw text back as content."""
        c = self.call
        raw = TOOL_OPEN + c.raw
        self.calls.pop()
        self.call = None
        self.mode = "content"
        self._emit_text(out, "content", raw, final)

    def _step_tool(self, out, final):
        c = self.call
        phase = self.tool_phase
        buf = self.buf
        if phase == "name":
            s = buf.lstrip(_WS)
            if s.startswith(FUNC_OPEN):
                j = s.find(">")
                nl = s.find("\n")
                if j >= 0 and (nl < 0 or j < nl):
                    name = s[len(FUNC_OPEN):j].strip()
                    consumed = len(buf) - len(s) + j + 1
                    c.raw += buf[:consumed]
                    self.buf = buf[consumed:]
                    if not name:
                        self._abandon_call(out, final)
                        return
                    c.name = name
                    out.append(Delta("tool_start", index=c.index, call_id=c.call_id, name=name))
                    self.tool_phase = "params"
                elif nl >= 0:  # malformed opening line
                    c.raw += buf
                    self.buf = ""
                    self._abandon_call(out, final)
                elif final:  # cut off before the name was complete
                    self._drop_call()
                return
            if s.startswith("{"):
                self._step_json_call(out, final)
                return
            if not s or FUNC_OPEN.startswith(s):
                if final:
                    self._drop_call()
                return
            c.raw += buf
            self.buf = ""
            self._abandon_call(out, final)
            return
        if phase == "params":
            k = _skip_ws(buf, 0)
            if buf.startswith(PARAM_OPEN, k):
                j = buf.find(">", k)
                end = None if j < 0 else self._find_param_end(buf, j + 1, final)
                if end is None:
                    if final:
                        self._truncate(out)
                    return
                vend, after = end
                key = buf[k + len(PARAM_OPEN):j].strip()
                value = buf[j + 1:vend]
                if value.startswith("\n"):
                    value = value[1:]
                if value.endswith("\n"):
                    value = value[:-1]
                self._emit_param(out, key, value)
                c.raw += buf[:after]
                self.buf = buf[after:]
                self._scan = 0
                return
            s = buf[k:]
            lead = k
            for tag, nxt in ((FUNC_CLOSE, "closing"), (TOOL_CLOSE, "done")):
                if s.startswith(tag):
                    c.raw += buf[:lead + len(tag)]
                    self.buf = buf[lead + len(tag):]
                    if nxt == "done":
                        self._close_call(out)
                    else:
                        self.tool_phase = "closing"
                    return
            if not s or any(t.startswith(s) for t in (PARAM_OPEN, FUNC_CLOSE, TOOL_CLOSE)):
                if final:
                    self._truncate(out)
                return
            # unexpected text inside the call: end the call there, rest is content
            self._close_call(out)
            self.buf = buf
            return
        if phase == "closing":
            s = buf.lstrip(_WS)
            if s.startswith(TOOL_CLOSE):
                self.buf = s[len(TOOL_CLOSE):]
                self._close_call(out)
                return
            if not s or TOOL_CLOSE.startswith(s):
                if final:
                    self.buf = ""
                    self._close_call(out)
                return
            # no </tool_call> (or end of output): the call is complete anyway
            self.buf = s
            self._close_call(out)
            return

    def _step_json_call(self, out, final):
        """Older Qwen form: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
        c = self.call
        buf = self.buf
        i = buf.find(TOOL_CLOSE)
        if i < 0 and not final:
            return
        body = buf if i < 0 else buf[:i]
        rest = "" if i < 0 else buf[i + len(TOOL_CLOSE):]
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            c.raw += buf if i < 0 else buf[:i + len(TOOL_CLOSE)]
            self.buf = rest
            self._abandon_call(out, final)
            return
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        c.name = obj["name"]
        out.append(Delta("tool_start", index=c.index, call_id=c.call_id, name=c.name))
        text = json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else "{}"
        out.append(Delta("tool_args", text, index=c.index))
        self.buf = rest
        self.call = None
        self.mode = "content"

    def _find_param_end(self, s: str, start: int, final: bool) -> tuple[int, int] | None:
        """Where a parameter value ends: ``(value_end, index_after_close_tag)``.

        A ``</parameter>`` closes the value only when what follows it (after whitespace) is
        another parameter, ``</function>`` or ``</tool_call>`` (or the end of the output),
        so values that themselves contain the tag text survive. The search resumes where
        the previous call stopped (``self._scan``), so a long value costs linear time.
        """
        pos = max(start, self._scan)
        follow = (PARAM_OPEN, FUNC_CLOSE, TOOL_CLOSE)
        while True:
            i = s.find(PARAM_CLOSE, pos)
            if i < 0:
                self._scan = max(start, len(s) - len(PARAM_CLOSE) + 1)
                return None
            after = i + len(PARAM_CLOSE)
            k = _skip_ws(s, after)
            if any(s.startswith(t, k) for t in follow):
                return i, after
            rest = s[k:k + 16]
            if k == len(s) or (len(rest) < 16 and any(t.startswith(rest) for t in follow)):
                if final:
                    return i, after
                self._scan = i
                return None  # undecided until more text arrives
            pos = after

    def _emit_param(self, out, key, value):
        c = self.call
        props = self.schemas.get(c.name)
        typed = convert_value(value, props.get(key) if isinstance(props, dict) else None)
        frag = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(typed, ensure_ascii=False)
        out.append(Delta("tool_args", ("{" if c.nparams == 0 else ", ") + frag, index=c.index))
        c.nparams += 1

    def _truncate(self, out):
        """Output ended inside a call: close its JSON with the complete parameters so far."""
        if self.call is not None:
            self.truncated.add(self.call.index)
        self.buf = ""
        self._close_call(out)


def _merge(events: list[Delta]) -> list[Delta]:
    """Join adjacent text events of the same kind (and args of the same call)."""
    merged: list[Delta] = []
    for ev in events:
        last = merged[-1] if merged else None
        if (last is not None and ev.kind == last.kind and ev.kind in ("reasoning", "content", "tool_args")
                and ev.index == last.index):
            last.text += ev.text
        else:
            merged.append(Delta(ev.kind, ev.text, ev.index, ev.call_id, ev.name))
    return merged


@dataclass
class ChatAccumulator:
    """Concatenates parser events into one assistant message (the non-streaming result)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    truncated: set[int] = field(default_factory=set)  # calls cut off by the end of the output

    def add(self, events: Iterable[Delta]) -> None:
        for ev in events:
            if ev.kind == "reasoning":
                self.reasoning += ev.text
            elif ev.kind == "content":
                self.content += ev.text
            elif ev.kind == "tool_start":
                self.tool_calls.append({"id": ev.call_id, "type": "function",
                                        "function": {"name": ev.name, "arguments": ""}})
            elif ev.kind == "tool_args":
                self.tool_calls[ev.index]["function"]["arguments"] += ev.text

    def drop_calls(self, indices) -> None:
        """Leave out the calls at ``indices`` (the parser's ``truncated``: cut off by the end
        of the output, so their arguments are incomplete and would not validate)."""
        self.tool_calls = [c for i, c in enumerate(self.tool_calls) if i not in indices]


def parse_complete(text: str, *, reasoning: bool = False, tools: list[dict] | None = None,
                   parse_tools: bool = True) -> ChatAccumulator:
    """Parse a whole reply at once (convenience for tests and tools)."""
    p = ChatOutputParser(reasoning=reasoning, tools=tools, parse_tools=parse_tools)
    acc = ChatAccumulator()
    acc.add(p.feed(text))
    acc.add(p.finish())
    acc.truncated = set(p.truncated)
    return acc


@dataclass
class ToolCall:
    """A tool call the model made: ``name`` and its ``arguments`` (a dict, values typed by
    the tool's JSON schema), with an ``id`` (``call_...``) for the tool result to cite."""

    id: str
    name: str
    arguments: dict


@dataclass
class ChatMessage:
    """An assistant reply split into its parts.

    ``reasoning`` is the thinking block's text (empty when there was none), ``content`` the
    visible answer, ``tool_calls`` the calls in order. :meth:`to_message` gives the
    message to append to the conversation for the next turn.
    """

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_message(self) -> dict:
        """``{"role": "assistant", "content", "reasoning_content"?, "tool_calls"?}`` in the
        shape the chat template (and OpenAI's API) takes in history."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.tool_calls]
        return msg


def parse_chat_output(text: str, *, reasoning: bool = False, tools: list[dict] | None = None,
                      parse_tools: bool = True) -> ChatMessage:
    """Split a whole raw reply (special tokens included, as the engine returns it) into
    reasoning, content and tool calls - the same parser the server streams with.

    ``reasoning``: the prompt left a ``<think>`` block open (:func:`prompt_opens_reasoning`);
    ``tools``: the tool definitions, which type the arguments; ``parse_tools=False`` leaves
    tool-call markup in the content. A call the output ended inside (max tokens) is left out:
    its arguments are incomplete.
    """
    acc = parse_complete(text, reasoning=reasoning, tools=tools, parse_tools=parse_tools)
    acc.drop_calls(acc.truncated)
    calls = [ToolCall(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in acc.tool_calls]
    return ChatMessage(acc.reasoning, acc.content, calls)
