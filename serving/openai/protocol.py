"""OpenAI request and response bodies (pydantic), checked field by field at the HTTP boundary.

Nothing malformed reaches the runtime: types are strict (no "5" for 5, no 1.5 or true for an integer),
floats are finite, every sampling value lies in the range the runtime accepts, integers fit the runtime's
tensors, text is valid Unicode, and unknown fields are refused (a field kiln ignored silently would change
results behind the client's back). Bounds that depend on the engine (vocabulary, max_input_len,
max_seq_len) are checked where prompts are tokenized (``generation.py``).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1
MAX_N = 128
MAX_STOP = 16
MAX_PROMPTS = 256
MAX_CHOICES = 256      # prompts x n in one request
MAX_CONSTRAINT_CHARS = 1 << 20   # a JSON schema, regex or grammar given as text
MAX_TOOLS = 128


class FieldError(ValueError):
    """A request that is well-typed but inconsistent; ``param`` names the field to change."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    def check_combinations(self) -> None:
        """Rules between fields (FieldError); the field types and ranges are checked by pydantic."""


def _one_or_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _text_parts(value: Any) -> Any:
    """OpenAI message content: a string, or a list of {"type": "text", "text": ...} parts (joined by newlines)."""
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                    and set(part) <= {"type", "text"}):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content part {i} is {kind!r}: only text parts ({{'type': 'text', 'text': ...}}) "
                                 "are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    return value


StopList = Annotated[list[Annotated[str, Field(min_length=1, max_length=512)]] | None,
                     BeforeValidator(_one_or_list), Field(max_length=MAX_STOP)]


class StreamOptions(RequestModel):
    include_usage: bool = False


# ---- structured output (the runtime's SamplingParams.structured_output; mapped in structured.py) --------------
def _schema(value: Any) -> Any:
    """A JSON schema (or structural tag) as an object or as its JSON text (parsed where it is compiled)."""
    if isinstance(value, dict) or (isinstance(value, str) and 0 < len(value) <= MAX_CONSTRAINT_CHARS):
        return value
    raise ValueError(f"must be a JSON object, or its JSON text (at most {MAX_CONSTRAINT_CHARS} characters)")


SchemaText = Annotated[str, Field(min_length=1, max_length=MAX_CONSTRAINT_CHARS)]
Schema = Annotated[Any, BeforeValidator(_schema)]   # a plain union would name its members in errors' param


class JsonSchemaFormat(RequestModel):
    """OpenAI's ``response_format.json_schema``."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Annotated[str, Field(max_length=4096)] | None = None
    schema_: Annotated[dict | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs`` extension: one constraint (see kiln.runtime.StructuredOutputParams)."""

    json_: Annotated[Schema | None, Field(alias="json")] = None
    regex: SchemaText | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]], Field(min_length=1,
                                                                                         max_length=1024)] | None = None
    grammar: SchemaText | None = None
    json_object: bool | None = None
    structural_tag: Schema | None = None
    disable_any_whitespace: bool | None = None   # vLLM's name; kiln's JSON is compact unless this is false


class StructuredOutputFields(RequestModel):
    """The ways a request asks for structured output (at most one per request)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names
    guided_json: Schema | None = None
    guided_regex: SchemaText | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]],
                             Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: SchemaText | None = None


class SamplingFields(StructuredOutputFields):
    """Fields both endpoints share: OpenAI's sampling options and kiln's extra ones (and structured output)."""

    model: Annotated[str, Field(max_length=256)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: StopList = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    # kiln's extras (vLLM's names)
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    ignore_eos: bool = False
    priority: Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)] = 0

    def check_combinations(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")

    def sampling_kwargs(self, max_tokens: int | None) -> dict[str, Any]:
        """SamplingParams keyword arguments (OpenAI defaults where the request left a field out)."""
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise FieldError("min_tokens", f"min_tokens ({self.min_tokens}) exceeds max_tokens ({max_tokens})")
        return dict(
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            stop=list(self.stop or []), ignore_eos=self.ignore_eos,
        )


def _check_prompt(value: Any) -> Any:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids (ints, not bools)."""
    def ids(x: Any) -> bool:
        return isinstance(x, list) and all(type(t) is int for t in x)

    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value) or ids(value) or all(ids(p) for p in value):
            if len(value) > MAX_PROMPTS and not ids(value):
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
            return value
    if isinstance(value, list) and not value:
        raise ValueError("the prompt is empty")
    raise ValueError("must be a string, a list of strings, a list of token ids (integers) or a list of such lists")


class CompletionRequest(SamplingFields):
    prompt: Annotated[Any, BeforeValidator(_check_prompt)]
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    def check_combinations(self) -> None:
        super().check_combinations()
        if self.echo and self.logprobs is not None:
            raise FieldError("echo", "echo with logprobs needs the prompt's log-probabilities, which kiln does not "
                                     "compute; drop echo or logprobs")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class FunctionCall(RequestModel):
    name: FunctionName
    arguments: Annotated[str, Field(max_length=MAX_CONSTRAINT_CHARS)]   # JSON text, as OpenAI sends it


class ToolCall(RequestModel):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | None, BeforeValidator(_text_parts)] = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None   # tool: the call answered


class FunctionDefinition(RequestModel):
    name: FunctionName
    description: Annotated[str, Field(max_length=4096)] | None = None
    parameters: dict | None = None   # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: FunctionName


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


def _tool_choice(value: Any) -> Any:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        return NamedToolChoice.model_validate(value)
    raise ValueError("must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True   # kiln/vLLM extra: False continues the last message instead
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Annotated[Any, BeforeValidator(_tool_choice)] = None   # a str of the three, or NamedToolChoice
    parallel_tool_calls: bool = True

    def check_combinations(self) -> None:
        super().check_combinations()
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs is only allowed when logprobs is true")
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise FieldError(f"messages[{i}].content", "content is required (only an assistant message with "
                                                           "tool_calls may leave it out)")
            if m.tool_calls and m.role != "assistant":
                raise FieldError(f"messages[{i}].tool_calls", f"only assistant messages have tool_calls, not {m.role}")
            if m.role == "tool" and m.tool_call_id is None:
                raise FieldError(f"messages[{i}].tool_call_id", "a tool message needs the tool_call_id it answers")
            for j, call in enumerate(m.tool_calls or []):
                try:
                    json.loads(call.function.arguments)
                except json.JSONDecodeError as exc:
                    raise FieldError(f"messages[{i}].tool_calls[{j}].function.arguments",
                                     f"arguments must be JSON text (as the API returned it): {exc}") from None
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldError("tools", f"function names must be unique, got {names}")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise FieldError("tool_choice", f"tool_choice {self.tool_choice_name!r} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice", f"tool_choice names the function {choice.function.name!r}, which is not "
                                            f"among the tools {names}")

    @property
    def tool_choice_name(self) -> str:
        """"none", "auto" (the default with tools), "required", or the named function."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        return choice or ("auto" if self.tools else "none")

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses ---------------------------------------------------------------------------------------------
class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob]


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str   # JSON text


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


def _none(value) -> bool:
    return value is None


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=_none)


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(ResponseModel):
    name: str | None = Field(default=None, exclude_if=_none)
    arguments: str = ""


class ToolCallDelta(ResponseModel):
    """A streamed piece of a tool call: the first one of a call has its id, type and name."""

    index: int
    id: str | None = Field(default=None, exclude_if=_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_none)
    function: FunctionCallDelta


class ChatDelta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_none)


class ChatChunkChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class LoadLoraAdapterRequest(RequestModel):
    """vLLM's ``/v1/load_lora_adapter`` body."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoraAdapterRequest(RequestModel):
    """vLLM's ``/v1/unload_lora_adapter`` body (``lora_int_id`` is accepted and not needed)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_int_id: int | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kiln"
    max_model_len: int
    root: str | None = None     # a LoRA adapter's directory
    parent: str | None = None   # a LoRA adapter's base model (the served model name)


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(ResponseModel):
    error: ErrorBody
