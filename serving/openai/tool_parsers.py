"""Tool calls out of a model's text, whole or as it streams: one parser per chat-template family.

* ``hermes`` (Hermes 2 Pro, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
  with text around them;
* ``llama3_json`` (Llama 3.1/3.2/3.3's JSON tool calling): the whole answer is ``{"name": ..., "parameters":
  {...}}`` (several separated by ``;``), optionally after ``<|python_tag|>``; any other answer is text;
* for ``tool_choice="required"``, a JSON array ``[{"name": ..., "parameters": {...}}, ...]`` (what the
  grammar built from the tools makes the model write); for a named ``tool_choice``, the whole output is the
  arguments of that function, streamed as they come.

A parser is fed the text deltas of one choice (``feed``) and told when it ended (``finish``); each returns the
content to show and the tool-call pieces to send (OpenAI's ``delta.tool_calls``: the first piece of a call has
its id and name, later ones add to its arguments). Content is stripped of the whitespace around tool calls
(trailing whitespace is held until more text follows), so the streamed content equals the whole one. Text
that looks like a tool call but does not parse stays content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass
class ToolCallPiece:
    index: int                 # which call of the choice (0, 1, ...)
    arguments: str = ""        # JSON text to append to the call's arguments
    id: str | None = None      # the first piece of a call only
    name: str | None = None    # the first piece of a call only


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def json_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array that starts at ``text[start]``, None while it is incomplete."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _call(text: str, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object {"name": ..., <arguments key>: {...}}, or None."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(args, str):   # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


@dataclass
class _Content:
    """Text shown as content, without leading whitespace and with trailing whitespace held back."""

    started: bool = False
    held: str = ""

    def add(self, text: str) -> str:
        text = self.held + text
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        self.held = text[len(body):]
        self.started = self.started or bool(body)
        return body


@dataclass
class ToolParser:
    """The shared bookkeeping: calls found so far and content released."""

    content: _Content = field(default_factory=_Content)
    calls: list[ParsedToolCall] = field(default_factory=list)

    def _new_call(self, name: str, arguments: str) -> ToolCallPiece:
        call = ParsedToolCall(new_call_id(), name, arguments)
        self.calls.append(call)
        return ToolCallPiece(len(self.calls) - 1, arguments, call.id, name)

    def feed(self, text: str) -> tuple[str, list[ToolCallPiece]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallPiece]]:
        raise NotImplementedError


class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.in_call = False

    def feed(self, text: str) -> tuple[str, list[ToolCallPiece]]:
        self.buffer += text
        shown, pieces = "", []
        while True:
            if self.in_call:
                end = self.buffer.find(self.CLOSE)
                if end < 0:
                    break
                shown += self._close(self.buffer[:end], pieces, self.CLOSE)
                self.buffer, self.in_call = self.buffer[end + len(self.CLOSE):], False
            else:
                start = self.buffer.find(self.OPEN)
                if start < 0:
                    keep = _partial_suffix(self.buffer, self.OPEN)
                    shown += self.content.add(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                shown += self.content.add(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start + len(self.OPEN):], True
        return shown, pieces

    def _close(self, body: str, pieces: list[ToolCallPiece], close: str) -> str:
        call = _call(body.strip(), ("arguments", "parameters"))
        if call is None:   # not a call after all: show it as it was written
            return self.content.add(self.OPEN + body + close)
        pieces.append(self._new_call(*call))
        return ""

    def finish(self) -> tuple[str, list[ToolCallPiece]]:
        pieces: list[ToolCallPiece] = []
        if self.in_call:   # the answer ended inside a call (some models stop before the closing tag)
            shown = self._close(self.buffer, pieces, "")
        else:
            shown = self.content.add(self.buffer)
        self.buffer, self.in_call = "", False
        return shown, pieces


class Llama3JsonParser(ToolParser):
    """Llama 3's JSON tool calls: the answer is one or more call objects (``;`` between them) or plain text."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.mode: str | None = None   # "calls" or "text", once the answer's start tells
        self.pos = 0                   # calls mode: where the next call may start in buffer

    def feed(self, text: str) -> tuple[str, list[ToolCallPiece]]:
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            if head.startswith(self.TAG):
                head = head[len(self.TAG):].lstrip()
            if not head or (self.TAG.startswith(head) and head != self.TAG):
                return "", []   # cannot tell yet
            self.mode = "calls" if head.startswith("{") else "text"
            if self.mode == "calls":
                self.buffer, self.pos = head, 0
        if self.mode == "text":
            shown, self.buffer = self.content.add(self.buffer), ""
            return shown, []
        return "", self._calls()

    def _calls(self) -> list[ToolCallPiece]:
        pieces = []
        while True:
            start = self.pos
            while start < len(self.buffer) and self.buffer[start] in " \t\r\n;":
                start += 1
            if start >= len(self.buffer) or self.buffer[start] != "{":
                return pieces
            end = json_end(self.buffer, start)
            if end is None:
                return pieces
            call = _call(self.buffer[start:end], ("parameters", "arguments"))
            if call is None:
                return pieces   # left in the buffer: finish shows it as text
            pieces.append(self._new_call(*call))
            self.pos = end

    def finish(self) -> tuple[str, list[ToolCallPiece]]:
        if self.mode == "calls" and self.calls:
            rest = self.buffer[self.pos:].strip(" \t\r\n;")   # after the calls: text, if any
        else:
            rest = self.buffer   # undecided, text, or no call parsed: the answer is text
        self.buffer, self.pos = "", 0
        return self.content.add(rest), []


class JsonArrayParser(ToolParser):
    """``tool_choice="required"``: ``[{"name": ..., "parameters": {...}}, ...]`` (the grammar's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.pos: int | None = None   # after "[": where the next call may start

    def feed(self, text: str) -> tuple[str, list[ToolCallPiece]]:
        self.buffer += text
        if self.pos is None:
            start = self.buffer.find("[")
            if start < 0:
                return "", []
            self.pos = start + 1
        pieces = []
        while True:
            start = self.pos
            while start < len(self.buffer) and self.buffer[start] in " \t\r\n,":
                start += 1
            if start >= len(self.buffer) or self.buffer[start] != "{":
                return "", pieces
            end = json_end(self.buffer, start)
            call = None if end is None else _call(self.buffer[start:end], ("parameters", "arguments"))
            if call is None:
                return "", pieces
            pieces.append(self._new_call(*call))
            self.pos = end

    def finish(self) -> tuple[str, list[ToolCallPiece]]:
        if self.calls:
            return "", []
        text, self.buffer = self.buffer, ""   # cut short before a whole call: what was written is all there is
        return self.content.add(text), []


class NamedParser(ToolParser):
    """A named ``tool_choice``: the output is that function's arguments, streamed into one call as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> tuple[str, list[ToolCallPiece]]:
        if not self.calls:
            return "", [self._new_call(self.name, text)]
        self.calls[0].arguments += text
        return "", [ToolCallPiece(0, text)] if text else []

    def finish(self) -> tuple[str, list[ToolCallPiece]]:
        return "", [] if self.calls else [self._new_call(self.name, "")]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (it may still become it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def make_parser(name: str) -> ToolParser:
    """A fresh parser of a family in TOOL_CALL_PARSERS."""
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser}[name]()


def detect_parser(template_source: str | None) -> str | None:
    """The parser a chat template's tool-call format needs, read off the template (None: no known format)."""
    if not template_source:
        return None
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|python_tag|>" in template_source or '"parameters"' in template_source:
        return "llama3_json"
    return None


def parse_whole(parser: ToolParser, text: str) -> tuple[str, list[ParsedToolCall]]:
    """Content and tool calls of a whole output."""
    shown, _ = parser.feed(text)
    rest, _ = parser.finish()
    return shown + rest, parser.calls
