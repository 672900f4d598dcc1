"""Request builders shared by the sync and async clients: only the options a caller gives are set, so unset
proto3 `optional` fields keep the server's documented defaults."""

from __future__ import annotations

import array
import json
import struct
from collections.abc import Iterable, Sequence
from typing import Any

from genserve.v1 import common_pb2, diffusion_pb2, gan_pb2, text_pb2, vae_pb2


def _set(message, **fields) -> None:
    for name, value in fields.items():
        if value is not None:
            setattr(message, name, value)


def text_request(
    prompt: str = "",
    *,
    messages: Sequence[dict[str, str]] = (),
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Iterable[str] = (),
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logprobs: int | None = None,
    json_schema: str | None = None,
    regex: str | None = None,
    tools: Sequence[dict[str, Any]] = (),
    tool_choice: str | None = None,
    parallel_tool_calls: bool | None = None,
    enable_thinking: bool | None = None,
    reasoning_effort: str | None = None,
    adapter: str | None = None,
    model: str | None = None,
) -> text_pb2.TextRequest:
    """`tools`: OpenAI's function tools ({"type": "function", "function": {...}}) or their `function` objects;
    `tool_choice`: "auto", "none", "required" or a tool's name. Messages may carry `tool_calls` ({id, name,
    arguments}) and `tool_call_id`. `adapter`: a loaded LoRA adapter's name (None: the base model). `model`: one of
    the text app's further base models (ModelInfo.models; None: its first)."""
    request = text_pb2.TextRequest(
        prompt=prompt, messages=[text_pb2.ChatMessage(**m) for m in messages], stop=list(stop),
        tools=[tool_message(t) for t in tools],
    )
    if tool_choice in ("auto", "none", "required"):
        request.tool_choice = tool_choice
    elif tool_choice:
        request.tool_choice, request.tool_name = "function", tool_choice
    _set(
        request, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, logprobs=logprobs, json_schema=json_schema, regex=regex,
        parallel_tool_calls=parallel_tool_calls, enable_thinking=enable_thinking, reasoning_effort=reasoning_effort,
        adapter=adapter, model=model,
    )
    return request


def tool_message(tool: dict[str, Any]) -> text_pb2.Tool:
    """An OpenAI function tool (or its `function` object) as a genserve.v1.Tool; its schema travels as JSON text."""
    function = tool.get("function", tool)
    parameters = function.get("parameters")
    return text_pb2.Tool(name=function.get("name", ""), description=function.get("description") or "",
                         parameters=json.dumps(parameters) if parameters is not None else "")


def tokenize_request(text: str = "", *, messages: Sequence[dict[str, str]] = (),
                     model: str | None = None) -> text_pb2.TokenizeRequest:
    request = text_pb2.TokenizeRequest(text=text, messages=[text_pb2.ChatMessage(**m) for m in messages])
    _set(request, model=model)
    return request


def model_info_request(model: str | None = None) -> text_pb2.ModelInfoRequest:
    request = text_pb2.ModelInfoRequest()
    _set(request, model=model)
    return request


def gan_sample_request(
    num_images: int | None = None, *, seed: int | None = None, truncation: float | None = None
) -> gan_pb2.GanSampleRequest:
    request = gan_pb2.GanSampleRequest()
    _set(request, num_images=num_images, seed=seed, truncation=truncation)
    return request


def gan_interpolate_request(
    seed_start: int, seed_end: int, *, steps: int | None = None, truncation: float | None = None
) -> gan_pb2.GanInterpolateRequest:
    request = gan_pb2.GanInterpolateRequest(seed_start=seed_start, seed_end=seed_end)
    _set(request, steps=steps, truncation=truncation)
    return request


def png_images(pngs: Iterable[bytes]) -> list[common_pb2.Image]:
    return [common_pb2.Image(png=png) for png in pngs]


def encode_request(pngs: Iterable[bytes], *, sample: bool = False, seed: int | None = None) -> vae_pb2.EncodeRequest:
    request = vae_pb2.EncodeRequest(images=png_images(pngs), sample=sample)
    _set(request, seed=seed)
    return request


def float32_tensor(shape: Sequence[int], values: Iterable[float]) -> common_pb2.Tensor:
    """A Tensor message from numbers in row-major order, as little-endian float32 bytes (no numpy or torch)."""
    return common_pb2.Tensor(shape=list(shape), dtype="float32", data=array.array("f", values).tobytes())


def tensor_values(tensor: common_pb2.Tensor) -> list[float]:
    """The numbers a Tensor message holds, in row-major order (float32, float16 or bfloat16 bytes)."""
    dtype = tensor.dtype or "float32"
    if dtype == "float32":
        return array.array("f", tensor.data).tolist()
    if dtype == "float16":
        return [v for (v,) in struct.iter_unpack("<e", tensor.data)]
    if dtype == "bfloat16":  # the top half of a float32
        return [v for (v,) in struct.iter_unpack("<f", b"".join(b"\0\0" + tensor.data[i : i + 2]
                                                                for i in range(0, len(tensor.data), 2)))]
    raise ValueError(f"unknown tensor dtype {dtype!r}")


def decode_request(shape: Sequence[int], values: Iterable[float]) -> vae_pb2.DecodeRequest:
    return vae_pb2.DecodeRequest(latents=float32_tensor(shape, values))


def reconstruct_request(pngs: Iterable[bytes]) -> vae_pb2.ReconstructRequest:
    return vae_pb2.ReconstructRequest(images=png_images(pngs))


def diffusion_request(
    prompt: str,
    *,
    negative_prompt: str = "",
    num_images: int | None = None,
    steps: int | None = None,
    guidance_scale: float | None = None,
    seed: int | None = None,
    scheduler: str = "",
    eta: float | None = None,
    preview_every: int = 0,
    width: int | None = None,
    height: int | None = None,
    guidance: str = "",
    negative_weight: float | None = None,
) -> diffusion_pb2.DiffusionRequest:
    request = diffusion_pb2.DiffusionRequest(
        prompt=prompt, negative_prompt=negative_prompt, scheduler=scheduler, preview_every=preview_every,
        guidance=guidance,
    )
    _set(request, num_images=num_images, steps=steps, guidance_scale=guidance_scale, seed=seed, eta=eta, width=width,
         height=height, negative_weight=negative_weight)
    return request
