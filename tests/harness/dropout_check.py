"""Run under torchrun: training with dropout on gloo keeps the tensor-parallel replicas equal, fused or not.

    torchrun --standalone --nproc-per-node 2 -m tests.harness.dropout_check

Dropout masks of a sharded program cannot be the single-device model's, so this checks Megatron's
invariant instead. Each rank compiles the same seeded GPT-2 (dropout 0.3 on embeddings, attention
and residuals) with autoshard(tp=world size), with and without fused kernels and sequence
parallelism, and trains a few SGD steps on its own rank module with gloo collectives. Outside
tensor-parallel regions every rank must draw the same masks, so every rank computes the same loss
and the replicated parameters (norms, position table, row-parallel biases) stay bitwise equal
across ranks; a fused program must have run its fused dropout modules. Exit status 1 otherwise;
rank 0 prints one line per configuration.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard import autoshard
from autoshard.testing.launch import agree, run_checker
from autoshard.testing.models import VOCAB, build_model
from autoshard.world import current

P_DROP = 0.3


def _same_on_every_rank(t: torch.Tensor) -> bool:
    got = t.new_empty((current().size(), *t.shape))             # [world, *t]
    current().all_gather(got, t.contiguous()[None])
    return all(torch.equal(g, got[0]) for g in got)


def check(fuse: bool, sequence_parallel: bool, steps: int) -> dict:
    rank, world = current().rank(), current().size()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (2, 16), generator=gen), torch.randint(0, VOCAB, (2, 16), generator=gen))
               for _ in range(steps)]
    prog = autoshard(build_model("gpt2", dropout=P_DROP).train(), tp=world, example_kwargs={"input_ids": batches[0][0]}, fuse=fuse,
                     sequence_parallel=sequence_parallel)
    rt = prog.distributed()
    fused = [n for n, _ in rt.named_children() if "_rng_fused_" in n]
    opt = torch.optim.SGD(rt.parameters(), lr=1e-2, momentum=0.9)
    losses, same_loss = [], True
    for ids, labels in batches:
        loss = F.cross_entropy(rt(input_ids=ids).logits.reshape(-1, VOCAB), labels.reshape(-1))
        same_loss &= _same_on_every_rank(loss.detach())
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    replicated = {n: p.detach() for n, p in rt.named_parameters() if n not in prog.sharding.params}
    differ = [n for n, p in replicated.items() if not _same_on_every_rank(p)]
    return {"fuse": fuse, "sequence_parallel": sequence_parallel, "rank": rank, "world": world,
            "fused_dropouts": len(fused), "losses": losses, "same_loss": same_loss,
            "replicated_params": len(replicated), "differ": differ}


def main() -> None:
    def checks() -> bool:
        ok = True
        for fuse in (False, True):
            for sp in (False, True):
                res = check(fuse, sp, steps=3)
                good = (res["same_loss"] and not res["differ"] and res["replicated_params"] > 0
                        and (res["fused_dropouts"] > 0) == fuse
                        and all(torch.isfinite(torch.tensor(res["losses"]))))
                ok &= agree(res, good)
        return ok
    run_checker(checks)


if __name__ == "__main__":
    main()
