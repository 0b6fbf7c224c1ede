"""Size-only tables computed once per shape (passes/tables.py) and SDPA's causal path for a mask that
is causal (passes/causal_attention.py), against the single-device model."""
import pytest
import torch
from torch import nn

from autoshard import autoshard
from autoshard.regions.tables import TableCache
from autoshard.testing import build_model, grad_errors, max_rel
from autoshard.testing.models import VOCAB


def _caches(module: nn.Module) -> list[TableCache]:
    return [m for m in module.modules() if isinstance(m, TableCache)]


def _hf_call(ids: torch.Tensor) -> dict:
    return {"input_ids": ids, "labels": (ids * 7 + 3) % VOCAB}


def test_llama_tables_once_per_shape_and_causal_attention():
    """Mask, positions and rotary tables leave the layers' code; attention calls SDPA's causal path
    with the kv heads unrepeated; loss and gradients equal the model's; the tables run once per
    shape (again for a new sequence length, in the same dynamic graph)."""
    model = build_model("llama", layers=2, heads=8, kv_heads=2)
    prog = autoshard(model, tp=2, example_kwargs=_hf_call(torch.randint(0, VOCAB, (2, 16))))
    code = prog.rank(0).code
    assert "self.tables(" in code and "attention(" in code and "repeat = 4" in code
    assert "scaled_dot_product_attention.default" not in code and "cos.default" not in code
    for seq in (16, 16, 11):
        ids = torch.randint(0, VOCAB, (2, seq))
        out, ref = prog.simulate(**_hf_call(ids)), model(**_hf_call(ids))
        assert max_rel(out.loss, ref.loss) <= 1e-6
        out.loss.backward()
        ref.loss.backward()
        errs = grad_errors(prog.full_grads(), {n: p.grad for n, p in model.named_parameters()})
        assert max(errs.values()) <= 1e-5, errs
        model.zero_grad()
        for r in prog.ranks():
            r.zero_grad()
    assert [c.runs for r in prog.ranks() for c in _caches(r)] == [2, 2]


@pytest.mark.parametrize("seq,causal", [(16, False), (4, True)])
def test_sliding_window_mask_is_not_taken_for_causal(seq, causal):
    """Mistral's sliding-window mask is built from sizes alone, so it is cached too; over a window of
    4 with 16 tokens it is not the lower triangle and attention must use it as given."""
    import transformers as hf
    torch.manual_seed(0)
    cfg = hf.MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                           intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=4)
    model = hf.MistralForCausalLM(cfg)
    ids = torch.randint(0, VOCAB, (2, seq))
    prog = autoshard(model, tp=2, example_kwargs=_hf_call(ids))
    out, ref = prog.simulate(**_hf_call(ids)), model(**_hf_call(ids))
    assert max_rel(out.logits, ref.logits) <= 1e-5
    out.loss.backward()
    ref.loss.backward()
    errs = grad_errors(prog.full_grads(), {n: p.grad for n, p in model.named_parameters()})
    assert max(errs.values()) <= 1e-5, errs
    flags = [v for c in _caches(prog.rank(0)) for _, outs in c._memo.values() for v in outs if isinstance(v, bool)]
    assert flags and all(f == causal for f in flags)


class _PositionScaled(nn.Module):
    """A table from a buffer (positions times `scale`) added to the embeddings; returns it too when
    `give_table`: a caller may then change the tensor it got."""

    def __init__(self, give_table: bool = False):
        super().__init__()
        self.give_table = give_table
        self.emb, self.mid, self.head = nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 64)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        table = torch.arange(ids.shape[1]).float() * self.scale                    # [s]
        logits = self.head(torch.relu(self.mid(self.emb(ids) + table[None, :, None])))
        return (logits, table) if self.give_table else logits


def test_a_buffer_loaded_again_recomputes_its_tables():
    model = _PositionScaled()
    ids = torch.randint(0, 64, (2, 8))
    prog = autoshard(model, tp=2, example_inputs=(ids,))
    assert "self.tables(" in prog.rank(0).code
    assert max_rel(prog.simulate(ids), model(ids)) <= 1e-6
    state = model.state_dict()
    state["scale"] = torch.tensor(3.0)
    model.load_state_dict(state)
    prog.load_state_dict(state)
    assert max_rel(prog.simulate(ids), model(ids)) <= 1e-6
    with torch.no_grad():
        for r in prog.ranks():
            r.get_buffer("scale").fill_(-1.0)         # modified in place: a new version of the same tensor
        model.scale.fill_(-1.0)
    assert max_rel(prog.simulate(ids), model(ids)) <= 1e-6


def test_a_table_the_model_returns_is_not_cached():
    model = _PositionScaled(give_table=True)
    ids = torch.randint(0, 64, (2, 8))
    prog = autoshard(model, tp=2, example_inputs=(ids,))
    assert "self.tables(" not in prog.rank(0).code
    _, table = prog.simulate(ids)
    table.add_(100.0)                                 # the caller's tensor; the next call must not see it
    _, again = prog.simulate(ids)
    assert torch.equal(again, model(ids)[1])


def test_microbatches_share_one_table(one_process_group):
    """Four microbatches of a step, and the next step, read the tables computed once."""
    model = build_model("llama", layers=2)
    ids = torch.randint(0, VOCAB, (8, 16))
    prog = autoshard(model, microbatches=4, example_kwargs=_hf_call(ids[:2]))
    rt = prog.distributed()
    for _ in range(2):
        rt.train_step(**_hf_call(ids))
    assert [c.runs for c in _caches(rt._program)] == [1]       # the rank program (not a submodule of rt)
    ref = model(**_hf_call(ids)).loss
    assert max_rel(rt.train_step(**_hf_call(ids)), ref) <= 1e-6


def test_attention_with_dropout_keeps_its_form():
    """SDPA's causal kernel would draw dropout differently: calls with dropout (the tensor-parallel
    RNG's module) are left as they are."""
    model = build_model("llama", layers=1, dropout=0.1)
    prog = autoshard(model, tp=2, example_kwargs=_hf_call(torch.randint(0, VOCAB, (2, 16))))
    code = prog.rank(0).code
    assert "self.tp_rng_scaled_dot_product_attention(" in code and "self.tables(" in code
    assert "kernels_attention_attention" not in code
    model.eval()
    prog.eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    out = prog.simulate(**_hf_call(ids))
    assert max_rel(out.logits, model(**_hf_call(ids)).logits) <= 1e-5
