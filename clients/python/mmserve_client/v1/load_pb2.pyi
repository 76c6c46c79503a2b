from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchLoadRequest(_message.Message):
    __slots__ = ("model", "interval_ms", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    interval_ms: int
    request_id: str
    def __init__(self, model: _Optional[str] = ..., interval_ms: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class ModelLoad(_message.Message):
    __slots__ = ("model", "running", "waiting", "kv_usage", "free_blocks", "total_blocks", "prefix_hit_rate", "tokens_in_flight", "calls_in_flight", "serving")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CALLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    model: str
    running: int
    waiting: int
    kv_usage: float
    free_blocks: int
    total_blocks: int
    prefix_hit_rate: float
    tokens_in_flight: int
    calls_in_flight: int
    serving: bool
    def __init__(self, model: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., tokens_in_flight: _Optional[int] = ..., calls_in_flight: _Optional[int] = ..., serving: _Optional[bool] = ...) -> None: ...

class WatchLoadResponse(_message.Message):
    __slots__ = ("models", "calls_in_flight", "draining", "request_id")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    CALLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelLoad]
    calls_in_flight: int
    draining: bool
    request_id: str
    def __init__(self, models: _Optional[_Iterable[_Union[ModelLoad, _Mapping]]] = ..., calls_in_flight: _Optional[int] = ..., draining: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...
