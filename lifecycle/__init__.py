"""Typed KV request lifecycle state machines."""
