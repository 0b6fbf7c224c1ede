"""Dropout, which the comparison with the model turns off (its masks are random), checked on its own:
the rule Megatron's RNG tracker keeps (parallel/rng.py). Outside tensor-parallel regions every rank
holds the same activations and must drop the same elements, or the replicas drift apart; inside,
each rank holds other features and must draw its own mask, or the ranks' masks repeat each other.

The program is compiled with the model's own dropout and run once in training mode with every rank in
this process, each random op recorded per rank: an op whose input is the same on every rank must
draw the same mask everywhere, an op whose input differs (a sharded region) must not draw the same
mask as another rank. The ranks' outputs must agree. Masks are read where an op shows them
(`native_dropout`'s mask, zeros of `dropout`); attention with dropout inside SDPA hides its mask, so
the tensor-parallel streams' seeds are checked too (one per rank).

With recomputation, backward runs each region again and must draw forward's masks again
(`recompute_items`): the split is run against itself without recomputation, dropout on, same seeds.
"""
from __future__ import annotations

import copy
from unittest import mock

import torch
import torch.utils._pytree as pytree
from torch import nn

from autoshard.parallel.rng import RegionRandomOp
from autoshard.runtime.batching import pick_loss
from autoshard.testing.metrics import max_rel, scaled_errors
from autoshard.verify.certificate import Item

__all__ = ["dropout_settings", "without_dropout", "dropout_items", "recompute_items"]


def dropout_settings(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every dropout probability above 0 in `model`: dropout modules' p, and the float attributes of
    other modules whose name says dropout (Hugging Face's attention keeps `attention_dropout` and
    passes it to SDPA; nanoGPT's keeps `dropout`)."""
    found = []
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            if m.p > 0:
                found.append((m, "p"))
            continue
        found += [(m, name) for name, value in vars(m).items() if "drop" in name and isinstance(value, float) and value > 0]
    return found


def without_dropout(model: nn.Module) -> int:
    """Every dropout probability set to 0 (its masks are random: two runs cannot be compared with
    them on); returns how many were set."""
    settings = dropout_settings(model)
    for m, name in settings:
        setattr(m, name, 0.0)
    return len(settings)


def _mask(out: object) -> torch.Tensor | None:
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor) and out[1].dtype == torch.bool:
        return out[1]                                   # native_dropout: (output, mask)
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        return out != 0
    return None


def dropout_items(model: nn.Module, split: dict, piece: dict[str, torch.Tensor], compile_split) -> list[Item]:
    """The two items (see the module doc) for `model` with its dropout, or none when it has none or
    the split has one tensor-parallel rank. `compile_split(model, example)` compiles the split."""
    if split.get("tp", 1) == 1 or split.get("ep", 1) > 1 or split.get("cp", 1) > 1 or not dropout_settings(model):
        return []
    prog = compile_split(copy.deepcopy(model).float(), piece)
    prog.train()
    prog.manual_seed(1)
    calls: dict[int, list[tuple[str, torch.Tensor, torch.Tensor | None]]] = {}   # rank -> its calls in order
    original = RegionRandomOp.forward

    def recorded(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.training and isinstance(args[0], torch.Tensor):       # SDPA's mask is not in its output
            shows = "scaled_dot_product" not in str(self.op)
            mine = calls.setdefault(self.tracker.rank, [])
            mine.append((f"random op {len(mine) + 1} ({self.op}, {self.region} stream)", args[0].detach(),
                         _mask(out) if shows else None))
        return out
    with mock.patch.object(RegionRandomOp, "forward", recorded):
        outs = prog.simulate_all(**piece)
    lead = _leaves(outs[0])
    drift = max((max_rel(a, b) for other in outs[1:] for a, b in zip(_leaves(other), lead)), default=0.0)
    ranks = sorted(calls)
    replicated_bad, repeated, first_bad, first_repeated = 0, 0, "", ""
    for column in zip(*(calls[r] for r in ranks)):
        what, x0, m0 = column[0]
        same_input = all(x.shape == x0.shape and torch.equal(x, x0) for _, x, _ in column[1:])
        if m0 is None:
            continue
        same_mask = [m is not None and m.shape == m0.shape and torch.equal(m, m0) for _, _, m in column[1:]]
        if same_input and not all(same_mask):
            replicated_bad += 1
            first_bad = first_bad or what
        if not same_input and any(same_mask) and m0.numel() >= 64 and not bool(m0.all()):
            repeated += 1
            first_repeated = first_repeated or what
    seeds = [prog.rank(r).rng.seeds["tensor_parallel"] for r in range(prog.tp)]
    shared_seeds = len(seeds) - len(set(seeds))
    return [Item("dropout", "replicated regions: same masks on every rank", max(drift, float(replicated_bad)),
                 f"{replicated_bad} op(s) drew other masks on another rank{f', first {first_bad}' if first_bad else ''}; "
                 f"outputs differ by {drift:.2g}", 0.0),
            Item("dropout", "tensor-parallel regions: each rank its own masks", float(repeated + shared_seeds),
                 f"{repeated} draw(s) repeated another rank's{f', first {first_repeated}' if first_repeated else ''}; "
                 f"{shared_seeds} tensor-parallel seed(s) shared", 0.0)]


def _leaves(out: object) -> list[torch.Tensor]:
    return [t.detach() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def recompute_items(model: nn.Module, split: dict, piece: dict[str, torch.Tensor], compile_split,
                    tolerance: float) -> list[Item]:
    """With recomputation and dropout: the split against the same split without recomputation, both
    with the model's dropout and the same seeds, on `piece`. Backward's recomputation must draw
    forward's masks again, so the loss and every gradient agree; a recomputation that does not
    restore the dropout streams computes gradients for other masks than the loss saw."""
    if split.get("recompute", "none") in (None, "none") or not dropout_settings(model):
        return []
    runs = []
    for recompute in (split["recompute"], "none"):
        prog = compile_split(copy.deepcopy(model).float(), piece, {**split, "recompute": recompute})
        prog.train()
        prog.manual_seed(1)
        torch.manual_seed(1)            # torch's own generator, where a model draws from it
        loss = pick_loss(prog.simulate(**piece))
        loss.backward()
        runs.append((loss.detach(), prog.full_grads()))
    (loss, grads), (plain_loss, plain_grads) = runs
    errors = scaled_errors({n: grads.get(n) for n in plain_grads if plain_grads[n] is not None},
                           {n: g for n, g in plain_grads.items() if g is not None})
    worst = max(errors, key=lambda n: errors[n] if errors[n] == errors[n] else float("inf"), default=None)
    err = max(max_rel(loss, plain_loss), errors[worst] if worst else 0.0)
    return [Item("dropout", f"recompute={split['recompute']} replays forward's masks", err,
                 f"against recompute=none, same seeds: loss {max_rel(loss, plain_loss):.2g}"
                 + (f", worst gradient {worst}" if worst else ""), tolerance)]
