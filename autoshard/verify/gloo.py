"""`autoshard verify --gloo`: the certificate's second run, in real processes on gloo.

The simulation (compare.py) runs every rank's program in one process; the runtime around it (each
process's own schedule, the point-to-point transfers between pipeline stages, the gradient buffer's
reductions over data-parallel, tied-weight and expert groups, the loss's token counts summed over
data-parallel ranks) runs only in real processes. Here every rank of the split is a process under
torchrun, rebuilds the same seeded model (the same command-line arguments) with its weights moved
as the simulation moves them, compiles the split, and takes the simulation's steps on the same
batches (verify/batch.py's step_batches): each a `MeshRuntime.train_step`, then an AdamW step on
its own shards (or, with `distributed_optimizer`, the runtime's DistributedOptimizer: AdamW's
state and the gradient reduce-scattered over data-parallel ranks, the updated pieces all-gathered;
then gradients are not compared, only what the step made of them). Each step's loss, reduced
gradient shards and updated shards are compared with the same slices of the single-device model's,
computed in every process (the models are small). Rank 0 gathers every rank's worst errors, each
naming its step, into the items the certificate prints.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile

import torch

from autoshard.api import autoshard
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.runtime.batching import pick_loss
from autoshard.testing.launch import init_gloo, leave, torchrun
from autoshard.testing.metrics import max_rel, norm_rel, scaled_errors
from autoshard.verify.batch import boundary_ids, label_classes, step_batches, verification_batch, vocab_of
from autoshard.verify.certificate import Item, worst_by_group
from autoshard.verify.compare import STEP, tp_slice
from autoshard.verify.dropout import without_dropout
from autoshard.verify.perturb import perturb_weights
from autoshard.verify.run import rows_and_seq
from autoshard.verify.source import model_from_args
from autoshard.world import current

__all__ = ["run_in_processes", "worker", "local_slice"]

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def run_in_processes(spec: dict, world: int, *, target: str = "autoshard.verify.gloo",
                     timeout: int = 600) -> tuple[list[Item], str | None]:
    """Launch `world` gloo processes of `target` (a module whose main calls `worker`) on `spec`
    (model_args: verify's model arguments; split; seq; dtype; tolerance); returns the items, or the
    reason there are none."""
    with tempfile.TemporaryDirectory(prefix="autoshard-verify-") as folder:
        path = os.path.join(folder, "spec.json")
        result = os.path.join(folder, "items.json")
        with open(path, "w") as f:
            json.dump({**spec, "result": result}, f)
        proc = torchrun(target, ["--spec", path], world, timeout=timeout)
        if not os.path.isfile(result):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
            return [], f"the gloo run failed: {tail[0][:200]}"
        with open(result) as f:
            rows = json.load(f)
    return [Item(kind, group, err, where, spec["tolerance"]) for kind, group, err, where in rows], None


def local_slice(prog, rt, name: str, full: torch.Tensor) -> torch.Tensor:
    """This process's part of the model's tensor `full` (parameter `name`): its tensor-parallel
    slice, and at ep > 1 its experts' rows."""
    t = tp_slice(prog, name, full, rt.tp_rank)
    group = rt.expert_group
    if group is not None and name in rt.expert_params:
        t = t.narrow(0, group.rank * group.per_rank, group.per_rank)
    return t


def _worst(kind: str, errors: dict[str, float], where_of) -> list[tuple[str, str, float, str]]:
    groups = worst_by_group({name: (err, where_of(name)) for name, err in errors.items()})
    return [(kind, g, err, where) for g, (err, where) in groups.items()]


def worker(spec: dict) -> list[tuple[str, str, float, str]]:
    """One process's comparisons (see the module doc); call inside a gloo process group."""
    split, rank = spec["split"], current().rank()
    model, _ = model_from_args(spec["model_args"], split)
    perturb_weights(model)                    # as the simulation does: every process moves them alike
    without_dropout(model)
    model = model.to(_DTYPES[spec["dtype"]])
    reference = copy.deepcopy(model)
    rows, seq = rows_and_seq(split, spec["seq"])
    vocab = vocab_of(model)
    classes = label_classes(model, rows, seq, vocab)
    first = verification_batch(model, rows, seq, vocab, classes=classes).inputs
    pieces = split.get("dp", 1) * split.get("microbatches", 1)
    prog = autoshard(model, example_kwargs={k: v[: rows // pieces] for k, v in first.items()}, **split)
    steps = step_batches(model, rows, seq, vocab, boundary_ids(prog, vocab), classes)
    rt = prog.distributed(mesh=True)
    rt.train()
    reference.train()
    sharded = bool(spec.get("distributed_optimizer"))
    optimizer = (DistributedOptimizer(rt, torch.optim.AdamW, shard=True, **STEP) if sharded
                 else torch.optim.AdamW(rt.parameters(), **STEP))
    ref_optimizer = torch.optim.AdamW(reference.parameters(), **STEP)
    ref = dict(reference.named_parameters())
    mine = dict(rt.named_parameters())
    worst: dict[tuple[str, str], tuple[str, str, float, str]] = {}
    for k, (label, batch) in enumerate(steps, 1):
        here = f"gloo rank {rank}, step {k} ({label})"
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        loss = rt.train_step(**batch.inputs)
        ref_loss = pick_loss(reference(**batch.inputs))
        ref_loss.backward()
        grads = {} if sharded else scaled_errors({n: p.grad for n, p in mine.items()},      # sharded: no .grad,
                                                 {n: local_slice(prog, rt, n, ref[n].grad) for n in mine})   # owned only
        optimizer.step()
        ref_optimizer.step()
        weights = {n: norm_rel({n: p.detach()}, {n: local_slice(prog, rt, n, ref[n].detach())}) for n, p in mine.items()}
        rows_here = ([("output", "loss (gloo)", max_rel(loss, ref_loss), f"loss ({here})")]
                     + _worst("gradient", grads, lambda n: f"{n} ({here})")
                     + _worst("weight", weights, lambda n: f"{n} ({here})"))
        for row in rows_here:
            key = row[:2]
            if key not in worst or row[2] > worst[key][2] or row[2] != row[2]:
                worst[key] = row
    return list(worst.values())


def gather_and_write(rows: list[tuple[str, str, float, str]], path: str) -> None:
    """Every rank's rows to rank 0, which keeps the worst per (kind, group) and writes them."""
    every = current().gather_objects(rows)
    if current().rank() == 0:
        worst: dict[tuple[str, str], tuple[str, str, float, str]] = {}
        for kind, group, err, where in (r for rs in every for r in rs):
            key = (kind, group)
            if key not in worst or err > worst[key][2] or err != err:
                worst[key] = (kind, group, err, where)
        with open(path, "w") as f:
            json.dump(list(worst.values()), f)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one process of autoshard verify --gloo")
    ap.add_argument("--spec", required=True)
    args = ap.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    init_gloo()
    torch.set_num_threads(1)
    gather_and_write(worker(spec), spec["result"])
    leave(0)


if __name__ == "__main__":
    main()
