"""The OpenAI-compatible HTTP app: completions, chat completions, models, health, metrics."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ..errors import InvalidArgument
from .body_limit import BodyLimit
from .chat import chat_prompt_ids
from .limits import RETRY_AFTER_S, Admission, QueueFull, ServeLimits
from .metrics import ServeMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, error_body
from .responses import ResponseShape, sse

#: threads that parse request bodies, tokenize prompts and render chats: work that grows with the body, which
#: would stall every other request (and /health) if it ran on the event loop
PREP_THREADS = min(4, os.cpu_count() or 1)
#: the status a request whose client went away is logged with (nginx's "client closed request")
STATUS_CLIENT_CLOSED_REQUEST = 499


class ModelNotFound(Exception):
    pass


def build_app(engine, served_model_name: str, limits: ServeLimits | None = None) -> FastAPI:
    """The app over a started ``kvpool.engine.Engine``; the engine's tokenizer renders chats and text.

    Args:
        engine: the engine (its background thread running).
        served_model_name: the name clients pass as ``model``.
        limits: the request body size and queue length limits (default: ``ServeLimits()``).
    """
    limits = limits or ServeLimits()
    prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="kvpool-serve-prep")

    @asynccontextmanager
    async def lifespan(_):
        yield
        prep.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvpool serve", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    admission = Admission(engine, limits.max_waiting_requests)
    metrics = ServeMetrics(engine, admission.waiting)
    app.state.engine, app.state.metrics = engine, metrics
    install_error_handlers(app)

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise ModelNotFound(f"the model {name!r} does not exist; this server serves {served_model_name!r}")

    def max_tokens(body, prompt_len: int) -> int:
        room = engine.max_model_len - prompt_len
        asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
        return min(asked, room) if asked else room

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(prep, fn, *args)

    async def parse(request: Request, model):
        """The body as ``model``: JSON and fields checked in one pass (pydantic's parser limits nesting)."""
        body = await off_loop(model.model_validate_json, await request.body())
        body.check_supported()
        check_model(body.model)
        return body

    async def run(request: Request, model, prompt_ids, shape: ResponseShape):
        """Parse, tokenize (``prompt_ids(body)``, off the loop) and queue the request; then answer it."""
        with admission.admit():
            body = await parse(request, model)
            ids = await off_loop(prompt_ids, body)
            params = body.params(max(1, max_tokens(body, len(ids))))
            started = time.monotonic()

            def observe(out):  # on the engine thread, so that aborted requests are counted too
                if out.finished:
                    metrics.observe(out, time.monotonic() - started)

            stream = engine.add_request_async(ids, params, callback=observe)
        if body.stream:
            return StreamingResponse(events(stream, shape, body.include_usage), media_type="text/event-stream")
        try:
            out = await result_unless_gone(request, stream)
        finally:
            if stream.last is None or not stream.last.finished:  # the client went away or the handler was cancelled
                engine.abort(stream.request_id)
        if out is None:
            return Response(status_code=STATUS_CLIENT_CLOSED_REQUEST)
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

    def prompt_of(body: CompletionRequest) -> list[int]:
        prompt = body.prompt_one()
        if isinstance(prompt, str) and engine.tokenizer is None:
            raise InvalidArgument("this model has no tokenizer: send token ids as the prompt")
        return engine.prompt_ids(prompt)

    def chat_of(body: ChatCompletionRequest) -> list[int]:
        if engine.tokenizer is None:
            raise InvalidArgument("chat needs a tokenizer; this model directory has none")
        return engine.prompt_ids(chat_prompt_ids(engine.tokenizer, [m.model_dump() for m in body.messages]))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, CompletionRequest, prompt_of, ResponseShape(False, served_model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, ChatCompletionRequest, chat_of, ResponseShape(True, served_model_name))

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


async def result_unless_gone(request: Request, stream):
    """The request's final output, or None when its client disconnects first."""
    result = asyncio.ensure_future(stream.aresult())
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (result, gone):
            task.cancel()
    return result.result() if result.done() and not result.cancelled() else None


async def disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body was read already, so nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def install_error_handlers(app: FastAPI) -> None:
    """Every error answers with OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``."""

    @app.exception_handler(ValidationError)
    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ())]
        param = ".".join(loc[1:] if loc[:1] == ["body"] else loc) or None
        return JSONResponse(error_body(f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param),
                            status_code=400)

    @app.exception_handler(InvalidArgument)
    async def _bad(_, exc: InvalidArgument):
        return JSONResponse(error_body(exc.message), status_code=400)

    @app.exception_handler(ModelNotFound)
    async def _no_model(_, exc: ModelNotFound):
        return JSONResponse(error_body(str(exc), param="model", code="model_not_found"), status_code=404)

    @app.exception_handler(QueueFull)
    async def _busy(_, exc: QueueFull):
        return JSONResponse(error_body(str(exc), code="queue_full"), status_code=429,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(HTTPException)
    async def _http(_, exc: HTTPException):  # unknown paths, wrong methods
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _crash(_, exc: Exception):  # the traceback is logged by the server
        return JSONResponse(error_body("internal server error", type_="server_error"), status_code=500)
