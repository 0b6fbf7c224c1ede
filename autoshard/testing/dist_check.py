"""Run under torchrun: each rank trains its own program on gloo and checks it against the model.

    torchrun --standalone --nproc-per-node 4 -m autoshard.testing.dist_check --models gpt2 llama

Every rank builds the same seeded model, compiles it with autoshard(tp=world size), runs its own
rank module with collectives on the default process group, and compares, after each of several
optimizer steps, its loss and its own parameter shards with single-device training of the same model.
A second input shape checks that the program runs on batch sizes and lengths other than the
example's. Exit status 1 on any mismatch; rank 0 prints one line per model.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from autoshard import autoshard
from autoshard.compile.rank import slice_layout
from autoshard.testing.launch import agree, run_checker
from autoshard.testing.metrics import max_rel, scaled_errors
from autoshard.testing.models import (
    MODEL_NAMES,
    VOCAB,
    build_model,
    input_name,
    label_name,
    logits_of,
)
from autoshard.world import current


def _loss(model, name: str, ids: torch.Tensor, labels: torch.Tensor, in_graph: bool) -> torch.Tensor:
    if in_graph:   # the model computes its loss: the program runs vocabulary-parallel cross-entropy
        out = model(**{input_name(name): ids, label_name(name): labels})
        return out[1] if isinstance(out, tuple) else out.loss
    logits = logits_of(model(**{input_name(name): ids}))    # gathered logits, loss outside
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:
    # Parameters are compared with SGD: it is linear in the gradients, so float noise stays noise.
    # Adam divides by sqrt(v) + eps and turns the ~1e-9 noise of exactly-zero gradients (key biases)
    # into lr-sized steps on either side, single-device or sharded alike.
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr)


def train_alongside(rt, ref, steps: list, make_optimizer) -> float:
    """Train the rank module `rt` and the single-device `ref` side by side, one optimizer step per
    entry of `steps` (each `step(model) -> loss`); returns the worst relative loss difference."""
    opt, ref_opt = make_optimizer(rt.parameters()), make_optimizer(ref.parameters())
    worst = 0.0
    for step in steps:
        loss, ref_loss = step(rt), step(ref)
        worst = max(worst, max_rel(loss, ref_loss))
        for o, value in ((opt, loss), (ref_opt, ref_loss)):
            o.zero_grad()
            value.backward()
            o.step()
    return worst


def shard_error(prog, rt, ref, rank: int) -> tuple[float, str]:
    """The worst scaled error of this rank's parameter shards against the same slices of `ref`'s
    parameters, and the parameter it is in."""
    local = {n: p.detach() for n, p in rt.named_parameters()}
    want = {}
    for pname, p in ref.named_parameters():
        use = prog.sharding.params.get(pname)
        want[pname] = slice_layout(p.detach(), use.dim, use.layout[rank]) if use else p.detach()
    errs = scaled_errors(local, want)
    where = max(errs, key=errs.get)
    return errs[where], where


def check_model(name: str, steps: int, rank: int, world: int, lr: float, optim: str, shape: dict,
                in_graph: bool, sequence_parallel: bool = False, fuse: bool = False) -> dict:
    ref = build_model(name, **shape)
    model = build_model(name, **shape)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (2, 16), generator=gen), torch.randint(0, VOCAB, (2, 16), generator=gen))
               for _ in range(steps)]
    batches.append((torch.randint(0, VOCAB, (3, 24), generator=gen), torch.randint(0, VOCAB, (3, 24), generator=gen)))
    # (3, 24): a new batch and length; 24 is divisible by 2 and 4, as sequence parallelism needs
    example = {input_name(name): batches[0][0]}
    if in_graph:
        example[label_name(name)] = batches[0][1]
    prog = autoshard(model, tp=world, example_kwargs=example, sequence_parallel=sequence_parallel, fuse=fuse)
    rt = prog.distributed()
    worst_loss = train_alongside(rt, ref, [lambda m, b=b: _loss(m, name, *b, in_graph) for b in batches],
                                 lambda params: _optimizer(optim, params, lr))
    worst_param, where = shard_error(prog, rt, ref, rank)
    return {"model": name, "rank": rank, "world": world, "optim": optim, "in_graph_loss": in_graph,
            "sequence_parallel": sequence_parallel, "fuse": fuse, "steps": len(batches), "loss_rel": worst_loss,
            "param_rel": worst_param, "worst_param": where, "sharded": len(prog.sharding.params)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tol", type=float, default=1e-5, help="relative error allowed on losses")
    ap.add_argument("--param-tol", type=float, default=1e-5, help="scaled error allowed on parameters")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--optim", choices=("sgd", "adamw"), default="sgd")
    ap.add_argument("--in-graph-loss", action="store_true",
                    help="pass labels to the model, so the compiled graph holds the loss")
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--fuse", action="store_true", help="fused ops (their torch implementations on the CPU)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    args = ap.parse_args()
    def checks() -> bool:
        rank, world = current().rank(), current().size()
        ok = True
        for name in args.models:
            shape = dict(layers=args.layers, hidden=args.hidden, heads=args.heads)
            res = check_model(name, args.steps, rank, world, args.lr, args.optim, shape, args.in_graph_loss,
                              args.sequence_parallel, args.fuse)
            ok &= agree(res, res["loss_rel"] <= args.tol and res["param_rel"] <= args.param_tol)
        return ok
    run_checker(checks)


if __name__ == "__main__":
    main()
