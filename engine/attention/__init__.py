"""Paged attention backends."""
from engine.attention.backend import (AttentionBackend, AttentionShape, available_backends,
                                      get_attention_backend)

__all__ = ["AttentionBackend", "AttentionShape", "available_backends", "get_attention_backend"]
