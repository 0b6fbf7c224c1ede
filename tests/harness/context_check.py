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
norm-wise). Each run's last step's ring records (the trace's ring steps) must add up and overlap their
compute. Exit status 1 on
any mismatch; rank 0 prints one line per model and mesh.
"""
from __future__ import annotations

import argparse
import functools
import os

import torch

from autoshard import autoshard
from autoshard.checkpoint.convert import load_full_state_dict
from autoshard.checkpoint.sharded import save
from autoshard.compile.rank import slice_layout
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.runtime.trace import RING_BLOCK, RING_EXCHANGE
from autoshard.testing.launch import agree, run_checker
from autoshard.testing.metrics import max_rel, norm_rel, scaled_errors
from autoshard.testing.models import MOE_NAMES, VOCAB, build_model, build_moe
from autoshard.world import current

MESHES = {"cp2xdp2": dict(cp=2, dp=2), "cp2xtp2": dict(cp=2, tp=2),
          "cp2xdp2xep4": dict(cp=2, dp=2, ep=4),     # experts over all four data ranks, cp and dp alike
          "cp2xtp2sp": dict(cp=2, tp=2, sequence_parallel=True),
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


def _build(name: str) -> torch.nn.Module:
    return build_moe(name) if name in MOE_NAMES else build_model(name, kv_heads=2)


@functools.cache
def _reference(name: str, steps: int) -> tuple[list[torch.Tensor], torch.nn.Module]:
    """The single-device model trained on the same batches (once per model in this process): its
    loss at each step, and the model after the last."""
    ref = _build(name)
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
    prog = autoshard(_build(name), example_kwargs=batches[0], cp_attention=attention,
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
        if pname in rt.expert_params:       # ep > 1: this rank's experts (data rank % ep)
            per = prog.experts_per_rank
            e = rt.dp_rank % prog.dims.ep
            want[pname] = want[pname][e * per:(e + 1) * per]
    errs = scaled_errors(local, want)
    where = max(errs, key=errs.get)
    worst_element = errs[where]
    saved = None
    if zero_to:
        save(zero_to, prog, rt, opt, step=steps)
        current().barrier()                  # rank 0 writes the index last
        full = load_full_state_dict(zero_to)
        saved = norm_rel(full, {n: p.detach() for n, p in ref.named_parameters()})
    ring_steps, ring_ok = _ring_steps(rt.records, MESHES[mesh]["cp"])
    return {"model": name, "mesh": mesh, "attention": attention, "distributed_optimizer": bool(zero_to),
            "ring_steps": ring_steps, "ring_steps_ok": ring_ok,
            "checkpoint_rel": saved, "rank": current().rank(), "steps": steps, "loss_rel": worst_loss,
            "param_rel": norm_rel(local, want), "element_rel": worst_element, "worst_element": where}


def _ring_steps(records: list, cp: int) -> tuple[int, bool]:
    """The last step's ring records (runtime/trace.py) and whether they add up: per ring call, cp
    blocks each way, cp - 1 exchanges forward and cp backward (dk / dv go home), every overlapped
    exchange launched with its block's compute and landing after it."""
    ring = [r for r in records if r.action.kind in (RING_BLOCK, RING_EXCHANGE)]
    count = {(kind, back): sum(r.action.kind == kind and r.action.chunk == back for r in ring)
             for kind in (RING_BLOCK, RING_EXCHANGE) for back in (0, 1)}
    calls = count[(RING_BLOCK, 0)] // cp
    ok = count == {(RING_BLOCK, 0): calls * cp, (RING_BLOCK, 1): calls * cp,
                   (RING_EXCHANGE, 0): calls * (cp - 1), (RING_EXCHANGE, 1): calls * cp}
    blocks = {(r.action.chunk, r.action.microbatch, i): r for i, r in enumerate(ring) if r.action.kind == RING_BLOCK}
    for i, r in enumerate(ring):
        if r.action.kind == RING_EXCHANGE:      # recorded right after its step's block
            block = blocks.get((r.action.chunk, r.action.microbatch, i - 1))
            ok &= block is not None and r.start <= block.start and r.end >= block.end
    return len(ring), ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--meshes", nargs="+", default=["cp2xdp2", "cp2xtp2"], choices=sorted(MESHES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--gather-models", nargs="*", default=[],
                    help="models also checked at cp=2 x dp=2 with cp_attention='all_gather' (the rest: ring), "
                         "with the distributed optimizer, then saved to --root and read back whole")
    ap.add_argument("--expert-models", nargs="*", default=[],
                    help="mixture-of-experts models also checked at cp=2 x dp=2 x ep=4 (ring attention)")
    ap.add_argument("--sp-models", nargs="*", default=[],
                    help="models also checked at cp=2 x tp=2 with sequence parallelism (ring attention)")
    ap.add_argument("--root", default=None, help="scratch folder for --gather-models' checkpoints")
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()

    def checks() -> bool:
        ok = True
        runs = [(name, mesh, "ring", None) for name in args.models for mesh in args.meshes]
        runs += [(name, "cp2xdp2", "all_gather", os.path.join(args.root, f"{name}-gather"))
                 for name in args.gather_models]
        runs += [(name, "cp2xdp2xep4", "ring", None) for name in args.expert_models]
        runs += [(name, "cp2xtp2sp", "ring", None) for name in args.sp_models]
        for name, mesh, attention, zero_to in runs:
            res = check(name, mesh, args.steps, attention, zero_to)
            saved_ok = zero_to is None or res["checkpoint_rel"] <= args.tol
            ok &= agree(res, res["loss_rel"] <= args.tol and res["param_rel"] <= args.tol and saved_ok
                        and res["ring_steps_ok"] and (res["ring_steps"] > 0) == (attention == "ring"))
        return ok
    run_checker(checks)


if __name__ == "__main__":
    main()
