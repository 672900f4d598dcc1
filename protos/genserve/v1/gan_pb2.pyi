from genserve.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GanSampleRequest(_message.Message):
    __slots__ = ("num_images", "seed", "truncation")
    NUM_IMAGES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_FIELD_NUMBER: _ClassVar[int]
    num_images: int
    seed: int
    truncation: float
    def __init__(self, num_images: _Optional[int] = ..., seed: _Optional[int] = ..., truncation: _Optional[float] = ...) -> None: ...

class GanInterpolateRequest(_message.Message):
    __slots__ = ("seed_start", "seed_end", "steps", "truncation")
    SEED_START_FIELD_NUMBER: _ClassVar[int]
    SEED_END_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_FIELD_NUMBER: _ClassVar[int]
    seed_start: int
    seed_end: int
    steps: int
    truncation: float
    def __init__(self, seed_start: _Optional[int] = ..., seed_end: _Optional[int] = ..., steps: _Optional[int] = ..., truncation: _Optional[float] = ...) -> None: ...
