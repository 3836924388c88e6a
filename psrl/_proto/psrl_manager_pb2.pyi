from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutInstanceId(_message.Message):
    __slots__ = ("worker_id", "dp_rank")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    dp_rank: int
    def __init__(self, worker_id: _Optional[str] = ..., dp_rank: _Optional[int] = ...) -> None: ...

class CanReserveRequest(_message.Message):
    __slots__ = ("request_ids", "model_versions", "without_new_reserve_entry", "is_validate")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    WITHOUT_NEW_RESERVE_ENTRY_FIELD_NUMBER: _ClassVar[int]
    IS_VALIDATE_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    model_versions: _containers.RepeatedScalarFieldContainer[int]
    without_new_reserve_entry: bool
    is_validate: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, request_ids: _Optional[_Iterable[int]] = ..., model_versions: _Optional[_Iterable[int]] = ..., without_new_reserve_entry: _Optional[bool] = ..., is_validate: _Optional[_Iterable[bool]] = ...) -> None: ...

class CanReserveResponse(_message.Message):
    __slots__ = ("results", "n_versions")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    N_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedScalarFieldContainer[bool]
    n_versions: int
    def __init__(self, results: _Optional[_Iterable[bool]] = ..., n_versions: _Optional[int] = ...) -> None: ...

class GetReserveIndicatorRequest(_message.Message):
    __slots__ = ("request_id", "model_versions", "is_validate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    IS_VALIDATE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    model_versions: _containers.RepeatedScalarFieldContainer[int]
    is_validate: bool
    def __init__(self, request_id: _Optional[int] = ..., model_versions: _Optional[_Iterable[int]] = ..., is_validate: _Optional[bool] = ...) -> None: ...

class GetReserveIndicatorResponse(_message.Message):
    __slots__ = ("indicators",)
    INDICATORS_FIELD_NUMBER: _ClassVar[int]
    indicators: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, indicators: _Optional[_Iterable[float]] = ...) -> None: ...

class ReserveRolloutInstanceRequestsRequest(_message.Message):
    __slots__ = ("rollout_instance_ids", "request_ids", "model_versions", "guarantee_not_aborted", "is_validate")
    ROLLOUT_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    GUARANTEE_NOT_ABORTED_FIELD_NUMBER: _ClassVar[int]
    IS_VALIDATE_FIELD_NUMBER: _ClassVar[int]
    rollout_instance_ids: _containers.RepeatedCompositeFieldContainer[RolloutInstanceId]
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    model_versions: _containers.RepeatedScalarFieldContainer[int]
    guarantee_not_aborted: bool
    is_validate: bool
    def __init__(self, rollout_instance_ids: _Optional[_Iterable[_Union[RolloutInstanceId, _Mapping]]] = ..., request_ids: _Optional[_Iterable[int]] = ..., model_versions: _Optional[_Iterable[int]] = ..., guarantee_not_aborted: _Optional[bool] = ..., is_validate: _Optional[bool] = ...) -> None: ...

class ReserveRolloutInstanceRequestsResponse(_message.Message):
    __slots__ = ("success", "buffer_ids", "entry_ids", "error_message")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_IDS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    buffer_ids: _containers.RepeatedScalarFieldContainer[int]
    entry_ids: _containers.RepeatedScalarFieldContainer[int]
    error_message: str
    def __init__(self, success: _Optional[bool] = ..., buffer_ids: _Optional[_Iterable[int]] = ..., entry_ids: _Optional[_Iterable[int]] = ..., error_message: _Optional[str] = ...) -> None: ...

class UpdateRequestInstanceIdRequest(_message.Message):
    __slots__ = ("request_id", "new_instance_id", "is_validate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    IS_VALIDATE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    new_instance_id: RolloutInstanceId
    is_validate: bool
    def __init__(self, request_id: _Optional[int] = ..., new_instance_id: _Optional[_Union[RolloutInstanceId, _Mapping]] = ..., is_validate: _Optional[bool] = ...) -> None: ...

class UpdateRequestInstanceIdResponse(_message.Message):
    __slots__ = ("success",)
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    success: bool
    def __init__(self, success: _Optional[bool] = ...) -> None: ...

class UpdateRequestVersionTagRequest(_message.Message):
    __slots__ = ("request_id", "new_version_tag", "is_validate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_VERSION_TAG_FIELD_NUMBER: _ClassVar[int]
    IS_VALIDATE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    new_version_tag: int
    is_validate: bool
    def __init__(self, request_id: _Optional[int] = ..., new_version_tag: _Optional[int] = ..., is_validate: _Optional[bool] = ...) -> None: ...

class UpdateRequestVersionTagResponse(_message.Message):
    __slots__ = ("success",)
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    success: bool
    def __init__(self, success: _Optional[bool] = ...) -> None: ...

class CheckAbortedRequestsRequest(_message.Message):
    __slots__ = ("request_ids", "remove")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    remove: bool
    def __init__(self, request_ids: _Optional[_Iterable[int]] = ..., remove: _Optional[bool] = ...) -> None: ...

class CheckAbortedRequestsResponse(_message.Message):
    __slots__ = ("is_aborted",)
    IS_ABORTED_FIELD_NUMBER: _ClassVar[int]
    is_aborted: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, is_aborted: _Optional[_Iterable[bool]] = ...) -> None: ...

class CheckAbortedModelVersionsRequest(_message.Message):
    __slots__ = ("model_versions",)
    MODEL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    model_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckAbortedModelVersionsResponse(_message.Message):
    __slots__ = ("is_aborted",)
    IS_ABORTED_FIELD_NUMBER: _ClassVar[int]
    is_aborted: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, is_aborted: _Optional[_Iterable[bool]] = ...) -> None: ...

class GetRolloutInstanceModelVersionRequest(_message.Message):
    __slots__ = ("rollout_instance_id",)
    ROLLOUT_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    rollout_instance_id: RolloutInstanceId
    def __init__(self, rollout_instance_id: _Optional[_Union[RolloutInstanceId, _Mapping]] = ...) -> None: ...

class GetRolloutInstanceModelVersionResponse(_message.Message):
    __slots__ = ("model_version",)
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    def __init__(self, model_version: _Optional[int] = ...) -> None: ...

class UpdateRequestStatusRequest(_message.Message):
    __slots__ = ("request_ids", "status", "model_versions", "rollout_instance_ids", "is_validate")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    IS_VALIDATE_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    status: str
    model_versions: _containers.RepeatedScalarFieldContainer[int]
    rollout_instance_ids: _containers.RepeatedCompositeFieldContainer[RolloutInstanceId]
    is_validate: bool
    def __init__(self, request_ids: _Optional[_Iterable[int]] = ..., status: _Optional[str] = ..., model_versions: _Optional[_Iterable[int]] = ..., rollout_instance_ids: _Optional[_Iterable[_Union[RolloutInstanceId, _Mapping]]] = ..., is_validate: _Optional[bool] = ...) -> None: ...

class UpdateRequestStatusResponse(_message.Message):
    __slots__ = ("succeeded",)
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    succeeded: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, succeeded: _Optional[_Iterable[bool]] = ...) -> None: ...

class AbortRequestsRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequestsResponse(_message.Message):
    __slots__ = ("was_reserved",)
    WAS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    was_reserved: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, was_reserved: _Optional[_Iterable[bool]] = ...) -> None: ...

class AbortModelVersionRequest(_message.Message):
    __slots__ = ("model_version",)
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    def __init__(self, model_version: _Optional[int] = ...) -> None: ...

class AbortModelVersionResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SetRolloutInstanceModelVersionRequest(_message.Message):
    __slots__ = ("rollout_instance_id", "model_version")
    ROLLOUT_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    rollout_instance_id: RolloutInstanceId
    model_version: int
    def __init__(self, rollout_instance_id: _Optional[_Union[RolloutInstanceId, _Mapping]] = ..., model_version: _Optional[int] = ...) -> None: ...

class SetRolloutInstanceModelVersionResponse(_message.Message):
    __slots__ = ("latest_model_version",)
    LATEST_MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    latest_model_version: int
    def __init__(self, latest_model_version: _Optional[int] = ...) -> None: ...

class ConsumeBufferRequest(_message.Message):
    __slots__ = ("model_version", "buffer_id", "is_validate")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    IS_VALIDATE_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    buffer_id: int
    is_validate: bool
    def __init__(self, model_version: _Optional[int] = ..., buffer_id: _Optional[int] = ..., is_validate: _Optional[bool] = ...) -> None: ...

class ConsumeBufferResponse(_message.Message):
    __slots__ = ("released_request_ids",)
    RELEASED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    released_request_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, released_request_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SetLatestModelVersionRequest(_message.Message):
    __slots__ = ("model_version",)
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    def __init__(self, model_version: _Optional[int] = ...) -> None: ...

class SetLatestModelVersionResponse(_message.Message):
    __slots__ = ("latest_model_version",)
    LATEST_MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    latest_model_version: int
    def __init__(self, latest_model_version: _Optional[int] = ...) -> None: ...

class GetSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSnapshotResponse(_message.Message):
    __slots__ = ("state_json",)
    STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    state_json: str
    def __init__(self, state_json: _Optional[str] = ...) -> None: ...
