"""The API's typed requests and replies (OpenAI's shapes, strict: unknown fields refused), the server's limits, and
its errors."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, fields
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sparsegen.engine.session import MOST_LOGPROBS

log = logging.getLogger("sparsegen.serve")


SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
SESSION_ID_RULE = "1-128 characters from A-Z a-z 0-9 . _ : @ -"


@dataclass(frozen=True)
class Limits:
    """What one server accepts. Every count must be at least 1, every timeout above 0."""

    max_sessions: int = 64
    max_batch: int = 16  # replies decoded together
    max_queue: int = 64  # requests waiting beyond that: 429
    max_tokens: int = 1024  # per reply
    max_prompt_tokens: int = 8192  # new tokens one request may ask the server to encode
    max_messages: int = 256
    max_stops: int = 4
    max_stop_chars: int = 256
    max_request_bytes: int = 1 << 20
    max_inspections: int = 2  # /v1/inspect calls running or waiting beyond which: 429
    header_timeout: float = 10.0  # seconds a client has to send a request's headers, once it starts them
    body_timeout: float = 30.0  # seconds a client has to send a request's whole body, once its headers are in
    api_keys: tuple[str, ...] = ()  # none: no authentication

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_timeout"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                    raise ValueError(f"{f.name} must be a positive number of seconds, got {value!r}")
            elif f.name != "api_keys" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")
        if any(not isinstance(key, str) or not key.strip() or not key.isprintable() for key in self.api_keys):
            raise ValueError("API keys must be non-empty printable strings")


MOST_NESTING = 32  # levels of JSON arrays and objects a request body may nest (a real request nests five at most)


def _readable_json(value):
    """A body the server can read, checked without recursion (a body nested 960 deep would otherwise raise a
    ``RecursionError`` here): at most ``MOST_NESTING`` levels, and text the tokenizer can take (JSON may carry lone
    UTF-16 surrogates, "\\ud800", that no UTF-8 text has)."""
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ValueError(f"a string holds a lone surrogate at character {err.start}; send valid "
                                 "Unicode") from None
        elif isinstance(item, (dict, list)):
            if depth >= MOST_NESTING:
                raise ValueError(f"the body nests arrays and objects more than {MOST_NESTING} levels deep; send "
                                 "the request's fields as the API documents them")
            pending += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return value


def _content_text(content) -> str | None:
    """A message's content as one string: a string, a list of text parts (joined), or None. Parts of any other
    type (images, audio, files) are refused by name: this server serves text models."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("content must be a string, a list of content parts, or null")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"content part {i} has type {kind!r}: this server serves a text-only model and reads "
                             f'only {{"type": "text", "text": ...}} parts')
        if not isinstance(part.get("text"), str):
            raise ValueError(f'content part {i} needs a string "text"')
        texts.append(part["text"])
    return "".join(texts)


class TextPart(BaseModel):
    """A part of a message's content (what the schema documents; ``_content_text`` reads them)."""

    type: Literal["text"]
    text: str


class Message(BaseModel):
    """A chat message as OpenAI clients send it: ``content`` a string, a list of text parts (joined), or null on an
    assistant turn; the ``developer`` role is the system role of newer models."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # read as one string (``_content_text``)
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value):
        return _content_text(value)

    @model_validator(mode="after")
    def _readable(self):
        if self.role == "tool" or self.tool_calls or self.tool_call_id is not None:
            raise ValueError("tool messages and tool calls are not supported: this server calls no tools")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (only an assistant turn may have null content)")
        return self

    def as_engine(self) -> dict:
        """``{"role", "content"}`` as the chat template takes them."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields both endpoints take; unset sampling fields take the server's defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    seed: int | None = Field(default=None, ge=-2**63, lt=2**64)  # any 64-bit seed, as OpenAI takes
    n: int = Field(default=1, ge=1)
    user: str | None = None
    session_id: str | None = Field(default=None, pattern=f"^{SESSION_ID.pattern}$")
    ignore_eos: bool = False  # vLLM's extension: decode max_tokens whatever the model says (fixed-length benchmarks)
    context: str | None = Field(default=None, max_length=128)  # sparsegen's: continue a compressed context (--context)
    # sent by OpenAI clients; neutral values are accepted, others are refused (REFUSED says why)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        return _readable_json(data)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MOST_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


class InspectRequest(BaseModel):
    """``POST /v1/inspect``: what each policy keeps of a text (``sparsegen.inspect``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    text: str = Field(min_length=1)
    policies: str | list[str] = "window,streaming,h2o,snapkv"
    budget: int | float | str = 256
    question: str | None = None
    answer: str | None = None
    protocol: Literal["stream", "context"] = "stream"
    kv_bits: Literal[32, 16, 8, 4, 2] | None = None
    max_new_tokens: int = Field(default=16, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        return _readable_json(data)


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value):
        if any(not prompt for prompt in ([value] if isinstance(value, str) else value)):
            raise ValueError("a prompt must be a non-empty string")
        return value


# What this server refuses of OpenAI's request fields, and why (docs/serving.md lists the same): field -> (the values
# accepted, the reason any other is refused).
REFUSED = {
    "n": ("1", "one reply per request: send several requests (each with its own seed) for several samples"),
    "best_of": ("1", "one reply per request"),
    "echo": ("false", "the prompt is not returned with the reply"),
    "suffix": ("null", "no fill-in-the-middle"),
    "frequency_penalty": ("0", "no repetition penalties: sampling is temperature and top_p"),
    "presence_penalty": ("0", "no repetition penalties: sampling is temperature and top_p"),
    "logit_bias": ("{}", "no logit biases"),
    "tools": ("[]", "this server calls no tools"),
    "tool_choice": ('"none"', "this server calls no tools"),
    "response_format": ('{"type": "text"}', "no constrained decoding (JSON modes and schemas)"),
}


def refused_field(parsed: GenerationRequest) -> str | None:
    """The first field of ``parsed`` set to a value this server does not honour (see ``REFUSED``), if any."""
    checks = {
        "n": parsed.n != 1,
        "best_of": getattr(parsed, "best_of", None) not in (None, 1),
        "echo": getattr(parsed, "echo", False),
        "suffix": getattr(parsed, "suffix", None) is not None,
        "frequency_penalty": bool(parsed.frequency_penalty),
        "presence_penalty": bool(parsed.presence_penalty),
        "logit_bias": bool(parsed.logit_bias),
        "tools": bool(getattr(parsed, "tools", None)),
        "tool_choice": getattr(parsed, "tool_choice", None) not in (None, "none"),
        "response_format": getattr(parsed, "response_format", None) is not None
        and parsed.response_format.type != "text",
    }
    return next((name for name, refused in checks.items() if refused), None)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="the prompt's tokens the conversation's cache already held (a session's "
                                           "earlier turns, a --context): not encoded again")


class Usage(BaseModel):
    prompt_tokens: int = Field(description="the whole prompt's tokens, cached ones included (OpenAI's meaning)")
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ReplyMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ReplyMessage
    logprobs: dict | None = None
    finish_reason: Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict | None = None
    finish_reason: Literal["stop", "length"]


class _Reply(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage
    session_id: str | None = Field(description="the conversation this reply extends, if any (no key's prefix)")


class ChatCompletion(_Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class Completion(_Reply):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorReply(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sparsegen"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def documented(reply: type[BaseModel]) -> dict:
    """The OpenAPI responses of a generation endpoint: the reply, its event stream, and the error shape."""
    errors = {status: {"model": ErrorReply, "description": about} for status, about in [
        (400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
        (413, "body too large"), (415, "not JSON"), (429, "queue full"), (500, "the reply failed"),
        (503, "shutting down")]}
    stream = {"schema": {"type": "string", "description": "with `stream`: `data: {chunk}` events, then "
                                                          "`data: [DONE]`"}}
    return {200: {"model": reply, "content": {"text/event-stream": stream}}, **errors}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def shutting_down(what: str = "the server is shutting down") -> ApiError:
    """The 503 every request gets that a stopping server will not answer."""
    return ApiError(503, f"{what}; retry on another server or later", "server_error", "shutting_down")


def log_5xx(request_id: str, err: ApiError) -> None:
    """The one log line a 5xx answer gets, wherever it was raised (``X-Request-Id`` names the same request)."""
    if err.status >= 500:
        log.log(logging.ERROR if err.status == 500 else logging.WARNING, "request %s: %d %s", request_id,
                err.status, err.message)


class ClientGone(Exception):
    """The client closed its connection: its reply was cancelled, and nobody is left to answer."""
