"""Request and response bodies of the OpenAI-compatible API (pydantic).

Requests follow OpenAI's chat-completions and completions schemas; unknown fields are ignored
(as OpenAI and vLLM do) so clients that send newer options keep working. A few vLLM-style
extensions are accepted: `top_k`, `ignore_eos`, `stop_token_ids`. Responses are built as these
models and serialized with `model_dump_json`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")


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


ContentPart = Annotated[Union[TextPart, ImageURLPart, VideoURLPart], Field(discriminator="type")]


class ChatMessage(_Req):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None


class StreamOptions(_Req):
    include_usage: bool = False


class SamplingFields(_Req):
    """Fields shared by both endpoints."""

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # extension
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Accepted only so that they can be refused with a clear message (not silently ignored).
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    best_of: int | None = None
    ignore_eos: bool = False  # extension (benchmarks)
    stop_token_ids: list[int] | None = None  # extension
    user: Text | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: Text | None = None


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "vlmctl"
    root: str | None = None
    max_model_len: int | None = None


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
