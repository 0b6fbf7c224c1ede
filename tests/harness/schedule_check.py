"""Run under torchrun: the zero-bubble schedules train exactly as 1F1B does.

    torchrun --standalone --nproc-per-node 4 -m tests.harness.schedule_check --pp 4 --schedules zb-h1 zbv v-half

For each model every rank builds the same seeded model, compiles it once per schedule (1F1B first,
the baseline) and trains it 10 AdamW steps with gradient clipping on the same global batches. Each
schedule's per-step losses and final parameters (all ranks' shards, gathered) are compared with
1F1B's: relative error, and whether they are bitwise equal. 1F1B itself is checked against one
device by autoshard.testing.pipeline_check. What the split must compose with, each a flag:
`--distributed-optimizer` (runtime/distributed_optimizer.py, state sharded over the data-parallel
ranks), `--dtype bf16` (the model cast, fp32 main weights: needs the distributed optimizer),
`--sequence-parallel`, `--recompute full|selective`, `--cp` (ring attention), and mixture-of-experts models (mixtral,
qwen3_moe, olmoe) with `--ep`. Rank 0 prints one JSON line per model and schedule; exit status 1
on any mismatch.
"""
from __future__ import annotations

import argparse

import torch

from autoshard import autoshard
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.testing.launch import agree, run_checker
from autoshard.testing.models import MOE_NAMES, VOCAB, build_model, build_moe, input_name, label_name
from autoshard.world import current

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _kw(name: str, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    return {input_name(name): ids, label_name(name): labels}


def train(name: str, schedule: str, args: argparse.Namespace) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """Losses of each step and every parameter shard at the end, keyed "tp<rank>.data<rank>/name"
    (every replica's: experts differ between the ranks of an expert-parallel group)."""
    model = (build_moe(name, layers=args.layers) if name in MOE_NAMES
             else build_model(name, layers=args.layers, hidden=args.hidden, heads=args.heads)).to(DTYPES[args.dtype])
    gen = torch.Generator().manual_seed(1)
    batch = args.dp * args.microbatches * args.micro_size
    steps = [(torch.randint(0, VOCAB, (batch, 16), generator=gen), torch.randint(0, VOCAB, (batch, 16), generator=gen))
             for _ in range(args.steps)]
    example = _kw(name, steps[0][0][: args.micro_size], steps[0][1][: args.micro_size])
    prog = autoshard(model, tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep, cp=args.cp, microbatches=args.microbatches,
                     schedule=schedule, example_kwargs=example, sequence_parallel=args.sequence_parallel,
                     recompute=args.recompute)
    rt = prog.distributed()
    opt = (DistributedOptimizer(rt, torch.optim.AdamW, lr=args.lr) if args.distributed_optimizer
           else torch.optim.AdamW(rt.parameters(), lr=args.lr))
    losses = []
    for ids, labels in steps:
        losses.append(float(rt.train_step(**_kw(name, ids, labels), max_norm=args.max_norm)))
        opt.step()
        opt.zero_grad()
    mine = {f"tp{rt.tp_rank}.data{rt.dp_rank}/{n}": p.detach().clone() for n, p in rt.named_parameters()}
    everyone: list[dict] = current().gather_objects(mine)
    params = {k: v for part in everyone for k, v in part.items()}
    kinds = [r.action.kind for r in rt.records]
    return losses, params, {"actions": sum(k in "FBW" for k in kinds), "w_actions": kinds.count("W")}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--schedules", nargs="+", default=["zb-h1", "zbv", "v-half"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--dtype", choices=DTYPES, default="fp32")
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--micro-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--tol", type=float, default=1e-6, help="relative error allowed against 1F1B")
    args = ap.parse_args()
    if args.dtype != "fp32" and not args.distributed_optimizer:
        ap.error(f"--dtype {args.dtype} keeps fp32 main weights in the distributed optimizer: add --distributed-optimizer")

    def checks() -> bool:
        ok = True
        for name in args.models:
            base_losses, base_params, _ = train(name, "1f1b", args)
            for schedule in args.schedules:
                losses, params, counts = train(name, schedule, args)
                loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, base_losses))
                same_keys = set(params) == set(base_params)
                # norm-wise over the whole model; the worst tensor too (a near-zero gradient, GPT-2's key
                # bias, is float noise Adam turns into steps of about lr: any change of summation order shows)
                param_rel = _rel(torch.cat([params[k].reshape(-1) for k in base_params]),
                                 torch.cat([base_params[k].reshape(-1) for k in base_params])) if same_keys else float("inf")
                bitwise = same_keys and losses == base_losses and all(torch.equal(params[k], base_params[k])
                                                                      for k in base_params)
                worst = max(base_params, key=lambda k: _rel(params[k], base_params[k])) if same_keys else None
                res = {"model": name, "schedule": schedule, "tp": args.tp, "pp": args.pp, "dp": args.dp,
                       "ep": args.ep, "cp": args.cp, "distributed_optimizer": args.distributed_optimizer, "dtype": args.dtype,
                       "sequence_parallel": args.sequence_parallel, "recompute": args.recompute, "steps": args.steps,
                       "loss_rel": loss_rel, "param_rel": param_rel, "bitwise": bitwise, "params": len(params),
                       "worst_tensor": worst, "worst_tensor_rel": _rel(params[worst], base_params[worst]) if worst else None,
                       **counts}
                ok &= agree(res, same_keys and loss_rel <= args.tol and param_rel <= args.tol)
        return ok
    run_checker(checks)


if __name__ == "__main__":
    main()
