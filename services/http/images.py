"""OpenAI image generations and edits <-> genserve.v1.DiffusionRequest and ImagesResponse.

The body is validated against the gRPC handler's DiffusionIn (one set of limits); `n` is its `num_images`. An edit
(`POST /v1/images/edits`) is multipart, as OpenAI's: `image` (PNG or JPEG; the SDK's list form `image[]` with one
file too), optional `mask`, `prompt`, `n`, `size` ("WxH"; unset: the image's), `response_format`, and genserve's
extras as form fields (`strength`, `seed`, `steps`, `guidance_scale`, `negative_prompt`, `scheduler`).
"""

from __future__ import annotations

import base64
import time
from typing import Any

from genserve.services.common.errors import InvalidArgument
from genserve.services.diffusion.schema import DiffusionIn
from genserve.services.http.schemas import ImageBody
from genserve.v1 import common_pb2, diffusion_pb2

# DiffusionIn's field names as the body spells them.
FIELDS = {"num_images": "n"}
EDIT_FIELDS = {"num_images": "n", "init_image": "image"}
# Edit form fields -> (DiffusionIn field, type)
_EDIT_FORM = {"prompt": ("prompt", str), "n": ("num_images", int), "seed": ("seed", int), "steps": ("steps", int),
              "guidance_scale": ("guidance_scale", float), "strength": ("strength", float),
              "negative_prompt": ("negative_prompt", str), "scheduler": ("scheduler", str)}


def size_name(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


def diffusion_request(body: ImageBody, native: tuple[int, int]) -> diffusion_pb2.DiffusionRequest:
    """The request for `body`; `native` is the model's (width, height), the one size it makes."""
    if body.response_format != "b64_json":
        raise InvalidArgument("response_format", "only 'b64_json' is served (genserve keeps no image store)")
    if body.size is not None and body.size != size_name(native):
        raise InvalidArgument("size", f"this model makes {size_name(native)} images; allowed sizes: "
                                      f"{size_name(native)}")
    fields = {"prompt": body.prompt, "num_images": body.n, "seed": body.seed, "steps": body.steps,
              "negative_prompt": body.negative_prompt, "guidance_scale": body.guidance_scale,
              "scheduler": body.scheduler, "guidance": body.guidance, "negative_weight": body.negative_weight}
    fields = {k: v for k, v in fields.items() if v is not None}
    DiffusionIn.model_validate(fields)
    return diffusion_pb2.DiffusionRequest(**fields)


def images_reply(images: common_pb2.ImagesResponse) -> dict[str, Any]:
    return {"created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(image.png).decode()} for image in images.images]}


async def _file_bytes(form: Any, names: tuple[str, ...], field: str) -> bytes:
    files = [item for name in names for item in form.getlist(name)]
    if len(files) > 1:
        raise InvalidArgument(field, f"one {field} only, got {len(files)}")
    if not files:
        return b""
    item = files[0]
    if isinstance(item, str):
        raise InvalidArgument(field, "must be a file (multipart/form-data)")
    return await item.read()


def _size(text: str) -> tuple[int, int]:
    """"WxH" -> (width, height)."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise InvalidArgument("size", f"must be WIDTHxHEIGHT in pixels, got {text!r}") from None
    return width, height


async def edit_request(form: Any) -> diffusion_pb2.DiffusionRequest:
    """The DiffusionRequest for a multipart edit form (starlette's FormData)."""
    if form.get("response_format", "b64_json") != "b64_json":
        raise InvalidArgument("response_format", "only 'b64_json' is served (genserve keeps no image store)")
    model = form.get("model")
    if model not in (None, "", "diffusion"):
        raise InvalidArgument("model", f"unknown model {model!r}; this server edits images with 'diffusion'")
    fields: dict[str, Any] = {"init_image": await _file_bytes(form, ("image", "image[]"), "image"),
                              "mask": await _file_bytes(form, ("mask",), "mask")}
    if not fields["init_image"]:
        raise InvalidArgument("image", "is required (a PNG or JPEG file)")
    for name, (target, kind) in _EDIT_FORM.items():
        value = form.get(name)
        if value is None or value == "":
            continue
        try:
            fields[target] = kind(value)
        except ValueError:
            raise InvalidArgument(name, f"must be {kind.__name__}, got {value!r}") from None
    if form.get("size"):
        fields["width"], fields["height"] = _size(form["size"])
    DiffusionIn.model_validate(fields)
    return diffusion_pb2.DiffusionRequest(**fields)
