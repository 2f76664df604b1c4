from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelControl(_message.Message):
    __slots__ = ("name", "state", "version", "reason", "residency", "resident_bytes", "weight_bytes", "queue_depth", "learned_cost_seconds", "weight", "max_batch_size", "requests", "executions", "batch_delay_seconds", "batch_target_rows", "successes", "success_seconds", "failures", "queue_seconds", "executions_by_batch_size", "in_flight", "latency_bucket_counts", "device_seconds", "rejections", "weight_loads", "evictions", "hook_failures", "weight_misses", "eviction_rank")
    class LearnedCostSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class ExecutionsByBatchSizeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class RejectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class HookFailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    LEARNED_COST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    EXECUTIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_DELAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TARGET_ROWS_FIELD_NUMBER: _ClassVar[int]
    SUCCESSES_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTIONS_BY_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_BUCKET_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_LOADS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HOOK_FAILURES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTION_RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    version: int
    reason: str
    residency: str
    resident_bytes: int
    weight_bytes: int
    queue_depth: int
    learned_cost_seconds: _containers.ScalarMap[int, float]
    weight: float
    max_batch_size: int
    requests: int
    executions: int
    batch_delay_seconds: float
    batch_target_rows: int
    successes: int
    success_seconds: float
    failures: int
    queue_seconds: float
    executions_by_batch_size: _containers.ScalarMap[int, int]
    in_flight: int
    latency_bucket_counts: _containers.RepeatedScalarFieldContainer[int]
    device_seconds: float
    rejections: _containers.ScalarMap[str, int]
    weight_loads: int
    evictions: int
    hook_failures: _containers.ScalarMap[str, int]
    weight_misses: int
    eviction_rank: int
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ..., residency: _Optional[str] = ..., resident_bytes: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., queue_depth: _Optional[int] = ..., learned_cost_seconds: _Optional[_Mapping[int, float]] = ..., weight: _Optional[float] = ..., max_batch_size: _Optional[int] = ..., requests: _Optional[int] = ..., executions: _Optional[int] = ..., batch_delay_seconds: _Optional[float] = ..., batch_target_rows: _Optional[int] = ..., successes: _Optional[int] = ..., success_seconds: _Optional[float] = ..., failures: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., executions_by_batch_size: _Optional[_Mapping[int, int]] = ..., in_flight: _Optional[int] = ..., latency_bucket_counts: _Optional[_Iterable[int]] = ..., device_seconds: _Optional[float] = ..., rejections: _Optional[_Mapping[str, int]] = ..., weight_loads: _Optional[int] = ..., evictions: _Optional[int] = ..., hook_failures: _Optional[_Mapping[str, int]] = ..., weight_misses: _Optional[int] = ..., eviction_rank: _Optional[int] = ...) -> None: ...

class ModelControlStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelControlStatusResponse(_message.Message):
    __slots__ = ("models", "worker", "backend", "budget_bytes", "resident_bytes", "discipline", "latency_bucket_bounds", "uptime_seconds", "executable_cache", "in_flight", "workers", "eviction_policy", "hook_threads", "hook_threads_busy", "hook_requests_waiting", "meta_threads", "meta_threads_busy", "meta_requests_waiting")
    class ExecutableCacheEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODELS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISCIPLINE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_BUCKET_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTABLE_CACHE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    HOOK_THREADS_FIELD_NUMBER: _ClassVar[int]
    HOOK_THREADS_BUSY_FIELD_NUMBER: _ClassVar[int]
    HOOK_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    META_THREADS_FIELD_NUMBER: _ClassVar[int]
    META_THREADS_BUSY_FIELD_NUMBER: _ClassVar[int]
    META_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelControl]
    worker: str
    backend: str
    budget_bytes: int
    resident_bytes: int
    discipline: str
    latency_bucket_bounds: _containers.RepeatedScalarFieldContainer[float]
    uptime_seconds: float
    executable_cache: _containers.ScalarMap[str, int]
    in_flight: int
    workers: _containers.RepeatedCompositeFieldContainer[ModelControlStatusResponse]
    eviction_policy: str
    hook_threads: int
    hook_threads_busy: int
    hook_requests_waiting: int
    meta_threads: int
    meta_threads_busy: int
    meta_requests_waiting: int
    def __init__(self, models: _Optional[_Iterable[_Union[ModelControl, _Mapping]]] = ..., worker: _Optional[str] = ..., backend: _Optional[str] = ..., budget_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., discipline: _Optional[str] = ..., latency_bucket_bounds: _Optional[_Iterable[float]] = ..., uptime_seconds: _Optional[float] = ..., executable_cache: _Optional[_Mapping[str, int]] = ..., in_flight: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[ModelControlStatusResponse, _Mapping]]] = ..., eviction_policy: _Optional[str] = ..., hook_threads: _Optional[int] = ..., hook_threads_busy: _Optional[int] = ..., hook_requests_waiting: _Optional[int] = ..., meta_threads: _Optional[int] = ..., meta_threads_busy: _Optional[int] = ..., meta_requests_waiting: _Optional[int] = ...) -> None: ...

class SetModelResidencyRequest(_message.Message):
    __slots__ = ("model", "residency", "worker")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    model: str
    residency: str
    worker: str
    def __init__(self, model: _Optional[str] = ..., residency: _Optional[str] = ..., worker: _Optional[str] = ...) -> None: ...

class SetModelResidencyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetModelPolicyRequest(_message.Message):
    __slots__ = ("model", "weight", "max_batch_size", "batch_delay_seconds", "batch_target_rows", "worker")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_DELAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TARGET_ROWS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    model: str
    weight: float
    max_batch_size: int
    batch_delay_seconds: float
    batch_target_rows: int
    worker: str
    def __init__(self, model: _Optional[str] = ..., weight: _Optional[float] = ..., max_batch_size: _Optional[int] = ..., batch_delay_seconds: _Optional[float] = ..., batch_target_rows: _Optional[int] = ..., worker: _Optional[str] = ...) -> None: ...

class SetModelPolicyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompactMemoryRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: str
    def __init__(self, worker: _Optional[str] = ...) -> None: ...

class CompactMemoryResponse(_message.Message):
    __slots__ = ("message", "freed_bytes")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    message: str
    freed_bytes: int
    def __init__(self, message: _Optional[str] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ("interval_seconds",)
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    interval_seconds: float
    def __init__(self, interval_seconds: _Optional[float] = ...) -> None: ...
