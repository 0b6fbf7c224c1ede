"""The distributed optimizer against the unsharded one, on real processes:

    torchrun --standalone --nproc-per-node 4 -m tests.harness.zero_check --dp 2 --tp 2

Each rank builds the model twice on the same (tp, pp, dp) mesh: one trained with plain AdamW over
`rt.parameters()` (gradients all-reduced after the whole backward), one with
`DistributedOptimizer(rt, AdamW)` (gradient buffer, reduce-scatter overlapped with backward,
1/dp of the state). Per-step losses and this rank's parameters after the steps must agree (the
parameters norm-wise, every element). The optimizer-state bytes per rank are reported beside the
unsharded ones, and whether a gradient reduction started before the last backward action ended
(the overlap).

The comparison runs in float64 (`--dtype`). The two optimizers sum the ranks' gradients in different
orders (reduce-scatter against all-reduce), and some gradients are zero in exact arithmetic (GPT-2's
key bias: a constant added to every score leaves softmax unchanged). In fp32 those come out as
~1e-8 noise of either sign, the size of Adam's eps, so Adam turns them into steps of about +-lr
whose signs depend on the summation order: a difference of order, not of algorithm. In fp64 the
noise is ~1e-17, nine orders below eps, so Adam cannot amplify it and every element is compared.

`--save DIR` writes a checkpoint after `--steps` and then trains `--more` steps, recording those
losses in DIR/losses.json; `--load DIR` (at any other dp, tp or pp) loads it and trains the same
`--more` steps, which must give the recorded losses. Rank 0 prints one JSON line per model.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from autoshard import autoshard
from autoshard.checkpoint import sharded as ck
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.runtime.trace import REDUCE
from autoshard.testing.launch import agree, run_checker
from autoshard.testing.metrics import norm_rel
from autoshard.testing.models import VOCAB, build_model, input_name, label_name
from tests.harness.recompute_check import worst

LR, ROWS, SEQ = 1e-2, 8, 16


def _batches(name: str, n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
        labels[0, :3] = -100
        out.append({input_name(name): ids, label_name(name): labels})
    return out


def _runtime(name: str, args: argparse.Namespace):
    example = {k: v[:2] for k, v in _batches(name, 1, 0)[0].items()}
    model = build_model(name, layers=args.layers).to(getattr(torch, args.dtype))
    prog = autoshard(model, tp=args.tp, pp=args.pp, dp=args.dp,
                     microbatches=args.microbatches, example_kwargs=example)
    return prog, prog.distributed(mesh=True)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _train(rt, opt, batches, max_norm: float) -> list[torch.Tensor]:
    losses = []
    for b in batches:
        losses.append(rt.train_step(**b, max_norm=max_norm).detach())
        opt.step()
        opt.zero_grad()
    return losses


def compare(name: str, args: argparse.Namespace) -> dict:
    batches = _batches(name, args.steps, 1)
    _, plain_rt = _runtime(name, args)
    plain = torch.optim.AdamW(plain_rt.parameters(), lr=LR)
    plain_losses = _train(plain_rt, plain, batches, args.max_norm)
    _, rt = _runtime(name, args)
    opt = DistributedOptimizer(rt, torch.optim.AdamW, lr=LR, bucket_bytes=args.bucket_kib * 1024, overlap=True)
    losses = _train(rt, opt, batches, args.max_norm)
    want = {n: p.detach() for n, p in plain_rt.named_parameters()}
    mine = {n: p.detach() for n, p in rt.named_parameters()}
    last_backward_end = max(r.end for r in rt.records if r.action.kind == "B")
    early = sum(r.start < last_backward_end for r in rt.records if r.action.kind == REDUCE)   # as traced
    return {"model": name, "rank": dist.get_rank(), "tp": args.tp, "pp": args.pp, "dp": args.dp,
            "loss_rel": max(((a - b).abs() / a.abs()).item() for a, b in zip(plain_losses, losses)),
            "param_rel": norm_rel(mine, want), "param_rel_worst_tensor": worst(want, mine),
            "state_bytes": opt.state_bytes()["optimizer_state"], "plain_state_bytes": _state_bytes(plain),
            "params": sum(p.numel() for p in rt.parameters()), "launched_in_backward": early,
            "buckets": opt.buckets}


def resume(name: str, args: argparse.Namespace) -> dict:
    """--save: train, checkpoint, train --more; --load: load, train --more; same losses."""
    prog, rt = _runtime(name, args)
    opt = DistributedOptimizer(rt, torch.optim.AdamW, lr=LR)
    folder = os.path.join(args.save or args.load, name)
    more = _batches(name, args.more, 2)
    if args.save:
        _train(rt, opt, _batches(name, args.steps, 1), args.max_norm)
        ck.save(folder, prog, rt, opt, step=args.steps)
        losses = [float(x) for x in _train(rt, opt, more, args.max_norm)]
        if dist.get_rank() == 0:
            with open(os.path.join(folder, "losses.json"), "w") as f:
                json.dump(losses, f)
        return {"model": name, "saved_at": [args.tp, args.pp, args.dp], "losses": losses, "loss_rel": 0.0}
    ck.load(folder, prog, rt, opt)
    losses = [float(x) for x in _train(rt, opt, more, args.max_norm)]
    with open(os.path.join(folder, "losses.json")) as f:
        want = json.load(f)
    return {"model": name, "loaded_at": [args.tp, args.pp, args.dp], "losses": losses,
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, want))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--more", type=int, default=3)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--bucket-kib", type=int, default=64, help="gradient bucket size (small: several buckets)")
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16", "float16"],
                    help="the model's dtype (half: fp32 main weights in the optimizer, saved in checkpoints; "
                         "float64 by default, see the module doc)")
    ap.add_argument("--save")
    ap.add_argument("--load")
    ap.add_argument("--tol", type=float, default=1e-10, help="relative tolerance (fp64 by default: see the module doc)")
    args = ap.parse_args()

    def checks() -> bool:
        ok = True
        for name in args.models:
            if args.save or args.load:
                res = resume(name, args)
                ok &= agree(res, res["loss_rel"] <= args.tol)
                continue
            res = compare(name, args)
            ok &= agree(res, res["loss_rel"] <= args.tol and res["param_rel"] <= args.tol
                            and res["launched_in_backward"] >= min(2, res["buckets"]))
        return ok
    run_checker(checks)


if __name__ == "__main__":
    main()
