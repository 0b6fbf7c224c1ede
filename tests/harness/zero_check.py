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

`--zero 3` runs the sharded model fully sharded (parameters and gradients 1/dp, gathered a layer at
a time: runtime/sharded_params.py).

`--one-device` also trains the whole model on one device with torch's AdamW on the same batches
and reports this rank's parameters against the same slices of it (`one_device_rel`). For Qwen2 the
float64 run is float64 everywhere (`every_op_in_float64`): transformers computes RMSNorm, the rotary
tables and the causal-LM loss in float32 whatever the model's dtype, so the run would otherwise carry
float32 rounding that Adam amplifies (1e-7 of a weight after five steps). With every op in float64,
sharded AdamW on the mesh meets one device to ~1e-13: the fp32 differences are rounding, not the
optimizer (benchmarks/RESULTS.md, "the distributed optimizer against one device").

`--save DIR` writes a checkpoint after `--steps` and then trains `--more` steps, recording those
losses in DIR/losses.json; `--load DIR` (at any other dp, tp or pp) loads it and trains the same
`--more` steps, which must give the recorded losses. Rank 0 prints one JSON line per model.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
from unittest import mock

import torch

from autoshard import autoshard
from autoshard.checkpoint import sharded as ck
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.runtime.trace import REDUCE
from autoshard.testing.launch import agree, run_checker
from autoshard.testing.metrics import norm_rel
from autoshard.testing.context_models import build_context
from autoshard.testing.models import MODEL_NAMES, VOCAB, build_model, input_name, label_name
from autoshard.compile.rank import slice_layout
from autoshard.world import current
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


_PATCHED = {"holders": 0, "stack": None}
_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def every_op_in_float64():
    """Qwen2's RMSNorm, rotary tables and the causal-LM loss in the model's own dtype (see the module
    doc) while the block runs: the same in every rank, for the program and the one-device model
    alike, and undone after (a shared launch runs other checks in this process next). The patches are
    the process's: on a local world, the first rank in applies them and the last one out undoes them."""
    with _PATCH_LOCK:
        if _PATCHED["holders"] == 0:
            _PATCHED["stack"] = contextlib.ExitStack()
            for patch in _float64_patches():
                _PATCHED["stack"].enter_context(patch)
        _PATCHED["holders"] += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCHED["holders"] -= 1
            if _PATCHED["holders"] == 0:
                _PATCHED["stack"].close()


def _float64_patches() -> list:
    import transformers.loss.loss_utils as loss_utils
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    def norm(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(device=x.device, dtype=x.dtype)
        emb = torch.cat((freqs, freqs), dim=-1)                    # [b, s, head_dim]
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kw):
        shift = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift.reshape(-1),
                                                 ignore_index=ignore_index)
    return [mock.patch.object(qwen2.Qwen2RMSNorm, "forward", norm),
            mock.patch.object(qwen2.Qwen2RotaryEmbedding, "forward", rotary),
            mock.patch.dict(loss_utils.LOSS_MAPPING, {"ForCausalLM": loss})]


def _build(name: str, args: argparse.Namespace) -> torch.nn.Module:
    model = (build_model(name, layers=args.layers) if name in MODEL_NAMES
             else build_context(name, num_hidden_layers=args.layers).train())
    return model.to(getattr(torch, args.dtype))


def _one_device(name: str, args: argparse.Namespace, batches: list[dict]) -> dict[str, torch.Tensor]:
    """The whole model trained with torch's AdamW on one device, clipped as train_step clips."""
    model = _build(name, args)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for b in batches:
        opt.zero_grad()
        model(**b).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _runtime(name: str, args: argparse.Namespace):
    example = {k: v[:2] for k, v in _batches(name, 1, 0)[0].items()}
    model = (build_model(name, layers=args.layers) if name in MODEL_NAMES
             else build_context(name, num_hidden_layers=args.layers).train()).to(getattr(torch, args.dtype))
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
    prog, plain_rt = _runtime(name, args)
    plain = torch.optim.AdamW(plain_rt.parameters(), lr=LR)
    plain_losses = _train(plain_rt, plain, batches, args.max_norm)
    _, rt = _runtime(name, args)
    opt = DistributedOptimizer(rt, torch.optim.AdamW, lr=LR, bucket_bytes=args.bucket_kib * 1024, overlap=True,
                               zero=args.zero)
    losses = _train(rt, opt, batches, args.max_norm)
    want = {n: p.detach() for n, p in plain_rt.named_parameters()}
    with opt.gathered():            # zero=3 holds 1/dp of each parameter between steps
        mine = {n: p.detach().clone() for n, p in rt.named_parameters()}
    last_backward_end = max(r.end for r in rt.records if r.action.kind == "B")
    early = sum(r.start < last_backward_end for r in rt.records if r.action.kind == REDUCE)   # as traced
    return {"model": name, "rank": current().rank(), "tp": args.tp, "pp": args.pp, "dp": args.dp,
            "loss_rel": max(((a - b).abs() / a.abs()).item() for a, b in zip(plain_losses, losses)),
            "param_rel": norm_rel(mine, want), "param_rel_worst_tensor": worst(want, mine),
            "state_bytes": opt.state_bytes()["optimizer_state"], "plain_state_bytes": _state_bytes(plain),
            "params": sum(p.numel() for p in rt.parameters()), "launched_in_backward": early,
            "buckets": opt.buckets, **(_against_one_device(name, args, batches, prog, rt, mine) if args.one_device else {})}


def _against_one_device(name, args, batches, prog, rt, mine: dict[str, torch.Tensor]) -> dict:
    whole = _one_device(name, args, batches)
    want = {}
    for n in mine:
        use = prog.sharding.params.get(n)
        want[n] = slice_layout(whole[n], use.dim, use.layout[rt.tp_rank]) if use else whole[n]
    return {"one_device_rel": norm_rel(mine, want), "one_device_worst_tensor": worst(want, mine)}


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
        if current().rank() == 0:
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
    ap.add_argument("--zero", type=int, default=1, choices=(1, 2, 3),
                    help="the sharded run's stage: 2 divides the gradients too, 3 the parameters too")
    ap.add_argument("--one-device", action="store_true", help="also compare with the whole model trained on one device")
    ap.add_argument("--save")
    ap.add_argument("--load")
    ap.add_argument("--tol", type=float, default=1e-10, help="relative tolerance (fp64 by default: see the module doc)")
    args = ap.parse_args()

    def checks() -> bool:
        with every_op_in_float64() if args.dtype == "float64" and args.one_device else contextlib.nullcontext():
            return _checks()

    def _checks() -> bool:
        ok = True
        for name in args.models:
            if args.save or args.load:
                res = resume(name, args)
                ok &= agree(res, res["loss_rel"] <= args.tol)
                continue
            res = compare(name, args)
            ok &= agree(res, res["loss_rel"] <= args.tol and res["param_rel"] <= args.tol
                            and res.get("one_device_rel", 0.0) <= args.tol
                            and res["launched_in_backward"] >= min(2, res["buckets"]))
        return ok
    run_checker(checks)


if __name__ == "__main__":
    main()
