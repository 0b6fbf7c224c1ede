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


def configless_lm():
    """A small causal language model with no `config` (nothing to read a vocabulary from but its
    embedding): 96 ids."""
    import torch
    from torch import nn

    class Nano(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(96, 32)
            self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
            self.head = nn.Linear(32, 96)

        def forward(self, input_ids, labels=None):
            logits = self.head(self.mlp(self.embed(input_ids)))      # [B, T, 96]
            if labels is None:
                return logits
            return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1))
    return Nano()


def needs_segments():
    """A model whose forward requires an input verify does not build (`segment_ids`)."""
    from torch import nn

    class Segmented(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            self.head = nn.Linear(16, 64)

        def forward(self, input_ids, segment_ids, labels=None):
            return self.head(self.embed(input_ids + segment_ids))
    return Segmented()
