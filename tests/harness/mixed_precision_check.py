"""Mixed precision on real processes: a bf16 or fp16 model trained with DistributedOptimizer's fp32
main weights, against the fp32 run and against a one-process reference with the same casts.

    torchrun --standalone --nproc-per-node 4 -m tests.harness.mixed_precision_check --tp 2 --dp 2

For each model and precision every rank:
1. trains the fp32 model and the half-precision model (`model.to(dtype)`, as Megatron casts it)
   `--steps` AdamW steps on the same batches, gradients clipped to norm 1 (computed in fp32 over
   all ranks), and reports the worst relative loss difference;
2. compares its fp32 main weights after step 1 with a reference that makes the same casts in one
   process: the same program simulated (all tp ranks in lockstep, so the same bf16 partial sums)
   on each data-parallel rank's microbatches in turn, each microbatch's half-precision gradient
   added in fp32, fp32 AdamW on float(weights). With tp = 1 that is the single-device model. A
   weight tied across pipeline stages is compared apart, to 1e-3: its stages' gradients are summed
   in fp32 here but in half precision by autograd in one process (fp16's unit roundoff is 2^-11),
   and Adam's first step g / (|g| + eps) passes that difference on where |g| is small;
3. fp16 only: an inf put into one gradient on the last rank at step 2 skips that step on every
   rank (parameters unchanged everywhere) and halves the loss scale.
Rank 0 prints one JSON line per model and precision.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from autoshard import autoshard
from autoshard.compile.rank import slice_layout
from autoshard.runtime.batching import split_batch
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.testing.launch import agree, run_checker
from autoshard.testing.metrics import norm_rel
from autoshard.testing.models import VOCAB, build_model, input_name, label_name
from autoshard.world import current

LR, SEQ, MAX_NORM = 3e-3, 16, 1.0
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _batches(name: str, rows: int, n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):          # arithmetic sequences mod VOCAB: learnable, so the losses fall
        start = torch.randint(0, VOCAB, (rows, 1), generator=gen)
        stride = torch.randint(1, 4, (rows, 1), generator=gen)
        ids = (start + stride * torch.arange(SEQ)) % VOCAB
        labels = ids.clone()
        labels[0, :3] = -100
        out.append({input_name(name): ids, label_name(name): labels})
    return out


def _reference_main(name: str, dtype: torch.dtype, batch: dict, args) -> dict[str, torch.Tensor]:
    """Step 1's fp32 main weights with the runtime's casts, in one process (see the module doc)."""
    model = build_model(name, layers=args.layers).to(dtype)
    prog = autoshard(model, tp=args.tp, example_kwargs={k: v[:2] for k, v in batch.items()})
    scale = 2.0 ** 16 if dtype == torch.float16 else 1.0
    labels = batch[label_name(name)]
    total = (labels[:, 1:] != -100).sum()            # the runtime's per-token weights: n_i / N over the batch
    grads: dict[str, torch.Tensor] = {}
    for part in split_batch(batch, args.dp, "dp"):
        for mb in split_batch(part, args.microbatches, "microbatches"):
            loss = prog.simulate(**mb).loss
            n = (mb[label_name(name)][:, 1:] != -100).sum()
            (loss * (n / total).float() * scale).backward()
            for k, g in prog.full_grads().items():
                grads[k] = grads.get(k, 0) + g.float()
            for r in prog.ranks():
                r.zero_grad()
    main = {k: p.detach().float().clone().requires_grad_() for k, p in model.named_parameters()}
    for k, p in main.items():
        p.grad = grads[k] / scale
    torch.nn.utils.clip_grad_norm_(list(main.values()), MAX_NORM)      # the norm of the fp32 gradients
    torch.optim.AdamW(list(main.values()), lr=LR).step()
    return {k: p.detach() for k, p in main.items()}


def _mine(prog, opt) -> tuple[dict, dict]:
    """This rank's fp32 main weights (whole per local parameter) and the slicing of the full ones."""
    mine = opt.main_params()
    return mine, {n: prog.sharding.params.get(n) for n in mine}


def check(name: str, precision: str, args) -> dict:
    dtype = DTYPES[precision]
    rows = args.dp * args.microbatches * 2
    batches = _batches(name, rows, args.steps)
    example = {k: v[:2] for k, v in batches[0].items()}
    runs = {}
    for label, dt in (("fp32", torch.float32), (precision, dtype)):
        prog = autoshard(build_model(name, layers=args.layers).to(dt), tp=args.tp, pp=args.pp, dp=args.dp,
                         microbatches=args.microbatches, example_kwargs=example)
        rt = prog.distributed(mesh=True)
        opt = DistributedOptimizer(rt, torch.optim.AdamW, lr=LR)
        losses = []
        for step, b in enumerate(batches):
            losses.append(float(rt.train_step(**b, max_norm=MAX_NORM)))
            opt.step()
            opt.zero_grad()
            if step == 0 and dt != torch.float32:
                mine, uses = _mine(prog, opt)
        runs[label] = losses
    ref = _reference_main(name, dtype, batches[0], args)
    want = {n: (slice_layout(ref[n], u.dim, u.layout[rt.tp_rank]) if u else ref[n]) for n, u in uses.items()}
    # a weight tied across pipeline stages (GPT-2's embedding and head) gets its two stages' half-precision
    # gradients summed in fp32 here, in half precision by autograd in one process: compared apart
    tied = {n for names in prog.shared_params.values() for n in names}
    apart = {n for n in mine if n in tied}
    result = {"model": name, "precision": precision, "rank": current().rank(), "tp": args.tp, "pp": args.pp,
              "dp": args.dp, "loss_rel_vs_fp32": max(abs(a - b) / abs(b) for a, b in zip(runs[precision], runs["fp32"])),
              "main_rel_step1": norm_rel({n: t for n, t in mine.items() if n not in apart},
                                         {n: t for n, t in want.items() if n not in apart}),
              "tied_main_rel_step1": norm_rel({n: mine[n] for n in apart}, {n: want[n] for n in apart}) if apart else 0.0, "first_losses": runs[precision][:3], "last_loss": runs[precision][-1],
              "fp32_last_loss": runs["fp32"][-1]}
    if dtype == torch.float16:
        result.update(_inject_inf(name, example, batches, args))
    return result


def _inject_inf(name: str, example: dict, batches: list, args) -> dict:
    prog = autoshard(build_model(name, layers=args.layers).half(), tp=args.tp, pp=args.pp, dp=args.dp,
                     microbatches=args.microbatches, example_kwargs=example)
    rt = prog.distributed(mesh=True)
    opt = DistributedOptimizer(rt, torch.optim.AdamW, lr=LR)
    poisoned = {"on": False}
    if current().rank() == current().size() - 1:
        p = next(iter(rt.parameters()))
        p.register_hook(lambda g: torch.full_like(g, float("inf")) if poisoned["on"] else g)
    scales, changed, skipped = [], [], []
    for step in range(3):
        poisoned["on"] = step == 2
        before = [p.detach().clone() for p in rt.parameters()]
        scales.append(opt.scaler.scale)
        rt.train_step(**batches[step])
        opt.step()
        opt.zero_grad()
        changed.append(any(not torch.equal(a, p) for a, p in zip(before, rt.parameters())))
        skipped.append(opt.scaler.skipped)
    # fp16 may also overflow on its own in the first steps (then a skip is right): only step 2 is judged
    return {"inf_step_changed_params": changed[2], "inf_step_skipped": skipped[2] == skipped[1] + 1,
            "scale_halved": opt.scaler.scale == scales[2] / 2, "scales": scales + [opt.scaler.scale],
            "changed": changed, "skipped": skipped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--loss-tol", type=float, default=2e-2)
    ap.add_argument("--main-tol", type=float, default=1e-6)
    args = ap.parse_args()

    def checks() -> bool:
        ok = True
        for name in args.models:
            for precision in args.precisions:
                r = check(name, precision, args)
                good = (r["loss_rel_vs_fp32"] <= args.loss_tol and r["main_rel_step1"] <= args.main_tol
                        and r["tied_main_rel_step1"] <= 1e-3)
                if precision == "fp16":
                    good &= not r["inf_step_changed_params"] and r["inf_step_skipped"] and r["scale_halved"]
                if not good:
                    print(json.dumps(r), file=sys.stderr, flush=True)     # this rank's numbers, for the report
                ok &= agree(r, good)
        return ok
    run_checker(checks)


if __name__ == "__main__":
    main()
