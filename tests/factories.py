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


def tiny_nanogpt():
    """nanoGPT's forward(idx, targets): `autoshard train` feeds it the next tokens as targets."""
    from autoshard.models import GPT, GPTConfig
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=320, block_size=64))


def no_loss():
    """A model whose forward takes no labels: `autoshard train` refuses it."""
    from torch import nn

    class Echo(nn.Module):
        def forward(self, x):
            return x
    return Echo()


def small_mixtral():
    from autoshard.testing.models import build_moe
    return build_moe("mixtral")
