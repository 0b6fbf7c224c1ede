"""The comparison itself: the program's every rank, in one process, against the single-device model.

The step is cut as the runtime cuts it (runtime/batching.py's split_batch: data-parallel slices, then
microbatches) and each piece's mean loss weighted by its share of the counted tokens (the runtime's
own loss_tokens / loss_factors), so what is compared is the runtime's arithmetic, not a convenient
equivalent. Every piece runs all ranks in lockstep (`prog.simulate`: tensor-parallel ranks with
their collectives, pipeline stages in turn, expert- and context-parallel replicas); one backward of
the weighted sum reaches every rank's shards.

Then each rank's gradient shard is compared with the same slice of the model's gradient (every rank:
rows two ranks hold must both be right), and an AdamW step is taken on each rank's shards and on
the model, and the updated shards compared. With expert or context parallelism a rank's gradient is
its replica's part of the batch only (the runtime sums them over the data ranks): there the
reassembled, summed gradients are compared, the step is taken on them and the stepped weights are
loaded back into every replica.

Several steps are taken, one per batch, each optimizer keeping its state: a bug that needs weights
the program itself has moved (a copy of a weight the step does not reach, a term that is zero only
at the initial values) shows from the second step. Each item is the worst over the steps and names
the step it was found in.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import nn

from autoshard.compile.rank import slice_layout
from autoshard.runtime.batching import pick_loss, split_batch
from autoshard.runtime import loss_tokens
from autoshard.testing.metrics import max_rel, norm_rel, scaled_errors
from autoshard.verify.certificate import Item, worst_by_group

__all__ = ["compare_steps", "microbatch_reference", "tp_slice", "STEP"]

# AdamW's settings for the step compared. Adam's update lr * g / (|g| + eps) turns a rounding
# difference dg of a gradient near eps into lr * dg / (4 eps) of weight: eps well above the gradients'
# float noise keeps the step a check of where each shard goes and how it moves, not of that ratio.
STEP = dict(lr=1e-3, eps=1e-4, weight_decay=0.1)


def _per_slice(prog, inputs: dict[str, torch.Tensor]) -> list[list[dict[str, torch.Tensor]]]:
    """The runtime's cut of the global batch: each data slice's microbatches."""
    return [split_batch(s, prog.microbatches, "microbatches") for s in split_batch(inputs, prog.dp, "dp")]


def _pieces(prog, inputs: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The runtime's cut of the global batch: data slice d's microbatch i, for every (d, i); with
    replicas in the simulator (ep, cp) the data slices' microbatch i together, as one call."""
    per_slice = _per_slice(prog, inputs)
    if prog.dims.ep > 1 or prog.cp > 1:
        return [{k: torch.cat([mbs[i][k] for mbs in per_slice]) if isinstance(v, torch.Tensor) else v
                 for k, v in inputs.items()} for i in range(prog.microbatches)]
    return [mb for mbs in per_slice for mb in mbs]


def _loss_factors(program, pieces: list[dict[str, torch.Tensor]]) -> list[float]:
    """Each piece's weight in the step's loss, as the runtime weighs its microbatches (its own
    token count: a patched runtime is the one verified), read off `program`'s graphs (a rank program)."""
    graphs = [program.graph_for((), p) for p in pieces]
    counter = loss_tokens.loss_tokens(graphs[0][0])
    factors, _ = loss_tokens.loss_factors(counter, [g[1] for g in graphs], [None] * len(pieces), False, "mean", -100,
                                          None, None)
    return factors


def microbatch_reference(prog, model: nn.Module, inputs: dict[str, torch.Tensor], program=None):
    """`model` run on each data slice's microbatches one at a time, their losses weighed and added as
    the runtime adds its microbatches' (gradient accumulation): (the loss, each piece's outputs in
    data-slice-major order). What an FP8 split is compared with: its scales are per microbatch, as a
    single-device FP8 model's are on the same microbatch. `program`: the rank program whose graphs
    count the tokens (a runtime's own: in a process of a real run the program's weights are released
    and no other rank can be cut); default rank 0's."""
    pieces = [mb for mbs in _per_slice(prog, inputs) for mb in mbs]
    outs = [model(**p) for p in pieces]
    loss = sum(pick_loss(o) * f for o, f in zip(outs, _loss_factors(program or prog.rank(0), pieces)))
    return loss, outs


def _floating_outputs(out: object) -> list[tuple[str, torch.Tensor]]:
    """Named floating outputs of a call, leaves in order; the loss included."""
    leaves, _ = pytree.tree_flatten_with_path(out)
    named = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            named.append((pytree.keystr(path).strip(".[]'\"") or "output", leaf))
    return named


def compare_steps(prog, model: nn.Module, batches: list[tuple[str, dict[str, torch.Tensor]]],
                  tolerance: float, by_microbatch: bool = False) -> list[Item]:
    """Outputs, gradients and an AdamW step of `prog` (compiled from a copy of `model`, same weights)
    against `model`, once per (label, inputs) of `batches`; `model` is trained by it (pass a copy).
    Each (kind, group) is one item: its worst step. `by_microbatch` (an FP8 split): `model` runs the
    runtime's microbatches one at a time (`microbatch_reference`), not the whole batch at once, and
    (at zero=1) every step starts from the first step's weights on both sides."""
    opt = _Steps(prog, model)
    worst: dict[tuple[str, str], Item] = {}
    # FP8: every step from the same weights (verify/run.py says why): the model's, which the program
    # was compiled with; at zero > 1 a runtime owns the parameters' storage, and the steps run on
    fresh = by_microbatch and getattr(prog, "zero", 1) == 1
    start = {n: t.detach().clone() for n, t in model.state_dict().items()} if fresh else None
    for k, (label, inputs) in enumerate(batches, 1):
        if start is not None and k > 1:
            prog.load_state_dict({n: t.clone() for n, t in start.items()}, strict=False)
            model.load_state_dict(start)
            opt = _Steps(prog, model)
        for item in _one_step(prog, model, inputs, tolerance, opt, by_microbatch):
            item = Item(item.kind, item.group, item.error, f"step {k} ({label}): {item.where}", item.tolerance)
            key = (item.kind, item.group)
            if key not in worst or item.error > worst[key].error or item.error != item.error:
                worst[key] = item
    return list(worst.values())


class _Steps:
    """The optimizers the steps share: the model's, and each rank's (or, with data replicas in the
    simulator, one over the reassembled full weights, loaded back into the program after each step)."""

    def __init__(self, prog, model: nn.Module):
        self.model = torch.optim.AdamW(list(model.parameters()), **STEP)
        self.ranks = [torch.optim.AdamW(list(r.parameters()), **STEP) for r in prog.ranks()] if _per_rank(prog) else []
        self.full: dict[str, nn.Parameter] = {}
        self.full_opt: torch.optim.Optimizer | None = None


def _one_step(prog, model: nn.Module, inputs: dict[str, torch.Tensor], tolerance: float, opt: _Steps,
              by_microbatch: bool = False) -> list[Item]:
    items: list[Item] = []
    prog.zero_grad()
    model.zero_grad(set_to_none=True)
    pieces = _pieces(prog, inputs)
    factors = _loss_factors(prog.rank(0), pieces)
    prog.train()
    total, outs = 0.0, []
    for piece, factor in zip(pieces, factors):
        out = prog.simulate(**piece)
        total = total + pick_loss(out) * factor
        outs.append(_floating_outputs(out))
    model.train()
    if by_microbatch:
        ref_loss, ref_outs = microbatch_reference(prog, model, inputs)
        ref_named = [(name, torch.cat([_floating_outputs(o)[j][1] for o in ref_outs]) if ref.dim() else ref)
                     for j, (name, ref) in enumerate(_floating_outputs(ref_outs[0]))]
    else:
        ref_out = model(**inputs)
        ref_loss, ref_named = pick_loss(ref_out), _floating_outputs(ref_out)
    items.append(Item("output", "loss", max_rel(total, ref_loss), "loss", tolerance))
    for j, (name, ref) in enumerate(ref_named):
        if ref.dim() == 0:
            continue
        got = torch.cat([o[j][1] for o in outs])
        if not _per_rank(prog):     # piece i holds microbatch i of every data slice: back to slice-major rows
            m, dp = prog.microbatches, prog.dp
            got = got.view(m, dp, -1, *got.shape[1:]).transpose(0, 1).reshape(got.shape)   # [m, dp, r, ...] -> [B, ...]
        items.append(Item("output", name, max_rel(got, ref), name, tolerance))
    total.backward()
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    items += _grad_items(prog, ref_grads, tolerance)
    items += _step_items(prog, model, tolerance, opt)
    return items


def _worst_by_group(kind: str, errors: dict[str, tuple[float, str]], tolerance: float) -> list[Item]:
    return [Item(kind, g, err, where, tolerance) for g, (err, where) in worst_by_group(errors).items()]


def tp_slice(prog, name: str, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """Tensor-parallel rank `tp_rank`'s part of the model's tensor `full` (parameter `name`)."""
    use = prog.sharding.params.get(name)
    return slice_layout(full, use.dim, use.layout[tp_rank]) if use else full


def _per_rank(prog) -> bool:
    """Whether each rank's shards hold the whole batch's gradient (no data replicas in the simulator)."""
    return prog.dims.ep == 1 and prog.cp == 1


def _norm_errors(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """||got - want|| / ||want|| per name: weights after an AdamW step, whose per-element update
    turns float noise on gradients near eps into steps of up to lr on a few elements; the norm reads
    through them to the tensor as a whole (testing/metrics.py's norm_rel, per tensor)."""
    return {n: float("inf") if got.get(n) is None else norm_rel({n: got[n]}, {n: w}) for n, w in want.items()}


def _rank_errors(prog, read, want: dict[str, torch.Tensor], measure=scaled_errors) -> dict[str, tuple[float, str]]:
    """Worst error (`measure`) over every tensor-parallel rank of `read(p)` against the slice of `want`."""
    errors: dict[str, tuple[float, str]] = {}
    for r, rank in enumerate(prog.ranks()):
        got, ref = {}, {}
        params = dict(rank.named_parameters())
        for name, full in want.items():
            ref[name] = tp_slice(prog, name, full, r)
            got[name] = read(params[name]) if name in params else None
        for name, err in measure(got, ref).items():
            if name not in errors or err > errors[name][0] or err != err:
                errors[name] = (err, f"{name} (tp rank {r})" if prog.tp > 1 else name)
    return errors


def _grad_items(prog, ref_grads: dict[str, torch.Tensor], tolerance: float) -> list[Item]:
    if _per_rank(prog):
        errors = _rank_errors(prog, lambda p: None if p.grad is None else p.grad.detach(), ref_grads)
    else:
        full = prog.full_grads()
        errors = {n: (e, n) for n, e in scaled_errors({n: full.get(n) for n in ref_grads}, ref_grads).items()}
    return _worst_by_group("gradient", errors, tolerance)


def _step_items(prog, model: nn.Module, tolerance: float, opt: _Steps) -> list[Item]:
    opt.model.step()
    want = {n: p.detach() for n, p in model.named_parameters() if p.grad is not None}
    if _per_rank(prog):
        for rank_opt in opt.ranks:
            rank_opt.step()
        errors = _rank_errors(prog, lambda p: p.detach(), want, _norm_errors)
    else:
        grads, weights = prog.full_grads(), prog.full_state_dict()
        if opt.full_opt is None:
            opt.full = {n: nn.Parameter(w.clone()) for n, w in weights.items()}
            opt.full_opt = torch.optim.AdamW(list(opt.full.values()), **STEP)
        for name, w in opt.full.items():
            w.grad = grads.get(name)
        opt.full_opt.step()
        prog.load_state_dict({n: w.detach().clone() for n, w in opt.full.items()}, strict=False)
        errors = {n: (e, n) for n, e in _norm_errors({n: opt.full[n].detach() for n in want}, want).items()}
    return _worst_by_group("weight", errors, tolerance)
