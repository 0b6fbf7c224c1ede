"""Tier (b): all ranks simulated in one process against the single-device model."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoshard import autoshard
from autoshard.testing import build_model, grad_errors, max_rel
from autoshard.testing.models import VOCAB, input_name, logits_of

HEADS = {"nanogpt": 8, "nanogpt-manual": 8, "gpt2": 8, "llama": 8, "bert": 8}


def _loss(out, labels):
    return F.cross_entropy(logits_of(out).reshape(-1, VOCAB), labels.reshape(-1))


@pytest.mark.parametrize("name", ["nanogpt", "nanogpt-manual", "gpt2", "llama", "bert"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_outputs_and_gradients_match(name, tp):
    model = build_model(name, heads=HEADS[name], kv_heads=2)
    ids = torch.randint(0, VOCAB, (2, 16))
    labels = torch.randint(0, VOCAB, (2, 16))
    kw = {input_name(name): ids}
    ref_out = model(**kw)
    _loss(ref_out, labels).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    prog = autoshard(model, tp=tp, example_kwargs=kw)
    out = prog.simulate(**kw)
    assert type(out) is type(ref_out)
    assert max_rel(logits_of(out), logits_of(ref_out)) <= 1e-5
    _loss(out, labels).backward()
    errs = grad_errors(prog.full_grads(), ref_grads)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-4, f"{worst}: {errs[worst]:.2e}"
    if tp > 1:
        assert prog.sharding.params, "nothing was sharded"


@pytest.mark.parametrize("attention", ["sdpa", "eager"])     # eager: kv heads repeated in code (repeat_kv)
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_multi_and_grouped_query_attention_with_fewer_kv_heads_than_ranks(kv_heads, tp, attention):
    model = build_model("llama", heads=8, kv_heads=kv_heads)
    model.config._attn_implementation = attention
    ids, labels = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    _loss(model(input_ids=ids), labels).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    prog = autoshard(model, tp=tp)
    k = "model.layers.0.self_attn.k_proj.weight"
    assert k in prog.sharding.params and prog.rank(0).get_parameter(k).shape[0] == 8   # one kv head each
    out = prog.simulate(input_ids=ids)
    assert max_rel(out.logits, model(input_ids=ids).logits) <= 1e-5
    _loss(out, labels).backward()
    assert max(grad_errors(prog.full_grads(), ref_grads).values()) <= 1e-4


class _MultiQuery(nn.Module):
    """StarCoder-style multi-query attention: one Linear makes [every head's queries | one key head |
    one value head], and all query heads read that single kv head."""

    def __init__(self, written_out: bool, dim: int = 64, heads: int = 8):
        super().__init__()
        self.written_out, self.heads, self.hd = written_out, heads, dim // heads
        self.wte = nn.Embedding(VOCAB, dim)
        self.c_attn = nn.Linear(dim, dim + 2 * self.hd)
        self.c_proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.wte(input_ids)
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split((d, self.hd, self.hd), dim=-1)
        q = q.view(b, t, self.heads, self.hd).transpose(1, 2)          # [b, heads, t, hd]
        k, v = k.unsqueeze(1), v.unsqueeze(1)                           # [b, 1, t, hd]
        if self.written_out:      # the kv head repeated for every query head, as HF's repeat_kv does
            k, v = (z[:, :, None].expand(b, 1, self.heads, t, self.hd).reshape(b, self.heads, t, self.hd)
                    for z in (k, v))                                    # [b, heads, t, hd]
            scores = (q @ k.transpose(-1, -2)) * self.hd ** -0.5
            causal = torch.ones(t, t, dtype=torch.bool).triu(1)
            y = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = y.transpose(1, 2).reshape(b, t, d)                          # [b, t, heads * hd]
        return self.head(x + self.c_proj(y))


@pytest.mark.parametrize("written_out", [False, True])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_multi_query_attention_shares_its_one_kv_head_over_every_rank(tp, written_out):
    torch.manual_seed(0)
    model, ref = _MultiQuery(written_out), _MultiQuery(written_out)
    ref.load_state_dict(model.state_dict())
    prog = autoshard(model, tp=tp, example_kwargs={"input_ids": torch.randint(0, VOCAB, (2, 16))})
    assert prog.sharding.fallbacks == [], prog.sharding.fallbacks
    assert prog.rank(0).get_parameter("c_attn.weight").shape[0] == 64 // tp + 16   # its queries, all of k and v
    assert "shared rows dim 0" in next(line for line in str(prog).splitlines() if line.startswith("c_attn.weight"))
    params = [p for r in prog.ranks() for p in r.parameters()]
    opt, ref_opt = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):      # the shared rows' gradients are summed over the ranks, so copies stay equal
        ids, labels = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
        out, ref_out = prog.simulate(input_ids=ids), ref(input_ids=ids)
        assert max_rel(out, ref_out) <= 1e-5, f"step {step}"
        for o, y in ((opt, out), (ref_opt, ref_out)):
            o.zero_grad()
            F.cross_entropy(y.reshape(-1, VOCAB), labels.reshape(-1)).backward()
            o.step()
    errs = grad_errors(prog.full_state_dict(), dict(ref.named_parameters()))
    assert max(errs.values()) <= 1e-5


def test_every_rank_computes_the_same_output():
    prog = autoshard(build_model("llama", kv_heads=2), tp=4)
    ids = torch.randint(0, VOCAB, (2, 16))
    outs = [o.logits for o in prog.simulate_all(input_ids=ids)]
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_several_optimizer_steps_match(name):
    model, ref = build_model(name), build_model(name)
    prog = autoshard(model, tp=4)
    params = [p for r in prog.ranks() for p in r.parameters()]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        ids = torch.randint(0, VOCAB, (2, 16))
        labels = torch.randint(0, VOCAB, (2, 16))
        loss, ref_loss = _loss(prog.simulate(input_ids=ids), labels), _loss(ref(input_ids=ids), labels)
        assert max_rel(loss, ref_loss) <= 1e-5, f"step {step}"
        for o, l in ((opt, loss), (ref_opt, ref_loss)):
            o.zero_grad()
            l.backward()
            o.step()
    errs = grad_errors(prog.full_state_dict(), dict(ref.named_parameters()))
    assert max(errs.values()) <= 1e-5


def test_full_state_dict_reassembles_the_model():
    model = build_model("gpt2")
    prog = autoshard(model, tp=4)
    sd = prog.full_state_dict()
    for n, p in model.named_parameters():
        assert torch.equal(sd[n], p.detach()), n
