"""The OpenAI-compatible HTTP app: completions, chat completions, models, health, metrics."""

from __future__ import annotations

import time
from dataclasses import asdict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import InvalidArgument
from .chat import chat_prompt_ids
from .metrics import ServeMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, error_body
from .responses import ResponseShape, sse


class ModelNotFound(Exception):
    pass


def build_app(engine, served_model_name: str) -> FastAPI:
    """The app over a started ``kvpool.engine.Engine``; the engine's tokenizer renders chats and text.

    Args:
        engine: the engine (its background thread running).
        served_model_name: the name clients pass as ``model``.
    """
    app = FastAPI(title="kvpool serve")
    metrics = ServeMetrics(engine)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param),
                            status_code=400)

    @app.exception_handler(InvalidArgument)
    async def _bad(_, exc: InvalidArgument):
        return JSONResponse(error_body(exc.message), status_code=400)

    @app.exception_handler(ModelNotFound)
    async def _no_model(_, exc: ModelNotFound):
        return JSONResponse(error_body(str(exc), param="model", code="model_not_found"), status_code=404)

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise ModelNotFound(f"the model {name!r} does not exist; this server serves {served_model_name!r}")

    def max_tokens(body, prompt_len: int) -> int:
        room = engine.max_model_len - prompt_len
        asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
        return min(asked, room) if asked else room

    async def run(request: Request, body, prompt, shape: ResponseShape):
        body.check_supported()
        check_model(body.model)
        if isinstance(prompt, str) and engine.tokenizer is None:
            raise InvalidArgument("this model has no tokenizer: send token ids as the prompt")
        ids = engine.prompt_ids(prompt)
        params = body.params(max(1, max_tokens(body, len(ids))))
        started = time.monotonic()

        def observe(out):  # on the engine thread, so that aborted streams are counted too
            if out.finished:
                metrics.observe(out, time.monotonic() - started)

        stream = engine.add_request_async(ids, params, callback=observe)
        if body.stream:
            return StreamingResponse(events(stream, shape, body.include_usage), media_type="text/event-stream")
        try:
            out = await stream.aresult()
        finally:
            if stream.last is None or not stream.last.finished:  # the handler was cancelled
                engine.abort(stream.request_id)
        if out.finish_reason == "error":
            return JSONResponse(error_body(out.error or "generation failed", type_="server_error"), status_code=500)
        return shape.full(out)

    async def events(stream, shape: ResponseShape, include_usage: bool):
        first = True
        try:
            async for out in stream:
                if out.finish_reason == "error":
                    yield sse(error_body(out.error or "generation failed", type_="server_error"))
                    break
                if out.new_token_ids or out.finished or first:  # one event per token, text or not
                    yield shape.chunk(out.new_text, out.finish_reason, first=first)
                    first = False
                if out.finished and include_usage:
                    yield shape.usage_chunk(out)
            yield sse("[DONE]")
        finally:
            if stream.last is None or not stream.last.finished:  # the client went away: free its sequence now
                engine.abort(stream.request_id)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await run(request, body, body.prompt_one(), ResponseShape(False, served_model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        if engine.tokenizer is None:
            raise InvalidArgument("chat needs a tokenizer; this model directory has none")
        ids = chat_prompt_ids(engine.tokenizer, [m.model_dump() for m in body.messages])
        return await run(request, body, ids, ResponseShape(True, served_model_name))

    @app.get("/v1/models")
    async def models():
        card = {"id": served_model_name, "object": "model", "created": 0, "owned_by": "kvpool",
                "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        expired = engine.client.session_expired.is_set()
        if expired or not engine.running:
            why = "the daemon dropped this session" if expired else "the engine thread is not running"
            return JSONResponse({"status": "unhealthy", "reason": why}, status_code=503)
        return {"status": "ok"}

    @app.get("/engine/stats")
    async def engine_stats():
        """Not OpenAI: the engine's counters and where its steps' time went (``StepTimings`` sums)."""
        return {"stats": asdict(engine.stats()), "step_timings": engine.timings.summary()}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
