"""The distributed optimizer (ZeRO-1, as Megatron's): optimizer state and fp32 main parameters
sharded over the data-parallel group.

    rt = prog.distributed()                                   # a MeshRuntime, inside torchrun
    opt = DistributedOptimizer(rt, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    for batch in data:
        loss = rt.train_step(**batch, max_norm=1.0)           # gradients reduce-scattered as backward ends
        opt.step()                                            # local step, then parameters all-gathered
        opt.zero_grad()

Gradients live in one flat fp32 buffer (runtime/grad_buffer.py): they accumulate there in fp32
across microbatches and are reduce-scattered over dp bucket by bucket, overlapped with backward.
Each dp rank owns 1/dp of every bucket; the wrapped optimizer (any element-wise torch.optim class:
AdamW, Adam, SGD: `ELEMENTWISE`; others are refused) sees only the owned pieces, one flat tensor per
parameter piece, so its state is 1/dp of the unsharded optimizer's. An lr scheduler takes
`opt.optimizer` (the wrapped torch optimizer; its param_groups are this one's). After its step the parameters' owned ranges are all-gathered,
into the parameters' own storage: they are views of one flat buffer laid out like the gradients.
With fp32 parameters the main parameters are those owned ranges themselves (no extra copy).

Mixed precision, as Megatron does it: cast the model before compiling (`model.to(torch.bfloat16)`
or `.half()`; the graph then computes in that dtype, with the fp32 upcasts the model writes itself:
norms, softmax, Hugging Face's loss). The optimizer keeps fp32 main parameters (its pieces, made
from the half-precision weights), accumulates and reduces gradients in fp32 and copies the updated
main parameters back into the half-precision weights before the all-gather. fp16 adds dynamic loss
scaling (runtime/loss_scale.py's LossScaler, default for fp16 parameters): the runtime multiplies
the loss by the scale before backward, the reduced gradients are divided by it, and an inf or NaN
on any rank skips the step on every rank and halves the scale.

`overlap` (default: on, except on gloo): start each bucket's reduction inside backward. On NCCL the
reduction runs beside the compute; on gloo it runs on the CPU cores the ranks' backward also uses,
and measured side by side it made steps 2-4% slower here (2 cores, dp=2; benchmarks/RESULTS.md),
so gloo reduces after backward unless asked.

Expert parallelism (ep > 1): the rank's experts are a second flat buffer (runtime/flat_params.py),
reduced and sharded over the dp/ep ranks holding the same experts (MeshGroups.expert_dp), the
rest over dp; in the global norm an expert element counts as often as the others do.

`shard=False` keeps everything on every rank (buckets all-reduced; the same numbers, 16 bytes a
parameter): the baseline the sharded one is checked against. Clipping by the global norm counts
each element once over tp x pp x dp. Checkpoints (autoshard/checkpoint) save the state whole per
parameter, gathered over dp, so they load at any other dp, tp or pp; with half-precision weights
the fp32 main parameters are saved too (state "main"), and the loss scaler's state in the
parameter groups.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist

from autoshard.errors import ShardingError
from autoshard.runtime.flat_params import FlatParams
from autoshard.runtime.grad_sync import global_grad_norm
from autoshard.runtime.json_gather import all_gather_json
from autoshard.runtime.loss_scale import LossScaler

__all__ = ["DistributedOptimizer", "ELEMENTWISE"]

# Optimizers whose update of an element reads only that element's gradient and state: stepping a
# flat 1-D piece of a parameter is then the same as stepping the parameter. Others (Adafactor's
# factored moments, LBFGS, sparse ones) would be silently different and are refused.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD)


_USE_CHECKPOINTS = (
    "DistributedOptimizer has no state_dict: each rank holds 1/dp of the state as flat pieces laid out for "
    "this mesh. Save and load it with autoshard.checkpoint: checkpoint.save(folder, prog, runtime, opt, step=n) "
    "on every rank, and checkpoint.load(folder, prog, runtime, opt) (at any tp, pp, dp)")


class DistributedOptimizer:
    """`optimizer_class(**defaults)` over this rank's owned shard of `runtime`'s parameters."""

    def __init__(self, runtime, optimizer_class: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW, *,
                 shard: bool = True, overlap: bool | None = None, bucket_bytes: int = 25 * 2 ** 20,
                 loss_scaler: LossScaler | None = None, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, ELEMENTWISE)):
            raise ShardingError(f"DistributedOptimizer steps flat pieces of parameters, which only an element-wise "
                                f"optimizer does exactly; got {getattr(optimizer_class, '__name__', optimizer_class)!r}, "
                                f"use one of {', '.join(c.__name__ for c in ELEMENTWISE)} (or a subclass)")
        named = list(runtime.named_parameters())
        if not named:
            raise ShardingError("DistributedOptimizer: the runtime holds no parameters")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) > 1:
            raise ShardingError(f"DistributedOptimizer needs one parameter dtype; this rank holds {sorted(map(str, dtypes))}")
        self.runtime, self.names = runtime, [n for n, _ in named]
        self.params = [p for _, p in named]
        dims = runtime.dims
        self.base_replicas = 1 if shard else dims.dp                 # ranks holding each non-expert element
        index = {n: i for i, n in enumerate(self.names)}
        tied = {index[n]: group for pps, group in runtime.groups.shared.items()
                for n in runtime._prog.shared_params.get(pps, []) if n in index}
        if overlap is None:       # see the module doc: on gloo the reduction costs the cores backward runs on
            overlap = dims.dp > 1 and dist.get_backend(runtime.groups.dp) != "gloo"
        experts = set(getattr(runtime, "expert_params", ())) if getattr(dims, "ep", 1) > 1 else set()
        spans = [([i for i, n in enumerate(self.names) if n not in experts], runtime.groups.dp, dims.dp, runtime.dp_rank)]
        if experts:           # experts: over the ranks holding the same experts (dp / ep of them)
            spans.append(([i for i, n in enumerate(self.names) if n in experts], runtime.groups.expert_dp,
                          dims.dp // dims.ep, runtime.dp_rank // dims.ep))
        self.parts: list[tuple[FlatParams, list[int]]] = [
            (FlatParams([self.params[i] for i in idx], group, size, rank, shard=shard, bucket_bytes=bucket_bytes,
                        tied={idx.index(i): g for i, g in tied.items() if i in idx}, overlap=overlap), idx)
            for idx, group, size, rank in spans if idx]
        runtime.grad_buffer = self
        self.optimizer = optimizer_class([m for part, _ in self.parts for _, _, m in part.pieces.values()], **defaults)
        # fp16: dynamic loss scaling unless a scaler is given; bf16 and fp32 need none
        self.scaler = loss_scaler if loss_scaler is not None else (LossScaler() if named[0][1].dtype == torch.float16 else None)
        self._skip = False

    def _owned(self):
        """(part, local index, global index, lo, hi, main) for every piece this rank owns."""
        for part, idx in self.parts:
            for li, (lo, hi, main) in part.pieces.items():
                yield part, li, idx[li], lo, hi, main

    @property
    def buckets(self) -> int:
        """Reductions per step (buckets over all parts)."""
        return sum(len(part.layout.buckets) for part, _ in self.parts)

    @property
    def overlap(self) -> bool:
        return all(part.grads.overlap for part, _ in self.parts)

    @overlap.setter
    def overlap(self, value: bool) -> None:
        for part, _ in self.parts:
            part.grads.overlap = value

    # ---- what the runtime calls ----------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """What the runtime multiplies the loss by before backward (1 without a loss scaler)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def begin(self, microbatches: int, scale: float | torch.Tensor, origin: float) -> None:
        """A step starts: gradients are multiplied by `scale` once reduced (the runtime's loss
        normalisation over the loss scale)."""
        if any(part.grads.reduced for part, _ in self.parts):
            raise ShardingError("DistributedOptimizer: the gradient buffer still holds the last step's reduced "
                                "gradients; call opt.step() and opt.zero_grad() before the next train_step "
                                "(accumulating over several train_steps is done with microbatches)")
        current = dict(self.runtime.named_parameters())
        for part, idx in self.parts:
            for li, i in enumerate(idx):
                if current.get(self.names[i]) is not self.params[i] or not part.is_storage(li, self.params[i]):
                    raise ShardingError(f"DistributedOptimizer: parameter {self.names[i]} was replaced after the "
                                        f"optimizer was built (set_tensors, .to(), load_state_dict with assign?); "
                                        f"build the optimizer after moving or loading the runtime")
        for part, _ in self.parts:
            part.grads.begin(microbatches, scale, origin)

    def reduce_records(self) -> list:
        """The last step's bucket reductions (runtime/grad_buffer.py's ReduceRecord), part by part."""
        return [r for part, _ in self.parts for r in part.grads.records]

    def finish(self, max_norm: float | None) -> torch.Tensor | None:
        """Reduce the step's gradients; with a loss scaler, skip the step on every rank if any
        gradient is inf or NaN (the norm is then inf); clip by the global norm if `max_norm`; return
        the norm."""
        for part, _ in self.parts:
            part.grads.finish()
        if self.scaler is not None:
            self._skip = self.scaler.found_inf([main.grad for *_, main in self._owned()])
            self.scaler.update(self._skip)
            if self._skip:
                return torch.tensor(float("inf"))
        if max_norm is None:
            return None
        weighted = []
        for part, li, i, lo, hi, main in self._owned():
            w = self.runtime._prog.param_weight(self.names[i], self.runtime.tp_rank)
            if isinstance(w, torch.Tensor):       # per row: spread over the parameter, then cut like the piece
                o = part.layout.offsets[li]
                w = w.expand(self.params[i].shape).reshape(-1)[lo - o: hi - o]
            # an element held by fewer ranks than the rest (experts, unsharded) counts as often as they do
            weighted.append((main.grad, w * (self.base_replicas // part.replicas)))
        norm = global_grad_norm(weighted, self.runtime.dims, replicas=self.base_replicas)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for *_, main in self._owned():
            main.grad.mul_(coef.to(main.grad.dtype))
        return norm

    # ---- the optimizer's interface -------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self) -> None:
        """The wrapped optimizer's step on this rank's pieces, then the parameters all-gathered;
        nothing when the loss scaler found an inf or NaN gradient in this step."""
        if self._skip:
            self._skip = False
            return
        self.optimizer.step()
        for part, _ in self.parts:
            part.publish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part, _ in self.parts:
            part.grads.zero()

    def state_dict(self) -> dict:
        """Refused: this rank's state is flat pieces of the parameters, laid out for this mesh and
        bucket size, which torch.save / load_state_dict would carry to no other layout."""
        raise ShardingError(_USE_CHECKPOINTS)

    def load_state_dict(self, state_dict: dict) -> None:
        """Refused (see state_dict)."""
        raise ShardingError(_USE_CHECKPOINTS)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for: the optimizer's state, fp32 main parameters apart from the
        parameters themselves, fp32 gradients, the parameters (padding included)."""
        state = sum(v.numel() * v.element_size() for s in self.optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        main = sum(m.numel() * m.element_size() for part, _, _, lo, hi, m in self._owned()
                   if m.data_ptr() != part.flat[lo:hi].data_ptr())
        return {"optimizer_state": state, "main_params": main,
                "grads": sum(part.grads.data.numel() * 4 for part, _ in self.parts),
                "params": sum(part.flat.numel() * part.flat.element_size() for part, _ in self.parts)}

    # ---- checkpoints: the state whole per parameter ----------------------------------------------
    def _wholes(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each parameter's `value_of(main)` by its index, whole (gathered over its part's group), in fp32."""
        out = {}
        for part, idx in self.parts:
            full = part.whole(value_of)
            for li, i in enumerate(idx):
                out[i] = part.view(full, li)
        return out

    def main_params(self) -> dict[str, torch.Tensor]:
        """The fp32 main parameters, whole per local parameter (every rank of the group must call it)."""
        return {self.names[i]: t for i, t in self._wholes(lambda m: m).items()}

    def checkpoint_view(self) -> SimpleNamespace:
        """An optimizer-like view (`state` by parameter, `param_groups`) with each tensor state whole
        per parameter, the fp32 main parameters as state "main" when they are not the parameters
        themselves (bf16, fp16), and the loss scaler's state in the parameter groups. Every dp rank
        must call it (it all-reduces)."""
        mine = {k: isinstance(v, torch.Tensor) and v.dim() > 0 for s in self.optimizer.state.values() for k, v in s.items()}
        sharded = self.base_replicas == 1 and self.runtime.dims.dp > 1
        kinds: dict[str, bool] = {}
        for part in (all_gather_json(mine, self.runtime.groups.dp) if sharded else [mine]):
            kinds.update(part)          # a rank may own no piece: every rank takes every key
        state: dict = {p: {} for p in self.params}
        for k in sorted(k for k in kinds if kinds[k]):
            for i, t in self._wholes(lambda m, k=k: self.optimizer.state[m][k]).items():
                state[self.params[i]][k] = t
        if any(part.separate_main() for part, _ in self.parts):
            for i, t in self._wholes(lambda m: m).items():
                state[self.params[i]]["main"] = t
        for k in sorted(k for k in kinds if not kinds[k]):        # scalars (AdamW's step): the same on every piece
            sample = next((s[k] for s in self.optimizer.state.values() if k in s), 0.0)
            value = torch.tensor(float(sample), dtype=torch.float64, device=self.params[0].device)
            if sharded:
                dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.runtime.groups.dp)
            for p in self.params:
                state[p][k] = value.float() if isinstance(sample, torch.Tensor) else float(value)
        if self.scaler is not None:
            for group in self.optimizer.param_groups:
                group.update(self.scaler.state())
        return SimpleNamespace(state=state, param_groups=self.optimizer.param_groups)

    def empty_view(self) -> SimpleNamespace:
        return SimpleNamespace(state={}, param_groups=self.optimizer.param_groups)

    @torch.no_grad()
    def load_checkpoint_view(self, view: SimpleNamespace) -> None:
        """Take the owned pieces of a whole-per-parameter state (what checkpoint.load filled in): the
        optimizer's state, the fp32 main parameters (saved ones, else the loaded parameters), the
        loss scaler's state."""
        for part, li, i, lo, hi, main in self._owned():
            p, o = self.params[i], part.layout.offsets[li]
            whole = dict(view.state.get(p, {}))
            saved_main = whole.pop("main", None)
            self.optimizer.state[main] = {
                k: (v.reshape(-1)[lo - o: hi - o].clone().to(main.dtype)
                    if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in whole.items()}
            if main.data_ptr() != part.flat[lo:hi].data_ptr():
                main.copy_(part.flat[lo:hi] if saved_main is None else saved_main.reshape(-1)[lo - o: hi - o])
        if self.scaler is not None:
            self.scaler.load(self.optimizer.param_groups[0])
