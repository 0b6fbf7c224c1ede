"""Context parallelism (cp) in simulation: every rank holds 1/cp of each sequence's tokens, attention
gathers keys and values, and the program equals the single-device model: logits, the loss
(token-weighted over the ranks) and every gradient, with a padding mask and -100 labels.

Nine Hugging Face decoders cover the forms the pass reads (autoshard/testing/context_models.py), each
at cp=2, cp=4, cp=2 x tp=2 and cp=2 x pp=2 (and some with recomputation); nanoGPT brings SDPA with
is_causal=True. SDPA
calls run as ring attention (the default) and, in some cases, with the key/value all-gather;
written-out attention (Gemma2, GPT-2 eager, Bloom) always gathers.
"""
import pytest
import torch
from torch import nn

from autoshard import autoshard
from autoshard.errors import ShardingError
from autoshard.parallel.context_parallel import context_positions, rank_order
from autoshard.testing import grad_errors, max_rel
from autoshard.testing.context_models import CONTEXT_MODELS, ONE_MESH, build_context, context_batch
from autoshard.testing.models import build_model

pytest.importorskip("transformers")

MESHES = [dict(cp=2), dict(cp=4), dict(cp=2, tp=2), dict(cp=2, pp=2, microbatches=2)]
CASES = [(name, {**mesh, "cp_attention": "ring"}) for name in sorted(set(CONTEXT_MODELS) - ONE_MESH)
         for mesh in MESHES] + [
    # interleaved rotary (torch.stack), StableLM's per-head norm, MPT's ALiBi (before: each refused)
    *[(name, dict(cp=2, cp_attention="ring")) for name in sorted(ONE_MESH)],
    # SDPA calls as ring attention (above), and with the key/value all-gather:
    ("llama", dict(cp=2, cp_attention="all_gather")), ("falcon", dict(cp=4, cp_attention="all_gather")),
    ("mixtral", dict(cp=2, tp=2, cp_attention="all_gather")), ("qwen2", dict(cp=2, pp=2, cp_attention="all_gather")),
    # expert parallelism over the data axis: one expert group of two cp ranks; two groups in four cp ranks
    ("mixtral", dict(cp=2, ep=2, cp_attention="ring")), ("mixtral", dict(cp=4, ep=2, cp_attention="ring")),
    # sequence parallelism inside each cp rank (static graphs read against a twin export): SDPA with a
    # mask table, GPT-2's position embedding chunk, Falcon's in-place add of two reduce-scatters, Gemma2's
    # written-out attention; and with pp
    *[(name, dict(cp=2, tp=2, sequence_parallel=True, cp_attention="ring")) for name in ("llama", "gpt2", "falcon",
                                                                                        "gemma2")],
    ("qwen2", dict(cp=2, tp=2, pp=2, microbatches=2, sequence_parallel=True, cp_attention="ring")),
    # recomputation: the ring and the gathers run again in backward
    ("llama", dict(cp=2, recompute="full", cp_attention="ring")), ("gemma2", dict(cp=2, tp=2, recompute="selective")),
]
_REFERENCE: dict[str, tuple] = {}       # model -> its single-device logits, loss and gradients (computed once)


def _reference(name: str, batch: dict):
    if name not in _REFERENCE:
        model = build_context(name)
        out = model(**batch)
        out.loss.backward()
        _REFERENCE[name] = (out.logits.detach(), out.loss.detach(),
                            {n: p.grad.clone() for n, p in model.named_parameters()})
    return _REFERENCE[name]


def _check(prog, batch: dict, logits, loss, grads) -> None:
    out = prog.simulate(**batch)
    assert max_rel(out.logits, logits) <= 1e-5
    assert abs(out.loss.item() - loss.item()) <= 1e-5 * abs(loss.item())
    out.loss.backward()
    errs = grad_errors(prog.full_grads(), grads)
    assert max(errs.values()) <= 1e-5, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


def _case_id(name: str, mesh: dict) -> str:
    parts = [name, *(f"{k}{v}" for k, v in mesh.items()
                     if k not in ("cp_attention", "microbatches", "recompute", "sequence_parallel"))]
    parts += ["sp"] if mesh.get("sequence_parallel") else []
    parts += [mesh["recompute"]] if "recompute" in mesh else []
    return "-".join(parts + (["gather"] if mesh.get("cp_attention") == "all_gather" else []))


@pytest.mark.parametrize("name,mesh", CASES, ids=[_case_id(n, m) for n, m in CASES])
def test_context_parallel_equals_one_device(name, mesh):
    batch = context_batch()
    logits, loss, grads = _reference(name, batch)
    prog = autoshard(build_context(name), example_kwargs=batch, **mesh)
    _check(prog, batch, logits, loss, grads)


@pytest.mark.parametrize("attention,op", [("ring", "cp_ring_"), ("all_gather", "causal_attention_at")])
def test_is_causal_sdpa_new_length_and_a_rank_without_tokens(attention, op):
    """nanoGPT calls SDPA with is_causal=True (no mask table): each rank masks by its own positions.
    A second length compiles nothing new (the sequence dim is dynamic); a rank whose tokens are all
    -100 adds nothing to the loss and takes no NaN into the gradients."""
    model, ref = build_model("nanogpt", layers=2), build_model("nanogpt", layers=2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    targets = torch.randint(0, 128, (2, 16), generator=g)
    prog = autoshard(model, cp=2, example_kwargs=dict(idx=ids, targets=targets), cp_attention=attention)
    assert op in prog.rank(0, cp_rank=1).code
    for seq in (16, 32):
        ids = torch.randint(0, 128, (2, seq), generator=g)
        targets = torch.randint(0, 128, (2, seq), generator=g)
        if seq == 32:       # rank 0 holds positions 0-7 and 24-31
            targets[:, :8] = -100
            targets[:, 24:] = -100
        out, want = prog.simulate(ids, targets=targets), ref(ids, targets=targets)
        assert max_rel(out[0], want[0]) <= 1e-5 and abs(out[1].item() - want[1].item()) <= 1e-5 * want[1].item()
        for p in list(ref.parameters()) + [p for r in prog._replicas().ranks() for p in r.parameters()]:
            p.grad = None
        out[1].backward()
        want[1].backward()
        errs = grad_errors(prog.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
        assert max(errs.values()) <= 1e-5


def test_the_comparison_fails_when_the_tokens_come_back_in_the_wrong_order(monkeypatch):
    """The equivalence check can fail: join the ranks' logits in rank order instead of position order."""
    import autoshard.compile.data_replicas as replicas
    batch = context_batch()
    logits, _, _ = _reference("llama", batch)
    prog = autoshard(build_context("llama"), example_kwargs=batch, cp=2, cp_attention="ring")
    monkeypatch.setattr(replicas, "rank_order", lambda seq, cp, device=None: torch.arange(seq))
    assert max_rel(prog.simulate(**batch).logits, logits) > 1e-2


def test_load_balanced_pieces_give_every_rank_the_same_causal_work():
    """Rank r holds pieces r and 2cp-1-r: disjoint, covering, and under a causal mask each rank
    scores the same number of (query, key) pairs (contiguous chunks would give the last rank
    2cp-1 times the first's)."""
    seq = 64
    for cp in (2, 4, 8):
        held = [context_positions(seq, cp, r) for r in range(cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(seq))
        work = [int((p + 1).sum()) for p in held]       # query at position p sees p + 1 keys
        assert max(work) / (sum(work) / cp) <= 1.02, work
        gathered = torch.cat(held)                      # what an all-gather returns, rank after rank
        assert gathered[rank_order(seq, cp)].tolist() == list(range(seq))


def test_rank_code_shows_the_cut_the_rings_and_the_gathers():
    batch = context_batch()
    ring = autoshard(build_context("llama"), example_kwargs=batch, cp=2, cp_attention="ring").rank(0, cp_rank=1).code
    assert "context_positions(" in ring and ", 2, 1," in ring     # cp=2, rank 1's positions
    assert ring.count("= self.cp_ring_") == 2 and "cp_gather_" not in ring     # one ring per layer
    gather = autoshard(build_context("llama"), example_kwargs=batch, cp=2, cp_attention="all_gather")
    assert gather.rank(0, cp_rank=1).code.count("= self.cp_gather_") == 4      # keys and values of 2 layers
    assert "tp=1 x cp=2 x pp=1 x dp=1, world size 2" in str(gather)
    assert "0 ring attention calls, 4 key/value all-gathers" in str(gather)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_print_counts_the_collectives_recomputed_regions_run(recompute):
    """Regression: with recompute="full", print(prog) said "0 ring attention calls" (and 0 f, 0 g)
    while each rank ran two rings: it counted the rank graph's own nodes, not its regions' bodies."""
    batch = context_batch()
    plain = str(autoshard(build_context("llama"), example_kwargs=batch, cp=2, tp=2, cp_attention="ring"))
    again = str(autoshard(build_context("llama"), example_kwargs=batch, cp=2, tp=2, cp_attention="ring",
                          recompute=recompute))
    assert "2 ring attention calls" in plain and "2 ring attention calls" in again, again
    collectives = [line for line in plain.splitlines() if line.startswith("collectives per rank")]
    assert collectives and collectives[0] in again.splitlines(), again


def test_refusals_name_the_numbers_and_the_node():
    batch = context_batch(seq=14)
    prog = autoshard(build_context("llama"), example_kwargs=context_batch(), cp=2)
    with pytest.raises(ShardingError, match="2 \\* cp = 4 equal pieces, but the sequence has 14 tokens"):
        prog.simulate(**batch)
    with pytest.raises(ShardingError, match="each rank's 12 / cp tokens over tp=4 ranks; pad it to a multiple of 16"):
        autoshard(build_context("llama"), example_kwargs=context_batch(seq=12), cp=2, tp=4, sequence_parallel=True)
    with pytest.raises(ShardingError, match="ep=4 must divide dp x cp = 1 x 2 = 2"):
        autoshard(build_context("mixtral"), example_kwargs=context_batch(), cp=2, ep=4)


class _CumulativeMean(nn.Module):
    """A model that averages its hidden states over the tokens so far (a scan over the sequence)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 16)
        self.head = nn.Linear(16, 128)

    def forward(self, ids):
        h = self.emb(ids).cumsum(1)
        return self.head(h)


def test_a_scan_over_the_tokens_is_refused_naming_the_node():
    with pytest.raises(ShardingError, match=r"node cumsum \(cumsum\).*reads along dim 1"):
        autoshard(_CumulativeMean(), cp=2, example_inputs=(torch.randint(0, 128, (2, 16)),))


@pytest.mark.parametrize("form", ["bool-mask", "additive-mask", "causal", "gqa-causal", "no-mask", "causal-float64"])
@pytest.mark.parametrize("overlap", [True, False])
def test_ring_attention_equals_sdpa(form, overlap):
    """The ring (blocks merged by their log-sum-exp, dk / dv travelling home) against SDPA on every
    token: outputs and q, k, v gradients, with the sends overlapped or not. The additive mask has a
    row whose every key is the dtype's lowest value, where SDPA's backward reads p = 1 per key.
    Regression (causal-float64): the fused pieces kept float32 log-sum-exps, which the float64
    backward refused (what `autoshard verify` runs an unpadded batch in)."""
    from autoshard.parallel.comm import SIMULATED
    from autoshard.parallel.ring_attention import ring_attention
    g = torch.Generator().manual_seed(5)
    b, h, seq, e, cp = 2, 4, 24, 8, 3
    hk = 2 if form == "gqa-causal" else h
    dtype = torch.float64 if form.endswith("float64") else torch.float32
    q, k, v = (torch.randn(b, n, seq, e, generator=g, dtype=dtype, requires_grad=True) for n in (h, hk, hk))
    causal = "causal" in form
    mask = None
    if form == "bool-mask":
        mask = torch.rand(b, 1, seq, seq, generator=g) > 0.3
        mask[0, 0, 5] = False                                   # a row that sees no key: 0, as SDPA
    elif form == "additive-mask":
        mask = torch.randn(b, h, seq, seq, generator=g).masked_fill(torch.rand(b, h, seq, seq, generator=g) > 0.6,
                                                                    torch.finfo(torch.float32).min)
        mask[1, :, 4] = torch.finfo(torch.float32).min
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                            enable_gqa=hk < h)
    dout = torch.randn(want.shape, generator=g, dtype=dtype)
    grads = torch.autograd.grad(want, (q, k, v), dout)
    pos = [context_positions(seq, cp, r) for r in range(cp)]
    outs = ring_attention(SIMULATED, [q[:, :, p] for p in pos], [k[:, :, p] for p in pos], [v[:, :, p] for p in pos],
                          pos, None if mask is None else [mask[:, :, p] for p in pos], scale=e ** -0.5, causal=causal,
                          overlap=overlap)
    got = torch.zeros_like(want)
    for p, o in zip(pos, outs):
        got = got.index_copy(2, p, o)
    assert (got - want).abs().max() <= 1e-5
    for mine, theirs in zip(torch.autograd.grad(got, (q, k, v), dout), grads):
        assert (mine - theirs).abs().max() <= 1e-5 * max(1.0, theirs.abs().max().item())


def test_a_causal_mask_table_runs_the_ring_in_pieces(monkeypatch):
    """Without padding, a Hugging Face mask table is the causal one: the ring reads it from the
    positions and runs fused attention per piece pair (no [L, L] scores), equal to one device."""
    import autoshard.parallel.ring_attention as ring
    calls = []
    real = ring.ring_pieces
    monkeypatch.setattr(ring, "ring_pieces", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, ref = build_context("llama"), build_context("llama")
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(4))
    prog = autoshard(model, cp=2, example_kwargs=dict(input_ids=ids, labels=ids), cp_attention="ring")
    out, want = prog.simulate(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert calls and max_rel(out.logits, want.logits) <= 1e-5
    out.loss.backward()
    want.loss.backward()
    errs = grad_errors(prog.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
    assert max(errs.values()) <= 1e-5


def test_dropout_streams_differ_per_context_parallel_rank():
    """cp ranks hold different tokens: each region's dropout stream differs between them, while the
    tensor-parallel ranks of one cp rank still draw the same replicated-region masks."""
    prog = autoshard(build_context("llama"), example_kwargs=context_batch(), cp=2, tp=2)
    seeds = {(t, c): prog.rank(t, cp_rank=c).rng.seeds for t in range(2) for c in range(2)}
    assert seeds[(0, 0)]["replicated"] == seeds[(1, 0)]["replicated"] != seeds[(0, 1)]["replicated"]
    assert len({s["tensor_parallel"] for s in seeds.values()}) == 4


class _PairTokens(nn.Module):
    """A model that merges each two neighbouring tokens into one (a pooling over the sequence)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 16)
        self.head = nn.Linear(32, 128)

    def forward(self, ids):
        h = self.emb(ids)
        b, s, c = h.shape
        return self.head(h.reshape(b, s // 2, 2 * c))


def test_a_view_that_pairs_neighbouring_tokens_is_refused():
    """Merging tokens with the batch is fine; merging them with each other would pair tokens of
    different pieces on a rank: refused, naming the node."""
    with pytest.raises(ShardingError, match=r"node reshape \(reshape\) in <top> \(_PairTokens\)"):
        autoshard(_PairTokens(), cp=2, example_inputs=(torch.randint(0, 128, (2, 16)),))


def test_auto_lets_the_cost_model_choose_the_exchange_per_call():
    """cp_attention="auto" (the default): at 16 tokens over cp=4 the ring's three steps cost more than
    they hide, so the keys are gathered; at 1024 tokens the ring's sends hide behind its blocks."""
    short = autoshard(build_context("llama"), example_kwargs=context_batch(), cp=4).rank(0).code
    assert "cp_gather_" in short and "cp_ring_" not in short
    long = autoshard(build_context("llama", max_position_embeddings=1024), example_kwargs=context_batch(seq=1024),
                     cp=4).rank(0).code
    assert "cp_ring_" in long and "cp_gather_" not in long
    with pytest.raises(ShardingError, match="cp_attention must be 'ring', 'all_gather' or 'auto', got 'p2p'"):
        autoshard(build_context("llama"), example_kwargs=context_batch(), cp=2, cp_attention="p2p")


def test_a_new_signature_after_the_model_is_released_runs_on_the_weights_device():
    """Regression: at cp=2 x dp=2 with one row per data-parallel rank, `train_step` on a program of a
    model built inline failed: the new signature (batch 1, specialized) was traced from the released
    model's meta skeleton, and the compiler read the experts' paths off the model it no longer held
    ('distributed() let it go'), then placed the ranks' token positions on the meta device."""
    import gc
    import weakref
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = build_model("llama", layers=2)
    prog = autoshard(build_model("llama", layers=2), cp=2, example_kwargs={"input_ids": ids, "labels": ids})
    prog.simulate(input_ids=ids, labels=ids)          # every rank cut, as distributed() cuts this process's
    gone = weakref.ref(prog.model)
    prog._release()                                   # what distributed() does once its rank is cut
    gc.collect()
    assert gone() is None
    got = prog.simulate(input_ids=ids[:1], labels=ids[:1]).loss
    assert max_rel(got, ref(input_ids=ids[:1], labels=ids[:1]).loss) <= 1e-5
