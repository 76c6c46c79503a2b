from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Task(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_UNSPECIFIED: _ClassVar[Task]
    TASK_GENERATE: _ClassVar[Task]
    TASK_EMBED: _ClassVar[Task]
    TASK_RERANK: _ClassVar[Task]
    TASK_CLASSIFY: _ClassVar[Task]
    TASK_SCORE: _ClassVar[Task]

class ScoreMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCORE_METHOD_UNSPECIFIED: _ClassVar[ScoreMethod]
    SCORE_METHOD_CROSS_ENCODER: _ClassVar[ScoreMethod]
    SCORE_METHOD_COSINE: _ClassVar[ScoreMethod]
    SCORE_METHOD_YES_TOKEN: _ClassVar[ScoreMethod]
TASK_UNSPECIFIED: Task
TASK_GENERATE: Task
TASK_EMBED: Task
TASK_RERANK: Task
TASK_CLASSIFY: Task
TASK_SCORE: Task
SCORE_METHOD_UNSPECIFIED: ScoreMethod
SCORE_METHOD_CROSS_ENCODER: ScoreMethod
SCORE_METHOD_COSINE: ScoreMethod
SCORE_METHOD_YES_TOKEN: ScoreMethod

class ListModelsRequest(_message.Message):
    __slots__ = ("model", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("request_id", "models")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, request_id: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "tasks", "max_context", "dtype", "device", "score_method", "labels", "embedding_dimension", "architecture", "supports_images", "quantization", "vocab_size", "speculative", "tensor_parallel_size", "kv_cache_dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SCORE_METHOD_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIMENSION_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_IMAGES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    tasks: _containers.RepeatedScalarFieldContainer[Task]
    max_context: int
    dtype: str
    device: str
    score_method: ScoreMethod
    labels: _containers.RepeatedScalarFieldContainer[str]
    embedding_dimension: int
    architecture: str
    supports_images: bool
    quantization: str
    vocab_size: int
    speculative: str
    tensor_parallel_size: int
    kv_cache_dtype: str
    def __init__(self, name: _Optional[str] = ..., tasks: _Optional[_Iterable[_Union[Task, str]]] = ..., max_context: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., score_method: _Optional[_Union[ScoreMethod, str]] = ..., labels: _Optional[_Iterable[str]] = ..., embedding_dimension: _Optional[int] = ..., architecture: _Optional[str] = ..., supports_images: _Optional[bool] = ..., quantization: _Optional[str] = ..., vocab_size: _Optional[int] = ..., speculative: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...
