from genserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DiffusionRequest(_message.Message):
    __slots__ = ("prompt", "negative_prompt", "num_images", "steps", "guidance_scale", "seed", "scheduler", "eta", "preview_every", "width", "height", "guidance", "negative_weight", "init_image", "strength", "mask", "cache_threshold", "lora", "lora_scale")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_IMAGES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    ETA_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_EVERY_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    INIT_IMAGE_FIELD_NUMBER: _ClassVar[int]
    STRENGTH_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    CACHE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    LORA_SCALE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    negative_prompt: str
    num_images: int
    steps: int
    guidance_scale: float
    seed: int
    scheduler: str
    eta: float
    preview_every: int
    width: int
    height: int
    guidance: str
    negative_weight: float
    init_image: bytes
    strength: float
    mask: bytes
    cache_threshold: float
    lora: str
    lora_scale: float
    def __init__(self, prompt: _Optional[str] = ..., negative_prompt: _Optional[str] = ..., num_images: _Optional[int] = ..., steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., scheduler: _Optional[str] = ..., eta: _Optional[float] = ..., preview_every: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., guidance: _Optional[str] = ..., negative_weight: _Optional[float] = ..., init_image: _Optional[bytes] = ..., strength: _Optional[float] = ..., mask: _Optional[bytes] = ..., cache_threshold: _Optional[float] = ..., lora: _Optional[str] = ..., lora_scale: _Optional[float] = ...) -> None: ...

class DiffusionProgress(_message.Message):
    __slots__ = ("step", "total_steps", "elapsed_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    total_steps: int
    elapsed_s: float
    def __init__(self, step: _Optional[int] = ..., total_steps: _Optional[int] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class DiffusionPreview(_message.Message):
    __slots__ = ("step", "images")
    STEP_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    step: int
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.Image]
    def __init__(self, step: _Optional[int] = ..., images: _Optional[_Iterable[_Union[_common_pb2.Image, _Mapping]]] = ...) -> None: ...

class DiffusionEvent(_message.Message):
    __slots__ = ("progress", "preview", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: DiffusionProgress
    preview: DiffusionPreview
    result: _common_pb2.ImagesResponse
    def __init__(self, progress: _Optional[_Union[DiffusionProgress, _Mapping]] = ..., preview: _Optional[_Union[DiffusionPreview, _Mapping]] = ..., result: _Optional[_Union[_common_pb2.ImagesResponse, _Mapping]] = ...) -> None: ...
