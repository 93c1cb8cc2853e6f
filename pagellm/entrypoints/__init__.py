"""User-facing entry points: the offline ``LLM`` class and the ``pagellm`` CLI."""
