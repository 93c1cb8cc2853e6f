"""Decoder building blocks shared by every model (torch only)."""
