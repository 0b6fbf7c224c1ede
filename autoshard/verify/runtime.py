"""The certificate's runtime run: every rank's MeshRuntime takes the simulation's steps.

The simulation (compare.py) runs the rank graphs in lockstep; what a torchrun job adds around them
(each rank's own schedule, the point-to-point transfers between pipeline stages, the gradient
buffer's buckets over data-parallel, tied-weight and expert groups, the loss's token counts summed
over data-parallel ranks, the distributed optimizer) runs here: each rank a `MeshRuntime` taking
the same steps on the same batches, `train_step` then an AdamW step on its own shards (or, with
`sharded`, the runtime's DistributedOptimizer: AdamW's state and the gradient reduce-scattered over
data-parallel ranks, the updated pieces all-gathered; then gradients are not compared, only what
the step made of them). Each step's loss, reduced gradient shards and updated shards are compared
with the same slices of the single-device model's, stepped alike beside it.

`local_items` runs every rank in this process on a LocalWorld (what `autoshard verify` does by
default); verify/gloo.py runs the same `rank_rows` in torchrun processes (`--gloo`). Three steps,
the simulation's three batches (padded, unpadded, packed): a bug that shows only once optimizer
state or a moved weight exists shows from step 2, and each input kind is taken once.
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from autoshard.runtime.batching import pick_loss
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.testing.metrics import max_rel, norm_rel, scaled_errors
from autoshard.verify.certificate import Item, worst_by_group
from autoshard.verify.compare import STEP, microbatch_reference, tp_slice
from autoshard.world import current

__all__ = ["Row", "local_items", "local_slice", "rank_rows", "worst_rows"]

Row = tuple[str, str, float, str]           # kind, group, error, where


def local_slice(prog, rt, name: str, full: torch.Tensor) -> torch.Tensor:
    """Runtime `rt`'s part of the model's tensor `full` (parameter `name`): its tensor-parallel
    slice, and at ep > 1 its experts' rows."""
    t = tp_slice(prog, name, full, rt.tp_rank)
    group = rt.expert_group
    if group is not None and name in rt.expert_params:
        t = t.narrow(0, group.rank * group.per_rank, group.per_rank)
    return t


def _worst(kind: str, errors: dict[str, float], where_of) -> list[Row]:
    groups = worst_by_group({name: (err, where_of(name)) for name, err in errors.items()})
    return [(kind, g, err, where) for g, (err, where) in groups.items()]


def worst_rows(rows) -> list[Row]:
    """The worst row per (kind, group); a NaN is the worst there is."""
    worst: dict[tuple[str, str], Row] = {}
    for row in rows:
        key = row[:2]
        if key not in worst or row[2] > worst[key][2] or row[2] != row[2]:
            worst[key] = row
    return list(worst.values())


def rank_rows(prog, rt, reference: nn.Module, steps: list[tuple[str, dict]], *, sharded: bool, run: str,
              by_microbatch: bool = False) -> list[Row]:
    """This rank's comparisons over `steps` ((label, inputs) pairs), `reference` (the whole model,
    this rank's own copy) stepped beside it; `run` names the run in each row. `by_microbatch`: the
    reference runs the runtime's microbatches one at a time (verify/compare.py's
    microbatch_reference: an FP8 split's scales are per microbatch)."""
    rank = current().rank()
    rt.train()
    reference.train()

    def optimizers():
        return (DistributedOptimizer(rt, torch.optim.AdamW, shard=True, **STEP) if sharded
                else torch.optim.AdamW(rt.parameters(), **STEP)), torch.optim.AdamW(reference.parameters(), **STEP)
    optimizer, ref_optimizer = optimizers()
    ref = dict(reference.named_parameters())
    mine = dict(rt.named_parameters())
    rows: list[Row] = []
    # FP8 (by_microbatch): every step from the same weights, as compare_steps does (verify/run.py says
    # why); at zero > 1 the optimizer owns the parameters' storage, and the steps run on from each other
    fresh = by_microbatch and (not sharded or getattr(prog, "zero", 1) == 1)
    start = ({n: p.detach().clone() for n, p in mine.items()},
             {n: t.detach().clone() for n, t in reference.state_dict().items()}) if fresh else None
    for k, (label, inputs) in enumerate(steps, 1):
        here = f"{run} rank {rank}, step {k} ({label})"
        if start is not None and k > 1:
            with torch.no_grad():
                for n, p in mine.items():
                    p.copy_(start[0][n])
            reference.load_state_dict(start[1])
            optimizer, ref_optimizer = optimizers()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        loss = rt.train_step(**inputs)
        ref_loss = microbatch_reference(prog, reference, inputs, rt.rank_program)[0] if by_microbatch \
            else pick_loss(reference(**inputs))
        ref_loss.backward()
        grads = {} if sharded else scaled_errors({n: p.grad for n, p in mine.items()},      # sharded: no .grad,
                                                 {n: local_slice(prog, rt, n, ref[n].grad) for n in mine})   # owned only
        optimizer.step()
        ref_optimizer.step()
        with optimizer.gathered() if sharded else contextlib.nullcontext():     # zero=3 holds 1/dp between steps
            weights = {n: norm_rel({n: p.detach()}, {n: local_slice(prog, rt, n, ref[n].detach())})
                       for n, p in mine.items()}
        rows += ([("output", f"loss ({run})", max_rel(loss, ref_loss), f"loss ({here})")]
                 + _worst("gradient", grads, lambda n: f"{n} ({here})")
                 + _worst("weight", weights, lambda n: f"{n} ({here})"))
    return worst_rows(rows)


def local_items(prog, reference: nn.Module, steps: list[tuple[str, dict]], tolerance: float, *,
                sharded: bool = False, by_microbatch: bool = False) -> list[Item]:
    """Every rank of `prog` in this process (`prog.local_mesh()`), each comparing itself with its own
    copy of `reference` (the model as compiled, not yet stepped) over `steps`."""
    mesh = prog.local_mesh()
    copies = [copy.deepcopy(reference) for _ in mesh.runtimes]
    per_rank = mesh.each(lambda rt, ref: rank_rows(prog, rt, ref, steps, sharded=sharded, run="runtime",
                                                   by_microbatch=by_microbatch), copies)
    return [Item(kind, group, err, where, tolerance) for kind, group, err, where in worst_rows(r for rs in per_rank
                                                                                             for r in rs)]
