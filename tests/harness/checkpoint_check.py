"""Run under torchrun: pipeline training that checkpoints and resumes.

    torchrun --standalone --nproc-per-node 4 -m tests.harness.checkpoint_check \\
        --tp 2 --pp 2 --root /tmp/ckpt --models gpt2 llama

For each model in turn, under root/MODEL: every rank resumes from the newest complete checkpoint
there (if any), trains up to --steps AdamW steps (step i's batch is drawn from seed 1000 + i, so a
resumed run sees the same data), saves every --save-every steps and at the end under final. Rank 0
appends one JSON line per step to root/MODEL/losses.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from autoshard import autoshard
from autoshard import checkpoint as ck
from autoshard.checkpoint.materialize import materialize
from autoshard.testing.launch import run_checker
from autoshard.testing.models import VOCAB, build_model, input_name, label_name
from autoshard.world import current


def batch(name: str, step: int, size: int) -> dict:
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (size, 16), generator=gen)
    return {input_name(name): ids, label_name(name): torch.randint(0, VOCAB, (size, 16), generator=gen)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2"])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--root", required=True)
    ap.add_argument("--meta", action="store_true", help="build the model on the meta device; each rank "
                    "materializes only its own shards")
    args = ap.parse_args()

    def train(model_name: str) -> None:
        root = os.path.join(args.root, model_name)
        if os.path.isfile(os.path.join(root, "final", "index.json")):
            return                                  # finished on an earlier attempt (the index is written last)
        os.makedirs(root, exist_ok=True)
        with torch.device("meta" if args.meta else "cpu"):
            model = build_model(model_name, layers=args.layers)
        micro = 2 * args.pp
        prog = autoshard(model, tp=args.tp, pp=args.pp, microbatches=micro,
                         example_kwargs=batch(model_name, 0, 2))
        rt = prog.distributed()
        if args.meta:
            materialize(prog, rt, seed=0)
        opt = torch.optim.AdamW(rt.parameters(), lr=1e-3)
        start = 0
        resume = ck.latest(root)
        if resume is not None:
            start = ck.load(resume, prog, rt, opt)["step"]
        for step in range(start, args.steps):
            loss = rt.train_step(**batch(model_name, step, 2 * micro), max_norm=1.0)
            opt.step()
            opt.zero_grad()
            if current().rank() == 0:
                with open(os.path.join(root, "losses.jsonl"), "a") as fh:
                    fh.write(json.dumps({"step": step, "loss": loss.item(), "resumed_from": resume}) + "\n")
            if (step + 1) % args.save_every == 0:
                ck.save(os.path.join(root, f"step-{step + 1:08d}"), prog, rt, opt, step=step + 1)
        ck.save(os.path.join(root, "final"), prog, rt, opt, step=args.steps)

    def job() -> bool:
        for model_name in args.models:
            train(model_name)
        return True

    run_checker(job)


if __name__ == "__main__":
    main()
