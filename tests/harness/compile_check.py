"""torch.compile of a rank program with vocabulary parallelism, on real processes:

    torchrun --standalone --nproc-per-node 4 -m tests.harness.compile_check [--cases gpt2:4 llama:2]

Four gloo processes hold, for each case MODEL:TP, a tp=4 program or two tp=2 programs (ranks 0-1 and
2-3, each pair its own group); by default both models at both sizes. Every rank compiles its rank module with `torch.compile(fullgraph=True)` (aot_eager: autograd
traced too) and checks, on the model's own loss (vocabulary-parallel embedding, head and
cross-entropy, -100 labels among them), that the compiled module's loss and every gradient equal
the eager module's, and that an out-of-range token id still raises in the compiled module (the id
check is an assertion op there, not a Python `if`). Rank 0 prints one JSON line per (model, tp).
"""
from __future__ import annotations

import argparse

import torch

from autoshard import autoshard
from autoshard.testing.launch import agree, run_checker
from autoshard.testing.metrics import grad_errors, max_rel
from autoshard.testing.models import VOCAB, build_model, input_name, label_name
from autoshard.world import Group, current


def _batch(name: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
    labels = torch.randint(0, VOCAB, (2, 16), generator=gen)
    labels[0, :4] = -100
    return {input_name(name): ids, label_name(name): labels}


def _loss_and_grads(run, rank, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    rank.zero_grad(set_to_none=True)
    out = run(**batch)
    loss = out.loss if hasattr(out, "loss") else out[1]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in rank.named_parameters()}


def check(name: str, tp: int, group: Group) -> dict:
    torch._dynamo.reset()
    batch = _batch(name)
    prog = autoshard(build_model(name), tp=tp, example_kwargs=batch)
    rank = prog.distributed(group)
    compiled = torch.compile(rank, backend="aot_eager", fullgraph=True)
    eager_loss, eager_grads = _loss_and_grads(rank, rank, batch)
    loss, grads = _loss_and_grads(compiled, rank, batch)
    errs = grad_errors(grads, eager_grads)
    bad = dict(batch)
    bad[input_name(name)] = batch[input_name(name)].clone()
    bad[input_name(name)][0, 0] = VOCAB + 3
    try:
        compiled(**bad)
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    return {"model": name, "tp": tp, "rank": current().rank(), "loss_rel": max_rel(loss, eager_loss),
            "grad_rel": max(errs.values()), "out_of_range_raised": "out of range" in raised}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["gpt2:4", "gpt2:2", "llama:4", "llama:2"],
                    help="MODEL:TP, TP the world size or 2")
    args = ap.parse_args()

    def checks() -> bool:
        world, me = current().size(), current().rank()
        pairs = [current().new_group([r, r + 1]) for r in range(0, world, 2)]       # every rank makes every group
        ok = True
        for case in args.cases:
            name, tp = case.split(":")[0], int(case.split(":")[1])
            if tp not in (world, 2):
                raise SystemExit(f"--cases {case}: tp must be the world size ({world}) or 2")
            group = None if tp == world else pairs[me // 2]
            res = check(name, tp, group)
            ok &= agree(res, res["loss_rel"] <= 1e-6 and res["grad_rel"] <= 1e-5 and res["out_of_range_raised"])
        return ok
    run_checker(checks)


if __name__ == "__main__":
    main()
