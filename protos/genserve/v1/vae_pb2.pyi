from genserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("images", "sample", "seed")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.Image]
    sample: bool
    seed: int
    def __init__(self, images: _Optional[_Iterable[_Union[_common_pb2.Image, _Mapping]]] = ..., sample: _Optional[bool] = ..., seed: _Optional[int] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("latents", "mean", "logvar", "scaling_factor")
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    LOGVAR_FIELD_NUMBER: _ClassVar[int]
    SCALING_FACTOR_FIELD_NUMBER: _ClassVar[int]
    latents: _common_pb2.Tensor
    mean: _common_pb2.Tensor
    logvar: _common_pb2.Tensor
    scaling_factor: float
    def __init__(self, latents: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., mean: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., logvar: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., scaling_factor: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("latents",)
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    latents: _common_pb2.Tensor
    def __init__(self, latents: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ReconstructRequest(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.Image]
    def __init__(self, images: _Optional[_Iterable[_Union[_common_pb2.Image, _Mapping]]] = ...) -> None: ...
