"""The rotary fusion may drop the gradient to its cos and sin tables only where none is owed.

Hugging Face built the tables under torch.no_grad until transformers 5.24; since then they are plain
ops on the inv_freq buffer and the position ids. Both forms fuse; a table computed from a trainable
parameter (learned frequencies) must not, or that parameter would silently get no gradient."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard import autoshard
from autoshard.testing import fused_ops, grad_errors, max_rel


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos.unsqueeze(1) + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin.unsqueeze(1)


class RotaryAttention(nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, learned: bool = False,
                 no_grad: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.no_grad = heads, hidden // heads, no_grad
        self.embed = nn.Embedding(vocab, hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.head = nn.Linear(hidden, vocab, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        if learned:
            self.inv_freq = nn.Parameter(inv_freq)
        else:
            self.register_buffer("inv_freq", inv_freq, persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq                    # [b, s, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                  # [b, s, d]
        return emb.cos(), emb.sin()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.shape
        x = self.embed(input_ids)
        positions = torch.arange(s).unsqueeze(0).expand(b, -1)
        if self.no_grad:
            with torch.no_grad():
                cos, sin = self.tables(positions)
        else:
            cos, sin = self.tables(positions)
        q, k, v = (lin(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)   # [b, a, s, d]
                   for lin in (self.q, self.k, self.v))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        return self.head(x + self.proj(y))


@pytest.mark.parametrize("learned,no_grad,fuses", [(False, False, True), (False, True, True), (True, False, False)])
def test_rotary_fuses_only_where_its_tables_owe_no_gradient(learned, no_grad, fuses):
    torch.manual_seed(0)
    model = RotaryAttention(learned=learned, no_grad=no_grad)
    ids, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    prog = autoshard(model, tp=2, example_kwargs={"input_ids": ids}, fuse=True)
    assert ("rotary" in fused_ops(prog.rank(0).graph_module)) == fuses
    ref = model(ids)
    F.cross_entropy(ref.reshape(-1, 64), labels.reshape(-1)).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if learned:
        assert ref_grads["inv_freq"].abs().max() > 0     # a gradient is owed: fusing would lose it
    out = prog.simulate(input_ids=ids)
    assert max_rel(out, ref) <= 1e-5
    F.cross_entropy(out.reshape(-1, 64), labels.reshape(-1)).backward()
    assert max(grad_errors(prog.full_grads(), ref_grads).values()) <= 1e-5
