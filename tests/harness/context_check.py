"""Run under torchrun (4 processes): context parallelism trains equal to one device on gloo.

    torchrun --standalone --nproc-per-node 4 -m tests.harness.context_check --models gpt2 llama --steps 10

For each model and mesh (cp=2 x dp=2, cp=2 x tp=2) every rank builds the same seeded model, compiles
it with autoshard(cp=2, ...) (SDPA as ring attention: point-to-point sends around the group;
`--gather-models`: also with the key/value all-gather) and trains its MeshRuntime with AdamW on batches of 4 sequences of 16
tokens with a padding mask and -100 labels (cut so that at cp=2 x dp=2 one rank counts no token:
its loss adds nothing, and its backward still runs for the others' keys), while a single-device copy trains on the same batches. After each step
the losses are compared (<= 1e-5 relative), at the end this rank's parameter shards: norm-wise
(<= 1e-5 relative over this rank's parameter vector). Elementwise the worst is reported, not bounded:
some gradients are zero in exact arithmetic (GPT-2's key bias) and come out as fp32 noise whose sign
depends on the summation order, which Adam turns into steps of about lr on either side (the same
happens at tp=2 x dp=2 or dp=4 without cp: tests/harness/zero_check.py's docstring). The keys and
values are gathered on the real context-parallel group, and gradients summed over cp x dp, in the
one gradient path. `--gather-models` trains a model again with the key/value all-gather and the distributed optimizer
(its state divided over the cp x dp data axis), saves a sharded checkpoint and reads it back whole:
cp splits no parameter, so the consolidated checkpoint equals the single-device model (<= 1e-5
norm-wise). Exit status 1 on
any mismatch; rank 0 prints one line per model and mesh.
"""
from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.distributed as dist

from autoshard import autoshard
from autoshard.checkpoint.convert import load_full_state_dict
from autoshard.checkpoint.sharded import save
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.testing.dist_check import shard_error
from autoshard.testing.launch import agree, run_checker
from autoshard.compile.rank import slice_layout
from autoshard.testing.metrics import max_rel, norm_rel
from autoshard.testing.models import VOCAB, build_model

MESHES = {"cp2xdp2": dict(cp=2, dp=2), "cp2xtp2": dict(cp=2, tp=2),
          "tp2xdp2": dict(tp=2, dp=2)}         # the last: the same check without cp, for a side-by-side baseline


def _batches(steps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 16), generator=gen)
        mask = torch.ones(4, 16, dtype=torch.long)
        mask[1, :5] = 0                              # left padding
        labels = ids.clone()
        labels[mask == 0] = -100
        labels[2:, :5] = -100                        # replica 1's context-parallel rank 0 (positions 0-3 and
        labels[2:, 12:] = -100                       # 12-15 at cp=2) counts no token at dp=2: its mean is 0/0
        out.append(dict(input_ids=ids, attention_mask=mask, labels=labels))
    return out


@functools.cache
def _reference(name: str, steps: int) -> tuple[list[torch.Tensor], torch.nn.Module]:
    """The single-device model trained on the same batches (once per model in this process): its
    loss at each step, and the model after the last."""
    ref = build_model(name, kv_heads=2)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses = []
    for batch in _batches(steps):
        loss = ref(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, ref


def check(name: str, mesh: str, steps: int, attention: str, zero_to: str | None = None) -> dict:
    """`zero_to`: train with the distributed optimizer (its state over cp x dp) and save a checkpoint
    there, whose consolidated parameters are compared with the single-device model's too."""
    ref_losses, ref = _reference(name, steps)
    batches = _batches(steps)
    prog = autoshard(build_model(name, kv_heads=2), example_kwargs=batches[0], cp_attention=attention,
                     **MESHES[mesh])
    rt = prog.distributed()
    opt = DistributedOptimizer(rt, torch.optim.AdamW, lr=1e-3) if zero_to else torch.optim.AdamW(rt.parameters(),
                                                                                                 lr=1e-3)
    worst_loss = 0.0
    for batch, ref_loss in zip(batches, ref_losses):
        loss = rt.train_step(**batch)
        opt.step()
        opt.zero_grad()
        worst_loss = max(worst_loss, max_rel(loss, ref_loss))
    local = {n: p.detach() for n, p in rt.named_parameters()}
    want = {}
    for pname, p in ref.named_parameters():
        use = prog.sharding.params.get(pname)
        want[pname] = slice_layout(p.detach(), use.dim, use.layout[rt.tp_rank]) if use else p.detach()
    worst_element, where = shard_error(prog, rt, ref, rt.tp_rank)
    saved = None
    if zero_to:
        save(zero_to, prog, rt, opt, step=steps)
        dist.barrier()                  # rank 0 writes the index last
        full = load_full_state_dict(zero_to)
        saved = norm_rel(full, {n: p.detach() for n, p in ref.named_parameters()})
    return {"model": name, "mesh": mesh, "attention": attention, "distributed_optimizer": bool(zero_to),
            "checkpoint_rel": saved, "rank": dist.get_rank(), "steps": steps, "loss_rel": worst_loss,
            "param_rel": norm_rel(local, want), "element_rel": worst_element, "worst_element": where}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--meshes", nargs="+", default=["cp2xdp2", "cp2xtp2"], choices=sorted(MESHES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--gather-models", nargs="*", default=[],
                    help="models also checked at cp=2 x dp=2 with cp_attention='all_gather' (the rest: ring), "
                         "with the distributed optimizer, then saved to --root and read back whole")
    ap.add_argument("--root", default=None, help="scratch folder for --gather-models' checkpoints")
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()

    def checks() -> bool:
        ok = True
        runs = [(name, mesh, "ring", None) for name in args.models for mesh in args.meshes]
        runs += [(name, "cp2xdp2", "all_gather", os.path.join(args.root, f"{name}-gather"))
                 for name in args.gather_models]
        for name, mesh, attention, zero_to in runs:
            res = check(name, mesh, args.steps, attention, zero_to)
            saved_ok = zero_to is None or res["checkpoint_rel"] <= args.tol
            ok &= agree(res, res["loss_rel"] <= args.tol and res["param_rel"] <= args.tol and saved_ok)
        return ok
    run_checker(checks)


if __name__ == "__main__":
    main()
