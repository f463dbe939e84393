"""The two completion endpoints: a checked OpenAI body in, the engine's requests (one per choice)
out, and the response, whole or streamed.

Each handler: parse and check the body (openai_request.py), build the prompt(s) and each
choice's sampling parameters, compile a grammar off the event loop (a 400 for a schema that
cannot be used), queue the choices as one group (n samples of a prompt share its KV through the
prefix cache), then render with render.py over streaming.py. What it is not: the app wiring
(app.py), the middleware or the engine's batching.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from . import schema as S
from .errors import APIError
from .media import load_image_url, load_video_url
from .middleware import AccessInfo
from .openai_request import (check_model, check_stream_options, choice_seed, compile_grammar, parse_body,
                             plan_tools, response_format_spec, sampling_params)
from .render import ChatChoice, CompletionChoice, usage_of
from .streaming import collect, sse_response


@dataclass
class ServeContext:
    engine: object
    aeng: object  # async_engine.AsyncEngine
    config: object  # app.ServerConfig
    model_name: str


def _ids(prefix: str, count: int) -> tuple[str, list[str]]:
    rid = S.new_id(prefix)
    return rid, ([rid] if count == 1 else [f"{rid}-{i}" for i in range(count)])


def _best(candidates: list, n: int) -> list:
    """The n candidates with the highest mean token log-probability, best first (OpenAI's best_of)."""
    def mean(c):
        lps = [e["logprob"] for e in c.request.logprobs]
        return sum(lps) / len(lps) if lps else float("-inf")

    return sorted(candidates, key=mean, reverse=True)[:n]


def _jobs(prompt, params, n: int) -> list:
    return [(prompt, params if i == 0 else params.replace(seed=choice_seed(params.seed, i))) for i in range(n)]


async def chat_completion(ctx: ServeContext, request: Request):
    engine, aeng = ctx.engine, ctx.aeng
    created = S.now()  # every object of the response carries the request's start, as OpenAI's do
    body = await parse_body(request, S.ChatCompletionRequest, "chat")
    check_model(body, ctx.model_name)
    check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    tools = plan_tools(engine, body)
    if tools is not None and tools.grammar is not None:
        grammar, grammar_param = tools.grammar, "tool_choice"
    else:
        grammar, grammar_param = response_format_spec(body.response_format), "response_format"
    messages = [m.to_engine() for m in body.messages]
    urls = [u for m in body.messages for u in m.image_urls()]
    limit = engine.limits.max_images_per_request
    if len(urls) > limit:
        raise APIError(400, f"{len(urls)} images in one request; this engine accepts at most {limit}",
                       param="messages", code="limit_exceeded")
    video_urls = [u for m in body.messages for u in m.video_urls()]
    if video_urls:  # refused before anything is fetched
        if not engine.family.video:
            raise APIError(400, f"this model ({engine.family.name}) takes no video input", param="messages")
        vlimit = engine.video_limits.max_videos_per_request
        if len(video_urls) > vlimit:
            raise APIError(400, f"{len(video_urls)} videos in one request; this engine accepts at most {vlimit}",
                           param="messages", code="limit_exceeded")
    images = await asyncio.gather(*(load_image_url(u, ctx.config.media, f"image {i + 1}",
                                                   limits=ctx.engine.image_limits)
                                    for i, u in enumerate(urls)))
    videos = await asyncio.gather(*(load_video_url(u, ctx.config.media, f"video {i + 1}")
                                    for i, u in enumerate(video_urls)))
    await compile_grammar(aeng, engine, grammar, grammar_param)
    video_items = None
    if videos:  # what is cheap to refuse goes first: decoding a video can take seconds
        engine.check_inputs(messages, list(images))
        video_items = await aeng.decode_videos(list(videos))
    prompt = await aeng.encode(engine.encode, messages, list(images), videos=list(videos),
                               tools=tools.tools if tools else None, video_items=video_items)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(engine, body, len(prompt.token_ids), body.max_completion_tokens or body.max_tokens,
                             logprobs, grammar)
    n = body.n or 1
    rid, ids = _ids("chatcmpl", n)
    stream = aeng.submit_group(_jobs(prompt, params, n), ids)
    request.state.access = AccessInfo(rid, stream.requests)
    choices = {r.id: ChatChoice(i, r, engine, logprobs=bool(body.logprobs), tools=tools)
               for i, r in enumerate(stream.requests)}
    head = {"id": rid, "created": created, "model": ctx.model_name}  # the same on every object of the response
    if not body.stream:
        await collect(request, stream, choices)
        resp = S.ChatCompletionResponse(**head, choices=[c.final() for c in choices.values()],
                                        usage=usage_of(stream.requests))
        return JSONResponse(resp.model_dump())
    usage = None
    if body.stream_options and body.stream_options.include_usage:
        usage = lambda: S.ChatCompletionChunk(**head, choices=[], usage=usage_of(stream.requests))  # noqa: E731
    return sse_response(stream, choices, lambda parts: S.ChatCompletionChunk(**head, choices=parts),
                        first=[S.ChatCompletionChunk(**head, choices=[c.first()]) for c in choices.values()],
                        usage=usage)


async def completion(ctx: ServeContext, request: Request):
    engine, aeng = ctx.engine, ctx.aeng
    created = S.now()  # every object of the response carries the request's start, as OpenAI's do
    body = await parse_body(request, S.CompletionRequest, "completions")
    check_model(body, ctx.model_name)
    check_stream_options(body)
    texts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
    if not texts:
        raise APIError(400, "prompt is an empty list; give at least one prompt", param="prompt")
    if not all(isinstance(t, str) for t in texts):
        raise APIError(400, "token-id prompts are not supported by this server; send the prompt as text",
                       param="prompt")
    n = body.n or 1
    best_of = body.best_of or n
    if best_of < n:
        raise APIError(400, f"best_of ({best_of}) must be at least n ({n})", param="best_of")
    if best_of > n and body.stream:
        raise APIError(400, "best_of > n cannot be streamed (the best are known only at the end)", param="best_of")
    if len(texts) * best_of > S.MAX_SEQUENCES:
        raise APIError(400, f"{len(texts)} prompts x {best_of} samples each is {len(texts) * best_of} sequences; one "
                       f"request may ask for at most {S.MAX_SEQUENCES}", param="prompt" if len(texts) > 1 else "n")
    grammar = response_format_spec(body.response_format)
    await compile_grammar(aeng, engine, grammar, "response_format")
    jobs = []
    # best_of ranks candidates by their tokens' mean log-probability, which each candidate then reports
    logprobs = body.logprobs if body.logprobs is not None or best_of == n else 0
    for text in texts:
        prompt = await aeng.encode(engine.encode_text, text)
        params = sampling_params(engine, body, len(prompt.token_ids), body.max_tokens, logprobs, grammar)
        jobs += _jobs(prompt, params, best_of)  # OpenAI's order: the choices of prompt 0, then of prompt 1, ...
    rid, ids = _ids("cmpl", len(jobs))
    stream = aeng.submit_group(jobs, ids)
    request.state.access = AccessInfo(rid, stream.requests)
    choices = {r.id: CompletionChoice(i, r, engine, logprobs=body.logprobs) for i, r in enumerate(stream.requests)}
    head = {"id": rid, "created": created, "model": ctx.model_name}
    if not body.stream:
        await collect(request, stream, choices)
        out = list(choices.values())
        if best_of > n:
            out = [c for k in range(len(texts)) for c in _best(out[k * best_of:(k + 1) * best_of], n)]
            for i, c in enumerate(out):
                c.index = i
        # usage counts every sample generated, best_of's candidates included (as OpenAI bills them)
        resp = S.CompletionResponse(**head, choices=[c.final() for c in out], usage=usage_of(stream.requests))
        return JSONResponse(resp.model_dump())
    usage = None
    if body.stream_options and body.stream_options.include_usage:
        usage = lambda: S.CompletionResponse(**head, choices=[], usage=usage_of(stream.requests))  # noqa: E731
    return sse_response(stream, choices, lambda parts: S.CompletionResponse(**head, choices=parts), usage=usage)
