"""The Llama-family decoder over a paged KV pool."""
from engine.model.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
