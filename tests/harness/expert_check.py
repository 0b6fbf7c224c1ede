"""Expert parallelism on real processes, against single-device training of the same model:

    torchrun --standalone --nproc-per-node 4 -m tests.harness.expert_check --dp 4 --ep 4

Every rank builds the same seeded MoE decoder, compiles it with autoshard(tp, pp, dp, ep) and trains
it through `train_step` with AdamW; rank 0 alone also trains it whole with AdamW on the same global
batches and sends every rank the result (`_reference`, once per model and arguments). The
reference computes its loss microbatch by microbatch as the mesh does: each data-parallel slice's
microbatches, each mean weighted by its share of the counted tokens (equal to the global mean of a
cross-entropy); with the model's load-balancing loss added (`--aux-loss`) the loss is no longer a
bare cross-entropy, and train_step weights every microbatch equally, as does the reference.
Checked per rank (`--max-norm`: both clip by the global gradient norm): every step's loss (<= 1e-5
relative), the final parameters (this rank's slices: <= 1e-6 norm-wise and <= 1e-4 per element at
the tensor's scale; AdamW turns ~1e-9 noise on near-zero gradients into steps of ~lr on either
side, so elements of rarely routed experts differ by more than the vector does), that the rank
holds only its experts, and the bytes it sent through the all-to-alls, against the formula from
the routing the single-device model chooses for every microbatch of its expert-parallel group:

    per MoE layer and microbatch: 8 (ep - 1) + r (8 + 8 H + 4) + m (8 H + 4)

r: its (token, slot) pairs whose expert another rank owns; m: pairs other ranks send it; H: hidden;
with `--recompute full` the forward's 8 (ep - 1) + r (8 + 4 H + 4) + m 4 H once more.
(Counts, then expert ids (int64), tokens and weights (fp32) out; results back. Backward: the results'
gradients out, the tokens' and weights' gradients back.) Rank 0 prints one JSON line.

`--meta` builds both on the meta device: each rank materializes only its shards, the reference
its whole (materialize_full), the same values by name. `--from-file DIR`: the reference is saved with
save_pretrained (experts one module each, as published checkpoints are) and every rank loads its
slices with load_from_file. `--optimizers adamw sharded unsharded`: each model trained with torch's
AdamW and with DistributedOptimizer(AdamW), sharded or not (the experts' gradients and state over
the ranks holding the same experts).
`--save DIR` writes a checkpoint after the steps; `--load DIR --skip K` (at any tp, pp, dp, ep) starts
from one written after K steps, the reference training those K steps first, and checks the same.
"""
from __future__ import annotations

import argparse

import torch

from autoshard import autoshard
from autoshard.checkpoint import sharded as ck
from autoshard.checkpoint.convert import load_from_file
from autoshard.checkpoint.materialize import materialize, materialize_full
from autoshard.regions.experts_call import expert_modules
from autoshard.compile.rank import slice_layout
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.testing.launch import agree, run_checker
from autoshard.testing.metrics import max_rel, norm_rel, scaled_errors
from autoshard.testing.models import MOE_NAMES, VOCAB, build_moe
from autoshard.world import current

ROWS, SEQ, LR = 8, 16, 1e-3


def _batches(n: int, empty_rows: int = 0) -> list[dict[str, torch.Tensor]]:
    """n global batches; the first `empty_rows` rows of each have only ignored labels (-100)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
        labels[0, :5] = -100                       # some tokens not counted
        labels[:empty_rows] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _microbatches(batch: dict, dp: int, m: int) -> list[list[dict]]:
    """[dp rank][microbatch] slices of a global batch, as train_step cuts it."""
    rows = ROWS // dp // m
    return [[{k: v[(d * m + i) * rows:(d * m + i + 1) * rows] for k, v in batch.items()} for i in range(m)]
            for d in range(dp)]


def _reference_step(ref, opt, slices: list[list[dict]], per_token: bool, max_norm: float | None) -> tuple[float, torch.Tensor | None,
                                                                                         list[list[list[torch.Tensor]]]]:
    """One AdamW step of the whole model on the mesh's microbatches; returns the loss, the gradient
    norm before clipping (with max_norm) and the routing
    ([dp rank][microbatch][layer] top-k expert indices) each microbatch took."""
    routes: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: routes.append(args[1].detach()))
             for m in expert_modules(ref).values()]
    counted = [[(mb["labels"][:, 1:] != -100).sum() if per_token else 1 for mb in per_dp] for per_dp in slices]
    total = sum(int(c) for per_dp in counted for c in per_dp)
    opt.zero_grad()
    # a microbatch with no counted token runs (its routing is part of the step) and adds nothing
    loss = sum(ref(**mb).loss * (int(c) / total) if int(c) else ref(**mb).loss.detach().nan_to_num() * 0
               for per_dp, cs in zip(slices, counted) for mb, c in zip(per_dp, cs))
    loss.backward()
    norm = None if max_norm is None else torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    opt.step()
    for h in hooks:
        h.remove()
    layers = len(hooks)
    per_mb = [routes[i:i + layers] for i in range(0, len(routes), layers)]
    m = len(slices[0])
    return float(loss.detach()), norm, [per_mb[d * m:(d + 1) * m] for d in range(len(slices))]


def _expected_bytes(routing: list[list[list[torch.Tensor]]], layers: list[int], dp_rank: int, ep: int, per_rank: int,
                    hidden: int, recomputed: bool) -> int:
    group = [dp_rank - dp_rank % ep + j for j in range(ep)]
    me = dp_rank % ep
    total = 0
    for i in range(len(routing[dp_rank])):
        for layer in layers:
            owners = {d: routing[d][i][layer].reshape(-1) // per_rank for d in group}
            r = int((owners[dp_rank] != me).sum())
            m = sum(int((owners[d] == me).sum()) for d in group if d != dp_rank)
            total += 8 * (ep - 1) + r * (8 + 8 * hidden + 4) + m * (8 * hidden + 4)
            if recomputed:          # the forward's exchanges run again in backward
                total += 8 * (ep - 1) + r * (8 + 4 * hidden + 4) + m * 4 * hidden
    return total


_REFERENCES: dict[tuple, dict] = {}      # one per model and command line: every --optimizers entry shares it


def _reference(name: str, args: argparse.Namespace, batches: list[dict], folder: str | None) -> dict:
    """The single-device run, on rank 0 only, sent to every rank: each step's loss, gradient norm and
    routing, and the final parameters (before: every rank trained its own copy of the whole model).
    With `folder`, the initial weights are saved there first, for the program to load."""
    key = (name, repr(sorted(vars(args).items())))
    if key in _REFERENCES:
        return _REFERENCES[key]
    record = None
    if current().rank() == 0:
        ref = build_moe(name, aux_loss=args.aux_loss, device="meta" if args.meta else "cpu")
        if args.meta:
            materialize_full(ref, seed=0)
        if folder:
            ref.save_pretrained(folder)      # transformers writes experts one module each
        opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        steps = [_reference_step(ref, opt, _microbatches(batch, args.dp, args.microbatches),
                                 per_token=not args.aux_loss, max_norm=args.max_norm) for batch in batches]
        record = {"steps": steps[args.skip:], "params": {n: p.detach() for n, p in ref.named_parameters()},
                  "paths": list(expert_modules(ref)),
                  "experts": [m.num_experts for m in expert_modules(ref).values()]}
    record = current().broadcast_object(record, src=0)
    _REFERENCES[key] = record
    return record


def check(name: str, args: argparse.Namespace, optimizer: str = "adamw") -> dict:
    model = build_moe(name, aux_loss=args.aux_loss, device="meta" if args.meta or args.from_file else "cpu")
    folder = f"{args.from_file}/{name}" if args.from_file else None
    batches = _batches(args.skip + args.steps, ROWS // args.dp // args.microbatches if args.empty_microbatch else 0)
    reference = _reference(name, args, batches, folder)
    example = {k: v[:2] for k, v in batches[0].items()}
    prog = autoshard(model, tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep, microbatches=args.microbatches,
                     example_kwargs=example, recompute=args.recompute)
    rt = prog.distributed(mesh=True)
    if args.meta or folder:                  # this rank's tp slices of its own experts, nothing more
        materialize(prog, rt, seed=0)
    if folder:
        load_from_file(folder, prog, rt)
    opt = (DistributedOptimizer(rt, torch.optim.AdamW, lr=LR, shard=optimizer == "sharded")
           if optimizer != "adamw" else torch.optim.AdamW(rt.parameters(), lr=LR))
    batches = batches[args.skip:]            # the reference trained the first --skip steps as well
    if args.load:
        ck.load(args.load, prog, rt, opt)
    paths = reference["paths"]
    here = [paths.index(c.region.path) for c in rt.expert_calls()]      # the MoE layers of this rank's stages
    group = rt.expert_group
    per_rank = group.per_rank if group else len(paths) and reference["experts"][0]
    worst_loss, worst_norm, sent, expected = 0.0, 0.0, 0, 0
    for batch, (ref_loss, ref_norm, routing) in zip(batches, reference["steps"]):
        before = group.sent_bytes if group else 0
        opt.zero_grad()
        loss = rt.train_step(**batch, max_norm=args.max_norm)
        opt.step()
        sent += (group.sent_bytes if group else 0) - before
        rel = max_rel(loss, torch.tensor(ref_loss))
        worst_loss = max(worst_loss, rel if rel == rel else float("inf"))      # max(0.0, nan) would be 0.0
        if ref_norm is not None:
            worst_norm = max(worst_norm, max_rel(rt.last_grad_norm.float(), ref_norm))
        expected += _expected_bytes(routing, here, rt.dp_rank, args.ep, per_rank, model.config.hidden_size,
                                    args.recompute == "full")
    if args.save:
        ck.save(args.save, prog, rt, opt, step=len(batches))
    mine = {n: p.detach() for n, p in rt.named_parameters()}
    e = rt.dp_rank % args.ep
    want, only_mine = {}, True
    for pname, p in reference["params"].items():
        if pname not in mine:
            continue
        use = prog.sharding.params.get(pname)
        full = slice_layout(p.detach(), use.dim, use.layout[rt.tp_rank]) if use else p.detach()
        if pname in rt.expert_params:
            only_mine &= mine[pname].shape[0] == per_rank
            full = full[e * per_rank:(e + 1) * per_rank]
        want[pname] = full
    errs = scaled_errors(mine, want)
    worst = max(errs, key=errs.get)
    whole = norm_rel(mine, want)
    expert_elems = sum(mine[n].numel() for n in rt.expert_params)
    return {"model": name, "tp": args.tp, "pp": args.pp, "dp": args.dp, "ep": args.ep, "rank": rt.global_rank,
            "steps": len(batches), "loss_rel": worst_loss, "grad_norm_rel": worst_norm, "param_rel": whole, "param_max_rel": errs[worst],
            "worst_param": worst,
            "only_own_experts": bool(only_mine and (rt.expert_params or args.ep == 1)), "expert_params_here": expert_elems,
            "all_to_all_bytes": sent, "formula_bytes": expected}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mixtral"], choices=MOE_NAMES)
    for flag, default in (("--tp", 1), ("--pp", 1), ("--dp", 2), ("--ep", 2), ("--microbatches", 2), ("--steps", 10)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    ap.add_argument("--max-norm", type=float, default=None, help="clip gradients to this global norm")
    ap.add_argument("--aux-loss", action="store_true", help="the model adds its load-balancing loss")
    ap.add_argument("--empty-microbatch", action="store_true",
                    help="data-parallel rank 0's first microbatch has only ignored labels (-100)")
    ap.add_argument("--meta", action="store_true", help="build on the meta device; each rank materializes its "
                                                        "shards (the reference: materialize_full)")
    ap.add_argument("--optimizers", nargs="+", default=["adamw"], choices=("adamw", "sharded", "unsharded"),
                    help="torch's AdamW on the runtime's parameters, or DistributedOptimizer(AdamW) sharded or not; "
                         "each model is checked with each")
    ap.add_argument("--from-file", metavar="DIR", help="the reference saved with save_pretrained under DIR; "
                                                       "the program built on meta and loaded from it")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--save", help="write a sharded checkpoint (parameters, AdamW state) after the steps")
    ap.add_argument("--load", help="start from this checkpoint, written after --skip steps at any mesh")
    ap.add_argument("--skip", type=int, default=0, help="steps the checkpoint already took (the reference "
                                                         "trains them first)")
    args = ap.parse_args()

    def checks() -> bool:
        ok = True
        for name in args.models:
            for optimizer in args.optimizers:
                res = check(name, args, optimizer)
                rows = current().gather_objects(res)
                good = (res["loss_rel"] <= args.tol and res["grad_norm_rel"] <= args.tol and res["param_rel"] <= 1e-6
                        and res["param_max_rel"] <= 1e-4 and res["only_own_experts"]
                        and res["all_to_all_bytes"] == res["formula_bytes"])
                ok &= agree({"model": name, "optimizer": optimizer, "ranks": rows}, good)
        return ok

    run_checker(checks)


if __name__ == "__main__":
    main()
