"""Run under torchrun: current models (issue 35's rules) trained on gloo equal the single-device model.

    torchrun --standalone --nproc-per-node 2 -m tests.harness.current_models_check --models Olmo2 GptOss

Each rank builds the same seeded model (autoshard/testing/current_models.py), compiles it with
autoshard(tp=world size), and trains its own rank module with gloo collectives for a few SGD steps
(with momentum; `--optim adamw` for AdamW, whose division by sqrt(v) turns gradients that are float
noise on both sides into lr-sized steps) on batches with a padding mask and -100 labels (the loss
in the graph). After each step its loss is
compared with single-device training of the same model, and at the end its own parameter shards.
The rules exercised: the distributed norm's g (OLMo 2), attention sinks, strided gate/up columns and
expert biases read split (gpt-oss), experts selected in a loop and heads per top-k slot (JetMoE); the
others run in simulation (tests/simulation/test_current_models.py). Exit status 1 on any mismatch; rank 0 prints one line per model.
"""
from __future__ import annotations

import argparse

import torch

from autoshard import autoshard
from autoshard.testing.current_models import CURRENT_MODELS, build_current
from autoshard.testing.dist_check import shard_error, train_alongside
from autoshard.testing.launch import agree, run_checker
from autoshard.world import current


def _batches(steps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(2, 128, (2, 16), generator=gen)
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, :4] = 0
        labels = torch.randint(0, 128, (2, 16), generator=gen)
        labels[mask == 0] = -100
        out.append(dict(input_ids=ids, attention_mask=mask, labels=labels))
    return out


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9) if kind == "sgd" else torch.optim.AdamW(params, lr=1e-3)


def check(name: str, steps: int, rank: int, world: int, optim: str) -> dict:
    ref, model = build_current(name), build_current(name)
    batches = _batches(steps)
    prog = autoshard(model, tp=world, example_kwargs=batches[0])
    rt = prog.distributed()
    worst_loss = train_alongside(rt, ref, [lambda m, b=b: m(**b).loss for b in batches],
                                 lambda params: _optimizer(optim, params))
    worst_param, where = shard_error(prog, rt, ref, rank)
    return {"model": name, "rank": rank, "world": world, "steps": steps, "optim": optim, "loss_rel": worst_loss,
            "param_rel": worst_param, "worst_param": where, "sharded": len(prog.sharding.params)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["Olmo2", "GptOss", "JetMoe"],
                    choices=sorted(CURRENT_MODELS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--optim", choices=("sgd", "adamw"), default="sgd")
    args = ap.parse_args()

    def checks() -> bool:
        rank, world = current().rank(), current().size()
        ok = True
        for name in args.models:
            res = check(name, args.steps, rank, world, args.optim)
            ok &= agree(res, res["loss_rel"] <= args.tol and res["param_rel"] <= args.tol)
        return ok
    run_checker(checks)


if __name__ == "__main__":
    main()
