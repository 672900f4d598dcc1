"""The browser playground's side of the HTTP app: the page itself, and the genserve calls a browser cannot make over
gRPC, as JSON and server-sent events.

    GET  /                          the playground (services/http/playground/index.html)
    GET  /playground/{file}         its ES modules and CSS, shipped in the package; nothing comes from elsewhere
    GET  /api/settings              each service's request defaults and limits (what the page's controls start from)
    GET  /api/models                what each service serves and its health, with live figures: requests running and
                                    waiting, the text engine's KV blocks
    POST /api/images/stream         text-to-image as events: `progress` per step, `preview` PNGs every
                                    `preview_every` steps, then `result` (the diffusion app's GenerateStream)
    POST /api/gan/samples           GAN samples (Sample): `n`, `seed`, `truncation`
    POST /api/gan/walk              a spherical walk between two seeds (Interpolate): `seed_start`, `seed_end`, `steps`
    POST /api/vae/reconstruct       the VAE round trip of one PNG (`image`, base64)

The page and its files are open; every /api route admits its caller like /v1 does (key, peer rule, rate limits).
The bodies reach the services as the same protobuf requests a gRPC client sends, so the limits are the services' own
and an error names the field as the body spells it. None of these routes is in /openapi.json: they are the page's,
not part of the OpenAI-compatible API.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import json
import logging
import re
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from genserve.services.common.errors import InvalidArgument
from genserve.services.common.gate import Ticket
from genserve.services.common.health import ServeStatusCache
from genserve.services.diffusion.schema import GUIDANCE_MODES, MAX_STEPS, SCHEDULERS, DiffusionIn
from genserve.services.http import images
from genserve.services.http.errors import ModelNotFound, describe
from genserve.services.http.schemas import Body, ImageBody
from genserve.services.text.schema import DEFAULT_MAX_TOKENS, TextIn
from genserve.shared.seeds import MAX_SEED
from genserve.v1 import common_pb2, gan_pb2, text_pb2, vae_pb2

logger = logging.getLogger("ray.serve")
ASSETS = Path(__file__).parent / "playground"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# The page may run code from its own origin only: no inline script, nothing from another host.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
SERVICES = ("text", "gan", "vae", "diffusion")
# Ray's Prometheus series the models panel shows live (summed over replicas).
ONGOING, QUEUED = "ray_genserve_ongoing_requests", "ray_serve_deployment_queued_queries"
METRICS_TIMEOUT_S = 2.0

router = APIRouter()


# ---- the page ---------------------------------------------------------------------------------------------------
@functools.cache
def asset_names() -> frozenset[str]:
    """The files the page may load: what the package ships next to index.html."""
    return frozenset(p.name for p in ASSETS.iterdir() if p.suffix in CONTENT_TYPES)


def _file(name: str) -> Response:
    if name not in asset_names():
        raise HTTPException(404, f"no playground file {name!r}")
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
    if name.endswith(".html"):
        headers["Content-Security-Policy"] = CSP
    return FileResponse(ASSETS / name, media_type=CONTENT_TYPES[Path(name).suffix], headers=headers)


@router.get("/", include_in_schema=False)
async def index() -> Response:
    return _file("index.html")


@router.get("/playground/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    return _file(name)


# ---- bodies -----------------------------------------------------------------------------------------------------
Seed = Annotated[int | None, Field(ge=0, le=MAX_SEED)]  # int64 on the wire; the services check the rest


class ImageStreamBody(ImageBody):
    """/v1/images/generations' body, with a preview every `preview_every` steps (0: none)."""

    preview_every: int = Field(0, ge=0, le=MAX_STEPS)
    seed: Seed = None


class GanSamplesBody(Body):
    n: int = 1
    seed: Seed = None
    truncation: float | None = None


class GanWalkBody(Body):
    seed_start: int = Field(0, ge=0, le=MAX_SEED)
    seed_end: int = Field(0, ge=0, le=MAX_SEED)
    steps: int | None = None
    truncation: float | None = None


class VaeBody(Body):
    image: str  # a PNG, base64 (a data: URL's prefix is allowed)


GAN_FIELDS = {"num_images": "n"}
VAE_FIELDS = {"images": "image", "png": "image"}


# ---- what the routes do -----------------------------------------------------------------------------------------
def _defaults(schema: type[BaseModel], names: tuple[str, ...]) -> dict[str, Any]:
    """Each field's default and bounds, as the service validates them."""
    out = {}
    for name in names:
        field = schema.model_fields[name]
        limits = {attr: getattr(m, attr) for m in field.metadata for attr in ("ge", "gt", "le", "lt")
                  if getattr(m, attr, None) is not None}
        out[name] = {"default": field.get_default(call_default_factory=True), **limits}
    return out


def settings() -> dict[str, Any]:
    text = _defaults(TextIn, ("temperature", "top_p", "max_tokens", "seed"))
    text["max_tokens"]["default"] = DEFAULT_MAX_TOKENS  # what an unset max_tokens gets (less near the context's end)
    diffusion = _defaults(DiffusionIn, ("steps", "guidance_scale", "seed", "num_images"))
    return {"text": text, "diffusion": {**diffusion, "schedulers": list(SCHEDULERS), "guidance": list(GUIDANCE_MODES)}}


def images_json(reply: common_pb2.ImagesResponse) -> dict[str, Any]:
    return {"seed": reply.seed, "images": [{"b64_json": base64.b64encode(i.png).decode(), "width": i.width,
                                            "height": i.height} for i in reply.images]}


def decode_png(data: str) -> bytes:
    """The bytes of a base64 PNG (optionally a data: URL), or InvalidArgument naming `image`."""
    payload = re.sub(r"^data:[\w/+.-]*;base64,", "", data.strip())
    try:
        png = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument("image", "is not base64") from None
    if not png.startswith(b"\x89PNG\r\n\x1a\n"):
        raise InvalidArgument("image", "is not a PNG (convert it first; the page sends PNGs)")
    return png


def parse_metrics(text: str, services: tuple[str, ...] = SERVICES) -> dict[str, dict[str, float]]:
    """{app: {"running", "waiting"}} from Ray's Prometheus text: genserve's in-flight gauge and Serve's queue."""
    live = {app: {"running": 0.0, "waiting": 0.0} for app in services}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name not in (ONGOING, QUEUED) or "}" not in rest:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', rest.rsplit("}", 1)[0]))
        app = labels.get("service") if name == ONGOING else labels.get("application")
        if app in live:
            live[app]["running" if name == ONGOING else "waiting"] += float(rest.rsplit(" ", 1)[1])
    return live


def _metrics_text() -> str:
    """The Prometheus text of this node's Ray metrics agent ('' when there is none)."""
    import ray

    ports = [n.get("MetricsExportPort") for n in ray.nodes() if n.get("Alive")]
    for port in filter(None, ports):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=METRICS_TIMEOUT_S) as r:
                return r.read().decode()
        except OSError:
            continue
    return ""


def _text_info(info: text_pb2.ModelInfo) -> dict[str, Any]:
    fields = ("model_name", "model_path", "quantization", "architecture", "n_params", "max_context", "dtype",
              "runner", "device", "kv_blocks_total", "kv_blocks_free", "block_size", "max_running",
              "prefix_caching")
    return {name: getattr(info, name) for name in fields}


class Playground:
    """The /api routes' work, on the HTTP app's deployment handles (`handle(app)`)."""

    def __init__(self, handle: Callable[[str], Any]):
        self.handle = handle
        self.status = ServeStatusCache()
        self._image_size: tuple[int, int] | None = None

    async def image_size(self) -> tuple[int, int]:
        if self._image_size is None:
            self._image_size = tuple(await self.handle("diffusion").image_size.remote())
        return self._image_size

    async def models(self) -> dict[str, Any]:
        running, metrics = await asyncio.gather(asyncio.to_thread(self.status.running),
                                                asyncio.to_thread(_metrics_text))
        live = parse_metrics(metrics)
        out = {}
        for app in SERVICES:
            entry: dict[str, Any] = {"deployed": app in running,
                                     "health": "SERVING" if running.get(app) else "NOT_SERVING",
                                     "live": live[app] if metrics else None}
            if running.get(app):
                entry.update(await self._facts(app))
            out[app] = entry
        return {"services": out}

    async def _facts(self, app: str) -> dict[str, Any]:
        if app == "text":
            return _text_info(await self.handle("text").GetModelInfo.remote(text_pb2.ModelInfoRequest()))
        if app == "diffusion":
            return {"image_size": images.size_name(await self.image_size())}
        if app == "vae":
            return {"downsample_factor": await self.handle("vae").downsample_factor.remote()}
        return {}

    async def gan_samples(self, body: GanSamplesBody, ticket: Ticket) -> Response:
        fields = {"num_images": body.n, "seed": body.seed, "truncation": body.truncation}
        request = gan_pb2.GanSampleRequest(**{k: v for k, v in fields.items() if v is not None})
        return await self._unary("gan", "Sample", request, ticket)

    async def gan_walk(self, body: GanWalkBody, ticket: Ticket) -> Response:
        fields = body.model_dump(exclude_none=True)
        return await self._unary("gan", "Interpolate", gan_pb2.GanInterpolateRequest(**fields), ticket)

    async def vae_reconstruct(self, body: VaeBody, ticket: Ticket) -> Response:
        request = vae_pb2.ReconstructRequest(images=[common_pb2.Image(png=decode_png(body.image))])
        return await self._unary("vae", "Reconstruct", request, ticket)

    async def _unary(self, app: str, method: str, request: Any, ticket: Ticket) -> Response:
        response = getattr(self.handle(app), method).remote(request)
        try:
            reply = await response
        except BaseException:
            response.cancel()
            raise
        ticket.charge(reply)
        return JSONResponse(images_json(reply))

    async def image_stream(self, body: ImageStreamBody, ticket: Ticket, request_id: Callable[[], str]) -> Response:
        if body.model not in (None, "diffusion"):
            raise ModelNotFound(body.model, "/api/images/stream")
        request = images.diffusion_request(body, await self.image_size())
        request.preview_every = body.preview_every
        stream = self.handle("diffusion").options(stream=True).GenerateStream.remote(request)
        try:  # the first event before the headers: an invalid request gets its own status
            first = await anext(stream)
        except BaseException:
            stream.cancel()
            raise

        async def events() -> AsyncIterator[bytes]:
            try:
                yield _event(first, ticket)
                async for event in stream:
                    yield _event(event, ticket)
            except Exception as exc:  # after the headers: the error goes in the stream, as in /v1
                rid = request_id()
                status, error = describe(exc, rid, images.FIELDS, {})
                if status >= 500:
                    logger.exception("playground image stream failed (request id %s)", rid)
                yield _sse(error)
            finally:
                stream.cancel()  # a browser that went away (Stop) stops the denoising

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _event(event: Any, ticket: Ticket) -> bytes:
    if event.HasField("progress"):
        p = event.progress
        return _sse({"type": "progress", "step": p.step, "total_steps": p.total_steps, "elapsed_s": p.elapsed_s})
    if event.HasField("preview"):
        previews = images_json(common_pb2.ImagesResponse(images=event.preview.images))["images"]
        return _sse({"type": "preview", "step": event.preview.step, "images": previews})
    ticket.charge(event.result)
    return _sse({"type": "result", **images_json(event.result)})
