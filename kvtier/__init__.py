"""kvtier: a host-side tier for LLM serving engines' prefix KV cache."""

__version__ = "0.1.0"
