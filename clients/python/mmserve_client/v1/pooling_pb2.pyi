from mmserve_client.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_UNSPECIFIED: _ClassVar[Encoding]
    ENCODING_FLOAT: _ClassVar[Encoding]
    ENCODING_FP32_BYTES: _ClassVar[Encoding]
    ENCODING_FP16_BYTES: _ClassVar[Encoding]
ENCODING_UNSPECIFIED: Encoding
ENCODING_FLOAT: Encoding
ENCODING_FP32_BYTES: Encoding
ENCODING_FP16_BYTES: Encoding

class EmbedRequest(_message.Message):
    __slots__ = ("model", "request_id", "inputs", "normalize", "dimensions", "truncate", "encoding", "prompt_name")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Input]
    normalize: bool
    dimensions: int
    truncate: _common_pb2.Truncate
    encoding: Encoding
    prompt_name: str
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[_common_pb2.Input, _Mapping]]] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ..., truncate: _Optional[_Union[_common_pb2.Truncate, str]] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., prompt_name: _Optional[str] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("request_id", "embeddings", "usage", "timing", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    usage: _common_pb2.Usage
    timing: _common_pb2.Timing
    model: str
    def __init__(self, request_id: _Optional[str] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "packed")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    packed: bytes
    def __init__(self, values: _Optional[_Iterable[float]] = ..., packed: _Optional[bytes] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("model", "request_id", "query", "documents", "top_n", "return_documents", "truncate")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    return_documents: bool
    truncate: _common_pb2.Truncate
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ..., truncate: _Optional[_Union[_common_pb2.Truncate, str]] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("request_id", "results", "usage", "timing", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    results: _containers.RepeatedCompositeFieldContainer[RerankResult]
    usage: _common_pb2.Usage
    timing: _common_pb2.Timing
    model: str
    def __init__(self, request_id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[RerankResult, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class RerankResult(_message.Message):
    __slots__ = ("index", "score", "document")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    score: float
    document: str
    def __init__(self, index: _Optional[int] = ..., score: _Optional[float] = ..., document: _Optional[str] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("model", "request_id", "inputs", "truncate")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Input]
    truncate: _common_pb2.Truncate
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[_common_pb2.Input, _Mapping]]] = ..., truncate: _Optional[_Union[_common_pb2.Truncate, str]] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("request_id", "results", "usage", "timing", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    results: _containers.RepeatedCompositeFieldContainer[Classification]
    usage: _common_pb2.Usage
    timing: _common_pb2.Timing
    model: str
    def __init__(self, request_id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[Classification, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class Classification(_message.Message):
    __slots__ = ("scores", "label")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[LabelScore]
    label: str
    def __init__(self, scores: _Optional[_Iterable[_Union[LabelScore, _Mapping]]] = ..., label: _Optional[str] = ...) -> None: ...

class LabelScore(_message.Message):
    __slots__ = ("label", "score")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    label: str
    score: float
    def __init__(self, label: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("model", "request_id", "first", "second", "truncate")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    SECOND_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    first: _containers.RepeatedCompositeFieldContainer[_common_pb2.Input]
    second: _containers.RepeatedCompositeFieldContainer[_common_pb2.Input]
    truncate: _common_pb2.Truncate
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., first: _Optional[_Iterable[_Union[_common_pb2.Input, _Mapping]]] = ..., second: _Optional[_Iterable[_Union[_common_pb2.Input, _Mapping]]] = ..., truncate: _Optional[_Union[_common_pb2.Truncate, str]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("request_id", "scores", "usage", "timing", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    scores: _containers.RepeatedScalarFieldContainer[float]
    usage: _common_pb2.Usage
    timing: _common_pb2.Timing
    model: str
    def __init__(self, request_id: _Optional[str] = ..., scores: _Optional[_Iterable[float]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...
