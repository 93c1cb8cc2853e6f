"""Multi-LoRA in the scheduler: at most ``max_loras`` distinct adapters among a step's sequences
(the worker has that many device slots). A waiting request whose adapter would be one too many is
passed over, keeping its place, for at most ``LORA_MAX_SKIPS`` steps; after that nobody passes it,
so it cannot starve."""

from __future__ import annotations

from collections.abc import Iterable

from pagellm.sequence import SequenceGroup

LORA_MAX_SKIPS = 8


class LoRAAdmission:
    """The adapter limit of a step and the steps each waiting request was passed over."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras  # 0: no LoRA, no limit
        self.skips: dict[str, int] = {}

    def adapters(self, running: Iterable[SequenceGroup]) -> set[int]:
        """The adapters these requests use (empty without LoRA)."""
        return {g.lora_id for g in running if g.lora_id} if self.max_loras else set()

    def over_limit(self, group: SequenceGroup, adapters: set[int]) -> bool:
        """Whether ``group``'s adapter would be one more than ``max_loras`` beside ``adapters``."""
        return (bool(self.max_loras and group.lora_id) and group.lora_id not in adapters
                and len(adapters) >= self.max_loras)

    def may_pass_over(self, group: SequenceGroup) -> bool:
        """Whether the requests behind ``group`` may go first this step (counted as a skip)."""
        skips = self.skips.get(group.request_id, 0)
        if skips >= LORA_MAX_SKIPS:
            return False
        self.skips[group.request_id] = skips + 1
        return True

    def forget(self, request_id: str) -> None:
        self.skips.pop(request_id, None)
