"""Request and response bodies of the OpenAI-compatible API (pydantic).

Requests follow OpenAI's chat-completions and completions schemas. These models check types and
ranges only: which fields exist and which vlmctl serves is decided first, on the raw body, by
openai_fields.py (an unknown or unsupported field is a 400 naming it), so the models ignore extra
keys. vLLM-style extensions: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`, `video_url` content parts. Responses are built as these models and serialized
with `model_dump_json`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


# OpenAI's own limit of choices per request
MAX_N = 128
# vlmctl's limit of sequences one request queues (completions: prompts x best_of): a 2 KB body must not
# fan out into tens of thousands of requests
MAX_SEQUENCES = 1024


class _Req(BaseModel):
    # strict: a wrong JSON type is a 400, as OpenAI answers it ("5" is not an integer, "yes" not a boolean,
    # true not a count); an integer still passes where a number is expected
    model_config = ConfigDict(extra="ignore", strict=True)


def _unicode_text(value: str) -> str:
    # JSON can spell a lone UTF-16 surrogate ("\ud800"); Python keeps it in the str, and the tokenizer
    # (and any UTF-8 encoder) fails on it later. Refuse it here, where it is a 400 with its field.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text contains a lone UTF-16 surrogate ({value[e.start]!r} at character {e.start}), "
                         "which is not valid Unicode") from None
    return value


# Every string a request carries into the tokenizer, the media loader or a response.
Text = Annotated[str, AfterValidator(_unicode_text)]


# ---- chat requests ---------------------------------------------------------------------------
class TextPart(_Req):
    type: Literal["text"]
    text: Text


class ImageURL(_Req):
    url: Text
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(_Req):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Req):
    url: Text


class VideoURLPart(_Req):  # vLLM's extension of OpenAI's content parts
    type: Literal["video_url"]
    video_url: VideoURL


class RefusalPart(_Req):
    type: Literal["refusal"]
    refusal: Text


ContentPart = Annotated[Union[TextPart, ImageURLPart, VideoURLPart, RefusalPart], Field(discriminator="type")]


class FunctionCall(_Req):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCallIn(_Req):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: Text | None = None  # tool
    refusal: Text | None = None  # assistant

    def to_engine(self) -> dict:
        """The message as models/chat.py renders it (the OpenAI shape; images as {"type": "image"},
        videos as {"type": "video"})."""
        out: dict = {"role": "system" if self.role == "developer" else self.role}
        if self.content is None and self.tool_calls:
            out["content"] = None  # calls only: templates check for content before writing the calls
        elif self.content is None or isinstance(self.content, str):
            out["content"] = self.content or ""
        else:
            out["content"] = [{"type": "image"} if isinstance(p, ImageURLPart)
                              else {"type": "video"} if isinstance(p, VideoURLPart) else p.model_dump()
                              for p in self.content]
        for key in ("name", "tool_call_id", "refusal"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [tc.model_dump() for tc in self.tool_calls]
        return out

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImageURLPart)]

    def video_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p.video_url.url for p in self.content if isinstance(p, VideoURLPart)]


class StreamOptions(_Req):
    include_usage: bool | None = False  # null counts as not sent


class SamplingFields(_Req):
    """Fields shared by both endpoints."""

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # extension
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)  # a 64-bit seed: a larger one would wrap onto another
    stop: Text | list[Text] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension
    min_p: float | None = None  # extension
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = False  # extension (benchmarks)
    stop_token_ids: list[int] | None = None  # extension

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingFields):
    # token-id prompts are typed here so that they get their own clear 400, not a type error
    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    response_format: dict[str, Any] | None = None  # extension (vLLM's): structured output here too


# ---- responses -------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # as models/tool_calls.ToolCallStreamParser makes them


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelRef(BaseModel):
    """The model a request names (`GET /v1/models/{model}`)."""
    model: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "vlmctl"
    root: str | None = None
    max_model_len: int | None = None


class VersionInfo(BaseModel):
    version: str
    model: str
    decoder_backend: str
    vision_backend: str
    openai_fields_checked_against: str  # the openai package release the request tables follow


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: Any = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code)).model_dump()
