"""``concept serve``: an OpenAI-compatible HTTP server for one model (FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``, plain or
streamed (``"stream": true``: server-sent events, ``data: {chunk}`` lines ending with ``data: [DONE]``,
as OpenAI's API sends them), so the official ``openai`` client works against it::

    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="m1", prompt="def fib(n):", max_tokens=32, temperature=0)

Requests are served **one at a time**, in arrival order, every one decoded in the same thread (the
model's KV caches and modules are not shared between concurrent decodes, and a compiled model's CUDA
graphs, which belong to the thread that records them, are recorded once), so concurrent requests are
safe and simply wait for their turn. ``temperature: 0`` is greedy decoding (OpenAI's default is 1, which
samples); ``seed`` makes sampling repeatable. Not supported, answered with a 400: ``n > 1``,
``best_of > 1``, ``logprobs``, ``echo``, ``suffix``, presence / frequency penalties, token-id prompts.

Every error is a JSON body in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``:
404 for an unknown model, 400 for bad parameters, malformed JSON or a prompt past the context, 500
for a failure inside the model (the server stays up in every case).
"""
from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from . import chat
from .errors import ConceptError
from .generation import TextStream, generate
from .tokens import tokenizer_for

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code}})


# -- requests --------------------------------------------------------------------------------------
class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[str]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None


def _unsupported(request: _Request) -> None:
    checks = [("n", request.n != 1, "only n=1 is supported (one choice per request)"),
              ("presence_penalty", request.presence_penalty != 0, "presence_penalty is not supported (use 0)"),
              ("frequency_penalty", request.frequency_penalty != 0, "frequency_penalty is not supported (use 0)"),
              ("logprobs", bool(getattr(request, "logprobs", None)), "logprobs are not supported"),
              ("echo", bool(getattr(request, "echo", False)), "echo is not supported"),
              ("best_of", (getattr(request, "best_of", None) or 1) != 1, "only best_of=1 is supported"),
              ("suffix", getattr(request, "suffix", None) is not None, "suffix is not supported")]
    for param, bad, message in checks:
        if bad:
            raise APIError(400, message, param=param)


# -- the model ---------------------------------------------------------------------------------------
@dataclass
class Reply:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class _Cancelled(Exception):
    """The client went away while its reply was streamed."""


class Engine:
    """One model and one decoding thread: :meth:`run` generates for one request at a time, in arrival order, every
    request in the same thread. torch's CUDA-graph trees (a compiled model's decoding steps, ``concept serve
    --compile``) belong to the thread that records them: decoded in one thread, they are recorded once and replayed
    for every request (in a thread per request, each request would record them again)."""

    def __init__(self, model, name: str, default_max_tokens: int = 16):
        self.model, self.name, self.default_max_tokens = model, name, default_max_tokens
        self.tokenizer = tokenizer_for(model)
        self.limit = getattr(model.backbone.config, "max_position_embeddings", None)
        self.decoding = ThreadPoolExecutor(max_workers=1, thread_name_prefix="concept-decode")  # (first in, first out)
        self.created = int(time.time())

    def settings(self, request: _Request, max_tokens: int | None, stops: tuple[str, ...]) -> dict:
        stop = request.stop if isinstance(request.stop, list) else [request.stop] if request.stop else []
        if any(not s for s in stop):
            raise APIError(400, "stop: an empty stop string would stop at once", param="stop")
        settings = {"max_new_tokens": max_tokens or self.default_max_tokens, "stop_strings": tuple(stop) + stops,
                    "do_sample": request.temperature > 0, "seed": request.seed}
        if request.temperature > 0:
            settings.update(temperature=request.temperature, top_p=request.top_p)
        return settings

    def prompt_ids(self, text: str) -> list[int]:
        """A completion prompt's ids, special tokens as the tokenizer adds them (as ``concept generate``)."""
        ids = list(self.tokenizer(text)["input_ids"])
        if not ids:
            raise APIError(400, "the prompt is empty; give at least one character of text", param="prompt")
        self.check_length(len(ids), "prompt")
        return ids

    def check_length(self, n: int, param: str) -> None:
        if self.limit is not None and n >= self.limit:
            raise APIError(400, f"this model's context is {self.limit} tokens, but the {param} has {n}; shorten it",
                           param=param if param == "prompt" else "messages", code="context_length_exceeded")

    def run(self, ids: list[int], settings: dict, write=None, cancelled: threading.Event | None = None) -> Reply:
        """Generate for one prompt in the decoding thread (after the requests before it); ``write(text)`` receives the
        reply as it grows."""
        streamer = None
        if write is not None:
            stream = TextStream(self.tokenizer, settings["stop_strings"], write=write)

            class Streamer:  # TextStream, stopping the decode when the client is gone
                def put(self, token_ids):
                    if cancelled is not None and cancelled.is_set():
                        raise _Cancelled()
                    stream.put(token_ids)

                def end(self):
                    stream.end()

            streamer = Streamer()
        try:
            out = self.decoding.submit(generate, self.model, [ids], tokenizer=self.tokenizer, streamer=streamer,
                                       **settings).result()
        except ConceptError as exc:
            raise APIError(400, str(exc)) from None
        if write is not None:
            stream.finish(out.texts[0])
        return Reply(out.texts[0], FINISH[out.finish_reasons[0]], len(ids), len(out.tokens[0]))


# -- responses ---------------------------------------------------------------------------------------
def _usage(reply: Reply) -> dict:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def _sse(payload: Any) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _stream(engine: Engine, ids: list[int], settings: dict, chunk, first=None, include_usage: bool = False):
    """Server-sent events: ``first`` (a chunk), a chunk per piece of text, the last one with the finish
    reason, the usage when asked, then ``[DONE]``. A thread of its own waits for the decode (the engine's decoding
    thread) and hands the text on; a client that goes away stops the decode at its next token."""
    pieces: queue.Queue = queue.Queue()
    cancelled = threading.Event()
    done = object()

    def work():
        try:
            pieces.put(("reply", engine.run(ids, settings, write=lambda text: pieces.put(("text", text)),
                                            cancelled=cancelled)))
        except _Cancelled:
            pass
        except APIError as exc:
            pieces.put(("error", exc))
        except Exception as exc:  # a failure inside the model: reported in the stream, the server goes on
            pieces.put(("error", APIError(500, f"generation failed: {type(exc).__name__}: {exc}", kind="server_error")))
        finally:
            pieces.put((done, None))

    def events():
        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        try:
            if first is not None:
                yield _sse(first)
            while True:
                what, value = pieces.get()
                if what is done:
                    break
                if what == "text":
                    yield _sse(chunk(text=value))
                elif what == "error":
                    yield _sse({"error": {"message": value.message, "type": value.kind, "param": value.param,
                                          "code": value.code}})
                elif what == "reply":
                    yield _sse(chunk(finish_reason=value.finish_reason))
                    if include_usage:
                        yield _sse(chunk(usage=_usage(value)))
            yield _sse("[DONE]")
        finally:
            cancelled.set()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(model, name: str, default_max_tokens: int = 16) -> FastAPI:
    """The server's app for ``model``, served as ``name``."""
    engine = Engine(model, name, default_max_tokens)
    app = FastAPI(title=f"concept: {name}", description="OpenAI-compatible completions from a concept model")
    app.state.engine = engine
    _add_error_handlers(app)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": engine.created,
                                            "owned_by": "concept"}]}

    @app.post("/v1/completions")
    def completions(request: CompletionRequest):
        return _completion(engine, request)

    @app.post("/v1/chat/completions")
    def chat_completions(request: ChatRequest):
        return _chat_completion(engine, request)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style error body: the API's own, a request that does not validate, any other."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return APIError(400, "the request body is not valid JSON", code="invalid_json").response()
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid request')}"
        return APIError(400, message, param=".".join(where) or None).response()

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):
        return APIError(500, f"{type(exc).__name__}: {exc}", kind="server_error").response()


def _check_model(engine: Engine, requested: str) -> None:
    if requested != engine.name:
        raise APIError(404, f"The model '{requested}' does not exist; this server serves '{engine.name}' "
                            f"(GET /v1/models)", param="model", code="model_not_found")


def _completion(engine: Engine, request: CompletionRequest):
    """``POST /v1/completions``: one prompt, the reply (or its stream)."""
    _check_model(engine, request.model)
    _unsupported(request)
    prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
    if len(prompts) != 1:
        raise APIError(400, "give one prompt per request (a string, or a list of one)", param="prompt")
    settings = engine.settings(request, request.max_tokens, ())
    ids = engine.prompt_ids(prompts[0])
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(text="", finish_reason=None, usage=None):
        return {"id": rid, "object": "text_completion", "created": created, "model": engine.name,
                "choices": [] if usage else [{"text": text, "index": 0, "logprobs": None,
                                              "finish_reason": finish_reason}],
                **({"usage": usage} if usage else {})}

    if request.stream:
        return _stream(engine, ids, settings, chunk, include_usage=bool((request.stream_options or {}).get("include_usage")))
    reply = engine.run(ids, settings)
    return {**chunk(reply.text, reply.finish_reason), "usage": _usage(reply)}


def _chat_completion(engine: Engine, request: ChatRequest):
    """``POST /v1/chat/completions``: the messages in the backbone's chat template, the reply (or its stream)."""
    _check_model(engine, request.model)
    _unsupported(request)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in request.messages]
    problems = chat.check(messages)
    if problems:
        raise APIError(400, "; ".join(problems), param="messages")
    settings = engine.settings(request, request.max_completion_tokens or request.max_tokens,
                               chat.stop_strings(engine.tokenizer))
    ids = chat.encode(engine.tokenizer, chat.prompt(engine.tokenizer, messages))
    engine.check_length(len(ids), "messages")
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(text=None, finish_reason=None, usage=None, role=None):
        delta = {**({"role": role} if role else {}), **({"content": text} if text is not None else {})}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": engine.name,
                "choices": [] if usage else [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish_reason}],
                **({"usage": usage} if usage else {})}

    if request.stream:
        return _stream(engine, ids, settings, chunk, first=chunk(text="", role="assistant"),
                       include_usage=bool((request.stream_options or {}).get("include_usage")))
    reply = engine.run(ids, settings)
    return {"id": rid, "object": "chat.completion", "created": created, "model": engine.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.text}, "logprobs": None,
                         "finish_reason": reply.finish_reason}], "usage": _usage(reply)}
