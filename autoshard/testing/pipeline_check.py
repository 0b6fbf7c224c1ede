"""Run under torchrun: tp x pp x dp training with a pipeline schedule, checked against one device.

    torchrun --standalone --nproc-per-node 8 -m autoshard.testing.pipeline_check --tp 2 --pp 2 --dp 2

Every rank builds the same seeded model, compiles it with autoshard and trains it through
`MeshRuntime.train_step` on its own rank; the reference is the same model trained single-device on
the same global batches with the same optimizer (AdamW) and gradient clipping, computed once by the
launching test (`--reference FILE`, written by `write_references`) or, without the flag, on every
rank. Per-step losses and, at the end, this rank's parameter shards are compared with the
single-device ones. Exit status 1 on any mismatch; rank 0 prints one JSON line per model (and per
optimizer, and fused or not with `--fuse both`: the fused ops' torch implementations on the CPU).
`--trace DIR` writes the last step's Chrome trace and PNG timeline.
"""
from __future__ import annotations

import argparse
import os

import torch

from autoshard import autoshard
from autoshard.compile.rank import slice_layout
from autoshard.runtime.schedules import stage_owner
from autoshard.runtime.trace import export_trace
from autoshard.testing.graphs import fused_ops
from autoshard.testing.launch import agree, run_checker
from autoshard.testing.metrics import max_rel, norm_rel, scaled_errors
from autoshard.testing.models import VOCAB, build_model, input_name, label_name
from autoshard.world import current


def _kw(name: str, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    return {input_name(name): ids, label_name(name): labels}


def global_batches(optim: str, args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's global batch (ids, labels), the same on every rank and in the reference."""
    gen = torch.Generator().manual_seed(1)
    batch = args.dp * args.microbatches * args.micro_size
    steps = [(torch.randint(0, VOCAB, (batch, 16), generator=gen), torch.randint(0, VOCAB, (batch, 16), generator=gen))
             for _ in range(args.steps)]
    # With SGD (linear in the gradients, so checked element by element), labels hold prompts of
    # uneven length (-100): the step's loss must be the per-token mean over the global batch, across
    # microbatches and data-parallel ranks. AdamW runs keep every label: over 10 steps Adam's
    # normalization amplifies 1e-7 rounding past the 1e-5 gradient-norm check (Llama: 1.6e-5).
    # Whole rows ignored are checked in one process (tests/simulation/test_real_inputs.py).
    for _, labels in steps if optim == "sgd" else ():
        prompt = torch.randint(0, 16, (batch,), generator=gen)
        labels[torch.arange(16) < prompt[:, None]] = -100
    return steps


def _optimizer(optim: str, params, lr: float) -> torch.optim.Optimizer:
    return (torch.optim.AdamW if optim == "adamw" else torch.optim.SGD)(params, lr=lr)


def reference(name: str, optim: str, args: argparse.Namespace) -> dict:
    """Single-device training on the same global batches, with the same optimizer and clipping:
    each step's loss and gradient norm, and the final parameters."""
    ref = build_model(name, layers=args.layers, hidden=args.hidden, heads=args.heads)
    opt = _optimizer(optim, ref.parameters(), args.lr)
    losses, norms = [], []
    for ids, labels in global_batches(optim, args):
        out = ref(**_kw(name, ids, labels))
        loss = out[1] if isinstance(out, tuple) else out.loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), args.max_norm))
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in ref.named_parameters()}}


def _runs(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """(model, optimizer, fused) of every check, in order."""
    fuses = {"off": [False], "on": [True], "both": [False, True]}[args.fuse]
    sgd = set(args.sgd_models or args.models)
    return [(m, o, f) for f in fuses for o in args.optim for m in args.models if o != "sgd" or m in sgd]


def write_references(path: str, argv: list[str]) -> None:
    """Every (model, optimizer) reference of the checker run `argv` describes, in one file (its
    --reference): computed once, in the launching process, instead of on every rank."""
    args = parser().parse_args(argv)
    torch.save({f"{m}|{o}": reference(m, o, args) for m, o in dict.fromkeys((m, o) for m, o, _ in _runs(args))}, path)


def check_model(name: str, optim: str, fuse: bool, args: argparse.Namespace, want: dict) -> dict:
    rank = current().rank()
    model = build_model(name, layers=args.layers, hidden=args.hidden, heads=args.heads)
    steps = global_batches(optim, args)
    example = _kw(name, steps[0][0][: args.micro_size], steps[0][1][: args.micro_size])
    prog = autoshard(model, tp=args.tp, pp=args.pp, dp=args.dp, virtual=args.virtual,
                     microbatches=args.microbatches, schedule=args.schedule, example_kwargs=example, fuse=fuse)
    rt = prog.distributed()
    opt = _optimizer(optim, rt.parameters(), args.lr)
    loss_errs, norm_errs = [], []
    for (ids, labels), ref_loss, ref_norm in zip(steps, want["losses"], want["norms"]):
        loss = rt.train_step(**_kw(name, ids, labels), max_norm=args.max_norm)
        opt.step()
        opt.zero_grad()
        norm_errs.append(max_rel(rt.last_grad_norm.float(), ref_norm))
        loss_errs.append(max_rel(loss, ref_loss))
    norms = [float(n) for n in want["norms"]]
    mine = [s for i, s in enumerate(prog.stage_modules(rt.tp_rank)) if stage_owner(i, args.pp, prog.placement)[0] == rt.pp_rank]
    fused = sum(len(fused_ops(s)) for s in mine)
    if args.trace:
        export_trace(rt.records, os.path.join(args.trace, f"{name}_tp{args.tp}_pp{args.pp}_dp{args.dp}_v{args.virtual}"))
    local = {n: p.detach() for n, p in rt.named_parameters()}
    expected = {}
    for pname, p in want["params"].items():
        if pname in local:
            use = prog.sharding.params.get(pname)
            expected[pname] = slice_layout(p, use.dim, use.layout[rt.tp_rank]) if use else p
    errs = scaled_errors(local, expected)
    where = max(errs, key=errs.get)
    return {"model": name, "rank": rank, "tp": args.tp, "pp": args.pp, "dp": args.dp, "virtual": args.virtual,
            "schedule": prog.schedule_name, "optim": optim, "fuse": fuse, "fused_ops": fused, "steps": args.steps, "loss_rel": max(loss_errs), "grad_norm_rel": max(norm_errs),
            "clipped_steps": sum(1 for n in norms if n > args.max_norm),
            "param_norm_rel": norm_rel(local, expected), "param_rel": errs[where], "worst_param": where, "params_here": len(local),
            "params_total": len(want["params"]), "bytes_sent": rt.transfer.bytes_sent,
            "messages_sent": rt.transfer.messages_sent, "received_ahead": rt.transfer.received_ahead}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    # not --virtual: torchrun's parser reads any prefix of its --virtual-local-rank as its own
    ap.add_argument("--virtual-pipeline", dest="virtual", type=int, default=1, help="virtual pipeline chunks per rank")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--micro-size", type=int, default=2, help="samples per microbatch")
    ap.add_argument("--schedule", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--optim", nargs="+", choices=("adamw", "sgd"), default=["adamw"],
                    help="SGD is linear in the gradients: a scaling error cannot hide behind Adam's normalisation, "
                         "and parameters must match element by element (--param-tol)")
    ap.add_argument("--sgd-models", nargs="+", default=None, help="the models SGD runs for (default: all)")
    ap.add_argument("--fuse", choices=("off", "on", "both"), default="off", help="fused ops (see autoshard(fuse=))")
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--tol", type=float, default=1e-5, help="relative error allowed on losses")
    ap.add_argument("--param-tol", type=float, default=1e-5, help="norm-wise relative error allowed on parameters")
    ap.add_argument("--element-tol", type=float, default=1e-2,
                    help="per-tensor scaled error allowed under Adam, which turns float noise on near-zero "
                         "gradients (key biases) into steps of up to lr on single elements")
    ap.add_argument("--trace", default=None, help="folder for the last step's Chrome trace and PNG")
    ap.add_argument("--reference", default=None,
                    help="the single-device results (write_references); without it each rank computes them")
    return ap


def main() -> None:
    args = parser().parse_args()

    def checks() -> bool:
        ok = True
        refs = torch.load(args.reference) if args.reference else {}
        for name, optim, fuse in _runs(args):
            want = refs.get(f"{name}|{optim}") or reference(name, optim, args)
            res = check_model(name, optim, fuse, args, want)
            element_tol = args.element_tol if optim == "adamw" else args.param_tol
            ok &= agree(res, res["loss_rel"] <= args.tol and res["grad_norm_rel"] <= args.tol
                        and res["param_norm_rel"] <= args.param_tol and res["param_rel"] <= element_tol
                        and (res["fused_ops"] > 0) == fuse)
        return ok
    run_checker(checks)


if __name__ == "__main__":
    main()
