"""Multi-LoRA: PEFT adapters loaded and checked against the base model, device slots, and the
low-rank updates added to the projections for the rows of each adapter (docs/lora.md)."""
