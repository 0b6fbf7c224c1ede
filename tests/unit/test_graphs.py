"""Tier (a): what each rank's graph and parameters look like, checked in one process."""
import pytest
import torch
from torch import nn

from autoshard import autoshard
from autoshard.testing import build_model, grad_errors, max_rel

ATTN_MLP = ("attn", "mlp", "attention", "intermediate", "output.dense", "self_attn")


def _is_block_weight(name: str) -> bool:
    return any(k in name for k in ATTN_MLP) and "norm" not in name.lower() and "ln" not in name.split(".")[-2]


@pytest.mark.parametrize("name", ["nanogpt", "gpt2", "llama", "bert"])
@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_holds_one_tp_th_of_attention_and_mlp(name, tp):
    model = build_model(name, kv_heads=8)   # kv heads >= tp: every weight splits evenly
    prog = autoshard(model, tp=tp)
    full = dict(model.named_parameters())
    for r in range(tp):
        local = dict(prog.rank(r).named_parameters())
        assert local.keys() == full.keys()
        for pname, p in full.items():
            if p.dim() == 2 and _is_block_weight(pname):
                assert local[pname].numel() * tp == p.numel(), f"{pname} on rank {r}: {tuple(local[pname].shape)}"


def test_rank_weights_are_slices_of_the_original():
    model = build_model("gpt2", heads=4)
    prog = autoshard(model, tp=2)
    w = model.transformer.h[0].attn.c_attn.weight     # Conv1D: (in, 3*out), q|k|v along dim 1
    r1 = prog.rank(1).get_parameter("transformer.h.0.attn.c_attn.weight")
    # strided: rank 1 holds the second half of q, of k and of v
    want = torch.cat([w[:, 32:64], w[:, 96:128], w[:, 160:192]], dim=1)
    assert torch.equal(r1, want)


def test_code_reads_like_megatron():
    prog = autoshard(build_model("nanogpt"), tp=2)
    code = prog.rank(0).code
    assert "self.f(" in code and "self.g(" in code
    # heads per rank rewritten in the view: 8 heads / 2 ranks
    assert "[sym_size_int_4, sym_size_int_5, 4, 8]" in code or ", 4, 8]" in code
    # the row-parallel bias is added once, after g
    lines = code.splitlines()
    row = next(i for i, line in enumerate(lines) if "self.g(linear" in line)
    assert "aten.add.Tensor(g" in lines[row + 1]
    # vocabulary-parallel word embedding: local ids, masked lookup, g; positions stay whole
    assert "aten.embedding.default(wte_weight, masked_fill" in code
    assert "aten.embedding.default(wpe_weight, arange)" in code


def test_ranks_have_identical_graph_structure():
    prog = autoshard(build_model("llama", kv_heads=2), tp=4)
    shapes = [[(n.op, str(n.target)) for n in prog.rank(r).graph_module.graph.nodes] for r in range(4)]
    assert all(s == shapes[0] for s in shapes)


def test_gqa_kv_heads_shared_between_ranks():
    model = build_model("llama", heads=8, kv_heads=2)
    prog = autoshard(model, tp=4)
    k = "model.layers.0.self_attn.k_proj.weight"     # (2 heads * 8, 64)
    rows = [prog.rank(r).get_parameter(k) for r in range(4)]
    full = model.get_parameter(k)
    assert [tuple(t.shape) for t in rows] == [(8, 64)] * 4
    assert torch.equal(rows[0], full[:8]) and torch.equal(rows[1], full[:8])
    assert torch.equal(rows[2], full[8:]) and torch.equal(rows[3], full[8:])
    assert "sync_model_layers_0_self_attn_k_proj_weight" in prog.rank(0).code


def test_printed_table_names_parameters_and_collectives():
    text = str(autoshard(build_model("gpt2"), tp=2))
    assert "transformer.h.0.attn.c_attn.weight" in text
    assert "split dim 1" in text        # Conv1D weights are (in, out): column split on dim 1
    assert "collectives per rank" in text
    assert "transformer.wte.weight" in text and "split dim 0" in text   # vocabulary-parallel, tied head
    assert "lm_head" not in text.split("collectives")[0]     # tied: one parameter, sharded once


class _StackFlatten(nn.Module):
    """Heads [b, s, heads, d] from a column-parallel linear, two halves of d stacked on a new dim,
    `join` back to [b', s', heads', d'], a row-parallel linear over the features."""
    def __init__(self, join):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32, bias=False), nn.Linear(32, 16, bias=False)
        self.join = join

    def forward(self, x):
        b, s = x.shape[:2]
        h = self.up(x).view(b, s, 4, 8)                                        # [b, s, heads, d]
        return self.down(self.join(-h[..., 1::2], h[..., ::2]).reshape(b, s, 32))


_JOINS = {   # name -> (join, heads stay sharded)
    # GPT-J's rotate_every_two: [b, s, heads, d/2, 2] -> [b, s, heads, d]
    "gptj": (lambda a, b: torch.stack((a, b), dim=-1).flatten(-2), True),
    # the new dim before the heads, [b, s, 2, heads, d/2]; b and s flattened in front of them
    "new-dim-first": (lambda a, b: torch.stack((a, b), dim=2).flatten(0, 1).transpose(1, 2), True),
    # flattening the new dim with the heads regroups the shard: refused, replicated
    "heads-flattened": (lambda a, b: torch.stack((a, b), dim=2).flatten(2, 3), False),
}


@pytest.mark.parametrize("join", sorted(_JOINS))
@pytest.mark.simulation
def test_stack_and_flatten_keep_heads_sharded_or_fall_back(join):
    fn, sharded = _JOINS[join]
    torch.manual_seed(0)
    model = _StackFlatten(fn)
    x = torch.randn(2, 5, 16)
    prog = autoshard(model, tp=2, example_inputs=(x,))
    assert ("up.weight" in prog.sharding.params) == sharded
    assert [("flattens sharded dim" in f.reason) for f in prog.sharding.fallbacks] == ([] if sharded else [True])
    out, ref = prog.simulate(x), model(x)
    assert max_rel(out, ref) <= 1e-5
    out.square().sum().backward()
    ref.square().sum().backward()
    assert max(grad_errors(prog.full_grads(), {n: p.grad for n, p in model.named_parameters()}).values()) <= 1e-5
