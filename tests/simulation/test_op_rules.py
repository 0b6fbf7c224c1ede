"""Each sharding rule of the op table added for the models people train now, on the op alone: a
column-parallel Linear, the op, a row-parallel Linear, at tp=2 against the single-device module
(outputs and gradients), with the weights split as a Megatron MLP's are. The models that use them
are tests/simulation/test_current_models.py."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoshard import ShardingError, autoshard
from autoshard.kernels.expert_matmul_ops import selected_linear
from autoshard.passes.rewrite import edits
from autoshard.passes.sharding.placement import PartialStatistic
from autoshard.testing import grad_errors, max_rel

D, H, HD = 16, 4, 8           # model width, heads, head size: the column side is H * HD = 32 wide


class _Around(nn.Module):
    """up (column) -> op -> down (row), with the op's own parameters if it has any."""

    def __init__(self, op, **params):
        super().__init__()
        self.up, self.down, self.op = nn.Linear(D, H * HD), nn.Linear(H * HD, D), op
        for name, value in params.items():
            setattr(self, name, nn.Parameter(value))

    def forward(self, x):
        return self.down(self.op(self, self.up(x)))


def _heads(h):
    return h.view(*h.shape[:-1], H, HD)              # (B, T, nh, hs)


def _flat(h):
    return h.reshape(*h.shape[:2], H * HD)


def _max_over_head_features(m, h):
    values, idx = _heads(h).max(dim=-1, keepdim=True)
    return _flat(_heads(h) - values + idx.to(h.dtype) * 0.01)


def _min_with_a_tensor(m, h):
    return torch.min(h, m.cap) + torch.max(h, -m.cap)      # min.other / max.other


def _amax_and_argmax(m, h):
    return _flat(_heads(h) * _heads(h).argmax(dim=-1, keepdim=True).to(h.dtype) - _heads(h).amax(-1, keepdim=True))


def _topk_within_heads(m, h):
    values, _ = _heads(h).topk(2, dim=-1)
    return _flat(_heads(h) - values.sum(-1, keepdim=True))


def _in_place(m, h):
    h = h.clone()
    h.mul_(2.0)
    h.add_(m.bias)
    h.sub_(1.0)
    return h


def _copy_into_new_empty(m, h):
    """DeepSeek's keys: per-head features and a part shared by all heads, copied into a new tensor."""
    q = _heads(h)
    out = q.new_empty(*q.shape[:-1], HD + 2)
    out[..., :HD].copy_(q)
    out[..., HD:].copy_(m.shared.expand(*q.shape[:-1], 2))
    return _flat(out[..., 1:HD + 1])


def _cat_with_shared(m, h):
    """MLA's keys: per-head features concatenated with a part every head shares, expanded over heads."""
    q = _heads(h)
    k = torch.cat([q, m.shared.expand(*q.shape[:-1], 2)], dim=-1)     # (B, T, nh, hs + 2)
    return _flat(k[..., 2:] * k[..., :HD].sum(-1, keepdim=True))


def _complex_rotary(m, h):
    q = torch.view_as_complex(_heads(h).float().reshape(*h.shape[:2], H, HD // 2, 2))
    angles = torch.arange(h.shape[1], dtype=torch.float32)[:, None] * torch.arange(1, HD // 2 + 1)
    freqs = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]   # (1, T, 1, hs/2)
    return _flat(torch.view_as_real(q * freqs).flatten(3))


def _repeat_heads(m, h):
    half = _heads(h)[..., : HD // 2]                                # (B, T, nh, hs/2)
    return _flat(torch.cat([half.repeat(1, 1, 1, 2)[..., : HD // 2], half.repeat_interleave(1, dim=2)], -1))


def _every_other_column(m, h):
    """gpt-oss's interleaved gate and up columns, widened back by repeat_interleave."""
    gate, up = h[..., ::2], h[..., 1::2]
    return (gate * torch.sigmoid(gate) * (up + 1)).repeat_interleave(2, dim=-1)


def _pad_features_of_heads(m, h):
    return _flat(F.pad(_heads(h), (0, 0, 0, 0, 1, 0))[:, 1:])


def _norm_over_all_heads(m, h):
    """OLMo 2's q_norm: an RMSNorm over every head's features, then the heads."""
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * m.scale
    return _flat(torch.tanh(_heads(normed)))


def _per_head_norms(m, h):
    pieces = _heads(h).transpose(1, 2).split(1, dim=1)             # nh pieces of (B, 1, T, hs)
    normed = [F.layer_norm(p, (HD,), m.w[i], m.b[i]) for i, p in enumerate(pieces)]
    return _flat(torch.cat(normed, dim=1).transpose(1, 2))


def _alias_spellings(m, h):
    """torch.multiply and torch.concatenate (aten.multiply / aten.concatenate), as * and torch.cat:
    regression, both were "no sharding rule" and kept the linears whole."""
    q = _heads(h)
    k = torch.concatenate([q, m.shared.expand(*q.shape[:-1], 2)], dim=-1)     # (B, T, nh, hs + 2)
    return _flat(torch.multiply(k[..., 2:], torch.subtract(k[..., :HD], 1.0).sum(-1, keepdim=True)))


def _depthwise_conv(m, h):
    """Mamba's and the short convolutions' causal depthwise conv over the sequence, channels split."""
    c = F.conv1d(h.transpose(1, 2), m.conv_w, m.conv_b, padding=2, groups=H * HD)     # (B, C, T + 2)
    return c[..., :h.shape[1]].transpose(1, 2)


def _norm_between_projections(m, h):
    """BitNet's attn_sub_norm / ffn_sub_norm: an RMSNorm over the whole width between two projections
    of full width. Before: kept whole as "a low-rank down-projection"; now a distributed norm."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * m.scale


def _chunked(m, h):
    """Mamba-2's chunks: positions regrouped in front of the heads, [B, T, nh, hs] -> [B, T/2, 2, nh,
    hs] (sizes sympy cannot equate to T's), the heads kept."""
    b, t = h.shape[:2]
    return _flat(torch.tanh(_heads(h).reshape(b, t // 2, 2, H, HD)).reshape(b, t, H, HD))


def _cumsum_within_heads(m, h):
    """Mamba-2's segment sums: a scan along the positions (and one along a head's features)."""
    return _flat(torch.cumsum(_heads(h), dim=1) - torch.cumsum(_heads(h), dim=-1))


def _einsum_over_heads(m, h):
    """Mamba-2's einsums over activations, the heads a subscript every operand and the output keep."""
    q = _heads(h)
    return _flat(torch.einsum("bthd,bthe->bthde", q, q.tanh()).mean(-1))


def _groups_to_heads(m, h):
    """Bamba's B and C: groups repeated to heads with output_size (the whole heads count)."""
    g = _heads(h)[:, :, ::2]                                              # (B, T, nh/2, hs): a group per 2 heads
    return _flat(g.repeat_interleave(2, dim=2, output_size=H) * _heads(h))


def _triangle_per_head(m, h):
    """A causal mask of each head's chunk scores: tril / triu of the last two dims."""
    x = _heads(h).transpose(1, 2)                                          # (B, nh, T, hs)
    s = x @ x.transpose(-1, -2)                                            # (B, nh, T, T)
    return _flat(((s.tril() - s.triu(1) * 0.5) @ x).transpose(1, 2))


def _pieces_joined(m, h):
    """Qwen3-Next's q and v: pieces of each head of different widths, flattened, joined with cat along
    the split features and scaled channel by channel (a depthwise conv's weight), then split apart."""
    x = _heads(h)
    q, v = x[..., :2].reshape(*h.shape[:2], -1), x[..., 2:].reshape(*h.shape[:2], -1)    # (B, T, 2nh), (B, T, 6nh)
    joined = torch.cat([q, v], dim=-1) * m.scale                                         # (B, T, 8nh)
    q, v = joined.split([2 * H, 6 * H], dim=-1)
    return torch.cat([v, q.tanh()], dim=-1)


def _rows_flattened(m, h):
    """Qwen3-Next's gated norm: every head's features as a row of [B*T*nh, hs], gated by another view
    of the heads, then back to (B, T, nh, hs)."""
    rows, gate = _heads(h).reshape(-1, HD), _heads(h.tanh()).reshape(-1, HD)
    y = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6) * m.w * F.silu(gate.float())
    return _flat(y.reshape(*h.shape[:2], H, HD))


def _batch_and_heads_merged(m, h):
    """Bloom's attention: batch and heads merged into one dim for baddbmm (a per-head bias from a
    [B, heads, T] reshape, alpha and beta) and bmm, unmerged by views."""
    B, T = h.shape[:2]
    q, k = _heads(h).transpose(1, 2), _heads(h.tanh()).transpose(1, 2)      # (B, nh, T, hs)
    bias = (m.slopes[:, None] * torch.arange(T, dtype=h.dtype).expand(B, 1, T)).reshape(B * H, 1, T)
    s = torch.baddbmm(bias, q.reshape(B * H, T, HD), k.reshape(B * H, T, HD).transpose(1, 2), beta=0.5, alpha=0.25)
    p = s.view(B, H, T, T).softmax(-1)
    out = torch.bmm(p.view(B * H, T, T), q.reshape(B * H, T, HD)).view(B, H, T, HD)
    return _flat(out.transpose(1, 2))


def _relative_scores(m, h):
    """DeBERTa-v2's content-to-position scores: position keys of the heads repeated per sample,
    scores gathered along the keys by an index expanded over batch and heads."""
    B, T = h.shape[:2]
    q = _heads(h).transpose(1, 2).reshape(B * H, T, HD)                     # (B*nh, T, hs)
    pos = _heads(torch.sin(h[:1])).transpose(1, 2).reshape(-1, T, HD)       # (nh, T, hs): sample 0's
    scores = torch.bmm(q, pos.repeat(B, 1, 1).transpose(-1, -2))            # (B*nh, T, T)
    rel = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp(0, T - 1)
    c2p = torch.gather(scores, -1, rel.unsqueeze(0).expand(B * H, T, T))
    p = (c2p / 4).view(B, H, T, T).softmax(-1)
    return _flat(torch.matmul(p, _heads(h).transpose(1, 2)).transpose(1, 2))


# the ops' own parameters from a fixed seed, not from whatever state the collection left (one such
# draw put new_empty+copy_'s `shared` gradient, a sum over every position, 2.4e-5 off: over 1e-5)
with torch.random.fork_rng():
    torch.manual_seed(0)
    CASES = {
        "max.dim": (_max_over_head_features, {}),
        "min.other": (_min_with_a_tensor, {"cap": torch.tensor(0.3)}),
        "argmax/amax": (_amax_and_argmax, {}),
        "topk": (_topk_within_heads, {}),
        "in-place": (_in_place, {"bias": torch.randn(H * HD)}),
        "new_empty+copy_": (_copy_into_new_empty, {"shared": torch.randn(2)}),
        "view_as_complex": (_complex_rotary, {}),
        "cat with a shared part": (_cat_with_shared, {"shared": torch.randn(2)}),
        "repeat": (_repeat_heads, {}),
        "strided slice": (_every_other_column, {}),
        "pad": (_pad_features_of_heads, {}),
        "distributed norm": (_norm_over_all_heads, {"scale": torch.rand(H * HD) + 0.5}),
        "alias ops": (_alias_spellings, {"shared": torch.randn(2)}),
        "depthwise conv1d": (_depthwise_conv, {"conv_w": torch.randn(H * HD, 1, 3), "conv_b": torch.randn(H * HD)}),
        "norm between projections": (_norm_between_projections, {"scale": torch.rand(H * HD) + 0.5}),
        "chunked positions": (_chunked, {}),
        "tril / triu per head": (_triangle_per_head, {}),
        "cumsum": (_cumsum_within_heads, {}),
        "einsum over heads": (_einsum_over_heads, {}),
        "repeat_interleave output_size": (_groups_to_heads, {}),
        "cat along the split features": (_pieces_joined, {"scale": torch.rand(H * HD) + 0.5}),
        "rows of the heads flattened": (_rows_flattened, {"w": torch.rand(HD) + 0.5}),
        "batch and heads merged for bmm": (_batch_and_heads_merged, {"slopes": torch.rand(H)}),
        "gather along the keys": (_relative_scores, {}),
    }


def _check(model, x, sharded, tp=2):
    model(x).square().mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    prog = autoshard(model, tp=tp, example_inputs=(x,))
    assert prog.sharding.fallbacks == [], prog.sharding.fallbacks
    assert set(sharded) <= set(prog.sharding.params), set(sharded) - set(prog.sharding.params)
    out = prog.simulate(x)
    assert max_rel(out, model(x)) <= 1e-5
    out.square().mean().backward()
    errs = grad_errors(prog.full_grads(), ref)
    assert max(errs.values()) <= 1e-5, errs
    return prog


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_between_column_and_row_parallel_linears(case):
    op, params = CASES[case]
    torch.manual_seed(0)
    model = _Around(op, **params)
    _check(model, torch.randn(2, 6, D), ["up.weight", "up.bias", "down.weight"])


def test_per_head_layer_norm_modules_split_with_the_heads():
    torch.manual_seed(0)
    model = _Around(_per_head_norms, w=torch.rand(H, HD) + 0.5, b=torch.randn(H, HD))
    prog = _check(model, torch.randn(2, 6, D), ["up.weight", "down.weight"])
    assert "per_head_layer_norm" in str(prog.rank(0).graph_module.code)


def test_a_norm_over_all_heads_sums_its_statistic_and_fails_without_it(monkeypatch):
    """The distributed norm's all-reduce (g on each rank's mean) is what makes it right: dropped,
    each rank normalizes by its own features' mean and the output is wrong."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, D)
    model = _Around(_norm_over_all_heads, scale=torch.rand(H * HD) + 0.5)
    prog = _check(model, x, ["up.weight", "scale", "down.weight"])
    assert "self.g(mean)" in prog.rank(0).graph_module.code
    row = edits.EDITS[PartialStatistic]
    monkeypatch.setitem(edits.EDITS, PartialStatistic, edits.Edit(row.phase, None, lambda rw, call, e, new: new))
    broken = autoshard(model, tp=2, example_inputs=(x,))
    assert max_rel(broken.simulate(x), model(x)) > 1e-2


class _Experts(nn.Module):
    """Stacked expert weights read three ways: bmm on [experts, in, out] (Llama 4), one expert's
    weight selected in a loop (JetMoE), and a bias gathered by expert id added in place (gpt-oss)."""

    def __init__(self, experts=2):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, D, H * HD) * 0.2)     # [experts, in, out]
        self.w2 = nn.Parameter(torch.randn(experts, H * HD, D) * 0.2)
        self.sel_up = nn.Parameter(torch.randn(experts, H * HD, D) * 0.2)  # [experts, out, in]
        self.sel_down = nn.Parameter(torch.randn(experts, D, H * HD) * 0.2)
        self.bias = nn.Parameter(torch.randn(experts, H * HD))

    def forward(self, x):                                  # x (experts, tokens, D)
        ids = torch.arange(x.shape[0]).repeat_interleave(x.shape[1])
        h = torch.bmm(x, self.w1).view(-1, H * HD)         # (experts * tokens, H * HD)
        h.add_(self.bias[ids])
        y = torch.bmm(F.silu(h).view(*x.shape[:2], -1), self.w2)
        z = torch.stack([F.linear(F.gelu(F.linear(x[e], self.sel_up[e])), self.sel_down[e])
                         for e in range(x.shape[0])])
        return y + z


def test_stacked_expert_weights_split_like_linear_layers():
    torch.manual_seed(0)
    model = _Experts()
    x = torch.randn(2, 5, D)
    model(x).square().mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    prog = autoshard(model, tp=2, example_inputs=(x,))
    assert prog.sharding.params["w1"].dim == 2 and prog.sharding.params["w2"].dim == 1
    assert prog.sharding.params["sel_up"].dim == 1 and prog.sharding.params["sel_down"].dim == 2
    assert prog.sharding.params["bias"].dim == 1
    out = prog.simulate(x)
    assert max_rel(out, model(x)) <= 1e-5
    out.square().mean().backward()
    assert max(grad_errors(prog.full_grads(), ref).values()) <= 1e-5
    assert selected_linear.__name__ in str(prog.rank(0).graph_module.code)


@pytest.mark.parametrize("softmax_first", [False, True])      # gpt-oss's order, Mixtral's
def test_a_router_top_k_over_its_experts_is_whole_by_design(softmax_first):
    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.out = nn.Linear(D, 4), nn.Linear(2, D)

        def forward(self, x):
            logits = self.gate(x)
            if softmax_first:
                return self.out(logits.softmax(-1).topk(2, dim=-1).values)
            return self.out(logits.topk(2, dim=-1).values.softmax(-1))
    prog = autoshard(Router(), tp=2, example_inputs=(torch.randn(2, 6, D),))
    (f,) = prog.sharding.fallbacks
    assert f.by_design and "router" in f.reason and "gate" in f.modules[0]
    assert "whole by design (replicated): gate (Linear)" in str(prog)


def test_writing_sharded_values_into_a_replicated_tensor_is_refused_not_run():
    class Accumulate(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(D, H * HD), nn.Linear(H * HD, D)

        def forward(self, x):
            acc = torch.zeros(*x.shape[:-1], H * HD)
            acc.add_(self.up(x))
            return self.down(acc)
    torch.manual_seed(0)
    model, x = Accumulate(), torch.randn(2, 6, D)
    prog = autoshard(model, tp=2, example_inputs=(x,))
    assert max_rel(prog.simulate(x), model(x)) <= 1e-5
    reasons = [f.reason for f in prog.sharding.fallbacks]
    assert any("add_" in r and "in place" in r for r in reasons), reasons


class _QueriesWithoutARule(nn.Module):
    """Eager grouped-query attention (4 query heads, 2 kv heads) whose queries and keys go through an
    op the table has no rule for (cummax): they stay replicated, and only the values are split."""

    def __init__(self, d=32, heads=4, kv=2):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv, d // heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, kv * self.hd), nn.Linear(d, kv * self.hd)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.h, self.hd).transpose(1, 2)       # (B, nh, T, hs)
        k = self.k(x).view(B, T, self.kv, self.hd).transpose(1, 2)      # (B, nkv, T, hs)
        v = self.v(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        q, k = torch.cummax(q, -1).values, torch.cummax(k, -1).values
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        a = (q @ k.transpose(-1, -2)).softmax(-1) @ v
        return self.o(a.transpose(1, 2).reshape(B, T, C))


def test_a_refusal_names_the_op_without_a_rule_first():
    # before: "tp=4 cannot split the input of node linear_3 (module o): ... the attention heads must
    # be divisible by tp=4 ..." although its 4 query heads divide by 4 (gpt-oss at tp=4, whose
    # attention-sink max had no rule)
    with pytest.raises(ShardingError) as e:
        autoshard(_QueriesWithoutARule(), tp=4, example_inputs=(torch.randn(2, 5, 32),))
    text = str(e.value)
    assert text.startswith("node cummax") and "no sharding rule for aten.cummax" in text
    assert "tp=4 cannot split the input of node linear_3" in text


def test_a_convolution_that_mixes_channels_stays_whole_saying_why():
    """groups=1: every output channel reads every input channel, so the projection before it stays
    whole (exact), and the fallback says the convolution is not depthwise."""
    torch.manual_seed(0)
    conv = lambda m, h: F.conv1d(h.transpose(1, 2), m.conv_w, padding=1).transpose(1, 2)    # noqa: E731
    model = _Around(conv, conv_w=torch.randn(H * HD, H * HD, 3) / 8)
    x = torch.randn(2, 6, D)
    prog = autoshard(model, tp=2, example_inputs=(x,))
    (fallback,) = prog.sharding.fallbacks
    assert "not depthwise: groups=1, weight [32, 32, 3] for 32 channels" in fallback.reason, fallback
    assert max_rel(prog.simulate(x), model(x)) <= 1e-5


class _WeightFirst(nn.Module):
    """Mamba-1's `dt_proj.weight @ time_step.transpose(1, 2)`: the weight on the left, its rows the
    output features in dim -2, then a row-parallel projection."""

    def __init__(self):
        super().__init__()
        self.w, self.down = nn.Parameter(torch.randn(H * HD, D) / 4), nn.Linear(H * HD, D)

    def forward(self, x):
        return self.down(torch.tanh(self.w @ x.transpose(1, 2)).transpose(1, 2))     # (B, H*HD, T) -> (B, T, D)


def test_a_weight_on_the_left_of_a_matmul_starts_a_column_parallel_region():
    # before: "w (32, 16): matmul reads it whole (no tensor-parallel region reaches it)"
    torch.manual_seed(0)
    _check(_WeightFirst(), torch.randn(2, 6, D), ["w", "down.weight"])


class _FusedQKVUnbound(nn.Module):
    """ModernBERT's Wqkv: one projection viewed as [.., 3, heads, hd] and unbound into q, k, v."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * H * HD), nn.Linear(H * HD, D)

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, H, HD).unbind(dim=2)       # each (B, T, nh, hs)
        return self.o(_flat(torch.tanh(q * k) + v))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_fused_projection_viewed_as_three_blocks_of_heads_splits_with_the_heads(tp):
    # before: "tp=2 cannot shard node linear (module qkv): tp=2 does not divide 3 blocks of 64", an
    # error, though the 4 heads divide by 2 and 4; then "no sharding rule for aten.unbind.int"
    torch.manual_seed(0)
    _check(_FusedQKVUnbound(), torch.randn(2, 6, D), ["qkv.weight", "qkv.bias", "o.weight"], tp=tp)


class _GatedByOneScore(nn.Module):
    """A shared expert's gate: one score per token (Linear(D, 1)) scaling a Megatron MLP."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.gate = nn.Linear(D, H * HD), nn.Linear(H * HD, D), nn.Linear(D, 1)

    def forward(self, x):
        return self.down(F.silu(self.up(x))) * torch.sigmoid(self.gate(x))


def test_a_projection_to_fewer_features_than_ranks_is_whole_without_a_fallback():
    # before: the gate was a column-parallel root of one feature, padded to tp, and abandoned as
    # "would cut a replicated operand at padded positions" (a fallback not by design)
    torch.manual_seed(0)
    prog = _check(_GatedByOneScore(), torch.randn(2, 6, D), ["up.weight", "down.weight"])
    assert "gate.weight" not in prog.sharding.params


def test_flattened_rows_are_kept_in_their_shape_only_when_every_op_is_row_wise():
    from autoshard.passes.merged_dims import keep_merged_dims

    def export(fn):
        class M(nn.Module):
            def forward(self, h):
                return fn(h)
        return torch.export.export(M(), (torch.randn(2, 6, H, HD),)).module()

    def gated(h):
        rows = h.reshape(-1, HD)
        return (rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True)) * F.silu(h.reshape(-1, HD))).reshape(h.shape)

    def mixes_rows(h):                    # softmax over the flattened dim: each row depends on the others
        return h.reshape(-1, HD).softmax(0).reshape(h.shape)

    for fn, regions in ((gated, 1), (mixes_rows, 0)):
        gm, h = export(fn), torch.randn(2, 6, H, HD)
        assert keep_merged_dims(gm) == regions, fn.__name__
        flat = [n for n in gm.graph.nodes if n.op == "call_function" and len(n.meta["val"].shape) == 2]
        assert (flat == []) == (regions == 1), fn.__name__
        assert torch.allclose(gm(h), fn(h), rtol=1e-6, atol=1e-6)
