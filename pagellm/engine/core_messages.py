"""The messages between an ``AsyncEngineClient`` and the engine core process, one class per kind.

They travel pickled (protocol 5) over ZMQ: ``RequestOutput`` and ``SamplingParams`` are plain
dataclasses, and one ``StepOutputs`` per step per client carries all of that client's outputs of
the step, a plain request's as an ``OutputDelta`` between its first and last (``output_delta``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from pagellm.engine.output_delta import OutputDelta
    from pagellm.engine.protocol import PromptType
    from pagellm.lora_request import LoRARequest
    from pagellm.outputs import RequestOutput
    from pagellm.pooling_params import PoolingInfo
    from pagellm.sampling_params import SamplingParams
    from pagellm.tokenizer import Tokenizer

ControlKind = Literal["stats", "health", "trace", "lora"]


# ---------------------------------------------------------------------- client -> core
@dataclass(frozen=True, slots=True)
class AddRequest:
    client: int  # whose output socket gets the request's outputs
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int = 0
    lora_request: LoRARequest | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class ControlRequest:
    """Stats, health, the step trace or a LoRA call (``arg``: ``(op, arg)``), answered between steps."""

    client: int
    token: int  # the ``ControlReply`` carries it back
    kind: ControlKind
    arg: Any = None


@dataclass(frozen=True, slots=True)
class ShutdownCore:
    """Finish the step in progress, then stop."""


ClientMessage = AddRequest | AbortRequest | ControlRequest | ShutdownCore


# ---------------------------------------------------------------------- core -> client
@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What a client needs to know about the engine in the core process (sent once, when ready)."""

    vocab_size: int
    max_model_len: int
    tokenizer: Tokenizer
    pooling: PoolingInfo | None = None  # runner="pooling"


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """The engine could not be built; the core process ends."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class StepOutputs:
    items: list[RequestOutput | OutputDelta]


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """A request the engine refused: its stream raises ``error``."""

    request_id: str
    error: BaseException


@dataclass(frozen=True, slots=True)
class ControlReply:
    token: int
    result: Any  # an exception is raised by the caller


@dataclass(frozen=True, slots=True)
class CoreDead:
    """A step failed; the core process ends."""

    reason: str


CoreMessage = CoreInfo | CoreFailed | StepOutputs | RequestFailed | ControlReply | CoreDead
