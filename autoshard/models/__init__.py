"""Small reference models used by the demo and tests."""
from autoshard.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
