"""Model factories the command-line tests name as `tests.factories:<name>`."""
from autoshard.testing.models import build_model


def small_llama():
    return build_model("llama", layers=2)


def small_gpt2():
    return build_model("gpt2", layers=4)


def plain_mlp():
    """A model whose inputs are features, not token ids: it needs example inputs."""
    from torch import nn
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))


def not_a_model():
    return 42
