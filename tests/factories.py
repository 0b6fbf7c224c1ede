"""Model factories the command-line tests name as `tests.factories:<name>`."""
from autoshard.testing.models import build_model


def small_llama():
    return build_model("llama", layers=2)


def small_gpt2():
    return build_model("gpt2", layers=4)
