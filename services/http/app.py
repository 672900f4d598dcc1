"""The `http` application: an OpenAI-compatible HTTP API on Ray Serve's HTTP proxy, as a FastAPI ingress.

    GET  /v1/models                 the served generative models: `text`, the text app's further base models, its
                                    loaded LoRA adapters, `diffusion`
    POST /v1/completions            text completions, unary or streamed (server-sent events ending in [DONE])
    POST /v1/chat/completions       chat (the text service applies the model's chat template), unary or streamed
    POST /v1/load_lora_adapter      vLLM's admin routes: load a LoRA adapter of the text model ({lora_name,
    POST /v1/unload_lora_adapter    lora_path}) or unload one ({lora_name}); an admin key when keys are set
    POST /v1/images/generations     text-to-image, PNGs as b64_json
    POST /v1/images/edits           image-to-image and inpainting (multipart: image, mask, prompt, ...), b64_json
    GET  /openapi.json              the schema of all of these (what schemathesis fuzzes)

Every route first admits its caller (services/common/gate.py): the `authorization: Bearer <key>` header (what the
openai SDK sends for api_key=), the peer rule without keys, and the rate limits of this app's `rate_limits` arg;
401 and 429 (with Retry-After) are OpenAI error objects like the rest. /openapi.json stays open. A text body's
`model` is `text` (the text app's first model), one of its further base models (serve config `models`, sent as
TextRequest.model), or a LoRA adapter's name, sent as TextRequest.adapter and as Ray Serve's multiplexed model id, so
that Serve prefers a replica that already holds the adapter.

It loads no model: it reaches the `text` and `diffusion` applications through deployment handles with the same
protobuf requests a gRPC client sends, so validation and limits are theirs, and the latents still go through `vae`.
A client that disconnects cancels its handle calls: the text engine aborts the request (its KV blocks are freed)
and the diffusion loop stops at its next step. Errors are OpenAI error objects (services/http/errors.py).
"""

# No `from __future__ import annotations` here: FastAPI reads the routes' parameter types at runtime (through
# serve.ingress), and string annotations would turn the bodies into query parameters.
import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.deployment import Application
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from genserve.services.common import drain
from genserve.services.common.builder import handle_to
from genserve.services.common.errors import InvalidArgument, PermissionDenied, RateLimited, Unauthenticated, field_path
from genserve.services.common.gate import Gate, Ticket
from genserve.services.common.rate_limit import RateLimits
from genserve.services.common.ray_adapter import serve_request_id
from genserve.services.diffusion.schema import KNOWN_ERRORS as IMAGE_ERRORS
from genserve.services.http import images, playground_api, responses, text
from genserve.services.http.errors import ModelNotFound, describe, error_body, error_response, refusal, to_error
from genserve.services.http.schemas import (
    MAX_BODY_BYTES,
    ChatBody,
    CompletionBody,
    ImageBody,
    LoadLoraBody,
    ResponsesBody,
    UnloadLoraBody,
)
from genserve.services.http.streams import batches, merge
from genserve.services.text.schema import ADAPTER_NAME, IMAGE_MODEL_ID
from genserve.services.text.schema import KNOWN_ERRORS as TEXT_ERRORS
from genserve.v1 import text_pb2

logger = logging.getLogger("ray.serve")
TEXT_MODEL, IMAGE_MODEL = text.BASE_MODEL, IMAGE_MODEL_ID
# How long a read of the text app's further base models (ModelInfo.models) answers for a `model` it lacks, before
# it is read again (the list changes only when the text app is deployed again).
TEXT_MODELS_TTL_S = 5.0
# The admin routes' names for LoadAdapterRequest's fields.
LORA_FIELDS = {"name": "lora_name", "path": "lora_path"}
UNION_TAGS = {"str", "int", "float", "bool", "list", "dict"}


class HttpArgs(BaseModel):
    """The http app's serve-config `args`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rate_limits: RateLimits = RateLimits()  # per caller and replica; tokens and images are both counted here
    # /v1/responses keeps responses for previous_response_id in this replica's memory: at most this many, this long.
    responses_max_count: int = Field(1000, ge=0)
    responses_ttl_s: float = Field(3600.0, gt=0)


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorObject


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": what}
    for status, what in ((400, "a field is wrong (`param` names it)"), (404, "unknown model"),
                         (401, "no or a wrong API key"), (403, "an admin route without an admin key"),
                         (413, "body too large"),
                         (429, "overloaded or rate-limited; see Retry-After"), (500, "internal error"),
                         (503, "the server is draining (shutting down)"))
}


class BodyLimit:
    """413 for a body over MAX_BODY_BYTES, before anything parses it (chunked bodies are counted as they come)."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        chunks, size = [], int(declared) if declared.isdigit() else 0
        if size <= self.limit:
            size = 0
            while True:
                message = await receive()
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if message["type"] != "http.request" or not message.get("more_body") or size > self.limit:
                    break
        if size > self.limit:
            too_large = error_response(413, f"the body is over {self.limit} bytes", code="request_too_large")
            return await too_large(scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # later reads wait for the client's disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class DrainGate:
    """503 for every new request while the stack drains (services/common/drain.py); responses already streaming run
    on, their calls counted by the replicas behind them."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and drain.watch().current().draining:
            return await error_response(503, drain.DRAINING_MESSAGE, code="draining")(scope, receive, send)
        await self.app(scope, receive, send)


api = FastAPI(title="genserve OpenAI-compatible API", version="1",
              description="Completions, chat and image generation on the genserve stack (docs/protocol.md).",
              docs_url=None, redoc_url=None)
api.add_middleware(BodyLimit)
api.add_middleware(DrainGate)
api.include_router(playground_api.router)  # the browser playground at /


def _request_id() -> str:
    return serve_request_id() or uuid.uuid4().hex


def _field_loc(loc: tuple) -> tuple:
    """pydantic's error location without the tags it adds for union members (`prompt.str`, `list[str]`)."""
    return tuple(part for part in loc if isinstance(part, int)
                 or (part.isidentifier() and part.islower() and part not in UNION_TAGS))


@api.exception_handler(RequestValidationError)
async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first.get('msg', '')}", code="json_invalid")
    path = field_path(_field_loc(loc[1:])) if loc[:1] == ("body",) and len(loc) > 1 else None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return error_response(400, f"{path}: {message}" if path else message, path, code=first.get("type"))


@api.exception_handler(Unauthenticated)
@api.exception_handler(PermissionDenied)
@api.exception_handler(RateLimited)
async def _refused(request: Request, exc: Unauthenticated | PermissionDenied | RateLimited) -> JSONResponse:
    return refusal(exc)


@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = "unknown_url" if exc.status_code == 404 else None
    return JSONResponse(error_body(exc.status_code, str(exc.detail), code=code), status_code=exc.status_code)


def _model_entry(model_id: str, created: int, root: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "genserve", "root": root}


def _check_text_model(model: str, endpoint: str) -> None:
    """The base model, or a name an adapter may have (whether it is loaded, the text app says: 404 naming it)."""
    if model == IMAGE_MODEL or (model != TEXT_MODEL and not ADAPTER_NAME.fullmatch(model)):
        raise ModelNotFound(model, endpoint)


@serve.deployment(name="OpenAIApi")
@serve.ingress(api)
class OpenAIApi:
    def __init__(self, settings: HttpArgs | None = None) -> None:
        settings = settings or HttpArgs()
        self.gate = Gate.from_env(settings.rate_limits)
        self.responses = responses.ResponseStore(settings.responses_max_count, settings.responses_ttl_s)
        self.created = int(time.time())
        self._handles: dict[str, Any] = {}
        self._text_models: frozenset[str] = frozenset()
        self._text_models_read = -TEXT_MODELS_TTL_S
        self._image_size: tuple[int, int] | None = None
        self.playground = playground_api.Playground(self._handle)

    def _handle(self, app: str) -> Any:
        if app not in self._handles:
            self._handles[app] = handle_to(app)
        return self._handles[app]

    async def _target(self, model: str) -> dict[str, str]:
        """A text body's `model` as TextRequest fields: the first model, a further base model, or an adapter."""
        if model != TEXT_MODEL and model not in self._text_models and \
                time.monotonic() - self._text_models_read > TEXT_MODELS_TTL_S:
            info = await self._handle("text").GetModelInfo.remote(text_pb2.ModelInfoRequest())
            self._text_models, self._text_models_read = frozenset(info.models), time.monotonic()
        return text.model_fields(model, self._text_models)

    def _text_handle(self, target: Mapping[str, str]) -> Any:
        """The text app's handle for a body's `target`: an adapter's name is also the multiplexed model id, so that
        Serve routes the call to a replica that holds the adapter where one does."""
        handle = self._handle("text")
        return handle.options(multiplexed_model_id=target["adapter"]) if "adapter" in target else handle

    def _admit(self, request: Request, *, admin: bool = False) -> Ticket:
        """The caller's ticket; Unauthenticated / PermissionDenied (`admin`: an admin route without an admin key) /
        RateLimited become 401 / 403 / 429 through `_refused`."""
        return self.gate.admit(request.headers.get("authorization"), request.client.host if request.client else None,
                               admin=admin)

    async def _respond(self, work: Awaitable[Response], fields: Mapping[str, str], known: Mapping) -> Response:
        """`work`'s response, or the OpenAI error for what it raised."""
        request_id = _request_id()
        try:
            return await work
        except Exception as exc:
            response = to_error(exc, request_id, fields, known)
            if response.status_code >= 500:
                logger.exception("HTTP request failed (request id %s)", request_id)
            return response

    @api.get("/v1/models", responses=ERRORS)
    async def models(self, request: Request) -> dict[str, Any]:
        self._admit(request)
        text_app = self._handle("text")
        info = await text_app.GetModelInfo.remote(text_pb2.ModelInfoRequest())
        further = await asyncio.gather(*(text_app.GetModelInfo.remote(text_pb2.ModelInfoRequest(model=name))
                                         for name in info.models))
        # tool_format: how a text model takes tools (its template's family, or "generic"); reasoning: it thinks.
        bases = [_model_entry(model_id, self.created, i.model_name) | {"tool_format": i.tool_format,
                                                                       "reasoning": i.reasoning}
                 for model_id, i in zip([TEXT_MODEL, *info.models], [info, *further], strict=True)]
        # As vLLM lists them: each adapter with the base model as its parent.
        adapters = [_model_entry(name, self.created, name) | {"parent": TEXT_MODEL} for name in info.adapters]
        return {"object": "list",
                "data": [*bases, *adapters, _model_entry(IMAGE_MODEL, self.created, IMAGE_MODEL)]}

    @api.post("/v1/load_lora_adapter", responses=ERRORS)
    async def load_lora_adapter(self, body: LoadLoraBody, request: Request) -> Response:
        self._admit(request, admin=True)
        return await self._respond(self._load_lora(body), LORA_FIELDS, TEXT_ERRORS)

    @api.post("/v1/unload_lora_adapter", responses=ERRORS)
    async def unload_lora_adapter(self, body: UnloadLoraBody, request: Request) -> Response:
        self._admit(request, admin=True)
        return await self._respond(self._unload_lora(body), LORA_FIELDS, TEXT_ERRORS)

    async def _load_lora(self, body: LoadLoraBody) -> Response:
        if body.lora_name in (TEXT_MODEL, IMAGE_MODEL):
            raise InvalidArgument("name", f"{body.lora_name!r} is a base model's id")
        await self._handle("text").LoadAdapter.remote(text_pb2.LoadAdapterRequest(name=body.lora_name,
                                                                                  path=body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")  # vLLM's words

    async def _unload_lora(self, body: UnloadLoraBody) -> Response:
        await self._handle("text").UnloadAdapter.remote(text_pb2.UnloadAdapterRequest(name=body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @api.post("/v1/completions", responses=ERRORS)
    async def completions(self, body: CompletionBody, request: Request) -> Response:
        ticket = self._admit(request)
        return await self._respond(self._text(body, ticket, chat=False), text.body_fields(body), TEXT_ERRORS)

    @api.post("/v1/chat/completions", responses=ERRORS)
    async def chat_completions(self, body: ChatBody, request: Request) -> Response:
        ticket = self._admit(request)
        return await self._respond(self._text(body, ticket, chat=True), text.body_fields(body), TEXT_ERRORS)

    @api.post("/v1/images/generations", responses=ERRORS)
    async def images_generations(self, body: ImageBody, request: Request) -> Response:
        ticket = self._admit(request)
        return await self._respond(self._images(body, ticket), images.FIELDS, IMAGE_ERRORS)

    @api.post("/v1/images/edits", responses=ERRORS)
    async def images_edits(self, request: Request) -> Response:
        """Image-to-image and inpainting (multipart, OpenAI's shape: services/http/images.py)."""
        ticket = self._admit(request)
        return await self._respond(self._image_edits(request, ticket), images.EDIT_FIELDS, IMAGE_ERRORS)

    async def _image_edits(self, request: Request, ticket: Ticket) -> Response:
        edit = await images.edit_request(await request.form())
        response = self._handle("diffusion").Generate.remote(edit)
        try:
            reply = await response
        except BaseException:
            response.cancel()
            raise
        ticket.charge(reply)
        return JSONResponse(images.images_reply(reply))

    # ---- text ---------------------------------------------------------------------------------------------
    async def _text(self, body: ChatBody | CompletionBody, ticket: Ticket, chat: bool) -> Response:
        _check_text_model(body.model, "/v1/chat/completions" if chat else "/v1/completions")
        target = await self._target(body.model)
        job = text.chat_job(body, target) if chat else text.completion_job(body, target)
        if body.stream:
            return await self._text_stream(body, job, target, ticket, chat)
        return await self._text_unary(body, job, target, ticket, chat)

    async def _token_texts(self, job: text.TextJob, logprobs: list) -> dict[int, str]:
        if job.top_logprobs is None:
            return {}
        return await self._handle("text").token_texts.remote(sorted(text.logprob_ids(logprobs)),
                                                             job.requests[0].model)

    async def _text_unary(self, body: ChatBody | CompletionBody, job: text.TextJob, target: Mapping[str, str],
                          ticket: Ticket, chat: bool) -> Response:
        responses = [self._text_handle(target).Generate.remote(r) for r in job.requests]
        try:
            replies = [await r for r in responses]
        except BaseException:
            for r in responses:
                r.cancel()
            raise
        for r in replies:
            ticket.charge(r)
        texts = await self._token_texts(job, [lp for r in replies for lp in r.logprobs])
        reply = text.chat_reply if chat else text.completion_reply
        return JSONResponse(reply(body.model, job, replies, texts))

    async def _text_stream(self, body: ChatBody | CompletionBody, job: text.TextJob, target: Mapping[str, str],
                           ticket: Ticket, chat: bool) -> Response:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        writer = text.ChunkWriter(chat, body.model, job, include_usage)
        handle = self._text_handle(target).options(stream=True)
        streams = [handle.GenerateStream.remote(r) for r in job.requests]
        chunks = merge(streams)

        def stop() -> None:
            for s in streams:
                s.cancel()

        try:  # the first chunk before the headers: an error up to here gets its own status
            first = await anext(chunks)
        except BaseException:
            stop()
            await chunks.aclose()
            raise

        async def write(items: list[tuple[int, text_pb2.TextChunk]]) -> bytes:
            events = []
            for index, chunk in items:
                ticket.charge(chunk)
                events.append(text.sse(writer.chunk(index, chunk, await self._token_texts(job, list(chunk.logprobs)))))
            return b"".join(events)

        async def events() -> AsyncIterator[bytes]:
            # Chunks that arrived together leave as one body message: each message is one item on Ray's stream to
            # the HTTP proxy, and under many streams those items, not the tokens, are what the proxy pays for.
            try:
                yield b"".join(map(text.sse, writer.roles())) + await write([first])
                async with contextlib.aclosing(batches(chunks)) as arrivals:  # its reader stops before aclose below
                    async for items in arrivals:
                        yield await write(items)
                if include_usage:
                    yield text.sse(writer.usage_chunk())
                yield text.sse("[DONE]")
            except Exception as exc:  # after the headers: the error goes in the stream, as OpenAI does
                request_id = _request_id()
                status, error = describe(exc, request_id, text.body_fields(body), TEXT_ERRORS)
                if status >= 500:
                    logger.exception("HTTP stream failed (request id %s)", request_id)
                yield text.sse(error)
            finally:
                stop()
                await chunks.aclose()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ---- responses ----------------------------------------------------------------------------------------
    @api.post("/v1/responses", responses=ERRORS)
    async def responses_create(self, body: ResponsesBody, request: Request) -> Response:
        ticket = self._admit(request)
        return await self._respond(self._responses(body, ticket), responses.FIELDS, responses.KNOWN)

    @api.get("/v1/responses/{response_id}", responses=ERRORS)
    async def responses_get(self, response_id: str, request: Request) -> Response:
        self._admit(request)

        async def stored() -> Response:
            return JSONResponse(self.responses.get(response_id).response)

        return await self._respond(stored(), {"previous_response_id": "response_id"}, responses.KNOWN)

    async def _responses(self, body: ResponsesBody, ticket: Ticket) -> Response:
        _check_text_model(body.model, "/v1/responses")
        target = await self._target(body.model)
        turn = responses.prepare(body, self.responses, target)
        if not body.stream:
            call = self._text_handle(target).Generate.remote(turn.request)
            try:
                reply = await call
            except BaseException:
                call.cancel()
                raise
            ticket.charge(reply)
            return JSONResponse(responses.reply_object(turn, reply, self.responses))
        stream = self._text_handle(target).options(stream=True).GenerateStream.remote(turn.request)
        events = responses.events(turn, stream, self.responses, ticket.charge)
        try:  # the first events wait for the first chunk: an error up to there gets its own status
            first = [await anext(events) for _ in range(3)]
        except BaseException:
            stream.cancel()
            await events.aclose()
            raise

        async def body_bytes() -> AsyncIterator[bytes]:
            try:
                yield b"".join(map(responses.sse, first))
                async for event in events:
                    yield responses.sse(event)
            except Exception as exc:  # after the headers: the error goes in the stream, as an `error` event
                status, error = describe(exc, _request_id(), responses.FIELDS, responses.KNOWN)
                if status >= 500:
                    logger.exception("HTTP responses stream failed")
                body = error["error"]
                yield responses.sse({"type": "error", "sequence_number": 0, "code": body["code"],
                                     "message": body["message"], "param": body["param"]})
            finally:
                stream.cancel()
                await events.aclose()

        return StreamingResponse(body_bytes(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ---- images -------------------------------------------------------------------------------------------
    async def _images(self, body: ImageBody, ticket: Ticket) -> Response:
        if body.model not in (None, IMAGE_MODEL):
            raise ModelNotFound(body.model, "/v1/images/generations")
        if self._image_size is None:
            self._image_size = tuple(await self._handle("diffusion").image_size.remote())
        request = images.diffusion_request(body, self._image_size)
        response = self._handle("diffusion").Generate.remote(request)
        try:
            reply = await response
        except BaseException:
            response.cancel()
            raise
        ticket.charge(reply)
        return JSONResponse(images.images_reply(reply))

    # ---- the browser playground's calls (services/http/playground_api.py) -----------------------------------------
    @api.get("/api/settings", include_in_schema=False)
    async def playground_settings(self, request: Request) -> dict[str, Any]:
        self._admit(request)
        return playground_api.settings()

    @api.get("/api/models", include_in_schema=False)
    async def playground_models(self, request: Request) -> dict[str, Any]:
        self._admit(request)
        return await self.playground.models()

    @api.post("/api/images/stream", include_in_schema=False)
    async def playground_images(self, body: playground_api.ImageStreamBody, request: Request) -> Response:
        ticket = self._admit(request)
        work = self.playground.image_stream(body, ticket, _request_id)
        return await self._respond(work, images.FIELDS, IMAGE_ERRORS)

    @api.post("/api/gan/samples", include_in_schema=False)
    async def playground_gan(self, body: playground_api.GanSamplesBody, request: Request) -> Response:
        ticket = self._admit(request)
        return await self._respond(self.playground.gan_samples(body, ticket), playground_api.GAN_FIELDS, {})

    @api.post("/api/gan/walk", include_in_schema=False)
    async def playground_gan_walk(self, body: playground_api.GanWalkBody, request: Request) -> Response:
        ticket = self._admit(request)
        return await self._respond(self.playground.gan_walk(body, ticket), {}, {})

    @api.post("/api/vae/reconstruct", include_in_schema=False)
    async def playground_vae(self, body: playground_api.VaeBody, request: Request) -> Response:
        ticket = self._admit(request)
        return await self._respond(self.playground.vae_reconstruct(body, ticket), playground_api.VAE_FIELDS, {})


def build(args: dict[str, Any] | None = None) -> Application:
    return OpenAIApi.bind(HttpArgs.model_validate(args or {}))
