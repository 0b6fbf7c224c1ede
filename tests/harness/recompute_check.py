"""Recomputation changes memory, never numbers: one program with `recompute=mode` against the same
program without, dropout on, same seed.

In one process (`compare_simulated`) and under torchrun, every schedule and mesh:

    torchrun --standalone --nproc-per-node 4 -m tests.harness.recompute_check --tp 2 --pp 2

Each rank builds the model twice (recompute "none" and the mode asked), trains both through
`MeshRuntime.train_step` for a few SGD steps on the same batches and seeds, and compares per-step
losses and this rank's gradients (relative to the largest gradient of each tensor). Exit status 1 on
any mismatch; rank 0 prints one JSON line per model and mode.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from autoshard import autoshard
from autoshard.testing.launch import agree, run_checker
from autoshard.testing.models import VOCAB, build_model, input_name, label_name
from autoshard.world import current

__all__ = ["compare_simulated", "recompute_calls", "worst"]


def worst(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> float:
    """Largest error over tensors, each relative to its own largest magnitude."""
    errs = [0.0]
    for k, x in a.items():
        y = b[k]
        if x is None or y is None:
            if (x is None) != (y is None):
                return float("inf")
            continue
        errs.append(((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item())
    return max(errs)


def recompute_calls(rank) -> int:
    """How many recomputed regions a rank's (or a MeshRuntime's) first graph calls."""
    gm = rank.graph_modules()[0]
    return sum(1 for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("recompute_"))


def _batch(name: str, rows: int, seq: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    labels[0, :3] = -100
    return {input_name(name): ids, label_name(name): labels}


def _build(name: str, layers: int, dropout: float) -> nn.Module:
    return build_model(name, layers=layers, dropout=dropout).train()


def compare_simulated(name: str, mode: str, *, tp: int = 2, pp: int = 1, virtual: int = 1,
                      sequence_parallel: bool = False, fuse: bool = False, dropout: float = 0.1,
                      layers: int = 4, steps: int = 2) -> dict:
    """One process, every rank in lockstep: `steps` SGD steps with and without recompute; the worst
    loss and gradient errors, and whether every step was bitwise equal."""
    gen = torch.Generator().manual_seed(0)
    batches = [_batch(name, 2, 16, gen) for _ in range(steps)]
    runs = {}
    for rc in ("none", mode):
        prog = autoshard(_build(name, layers, dropout), tp=tp, pp=pp, virtual=virtual, recompute=rc,
                         microbatches=pp if virtual > 1 else 1,
                         sequence_parallel=sequence_parallel, fuse=fuse, example_kwargs=batches[0])
        prog.manual_seed(11)
        opt = torch.optim.SGD([p for r in prog.ranks() for p in r.parameters()], lr=0.1)
        losses, grads = [], []
        for b in batches:
            out = prog.simulate(**b)
            loss = out.loss if hasattr(out, "loss") else out[1]
            loss.backward()
            losses.append(loss.detach())
            grads.append(prog.full_grads())
            opt.step()
            opt.zero_grad()
        runs[rc] = (losses, grads, recompute_calls(prog.rank(0)))
    (l0, g0, _), (l1, g1, calls) = runs["none"], runs[mode]
    loss_rel = max(((a - b).abs() / a.abs()).item() for a, b in zip(l0, l1))
    grad_rel = max(worst(a, b) for a, b in zip(g0, g1))
    bitwise = all(torch.equal(a, b) for a, b in zip(l0, l1)) and all(
        all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a.values(), b.values()))
        for a, b in zip(g0, g1))
    return {"model": name, "mode": mode, "tp": tp, "pp": pp, "virtual": virtual, "sp": sequence_parallel,
            "fuse": fuse, "regions": calls, "loss_rel": loss_rel, "grad_rel": grad_rel, "bitwise": bitwise}


def _check_distributed(name: str, mode: str, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(0)
    rows = args.dp * args.microbatches * 2
    batches = [_batch(name, rows, 16, gen) for _ in range(args.steps)]
    example = {k: v[:2] for k, v in batches[0].items()}
    runs = {}
    for rc in ("none", mode):
        prog = autoshard(_build(name, args.layers, args.dropout), tp=args.tp, pp=args.pp, dp=args.dp,
                         virtual=args.virtual, microbatches=args.microbatches, recompute=rc,
                         sequence_parallel=args.sp, example_kwargs=example)
        prog.manual_seed(11)
        rt = prog.distributed(mesh=True)
        opt = torch.optim.SGD(rt.parameters(), lr=0.1)
        losses, grads = [], []
        for b in batches:
            losses.append(rt.train_step(**b).detach())
            grads.append({n: None if p.grad is None else p.grad.clone() for n, p in rt.named_parameters()})
            opt.step()
            opt.zero_grad()
        runs[rc] = (losses, grads, recompute_calls(rt))
    (l0, g0, _), (l1, g1, calls) = runs["none"], runs[mode]
    return {"model": name, "mode": mode, "rank": current().rank(), "tp": args.tp, "pp": args.pp, "dp": args.dp,
            "virtual": args.virtual, "sp": args.sp, "regions": calls,
            "loss_rel": max(((a - b).abs() / a.abs()).item() for a, b in zip(l0, l1)),
            "grad_rel": max(worst(a, b) for a, b in zip(g0, g1))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--modes", nargs="+", default=["full", "selective"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--virtual-pipeline", dest="virtual", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--tol", type=float, default=1e-6)
    args = ap.parse_args()

    def checks() -> bool:
        ok = True
        for name in args.models:
            for mode in args.modes:
                res = _check_distributed(name, mode, args)
                ok &= agree(res, res["loss_rel"] <= args.tol and res["grad_rel"] <= args.tol and res["regions"] > 0)
        return ok
    run_checker(checks)


if __name__ == "__main__":
    main()
