from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
INT32: DType
INT64: DType
UINT8: DType
BOOL: DType
FLOAT16: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class BoxSpace(_message.Message):
    __slots__ = ("shape", "dtype", "low", "high")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    low: _containers.RepeatedScalarFieldContainer[float]
    high: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., low: _Optional[_Iterable[float]] = ..., high: _Optional[_Iterable[float]] = ...) -> None: ...

class StreamHello(_message.Message):
    __slots__ = ("session_id", "env_name", "num_envs", "obs_shape", "max_inflight", "backfill", "mid_episode", "resumes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    OBS_SHAPE_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    BACKFILL_FIELD_NUMBER: _ClassVar[int]
    MID_EPISODE_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    env_name: str
    num_envs: int
    obs_shape: _containers.RepeatedScalarFieldContainer[int]
    max_inflight: int
    backfill: bool
    mid_episode: bool
    resumes: bool
    def __init__(self, session_id: _Optional[str] = ..., env_name: _Optional[str] = ..., num_envs: _Optional[int] = ..., obs_shape: _Optional[_Iterable[int]] = ..., max_inflight: _Optional[int] = ..., backfill: _Optional[bool] = ..., mid_episode: _Optional[bool] = ..., resumes: _Optional[bool] = ...) -> None: ...

class StepObservation(_message.Message):
    __slots__ = ("seq", "env_ids", "obs", "rewards", "terminated", "truncated", "fallback", "obs_index")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ENV_IDS_FIELD_NUMBER: _ClassVar[int]
    OBS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    OBS_INDEX_FIELD_NUMBER: _ClassVar[int]
    seq: int
    env_ids: _containers.RepeatedScalarFieldContainer[int]
    obs: Tensor
    rewards: _containers.RepeatedScalarFieldContainer[float]
    terminated: _containers.RepeatedScalarFieldContainer[bool]
    truncated: _containers.RepeatedScalarFieldContainer[bool]
    fallback: _containers.RepeatedScalarFieldContainer[bool]
    obs_index: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq: _Optional[int] = ..., env_ids: _Optional[_Iterable[int]] = ..., obs: _Optional[_Union[Tensor, _Mapping]] = ..., rewards: _Optional[_Iterable[float]] = ..., terminated: _Optional[_Iterable[bool]] = ..., truncated: _Optional[_Iterable[bool]] = ..., fallback: _Optional[_Iterable[bool]] = ..., obs_index: _Optional[_Iterable[int]] = ...) -> None: ...

class ActRequest(_message.Message):
    __slots__ = ("hello", "step")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    hello: StreamHello
    step: StepObservation
    def __init__(self, hello: _Optional[_Union[StreamHello, _Mapping]] = ..., step: _Optional[_Union[StepObservation, _Mapping]] = ...) -> None: ...

class ActResponse(_message.Message):
    __slots__ = ("seq", "env_ids", "actions", "log_probs", "policy_version", "queue_wait_us", "inference_us", "batch_rows")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ENV_IDS_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    env_ids: _containers.RepeatedScalarFieldContainer[int]
    actions: Tensor
    log_probs: _containers.RepeatedScalarFieldContainer[float]
    policy_version: int
    queue_wait_us: int
    inference_us: int
    batch_rows: int
    def __init__(self, seq: _Optional[int] = ..., env_ids: _Optional[_Iterable[int]] = ..., actions: _Optional[_Union[Tensor, _Mapping]] = ..., log_probs: _Optional[_Iterable[float]] = ..., policy_version: _Optional[int] = ..., queue_wait_us: _Optional[int] = ..., inference_us: _Optional[int] = ..., batch_rows: _Optional[int] = ...) -> None: ...

class ActUnaryRequest(_message.Message):
    __slots__ = ("obs",)
    OBS_FIELD_NUMBER: _ClassVar[int]
    obs: Tensor
    def __init__(self, obs: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerLimits(_message.Message):
    __slots__ = ("max_batch_size", "max_delay_us", "max_queue_rows", "max_message_bytes", "max_envs_per_stream", "sync_env_steps", "max_streams", "max_weights_bytes")
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_DELAY_US_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ENVS_PER_STREAM_FIELD_NUMBER: _ClassVar[int]
    SYNC_ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_batch_size: int
    max_delay_us: int
    max_queue_rows: int
    max_message_bytes: int
    max_envs_per_stream: int
    sync_env_steps: int
    max_streams: int
    max_weights_bytes: int
    def __init__(self, max_batch_size: _Optional[int] = ..., max_delay_us: _Optional[int] = ..., max_queue_rows: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_envs_per_stream: _Optional[int] = ..., sync_env_steps: _Optional[int] = ..., max_streams: _Optional[int] = ..., max_weights_bytes: _Optional[int] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("observation_space", "action_space", "policy_version", "limits", "backend", "env_name", "server_version", "action_chunk")
    OBSERVATION_SPACE_FIELD_NUMBER: _ClassVar[int]
    ACTION_SPACE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTION_CHUNK_FIELD_NUMBER: _ClassVar[int]
    observation_space: BoxSpace
    action_space: BoxSpace
    policy_version: int
    limits: ServerLimits
    backend: str
    env_name: str
    server_version: str
    action_chunk: int
    def __init__(self, observation_space: _Optional[_Union[BoxSpace, _Mapping]] = ..., action_space: _Optional[_Union[BoxSpace, _Mapping]] = ..., policy_version: _Optional[int] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ..., backend: _Optional[str] = ..., env_name: _Optional[str] = ..., server_version: _Optional[str] = ..., action_chunk: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("requests", "batches", "rows", "max_batch_rows", "rejected_queue_full", "rejected_invalid", "active_streams", "queue_wait_us_p50", "queue_wait_us_p99", "inference_us_p50", "inference_us_p99", "policy_version", "transitions", "segments_acked", "transitions_pending", "transitions_dropped_overflow", "transitions_dropped_disconnect", "backpressure_wait_us", "weight_publishes", "sessions_forgotten", "rejected_streams", "failed_requests", "streams_awaiting_hello", "queue_wait_us_sum", "inference_us_sum")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_QUEUE_FULL_FIELD_NUMBER: _ClassVar[int]
    REJECTED_INVALID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_US_P50_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_US_P99_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_US_P50_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_US_P99_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSITIONS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_ACKED_FIELD_NUMBER: _ClassVar[int]
    TRANSITIONS_PENDING_FIELD_NUMBER: _ClassVar[int]
    TRANSITIONS_DROPPED_OVERFLOW_FIELD_NUMBER: _ClassVar[int]
    TRANSITIONS_DROPPED_DISCONNECT_FIELD_NUMBER: _ClassVar[int]
    BACKPRESSURE_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_PUBLISHES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    REJECTED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_AWAITING_HELLO_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_US_SUM_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_US_SUM_FIELD_NUMBER: _ClassVar[int]
    requests: int
    batches: int
    rows: int
    max_batch_rows: int
    rejected_queue_full: int
    rejected_invalid: int
    active_streams: int
    queue_wait_us_p50: int
    queue_wait_us_p99: int
    inference_us_p50: int
    inference_us_p99: int
    policy_version: int
    transitions: int
    segments_acked: int
    transitions_pending: int
    transitions_dropped_overflow: int
    transitions_dropped_disconnect: int
    backpressure_wait_us: int
    weight_publishes: int
    sessions_forgotten: int
    rejected_streams: int
    failed_requests: int
    streams_awaiting_hello: int
    queue_wait_us_sum: int
    inference_us_sum: int
    def __init__(self, requests: _Optional[int] = ..., batches: _Optional[int] = ..., rows: _Optional[int] = ..., max_batch_rows: _Optional[int] = ..., rejected_queue_full: _Optional[int] = ..., rejected_invalid: _Optional[int] = ..., active_streams: _Optional[int] = ..., queue_wait_us_p50: _Optional[int] = ..., queue_wait_us_p99: _Optional[int] = ..., inference_us_p50: _Optional[int] = ..., inference_us_p99: _Optional[int] = ..., policy_version: _Optional[int] = ..., transitions: _Optional[int] = ..., segments_acked: _Optional[int] = ..., transitions_pending: _Optional[int] = ..., transitions_dropped_overflow: _Optional[int] = ..., transitions_dropped_disconnect: _Optional[int] = ..., backpressure_wait_us: _Optional[int] = ..., weight_publishes: _Optional[int] = ..., sessions_forgotten: _Optional[int] = ..., rejected_streams: _Optional[int] = ..., failed_requests: _Optional[int] = ..., streams_awaiting_hello: _Optional[int] = ..., queue_wait_us_sum: _Optional[int] = ..., inference_us_sum: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("seq", "session_id", "env_id", "episode", "t", "obs", "actions", "log_probs", "values", "policy_versions", "rewards", "terminated", "truncated", "fallback", "autoreset", "bootstrap_obs", "joined_mid_episode")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    T_FIELD_NUMBER: _ClassVar[int]
    OBS_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    AUTORESET_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_OBS_FIELD_NUMBER: _ClassVar[int]
    JOINED_MID_EPISODE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    session_id: str
    env_id: int
    episode: int
    t: int
    obs: Tensor
    actions: Tensor
    log_probs: _containers.RepeatedScalarFieldContainer[float]
    values: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    rewards: _containers.RepeatedScalarFieldContainer[float]
    terminated: _containers.RepeatedScalarFieldContainer[bool]
    truncated: _containers.RepeatedScalarFieldContainer[bool]
    fallback: _containers.RepeatedScalarFieldContainer[bool]
    autoreset: _containers.RepeatedScalarFieldContainer[bool]
    bootstrap_obs: Tensor
    joined_mid_episode: bool
    def __init__(self, seq: _Optional[int] = ..., session_id: _Optional[str] = ..., env_id: _Optional[int] = ..., episode: _Optional[int] = ..., t: _Optional[int] = ..., obs: _Optional[_Union[Tensor, _Mapping]] = ..., actions: _Optional[_Union[Tensor, _Mapping]] = ..., log_probs: _Optional[_Iterable[float]] = ..., values: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., rewards: _Optional[_Iterable[float]] = ..., terminated: _Optional[_Iterable[bool]] = ..., truncated: _Optional[_Iterable[bool]] = ..., fallback: _Optional[_Iterable[bool]] = ..., autoreset: _Optional[_Iterable[bool]] = ..., bootstrap_obs: _Optional[_Union[Tensor, _Mapping]] = ..., joined_mid_episode: _Optional[bool] = ...) -> None: ...

class TransitionAck(_message.Message):
    __slots__ = ("acked_seq", "window_steps", "trainer_id")
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    acked_seq: int
    window_steps: int
    trainer_id: str
    def __init__(self, acked_seq: _Optional[int] = ..., window_steps: _Optional[int] = ..., trainer_id: _Optional[str] = ...) -> None: ...

class TransitionBatch(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("version", "tensors")
    class TensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.MessageMap[str, Tensor]
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Mapping[str, Tensor]] = ...) -> None: ...

class WeightsPart(_message.Message):
    __slots__ = ("version", "layout", "name", "data")
    class LayoutEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    layout: _containers.MessageMap[str, Tensor]
    name: str
    data: bytes
    def __init__(self, version: _Optional[int] = ..., layout: _Optional[_Mapping[str, Tensor]] = ..., name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "applied", "swap_us")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    SWAP_US_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    applied: bool
    swap_us: int
    def __init__(self, policy_version: _Optional[int] = ..., applied: _Optional[bool] = ..., swap_us: _Optional[int] = ...) -> None: ...
