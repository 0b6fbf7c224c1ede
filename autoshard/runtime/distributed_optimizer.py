"""The distributed optimizer (ZeRO-1, as Megatron's): optimizer state and fp32 main parameters
sharded over the data-parallel group.

    rt = prog.distributed()                                   # a MeshRuntime, inside torchrun
    opt = DistributedOptimizer(rt, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    for batch in data:
        loss = rt.train_step(**batch, max_norm=1.0)           # gradients reduce-scattered as backward ends
        opt.step()                                            # local step, then parameters all-gathered
        opt.zero_grad()

Gradients are the runtime's (runtime/gradients.py): building the optimizer asks the runtime to lay
them out sharded (`MeshRuntime.shard_gradients`), so they accumulate in an fp32 buffer across
microbatches and are reduce-scattered over dp bucket by bucket, overlapped with backward; the
runtime also checks them for inf/NaN, takes the global norm and clips. This class is what is left:
the wrapped optimizer (any element-wise torch.optim class: AdamW, Adam, SGD: `ELEMENTWISE`; others
are refused) over the owned pieces (runtime/flat_params.py: one flat tensor per parameter piece, so
its state is 1/dp of the unsharded optimizer's), the all-gather that publishes them after its step,
and its checkpoint view. Each dp rank owns 1/dp of every bucket. An lr scheduler takes
`opt.optimizer` (the wrapped torch optimizer; its param_groups are this one's). The parameters'
owned ranges are all-gathered into the parameters' own storage: they are views of one flat buffer
laid out like the gradients. With fp32 parameters the main parameters are those owned ranges
themselves (no extra copy). Frozen parameters (requires_grad=False) are left out: no piece, no
state, never written.

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

`zero` (default: the program's, autoshard's `zero`): 1 is the above; 2 also holds 1/dp of the
gradients (each unit's reduce-scattered after every backward pass: runtime/grad_buffer.py's
per_pass); 3 also holds 1/dp of the parameters, each unit gathered only while forward or backward
reads it (runtime/sharded_params.py; `keep_last` units, the last of the rank's forward, stay
gathered from forward to backward). A unit is one repeated layer, or the parameters read before or
after the layers (passes/unit_gathers.py). `gathered()` makes every parameter whole for reading or
writing them outside a step (checkpoints use it).

Expert parallelism (ep > 1): the rank's experts are a second part of the gradients and a second
flat storage, reduced and sharded over the dp/ep ranks holding the same experts
(MeshGroups.expert_dp), the rest over dp.

`shard=False` keeps everything on every rank (buckets all-reduced; the same numbers, 16 bytes a
parameter): the baseline the sharded one is checked against. Clipping by the global norm counts
each element once over tp x pp x dp. Checkpoints (autoshard/checkpoint) save the state whole per
parameter, gathered over dp, so they load at any other dp, tp or pp; with half-precision weights
the fp32 main parameters are saved too (state "main"), and the loss scaler's state in the
parameter groups.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Callable, Iterator

import torch

from autoshard.errors import ShardingError
from autoshard.runtime.flat_params import FlatParams
from autoshard.runtime.json_gather import all_gather_json
from autoshard.runtime.loss_scale import LossScaler
from autoshard.runtime.sharded_params import ShardedParams, UnitGathers

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
    """`optimizer_class(**defaults)` over this rank's owned shard of `runtime`'s trainable parameters."""

    def __init__(self, runtime, optimizer_class: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW, *,
                 shard: bool = True, overlap: bool | None = None, bucket_bytes: int = 25 * 2 ** 20,
                 loss_scaler: LossScaler | None = None, zero: int | None = None, keep_last: int = 0, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, ELEMENTWISE)):
            raise ShardingError(f"DistributedOptimizer steps flat pieces of parameters, which only an element-wise "
                                f"optimizer does exactly; got {getattr(optimizer_class, '__name__', optimizer_class)!r}, "
                                f"use one of {', '.join(c.__name__ for c in ELEMENTWISE)} (or a subclass)")
        trainable = [(n, p) for n, p in runtime.named_parameters() if p.requires_grad]
        if not trainable:
            raise ShardingError("DistributedOptimizer: the runtime holds no trainable parameters")
        dtypes = {p.dtype for _, p in trainable}
        if len(dtypes) > 1:
            raise ShardingError(f"DistributedOptimizer needs one parameter dtype; this rank's trainable parameters "
                                f"are {sorted(map(str, dtypes))}")
        zero = getattr(runtime, "zero", 1) if zero is None else zero
        if zero not in (1, 2, 3) or (zero > 1 and not shard):
            raise ShardingError(f"DistributedOptimizer: zero={zero!r}; 1 shards the optimizer state, 2 the gradients "
                                f"too, 3 the parameters too (each needs shard=True)")
        self.runtime, self.zero = runtime, zero
        units = runtime.param_units() if zero > 1 else None
        self.grads = runtime.shard_gradients(shard=shard, bucket_bytes=bucket_bytes, overlap=overlap, units=units)
        self.parts = [(ShardedParams if zero == 3 else FlatParams)(part) for part in self.grads.parts]
        self.grads.pin()                 # the parameters now live in the parts' flat storage
        if zero == 3:
            runtime.use_unit_gathers(UnitGathers(self.parts, units, keep_last))
        self.names = [n for part in self.grads.parts for n in part.names]
        self.params = [p for part in self.grads.parts for p in part.params]
        self.optimizer = optimizer_class([m for flat in self.parts for _, _, m in flat.pieces.values()], **defaults)
        # fp16: dynamic loss scaling unless a scaler is given; bf16 and fp32 need none
        self.grads.scaler = loss_scaler if loss_scaler is not None else \
            (LossScaler() if trainable[0][1].dtype == torch.float16 else None)

    @property
    def scaler(self) -> LossScaler | None:
        return self.grads.scaler

    def _owned(self):
        """(flat params, local index, global index, lo, hi, main) for every piece this rank owns."""
        first = 0
        for flat in self.parts:
            for li, (lo, hi, main) in flat.pieces.items():
                yield flat, li, first + li, lo, hi, main
            first += len(flat.params)

    @property
    def buckets(self) -> int:
        """Reductions per step (buckets over all parts)."""
        return self.grads.buckets

    @property
    def overlap(self) -> bool:
        return all(part.buffer.overlap for part in self.grads.parts)

    @overlap.setter
    def overlap(self, value: bool) -> None:
        for part in self.grads.parts:
            part.buffer.overlap = value

    # ---- the optimizer's interface -------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self) -> None:
        """The wrapped optimizer's step on this rank's pieces, then the parameters all-gathered;
        nothing when the loss scaler found an inf or NaN gradient in this step."""
        if self.grads.skipped:
            self.grads.skipped = False
            return
        self.optimizer.step()
        for flat in self.parts:
            flat.publish()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter whole on this rank inside (zero=3 releases them between uses); what is
        written to them inside is kept. Other zero stages hold them whole anyway. Every
        data-parallel rank must enter it together (it all-gathers)."""
        with contextlib.ExitStack() as stack:
            for flat in self.parts:
                if isinstance(flat, ShardedParams):
                    stack.enter_context(flat.gathered())
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads.zero()

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
        main = sum(m.numel() * m.element_size() for flat, _, _, lo, hi, m in self._owned()
                   if m.data_ptr() != flat.local(lo, hi).data_ptr())
        return {"optimizer_state": state, "main_params": main,
                "grads": sum(part.buffer.data.numel() * part.buffer.data.element_size() for part in self.grads.parts),
                "params": sum(flat.param_bytes() for flat in self.parts)}

    # ---- checkpoints: the state whole per parameter ----------------------------------------------
    def _wholes(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each parameter's `value_of(main)` by its index, whole (gathered over its part's group), in fp32."""
        out, first = {}, 0
        for flat in self.parts:
            full = flat.whole(value_of)
            for li in range(len(flat.params)):
                out[first + li] = flat.view(full, li)
            first += len(flat.params)
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
        sharded = self.grads.sharded and self.runtime.dims.data > 1
        kinds: dict[str, bool] = {}
        for part in (all_gather_json(mine, self.runtime.groups.dp) if sharded else [mine]):
            kinds.update(part)          # a rank may own no piece: every rank takes every key
        state: dict = {p: {} for p in self.params}
        for k in sorted(k for k in kinds if kinds[k]):
            for i, t in self._wholes(lambda m, k=k: self.optimizer.state[m][k]).items():
                state[self.params[i]][k] = t
        if any(flat.separate_main() for flat in self.parts):
            for i, t in self._wholes(lambda m: m).items():
                state[self.params[i]]["main"] = t
        for k in sorted(k for k in kinds if not kinds[k]):        # scalars (AdamW's step): the same on every piece
            sample = next((s[k] for s in self.optimizer.state.values() if k in s), 0.0)
            value = torch.tensor(float(sample), dtype=torch.float64, device=self.params[0].device)
            if sharded:
                self.runtime.groups.world.all_reduce(value, op="max", group=self.runtime.groups.dp)
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
        for flat, li, i, lo, hi, main in self._owned():
            p, o = self.params[i], flat.layout.offsets[li]
            whole = dict(view.state.get(p, {}))
            saved_main = whole.pop("main", None)
            self.optimizer.state[main] = {
                k: (v.reshape(-1)[lo - o: hi - o].clone().to(main.dtype)
                    if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in whole.items()}
            if main.data_ptr() != flat.local(lo, hi).data_ptr():
                main.copy_(flat.local(lo, hi) if saved_main is None else saved_main.reshape(-1)[lo - o: hi - o])
        if self.scaler is not None:
            self.scaler.load(self.optimizer.param_groups[0])
