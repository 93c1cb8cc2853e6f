"""``LoRAManager``: the engine's side of multi-LoRA serving.

It checks adapters (``add``: their config and safetensors header against the base model, and
their files' hash as their identity; callers do it before their requests reach the engine loop:
``LLM.generate`` up front, the server in a thread), counts the live requests of each, and before
every step gives each adapter the step uses one of the ``max_loras`` device slots
(``assign_slots``: an adapter already in a slot stays there; a new one takes a free slot or the
least recently used one this step does not need), telling the worker which slots to (re)fill. The
worker reads an adapter's tensors when it first fills a slot with it and keeps the last
``max_cpu_loras`` in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.lora_request import AdapterSpec, LoRAError, LoRAInUse, LoRARequest, inspect_adapter
from pagellm.sequence import SequenceGroup

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoRAStats:
    loads: int = 0  # adapters checked and registered
    slot_loads: int = 0  # adapters copied into a device slot


class LoRAManager:
    """Adapters by ``lora_int_id``; device slots; live request counts (see the module docstring)."""

    def __init__(self, max_loras: int, max_lora_rank: int, module_shapes: dict[str, list[tuple[int, int]]],
                 num_layers: int) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.module_shapes = module_shapes
        self.num_layers = num_layers
        self.specs: dict[int, AdapterSpec] = {}  # the checked adapter of each id in ``requests``
        self.requests: dict[int, LoRARequest] = {}
        self.in_use: dict[int, int] = {}
        self.slots: list[int | None] = [None] * max_loras  # adapter id per device slot
        self._slot_used: list[int] = [0] * max_loras  # step of last use, for LRU
        self._step = 0
        self.stats = LoRAStats()

    # ------------------------------------------------------------------ adapters
    def add(self, request: LoRARequest) -> AdapterSpec:
        """Load (or find loaded) the adapter of ``request``; a known id with another path or name
        is reloaded (and gets a new identity for the prefix cache if its weights changed)."""
        known = self.requests.get(request.lora_int_id)
        if known == request:
            return self.specs[request.lora_int_id]
        if known is not None and self.in_use.get(request.lora_int_id):
            raise LoRAInUse(f"lora_int_id {request.lora_int_id} is {known.lora_name!r} at {known.lora_path!r}, "
                            "in use by running requests: it cannot be replaced now")
        for other_id, other in self.requests.items():
            if other.lora_name == request.lora_name and other_id != request.lora_int_id:
                raise LoRAError(f"LoRA name {request.lora_name!r} is already lora_int_id {other_id}")
        adapter = inspect_adapter(request.lora_name, request.lora_path, self.max_lora_rank, self.module_shapes,
                                  self.num_layers)
        self.stats.loads += 1
        self._forget_slot(request.lora_int_id)  # old weights in a slot must not serve the new ones
        self.requests[request.lora_int_id] = request
        self.specs[request.lora_int_id] = adapter
        logger.info("LoRA adapter %r (id %d, rank %d) loaded from %s", request.lora_name, request.lora_int_id,
                    adapter.rank, request.lora_path)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Unload an adapter; refuses (``LoRAInUse``) while live requests use it."""
        if self.in_use.get(lora_int_id):
            raise LoRAInUse(f"LoRA adapter {lora_int_id} is used by {self.in_use[lora_int_id]} running request(s)")
        found = self.requests.pop(lora_int_id, None) is not None
        self.specs.pop(lora_int_id, None)
        self._forget_slot(lora_int_id)
        return found

    def _forget_slot(self, lora_int_id: int) -> None:
        for i, s in enumerate(self.slots):
            if s == lora_int_id:
                self.slots[i] = None

    def acquire(self, request: LoRARequest) -> AdapterSpec:
        """A request starts using the adapter (checked and registered on first use)."""
        adapter = self.add(request)
        self.in_use[request.lora_int_id] = self.in_use.get(request.lora_int_id, 0) + 1
        return adapter

    def release(self, lora_int_id: int) -> None:
        n = self.in_use.get(lora_int_id, 0) - 1
        if n > 0:
            self.in_use[lora_int_id] = n
        else:
            self.in_use.pop(lora_int_id, None)

    # ------------------------------------------------------------------ device slots
    def decorate_step(self, so: SchedulerOutput, requests: Mapping[str, SequenceGroup]) -> None:
        """The step's adapter slots (``LoRAHook.decorate_step``)."""
        self.assign_slots(so, {s.request_id: requests[s.request_id].lora_id for s in so.scheduled})

    def assign_slots(self, so: SchedulerOutput, lora_of: dict[str, int]) -> None:
        """Give every adapter of the step's sequences a slot (``so.lora_loads`` says which slots
        the worker must fill first) and each scheduled sequence its slot (-1: the base model).
        The scheduler admitted at most ``max_loras`` distinct adapters, so slots always suffice."""
        self._step += 1
        needed = {lora_of[s.request_id] for s in so.scheduled if lora_of.get(s.request_id)}
        where = {a: i for i, a in enumerate(self.slots) if a is not None}
        for lora_id in needed:
            if lora_id in where:
                continue
            free = [i for i, a in enumerate(self.slots) if a is None or a not in needed]
            if not free:
                raise RuntimeError(f"{len(needed)} adapters in one step, max_loras={self.max_loras}")
            slot = min(free, key=lambda i: (self.slots[i] is not None, self._slot_used[i]))
            self.slots[slot] = lora_id
            where[lora_id] = slot
            so.lora_loads[slot] = self.specs[lora_id]
            self.stats.slot_loads += 1
        for lora_id in needed:
            self._slot_used[where[lora_id]] = self._step
        for s in so.scheduled:
            lora_id = lora_of.get(s.request_id, 0)
            s.lora_slot = where[lora_id] if lora_id else -1

    @property
    def num_active(self) -> int:
        return len(self.in_use)
