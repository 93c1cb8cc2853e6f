"""Turning logits into tokens."""
