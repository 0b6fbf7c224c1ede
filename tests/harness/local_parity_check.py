"""The same program's steps on gloo and on a local world, to compare bit for bit:

    torchrun --standalone --nproc-per-node 8 -m tests.harness.local_parity_check --config interleaved

`interleaved`: nanoGPT at tp=2 x pp=2 x dp=2, two chunks per pipeline rank (interleaved 1F1B),
float64, stepped by the DistributedOptimizer (AdamW). `moe`: Mixtral at cp=2 x ep=2, float32, AdamW
on each rank's shards. Three steps, no clipping (a norm summed over eight ranks is summed in another
order by gloo; every other reduction here is over two ranks, which both worlds add alike). Rank 0
prints one JSON line: each step's loss and a digest of every rank's parameters after the steps.
tests/distributed/test_distributed.py runs it on gloo and on a local world and compares the lines.
"""
from __future__ import annotations

import argparse
import hashlib

import torch

from autoshard import autoshard
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.testing.context_models import build_context, context_batch
from autoshard.testing.launch import agree, run_checker
from autoshard.testing.models import VOCAB, build_model
from autoshard.world import current


def _program(config: str):
    if config == "interleaved":
        model = build_model("nanogpt", layers=4).double()
        g = torch.Generator().manual_seed(1)
        batches = [{"idx": torch.randint(0, VOCAB, (4, 16), generator=g),
                    "targets": torch.randint(0, VOCAB, (4, 16), generator=g)} for _ in range(3)]
        prog = autoshard(model, tp=2, pp=2, dp=2, virtual=2, microbatches=2,
                         example_kwargs={k: v[:1] for k, v in batches[0].items()})
        return prog, batches, True
    model = build_context("mixtral", num_hidden_layers=2).train()
    batches = [context_batch(batch=2, seq=16, seed=s) for s in (1, 2, 3)]
    return autoshard(model, cp=2, ep=2, example_kwargs=batches[0]), batches, False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=["interleaved", "moe"], required=True)
    args = ap.parse_args()

    def check() -> bool:
        prog, batches, sharded = _program(args.config)
        rt = prog.distributed(mesh=True)
        opt = (DistributedOptimizer(rt, torch.optim.AdamW, lr=1e-2, bucket_bytes=8 * 1024) if sharded
               else torch.optim.AdamW(rt.parameters(), lr=1e-2))
        losses = []
        for batch in batches:
            losses.append(rt.train_step(**batch).item())
            opt.step()
            opt.zero_grad()
        digest = hashlib.sha1()
        for name, p in sorted(rt.named_parameters()):
            digest.update(name.encode() + p.detach().contiguous().numpy().tobytes())
        everyone = current().gather_objects(digest.hexdigest())
        return agree({"config": args.config, "world": current().size(), "losses": losses, "params": everyone}, True)
    run_checker(check)


if __name__ == "__main__":
    main()
