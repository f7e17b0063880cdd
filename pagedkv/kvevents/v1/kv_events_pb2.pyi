from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchRequest(_message.Message):
    __slots__ = ("from_seq", "has_from_seq")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    HAS_FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    has_from_seq: bool
    def __init__(self, from_seq: _Optional[int] = ..., has_from_seq: _Optional[bool] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("seq", "ts", "events", "snapshot", "block_size")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ts: float
    events: _containers.RepeatedCompositeFieldContainer[Event]
    snapshot: bool
    block_size: int
    def __init__(self, seq: _Optional[int] = ..., ts: _Optional[float] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., snapshot: _Optional[bool] = ..., block_size: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: Stored
    removed: Removed
    cleared: Cleared
    def __init__(self, stored: _Optional[_Union[Stored, _Mapping]] = ..., removed: _Optional[_Union[Removed, _Mapping]] = ..., cleared: _Optional[_Union[Cleared, _Mapping]] = ...) -> None: ...

class Stored(_message.Message):
    __slots__ = ("hashes", "parent", "has_parent", "token_ids", "medium", "salt", "lora_name")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    HAS_PARENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[int]
    parent: int
    has_parent: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    medium: str
    salt: str
    lora_name: str
    def __init__(self, hashes: _Optional[_Iterable[int]] = ..., parent: _Optional[int] = ..., has_parent: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ..., medium: _Optional[str] = ..., salt: _Optional[str] = ..., lora_name: _Optional[str] = ...) -> None: ...

class Removed(_message.Message):
    __slots__ = ("hashes", "medium")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[int]
    medium: str
    def __init__(self, hashes: _Optional[_Iterable[int]] = ..., medium: _Optional[str] = ...) -> None: ...

class Cleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
