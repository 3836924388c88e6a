from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]
    PAUSE_MODE_KEEP: _ClassVar[PauseMode]

class Admission(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADMISSION_OPEN: _ClassVar[Admission]
    ADMISSION_PAUSED: _ClassVar[Admission]
    ADMISSION_FAILED: _ClassVar[Admission]
PAUSE_MODE_ABORT: PauseMode
PAUSE_MODE_WAIT: PauseMode
PAUSE_MODE_KEEP: PauseMode
ADMISSION_OPEN: Admission
ADMISSION_PAUSED: Admission
ADMISSION_FAILED: Admission

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode", "clear_cache")
    MODE_FIELD_NUMBER: _ClassVar[int]
    CLEAR_CACHE_FIELD_NUMBER: _ClassVar[int]
    mode: PauseMode
    clear_cache: bool
    def __init__(self, mode: _Optional[_Union[PauseMode, str]] = ..., clear_cache: _Optional[bool] = ...) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ("weight_version", "aborted_request_ids", "paused")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    paused: bool
    def __init__(self, weight_version: _Optional[int] = ..., aborted_request_ids: _Optional[_Iterable[str]] = ..., paused: _Optional[bool] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("version", "seed", "path")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    version: int
    seed: int
    path: str
    def __init__(self, version: _Optional[int] = ..., seed: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    def __init__(self, weight_version: _Optional[int] = ...) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationResponse(_message.Message):
    __slots__ = ("weight_version", "paused")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    paused: bool
    def __init__(self, weight_version: _Optional[int] = ..., paused: _Optional[bool] = ...) -> None: ...

class GetSyncStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSyncStateResponse(_message.Message):
    __slots__ = ("paused", "weight_version", "running_requests", "waiting_requests", "admission", "failure_reason")
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    weight_version: int
    running_requests: int
    waiting_requests: int
    admission: Admission
    failure_reason: str
    def __init__(self, paused: _Optional[bool] = ..., weight_version: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., admission: _Optional[_Union[Admission, str]] = ..., failure_reason: _Optional[str] = ...) -> None: ...

class FailSyncRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class FailSyncResponse(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    def __init__(self, weight_version: _Optional[int] = ...) -> None: ...
