"""Structured output: grammar-constrained decoding (vLLM's ``structured_outputs``).

A request's ``SamplingParams.structured_outputs`` compiles to a grammar off the engine loop
(``manager.StructuredOutputManager``); each step the manager fills one bitmask row per constrained
sequence, the worker masks those logits before sampling, and the sampled token advances the
sequence's matcher. The grammar engines are libraries behind ``backend.StructuredOutputBackend``:
llguidance (``"guidance"``, the default) and xgrammar (an extra).
"""
