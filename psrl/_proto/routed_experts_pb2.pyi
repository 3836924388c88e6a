from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoutedExpertsStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTED_EXPERTS_OK: _ClassVar[RoutedExpertsStatus]
    ROUTED_EXPERTS_NOT_RECORDED: _ClassVar[RoutedExpertsStatus]
    ROUTED_EXPERTS_UNSUPPORTED: _ClassVar[RoutedExpertsStatus]
ROUTED_EXPERTS_OK: RoutedExpertsStatus
ROUTED_EXPERTS_NOT_RECORDED: RoutedExpertsStatus
ROUTED_EXPERTS_UNSUPPORTED: RoutedExpertsStatus

class TakeRoutedExpertsRequest(_message.Message):
    __slots__ = ("request_id", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class TakeRoutedExpertsResponse(_message.Message):
    __slots__ = ("status", "reason", "data", "num_rows", "num_layers", "top_k", "dtype", "prompt_start")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_START_FIELD_NUMBER: _ClassVar[int]
    status: RoutedExpertsStatus
    reason: str
    data: bytes
    num_rows: int
    num_layers: int
    top_k: int
    dtype: str
    prompt_start: int
    def __init__(self, status: _Optional[_Union[RoutedExpertsStatus, str]] = ..., reason: _Optional[str] = ..., data: _Optional[bytes] = ..., num_rows: _Optional[int] = ..., num_layers: _Optional[int] = ..., top_k: _Optional[int] = ..., dtype: _Optional[str] = ..., prompt_start: _Optional[int] = ...) -> None: ...
