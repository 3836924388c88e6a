from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PinKvRequest(_message.Message):
    __slots__ = ("request_id", "data_parallel_rank", "ttl_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    data_parallel_rank: int
    ttl_ms: int
    def __init__(self, request_id: _Optional[str] = ..., data_parallel_rank: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class PinKvResponse(_message.Message):
    __slots__ = ("num_tokens",)
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    def __init__(self, num_tokens: _Optional[int] = ...) -> None: ...

class UnpinKvRequest(_message.Message):
    __slots__ = ("request_id", "data_parallel_rank")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    data_parallel_rank: int
    def __init__(self, request_id: _Optional[str] = ..., data_parallel_rank: _Optional[int] = ...) -> None: ...

class UnpinKvResponse(_message.Message):
    __slots__ = ("unpinned",)
    UNPINNED_FIELD_NUMBER: _ClassVar[int]
    unpinned: bool
    def __init__(self, unpinned: _Optional[bool] = ...) -> None: ...

class TransferKvRequest(_message.Message):
    __slots__ = ("request_id", "data_parallel_rank", "token_ids", "max_tokens", "channel", "layout_json", "allow_prefix_cache", "keep_pin", "start_token", "node_id", "device")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    KEEP_PIN_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    data_parallel_rank: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    channel: str
    layout_json: str
    allow_prefix_cache: bool
    keep_pin: bool
    start_token: int
    node_id: str
    device: str
    def __init__(self, request_id: _Optional[str] = ..., data_parallel_rank: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., channel: _Optional[str] = ..., layout_json: _Optional[str] = ..., allow_prefix_cache: _Optional[bool] = ..., keep_pin: _Optional[bool] = ..., start_token: _Optional[int] = ..., node_id: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class TransferKvResponse(_message.Message):
    __slots__ = ("num_tokens", "transfer_id", "transfer_json", "source", "nbytes", "reason", "block_ids")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_JSON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    transfer_id: str
    transfer_json: str
    source: str
    nbytes: int
    reason: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_tokens: _Optional[int] = ..., transfer_id: _Optional[str] = ..., transfer_json: _Optional[str] = ..., source: _Optional[str] = ..., nbytes: _Optional[int] = ..., reason: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GetKvMigrationStatsRequest(_message.Message):
    __slots__ = ("data_parallel_rank",)
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    data_parallel_rank: int
    def __init__(self, data_parallel_rank: _Optional[int] = ...) -> None: ...

class KvMigrationStats(_message.Message):
    __slots__ = ("transfers_out", "bytes_out", "transfers_in", "bytes_in", "tokens_in", "transfer_seconds_in", "fallbacks", "prompt_tokens_computed", "pinned_requests")
    TRANSFERS_OUT_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_IN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_IN_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    PINNED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    transfers_out: int
    bytes_out: int
    transfers_in: int
    bytes_in: int
    tokens_in: int
    transfer_seconds_in: float
    fallbacks: int
    prompt_tokens_computed: int
    pinned_requests: int
    def __init__(self, transfers_out: _Optional[int] = ..., bytes_out: _Optional[int] = ..., transfers_in: _Optional[int] = ..., bytes_in: _Optional[int] = ..., tokens_in: _Optional[int] = ..., transfer_seconds_in: _Optional[float] = ..., fallbacks: _Optional[int] = ..., prompt_tokens_computed: _Optional[int] = ..., pinned_requests: _Optional[int] = ...) -> None: ...
