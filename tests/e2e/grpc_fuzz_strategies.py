"""hypothesis strategies for every genserve request message, derived from the protobuf descriptors.

`request_strategy(descriptor)` walks the message's fields: each scalar type has a generic strategy (extremes,
NaN/inf, odd Unicode, random bytes), repeated fields are empty, short or huge, optional fields are set or not,
oneofs pick a member, nested messages recurse. A field added to a .proto is fuzzed without a change here.
`TARGETED` adds values that reach deeper for fields whose meaning the descriptor cannot tell: real, truncated and
hostile images, latents of near-valid shapes, chat roles, schedulers, JSON Schemas and regular expressions, and
cheap valid settings, so a good share of requests get past validation and run the models. Values at the limits
that cost the most (1024 tokens, 200 denoising steps) come rarely, so a run of thousands stays minutes long.
"""

from __future__ import annotations

import io
import json
import math
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st
from PIL import Image

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT32 = (0, 2**32 - 1)
UINT64 = (0, 2**64 - 1)
FLOAT32_MAX = 3.4028234663852886e38
# Huge repeated fields and strings: element counts and sizes that reach the server's message and field limits.
HUGE_COUNTS = (1_000, 100_000)
HUGE_CHARS = (10_000, 100_000, 3_000_000)
# A huge repeated field holds about this many bytes: beyond the 4 MiB a gRPC server takes by default.
HUGE_BYTES = 6 * 2**20
MAX_DEPTH = 3

ODD_TEXT = (
    "", " ", "\x00", "\x00" * 64, "\t\r\n", "\u202e" + "evil", "\u200b\u200d\ufeff", "e\u0301" * 50,
    "Z\u0351\u0300\u0316\u0317" * 20, "\U0001f469\u200d\U0001f469\u200d\U0001f467" * 10, "\U0010ffff", "\ufffd",
    "\u2028\u2029", "日本語のテキスト", "مرحبا بالعالم", "🙂" * 300, "%s%n{0}{}\\x00", "<|endoftext|>", "</s><s>",
    "{{ raise_exception('x') }}", "{% for x in range(10**9) %}x{% endfor %}", "../../etc/passwd",
)


def _uniform(n: int) -> st.SearchStrategy[int]:
    """0..n-1 uniformly. Inside large messages hypothesis repeats some choices far more often than their share (it
    copies choices between spans); structural picks go through a seeded Random so each branch gets its weight."""
    return st.randoms(use_true_random=True).map(lambda r: r.randrange(n))


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of `choices`, drawn with the given integer weights (hypothesis' one_of has no weights)."""
    total = sum(w for w, _ in choices)

    def pick(r: int) -> st.SearchStrategy:
        for w, strategy in choices:
            if r < w:
                return strategy
            r -= w
        raise AssertionError(r)

    return _uniform(total).flatmap(pick)


def chance(p: float) -> st.SearchStrategy[bool]:
    return _uniform(1000).map(lambda r: r < 1000 * p)


def integers(low: int, high: int) -> st.SearchStrategy[int]:
    """The whole range, with its ends, zero and small numbers and their negatives drawn often."""
    edges = sorted({v for v in (low, low + 1, high - 1, high, 0, 1, -1, 2, 3, 7, 8, 64, 65) if low <= v <= high})
    return weighted((2, st.sampled_from(edges)), (2, st.integers(low, high)),
                    (1, st.integers(max(low, -100), min(high, 100))))


def floats(width: int) -> st.SearchStrategy[float]:
    """Any float of the field's width, NaN and the infinities included, with its extremes and subnormals."""
    largest = FLOAT32_MAX if width == 32 else 1.7976931348623157e308
    tiny = 1.401298464324817e-45 if width == 32 else 5e-324
    edges = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, math.nan, math.inf, -math.inf, largest, -largest, tiny, -tiny]
    return weighted((3, st.sampled_from(edges)), (2, st.floats(width=width)), (1, st.floats(-4, 4, width=width)))


def texts() -> st.SearchStrategy[str]:
    """Odd Unicode (controls, bidi overrides, combining runs, astral planes, template syntax), random text, huge."""
    huge = st.builds(lambda s, n: (s or "x") * (n // max(1, len(s or "x"))), st.sampled_from(ODD_TEXT + ("ab",)),
                     st.sampled_from(HUGE_CHARS))
    return weighted((4, st.sampled_from(ODD_TEXT)), (6, st.text(max_size=64)), (1, huge))


def blobs() -> st.SearchStrategy[bytes]:
    huge = st.builds(lambda b, n: (b or b"\xff") * n, st.binary(min_size=1, max_size=4), st.sampled_from(HUGE_CHARS))
    return weighted((8, st.binary(max_size=256)), (1, huge))


SCALARS: dict[int, Callable[[], st.SearchStrategy]] = {
    FieldDescriptor.TYPE_INT32: lambda: integers(*INT32),
    FieldDescriptor.TYPE_SINT32: lambda: integers(*INT32),
    FieldDescriptor.TYPE_SFIXED32: lambda: integers(*INT32),
    FieldDescriptor.TYPE_INT64: lambda: integers(*INT64),
    FieldDescriptor.TYPE_SINT64: lambda: integers(*INT64),
    FieldDescriptor.TYPE_SFIXED64: lambda: integers(*INT64),
    FieldDescriptor.TYPE_UINT32: lambda: integers(*UINT32),
    FieldDescriptor.TYPE_FIXED32: lambda: integers(*UINT32),
    FieldDescriptor.TYPE_UINT64: lambda: integers(*UINT64),
    FieldDescriptor.TYPE_FIXED64: lambda: integers(*UINT64),
    FieldDescriptor.TYPE_FLOAT: lambda: floats(32),
    FieldDescriptor.TYPE_DOUBLE: lambda: floats(64),
    FieldDescriptor.TYPE_BOOL: st.booleans,
    FieldDescriptor.TYPE_STRING: texts,
    FieldDescriptor.TYPE_BYTES: blobs,
}


# --- targeted values --------------------------------------------------------------------------------------------


def png(width: int, height: int, mode: str = "RGB", fmt: str = "PNG", seed: int = 0) -> bytes:
    """A real image file of that size and mode, with noisy pixels."""
    noise = np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8)
    image = Image.fromarray(noise, "RGBA").convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims width x height pixels (a decompression bomb's header, CRC fixed)."""
    data = bytearray(png(1, 1))
    ihdr = 8 + 8  # signature, then length + b"IHDR"
    data[ihdr: ihdr + 8] = struct.pack(">II", width, height)
    data[ihdr + 13: ihdr + 17] = struct.pack(">I", zlib.crc32(bytes(data[ihdr - 4: ihdr + 13])))
    return bytes(data)


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 32 32\nshowpage\n"


@st.composite
def image_bytes(draw: st.DrawFn) -> bytes:
    """Valid PNGs of the served size and others, other formats and modes, truncated, bit-flipped, bombs, junk."""
    size = draw(weighted((6, st.just(32)), (1, st.sampled_from([1, 8, 31, 33, 64, 256]))))
    kind = draw(weighted((12, st.just("png")), (2, st.just("mode")), (2, st.just("format")),
                         (1, st.sampled_from(["truncated", "flipped", "bomb", "junk"]))))
    seed = draw(st.integers(0, 1000))
    if kind == "png":
        return png(size, size, seed=seed)
    if kind == "mode":
        return png(size, size, draw(st.sampled_from(["RGBA", "L", "LA", "P", "1", "I;16"])), seed=seed)
    if kind == "format":
        fmt = draw(st.sampled_from(["JPEG", "GIF", "BMP", "TIFF", "WEBP", "ICO", "PPM", "EPS"]))
        return EPS if fmt == "EPS" else png(size, size, fmt=fmt, seed=seed)
    good = png(size, size, seed=seed)
    if kind == "truncated":
        return good[: draw(st.integers(0, len(good) - 1))]
    if kind == "flipped":
        data = bytearray(good)
        for index in draw(st.lists(st.integers(0, len(data) - 1), min_size=1, max_size=8)):
            data[index] ^= draw(st.integers(1, 255))
        return bytes(data)
    if kind == "bomb":
        return png_claiming(*draw(st.sampled_from([(100_000, 100_000), (65_535, 1), (1025, 1024), (2**31 - 1, 1)])))
    return draw(st.binary(max_size=4096))


@st.composite
def tensors(draw: st.DrawFn) -> dict[str, Any]:
    """Latents: the served shape (N, 4, 8, 8) and near misses, every dtype name and some others, data of the right
    size with random values (NaN/inf included) or of a wrong size."""
    n = draw(weighted((8, st.integers(1, 4)), (1, st.sampled_from([0, 64, 65, -1]))))
    shape = draw(weighted(
        (12, st.just([n, 4, 8, 8])),
        (3, st.sampled_from([[n, 4, 16, 16], [n, 3, 8, 8], [4, 8, 8], [n, 4, 8, 8, 1]])),
        (2, st.lists(integers(*INT32), max_size=6)),
    ))
    dtype = draw(weighted((8, st.sampled_from(["float32", "", "float16", "bfloat16"])),
                          (1, st.sampled_from(["float64", "int8", "FLOAT32", "\x00"]))))
    width = {"float16": 2, "bfloat16": 2}.get(dtype, 4)
    count = math.prod(shape) if shape and all(0 < d < 2**16 for d in shape) else 0
    if draw(weighted((6, st.just(True)), (1, st.just(False)))) and 0 < count <= 64 * 4 * 16 * 16:
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        values = (rng.standard_normal(count) * draw(st.sampled_from([1.0, 1e-3, 1e3, 1e30]))).astype("<f4")
        for index in draw(st.lists(st.integers(0, count - 1), max_size=3)):  # a few hostile values among them
            values[index] = draw(st.sampled_from([math.nan, math.inf, -math.inf, FLOAT32_MAX]))
        data = values.tobytes()
        if width == 2:  # the top half of each float32: bfloat16 exactly, float16 as arbitrary bit patterns
            data = values.view("<u2")[1::2].tobytes()
    else:
        data = draw(st.binary(max_size=4096))
    return {"shape": shape, "dtype": dtype, "data": data}


JSON_SCHEMAS = (
    '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}',
    '{"type": "integer", "minimum": 0, "maximum": 9}',
    '{"type": "string", "enum": ["red", "green", "blue"]}',
    '{"type": "array", "items": {"type": "boolean"}, "maxItems": 3}',
    '{"type": "string", "pattern": "^[a-z]{1,5}$"}',
    '{"type": "string", "minLength": 1000000}',
    '{"type": "array", "minItems": 100000, "items": {"type": "integer"}}',
    '{"type": "string", "pattern": "(a|b){0,100000}"}',
    '{"$ref": "#/definitions/missing"}',
    '{"$ref": "#"}',
    '{"type": "object", "properties": {"a": {"$ref": "#"}}}',
    '{"allOf": [{"type": "string"}, {"type": "integer"}]}',
    '{"type": "object", "additionalProperties": false, "properties": {}}',
    '{"type": "number", "multipleOf": 0}',
    '{"type": ["string", "null"]}',
    '{"type": "unknown-type"}',
    '{"enum": []}',
    '{"type": "object", "patternProperties": {"^x": {"type": "integer"}}}',
    '{"type": "integer", "minimum": 1e400}', '{"type": "number", "maximum": NaN}',
    '{"type": "string", "maxLength": -1}',
    "{}", "[]", "null", "1", '"x"', "{", "{\"type\": \"object\"", "\x00",
)


def nested_schema(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth


SCHEMA_KEYS = (
    "type", "properties", "items", "prefixItems", "required", "enum", "const", "anyOf", "oneOf", "allOf", "not", "$ref",
    "$defs", "definitions", "pattern", "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
    "multipleOf", "minItems", "maxItems", "uniqueItems", "additionalProperties", "patternProperties", "if", "then",
)
SCHEMA_WORDS = ("object", "array", "string", "integer", "number", "boolean", "null", "#", "#/$defs/a",
                "#/properties/a", "date-time", "email", "uuid", "^[a-z]+$", "(a|b){0,99999}")


def json_values() -> st.SearchStrategy:
    """JSON documents built from JSON Schema's words: nested keywords, odd bounds (NaN, 1e308, 2**70), refs."""
    leaves = st.one_of(st.none(), st.booleans(), st.sampled_from(SCHEMA_WORDS), integers(-(2**70), 2**70),
                       floats(64), st.text(max_size=8))
    keys = st.one_of(st.sampled_from(SCHEMA_KEYS), st.sampled_from(SCHEMA_KEYS), st.text(max_size=6))
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
                        max_leaves=24)


def json_schemas() -> st.SearchStrategy[str]:
    """Hand-picked schemas, generated ones, and containers nested past any parser's recursion."""
    generated = st.dictionaries(st.sampled_from(SCHEMA_KEYS), json_values(), max_size=5).map(json.dumps)
    deep = st.one_of(st.integers(1, 8000).map(lambda d: "[" * d + "]" * d),
                     st.integers(1, 1000).map(lambda d: '{"anyOf": [' * d + "{}" + "]}" * d),
                     st.sampled_from([1, 8, 63, 64, 65, 200, 400]).map(nested_schema))
    return weighted((6, st.sampled_from(JSON_SCHEMAS)), (6, generated), (2, deep))


REGEXES = (
    "[a-z]{1,8}", "yes|no", r"\d{3}-\d{4}", "(ab)+", ".*", "", "(", "[", "a**", r"(a)\1", "(?=a)a", "(?<=a)b",
    "a{1000}", "a{100000}", "(a|b){0,10000}", "[^x]{500}", "(a*)*b", "((a+)+)+$", r"\p{L}+", r"\b\w+\b", "^$", "$^",
    "[\x00-\U0010ffff]+", "\\", "(?P<n>x)(?P=n)", "a{2,1}", "x" * 1024, ".{0,4294967295}", "a{4294967296}",
)
REGEX_ATOMS = ("a", "b", ".", r"\d", r"\w", r"\s", "[a-z]", "[^x]", "[\u0000-\uffff]", "\\", "(", ")", "[", "^", "$",
               "é", "\U0001f600", "\\x00", "\\n", "\\p{L}", "|", "{")
REGEX_REPEATS = ("*", "+", "?", "*?", "+?", "{0}", "{1,3}", "{1000}", "{0,65535}", "{2,1}", "{4294967295}",
                 "{4294967296}", "{,5}", "{3,}")


def regexes() -> st.SearchStrategy[str]:
    """Hand-picked patterns, random ones from a small regex grammar (repeats up to 2**32), and deep nesting."""
    generated = st.recursive(st.sampled_from(REGEX_ATOMS), lambda r: st.one_of(
        st.tuples(r, r).map("".join),
        st.tuples(r, r).map("|".join),
        r.map(lambda x: f"({x})"), r.map(lambda x: f"(?:{x})"), r.map(lambda x: f"(?={x})"),
        st.tuples(r, st.sampled_from(REGEX_REPEATS)).map("".join),
    ), max_leaves=16)
    deep = st.integers(1, 520).map(lambda d: "(" * d + "a" + ")" * d)
    return weighted((4, st.sampled_from(REGEXES)), (8, generated), (1, deep))


def adapter_names() -> st.SearchStrategy[str]:
    """LoRA adapter names: ones a server may hold, at and past the length and charset limits, and any text."""
    return weighted((4, st.sampled_from(["a", "org/name-lora", "x" * 128, "x" * 129, "-a", "a b", "é"])),
                    (2, st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,20}", fullmatch=True)), (1, texts()))


def targeted() -> dict[str, st.SearchStrategy]:
    """Field full name -> values that reach past validation or probe what the descriptor cannot tell."""
    small = st.integers
    return {
        "genserve.v1.Image.png": image_bytes(),
        "genserve.v1.ChatMessage.role": weighted((30, st.sampled_from(["system", "user", "assistant"])),
                                                 (1, st.sampled_from(["tool", "USER", ""]))),
        "genserve.v1.TokenizeRequest.text": weighted((12, st.sampled_from(["Once upon a time", "hi", "1 2 3"])),
                                                     (1, st.just("x" * 16_385))),
        "genserve.v1.TextRequest.prompt": weighted((12, st.sampled_from(["Once upon a time", "hi", "1 2 3"])),
                                                   (1, st.just("a " * 8000)), (1, st.just("x" * 16_385))),
        "genserve.v1.TextRequest.max_tokens": weighted((40, small(1, 8)), (1, st.sampled_from([1024, 1025]))),
        "genserve.v1.TextRequest.temperature": st.floats(0, 2, width=32),
        "genserve.v1.TextRequest.top_p": st.floats(0, 1, width=32),
        "genserve.v1.TextRequest.top_k": small(0, 1001),
        "genserve.v1.TextRequest.min_p": st.floats(0, 1, width=32),
        "genserve.v1.TextRequest.repetition_penalty": st.floats(0, 10, width=32),
        "genserve.v1.TextRequest.presence_penalty": st.floats(-2, 2, width=32),
        "genserve.v1.TextRequest.frequency_penalty": st.floats(-2, 2, width=32),
        "genserve.v1.TextRequest.logprobs": small(0, 6),
        "genserve.v1.TextRequest.stop": weighted(
            (8, st.lists(st.sampled_from(["\n", ".", "the", "x" * 64]), max_size=4)),
            (1, st.lists(st.sampled_from(["", "x" * 65, "."]), max_size=5)),
        ),
        "genserve.v1.TextRequest.json_schema": json_schemas(),
        "genserve.v1.TextRequest.regex": regexes(),
        "genserve.v1.TextRequest.adapter": adapter_names(),
        "genserve.v1.LoadAdapterRequest.name": adapter_names(),
        "genserve.v1.LoadAdapterRequest.path": weighted(
            (4, st.sampled_from(["a", "adapters/a", "../a", "/", "/etc", "a/../../b", "x" * 4097, "a\0b"])),
            (2, texts())),
        "genserve.v1.UnloadAdapterRequest.name": adapter_names(),
        "genserve.v1.GanSampleRequest.num_images": small(1, 4),
        "genserve.v1.GanSampleRequest.truncation": st.floats(0, 5, width=32),
        "genserve.v1.GanInterpolateRequest.steps": weighted((20, small(2, 6)), (1, st.sampled_from([64, 65]))),
        "genserve.v1.GanInterpolateRequest.truncation": st.floats(0, 5, width=32),
        "genserve.v1.DiffusionRequest.prompt": weighted((10, st.sampled_from(["a red circle", "two blue squares"])),
                                                        (1, st.sampled_from(["x" * 200, "x" * 201]))),
        "genserve.v1.DiffusionRequest.num_images": weighted((20, small(1, 2)), (1, st.sampled_from([8, 9]))),
        "genserve.v1.DiffusionRequest.steps": weighted((20, small(1, 3)), (1, st.sampled_from([200, 201]))),
        "genserve.v1.DiffusionRequest.guidance_scale": st.floats(-1, 21, width=32),
        "genserve.v1.DiffusionRequest.scheduler": st.sampled_from(["", "ddpm", "ddim", "dpmpp_2m", "euler", "DDIM",
                                                                   "lms"]),
        "genserve.v1.DiffusionRequest.eta": st.floats(-0.5, 1.5, width=32),
        "genserve.v1.DiffusionRequest.preview_every": small(0, 3),
        "genserve.v1.DiffusionRequest.width": st.sampled_from([32, 16, 24, 64, 8, 33, 1024, 4096]),
        "genserve.v1.DiffusionRequest.height": st.sampled_from([32, 16, 24, 64, 8, 33, 1024, 4096]),
    }


TARGETED_MESSAGES = {"genserve.v1.Tensor": tensors}
# How often a field is set (default 1/2): a prompt most of the time, a grammar rarely (at most one is allowed).
PRESENCE = {
    "genserve.v1.Image.png": 0.95,
    "genserve.v1.DiffusionRequest.prompt": 0.95,
    "genserve.v1.TextRequest.prompt": 0.6,
    "genserve.v1.TextRequest.messages": 0.4,
    "genserve.v1.TextRequest.json_schema": 0.1,
    "genserve.v1.TextRequest.regex": 0.1,
    "genserve.v1.TextRequest.adapter": 0.1,  # a name not loaded ends the request at NOT_FOUND, before the engine
    "genserve.v1.TokenizeRequest.text": 0.6,
    "genserve.v1.TokenizeRequest.messages": 0.4,
}
# Fields of which a valid request sets exactly one (what a proto3 `oneof` would say, had the protocol used one):
# a plausible request sets one of each group.
EXCLUSIVE = (
    ("genserve.v1.TextRequest.prompt", "genserve.v1.TextRequest.messages"),
    ("genserve.v1.TokenizeRequest.text", "genserve.v1.TokenizeRequest.messages"),
    ("genserve.v1.TextRequest.json_schema", "genserve.v1.TextRequest.regex", ""),
)


# --- the descriptor walk ----------------------------------------------------------------------------------------


def approx_size(value: Any) -> int:
    """Bytes a drawn value takes on the wire, roughly (strings, bytes and lists dominate); a string counts its UTF-8
    bytes, up to 4 a character."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, dict):
        return sum(approx_size(v) for v in value.values())
    if isinstance(value, list):
        return sum(approx_size(v) for v in value)
    return 8


def repeated(element: st.SearchStrategy) -> st.SearchStrategy[list]:
    """Empty, a few, or huge: one element repeated (no generation time), as many times as fit HUGE_BYTES."""
    huge = st.builds(lambda x, n: [x] * min(n, max(1, HUGE_BYTES // (approx_size(x) + 1))), element,
                     st.sampled_from(HUGE_COUNTS))
    return weighted((10, st.lists(element, min_size=1, max_size=6)), (6, st.just([])), (1, huge))


@dataclass(frozen=True)
class Walk:
    """How a message's fields are drawn: `targeted` values by field full name; `plausible` draws only the targeted
    values where a field has them (most of them valid), so that a share of requests reaches the models."""

    targeted: dict[str, st.SearchStrategy]
    plausible: bool

    def pick(self, special: st.SearchStrategy | None, generic: st.SearchStrategy) -> st.SearchStrategy:
        if special is None:
            return generic
        return special if self.plausible else weighted((1, special), (1, generic))

    def value(self, field: FieldDescriptor, depth: int) -> st.SearchStrategy:
        """A value for one (non-repeated) element of `field`."""
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            special = TARGETED_MESSAGES.get(field.message_type.full_name)
            return self.pick(special and special(), message_fields(field.message_type, depth + 1, self))
        if field.type == FieldDescriptor.TYPE_ENUM:
            numbers = [v.number for v in field.enum_type.values]
            return st.one_of(st.sampled_from(numbers), integers(*INT32))
        return self.pick(self.targeted.get(field.full_name), SCALARS[field.type]())

    def values(self, field: FieldDescriptor, depth: int) -> st.SearchStrategy[list]:
        element = self.value(field, depth)
        lists = st.lists(element, min_size=1, max_size=6) if self.plausible else repeated(element)
        return self.pick(self.targeted.get(field.full_name), lists)


def is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def message_fields(descriptor: Descriptor, depth: int, walk: Walk) -> st.SearchStrategy[dict]:
    """Dicts of field name -> value (nested messages as dicts; unset fields absent). Every strategy is built here,
    once, so drawing a request only draws."""
    plan: list[tuple[FieldDescriptor, float, st.SearchStrategy]] = []
    for field in descriptor.fields:
        if depth >= MAX_DEPTH and field.type == FieldDescriptor.TYPE_MESSAGE:
            continue
        if is_map(field):
            entry = field.message_type.fields_by_name
            strategy = st.dictionaries(walk.value(entry["key"], depth), walk.value(entry["value"], depth), max_size=4)
            plan.append((field, 1.0, strategy))
        elif field.is_repeated:
            plan.append((field, 1.0, walk.values(field, depth)))
        else:
            plan.append((field, 0.5, walk.value(field, depth)))
    oneofs = {o.name: st.sampled_from([None, *(f.name for f in o.fields)])
              for o in descriptor.oneofs if not o.name.startswith("_")}  # "_x": a proto3 `optional`
    groups = [(g, st.sampled_from(g)) for g in EXCLUSIVE
              if walk.plausible and g[0].startswith(descriptor.full_name + ".")]
    chances = {p: chance(p) for p in {0.0, 1.0, *PRESENCE.values(), *(default for _, default, _ in plan)}}

    @st.composite
    def draw_fields(draw: st.DrawFn) -> dict:
        presence = dict(PRESENCE)
        for group, pick_one in groups:
            chosen = draw(pick_one)
            presence |= {name: float(name == chosen) for name in group if name}
        chosen_members = {name: draw(strategy) for name, strategy in oneofs.items()}
        out: dict[str, Any] = {}
        for field, default, strategy in plan:
            oneof = field.containing_oneof
            if oneof is not None and oneof.name in oneofs and chosen_members[oneof.name] != field.name:
                continue
            if draw(chances[presence.get(field.full_name, default)]):  # else unset: absent, or the default
                out[field.name] = draw(strategy)
        return out

    return draw_fields()


def fields_strategy(descriptor: Descriptor, targeted_values: dict[str, st.SearchStrategy] | None = None
                    ) -> st.SearchStrategy[dict]:
    """Field values for a `descriptor` message: half the time anything, half the time plausible (see Walk)."""
    values = targeted() if targeted_values is None else targeted_values
    return st.one_of(message_fields(descriptor, 0, Walk(values, plausible=True)),
                     message_fields(descriptor, 0, Walk(values, plausible=False)))


def build(message_class: type[Message], values: dict[str, Any]) -> Message:
    """The message with these field values (nested dicts become messages); values protobuf refuses to hold (a
    float beyond float32, say) are left out, as a client could not send them either."""
    message = message_class()
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        target = getattr(message, name)
        try:
            if is_map(field):
                _fill_map(target, field, value)
            elif field.type == FieldDescriptor.TYPE_MESSAGE and field.is_repeated:
                element = GetMessageClass(field.message_type)
                for item in value:
                    target.add().CopyFrom(build(element, item))
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                target.CopyFrom(build(GetMessageClass(field.message_type), value))
            elif field.is_repeated:
                target.extend(value)
            else:
                setattr(message, name, value)
        except (ValueError, TypeError, OverflowError):
            message.ClearField(name)
    return message


def _fill_map(target: Any, field: FieldDescriptor, values: dict) -> None:
    value_field = field.message_type.fields_by_name["value"]
    for key, value in values.items():
        if value_field.type == FieldDescriptor.TYPE_MESSAGE:
            target[key].CopyFrom(build(GetMessageClass(value_field.message_type), value))
        else:
            target[key] = value


def request_strategy(message_class: type[Message]) -> st.SearchStrategy[Message]:
    """Requests of `message_class`, every field fuzzed (see the module docstring)."""
    return fields_strategy(message_class.DESCRIPTOR).map(lambda values: build(message_class, values))


def field_names(descriptor: Descriptor, prefix: str = "", depth: int = 0) -> Sequence[str]:
    """Every field path of a message (`images.png`), nested messages down to MAX_DEPTH: what a run must cover."""
    names: list[str] = []
    for field in descriptor.fields:
        path = f"{prefix}{field.name}"
        names.append(path)
        if field.type == FieldDescriptor.TYPE_MESSAGE and not is_map(field) and depth + 1 < MAX_DEPTH:
            names += field_names(field.message_type, path + ".", depth + 1)
    return names
