"""OpenAI image generations <-> genserve.v1.DiffusionRequest and ImagesResponse.

The body is validated against the gRPC handler's DiffusionIn (one set of limits); `n` is its `num_images`.
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
