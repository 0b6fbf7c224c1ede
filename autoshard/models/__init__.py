"""Small reference models used by the demo and tests."""
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
