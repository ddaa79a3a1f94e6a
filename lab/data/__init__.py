"""Procedural tasks: seeded generators, no downloads."""

from lab.data.kv_recall import KVRecall

__all__ = ["KVRecall"]
