"""Scheduling and KV-block bookkeeping in pure Python (no torch: testable in milliseconds)."""
