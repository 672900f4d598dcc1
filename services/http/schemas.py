"""The OpenAI request bodies as the HTTP API accepts them (and as its OpenAPI schema publishes them).

These models check only the wire types: strict, so `"temperature": "0.5"` is a 400 as it is at OpenAI, and
unknown keys are ignored as OpenAI ignores them. The value limits are the gRPC handlers' own (TextIn and DiffusionIn
in services/text/app.py and services/diffusion/app.py): the ingress maps a body onto those and validates there, so
there is one set of limits. Only what gRPC has no counterpart for is limited here: `n` and the body size.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from genserve.services.diffusion.schema import GUIDANCE_MODES, SCHEDULERS, DiffusionIn
from genserve.services.text.schema import TextIn

# Choices per request: completions multiply it by the number of prompts.
MAX_CHOICES = 8
# Larger bodies get 413 before they are parsed (a full 64-message conversation is far below).
MAX_BODY_BYTES = 1 << 20


# The JSON Schema keywords of pydantic's numeric constraints.
BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}


def bounds(schema: type[BaseModel], field: str, **extra: Any) -> Any:
    """A Field whose published schema carries the bounds of `schema`'s `field` (TextIn or DiffusionIn): the limits
    are documented where they are enforced, and not enforced twice."""
    published = {key: getattr(m, attr) for m in schema.model_fields[field].metadata
                 for attr, key in BOUNDS.items() if getattr(m, attr, None) is not None}
    return Field(None, json_schema_extra={**published, **extra})


def served(model: str) -> Any:
    """The `model` field: any string is read (a loaded LoRA adapter's name too; others get 404), the schema names
    the base model."""
    return Field(json_schema_extra={"enum": [model]})


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchemaFormat(Body):
    name: str = "output"
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ChatToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    # "developer" is OpenAI's newer name for the system role.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # null on an assistant turn that only calls tools
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object; absent: no arguments
    strict: bool | None = None  # calls always follow the schema here (a grammar), strict or not


class ChatTool(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class TemplateKwargs(Body):
    """Chat-template switches (vLLM's `chat_template_kwargs`, sent with the SDK's extra_body)."""

    enable_thinking: bool | None = None


class Sampling(Body):
    """The fields completions and chat share."""

    model: str = served("text")
    max_tokens: int | None = bounds(TextIn, "max_tokens")
    temperature: float | None = bounds(TextIn, "temperature")
    top_p: float | None = bounds(TextIn, "top_p")
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stop: str | list[str] | None = None
    seed: int | None = bounds(TextIn, "seed")
    presence_penalty: float | None = bounds(TextIn, "presence_penalty")
    frequency_penalty: float | None = bounds(TextIn, "frequency_penalty")
    speculative: bool | None = None  # genserve's extra (extra_body): false, never drafted for
    user: str | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionBody(Sampling):
    prompt: str | list[str]
    # The number of alternatives to return with each token (OpenAI's legacy completions).
    logprobs: int | None = bounds(TextIn, "logprobs")


class ChatBody(Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = bounds(TextIn, "max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = bounds(TextIn, "logprobs")
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    chat_template_kwargs: TemplateKwargs | None = None


class ImageBody(Body):
    prompt: str
    model: str | None = Field(None, json_schema_extra={"enum": ["diffusion"]})
    n: int | None = bounds(DiffusionIn, "num_images")
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    seed: int | None = bounds(DiffusionIn, "seed")
    user: str | None = None
    # genserve's extras (the OpenAI SDK sends them with `extra_body`).
    negative_prompt: str | None = None
    steps: int | None = bounds(DiffusionIn, "steps")
    guidance_scale: float | None = bounds(DiffusionIn, "guidance_scale")
    scheduler: str | None = Field(None, json_schema_extra={"enum": list(SCHEDULERS)})
    guidance: str | None = Field(None, json_schema_extra={"enum": list(GUIDANCE_MODES)})
    negative_weight: float | None = bounds(DiffusionIn, "negative_weight")


# ---- the Responses API (POST /v1/responses) ----------------------------------------------------------------------
class InputPart(Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputItem(Body):
    """One item of `input`: a message (`type` "message" or absent), a function call the model made earlier, or a
    call's output. Reasoning items sent back are accepted and not shown to the model again."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class FunctionTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class LoadLoraBody(Body):
    """vLLM's POST /v1/load_lora_adapter: a PEFT adapter folder under the text app's lora.root, as `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadLoraBody(Body):
    """vLLM's POST /v1/unload_lora_adapter."""

    lora_name: str


class ReasoningConfig(Body):
    effort: Literal["low", "medium", "high"] | None = None


class ResponsesBody(Body):
    model: str = served("text")
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = bounds(TextIn, "max_tokens")
    temperature: float | None = bounds(TextIn, "temperature")
    top_p: float | None = bounds(TextIn, "top_p")
    seed: int | None = bounds(TextIn, "seed")  # genserve's extra (extra_body)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
