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
AdamW, Adam, SGD) sees only the owned pieces, one flat tensor per parameter piece, so its state is
1/dp of the unsharded optimizer's. After its step the parameters' owned ranges are all-gathered,
into the parameters' own storage: they are views of one flat buffer laid out like the gradients.
With fp32 parameters the main parameters are those owned ranges themselves (no extra copy).

`overlap` (default: on, except on gloo): start each bucket's reduction inside backward. On NCCL the
reduction runs beside the compute; on gloo it runs on the CPU cores the ranks' backward also uses,
and measured side by side it made steps 2-4% slower here (2 cores, dp=2; benchmarks/RESULTS.md),
so gloo reduces after backward unless asked.

`shard=False` keeps everything on every rank (buckets all-reduced; the same numbers, 16 bytes a
parameter): the baseline the sharded one is checked against. Clipping by the global norm counts
each element once over tp x pp x dp. Checkpoints (autoshard/checkpoint) save the state whole per
parameter, gathered over dp, so they load at any other dp, tp or pp.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist

from autoshard.errors import ShardingError
from autoshard.runtime.grad_buffer import GradBuffer, plan_layout
from autoshard.runtime.grad_sync import global_grad_norm

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer:
    """`optimizer_class(**defaults)` over this rank's owned shard of `runtime`'s parameters."""

    def __init__(self, runtime, optimizer_class: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW, *,
                 shard: bool = True, overlap: bool | None = None, bucket_bytes: int = 25 * 2 ** 20, **defaults):
        named = list(runtime.named_parameters())
        if not named:
            raise ShardingError("DistributedOptimizer: the runtime holds no parameters")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) > 1:
            raise ShardingError(f"DistributedOptimizer needs one parameter dtype; this rank holds {sorted(map(str, dtypes))}")
        self.runtime, self.names = runtime, [n for n, _ in named]
        self.params = [p for _, p in named]
        dims = runtime.dims
        self.shards = dims.dp if shard else 1
        self.shard_rank = runtime.dp_rank if shard else 0
        index = {n: i for i, n in enumerate(self.names)}
        tied = {index[n]: group for pps, group in runtime.groups.shared.items()
                for n in runtime._prog.shared_params.get(pps, []) if n in index}
        self.layout = plan_layout([p.numel() for p in self.params], self.shards,
                                  max(1, bucket_bytes // 4), set(tied))
        dtype, device = self.params[0].dtype, self.params[0].device
        self.flat = torch.zeros(self.layout.numel, dtype=dtype, device=device)     # the parameters' storage
        with torch.no_grad():
            for i, p in enumerate(self.params):
                o = self.layout.offsets[i]
                self.flat[o: o + p.numel()].copy_(p.reshape(-1))
                p.data = self.flat[o: o + p.numel()].view(p.shape)
        if overlap is None:       # see the module doc: on gloo the reduction costs the cores backward runs on
            overlap = dims.dp > 1 and dist.get_backend(runtime.groups.dp) != "gloo"
        self.grads = GradBuffer(self.params, self.layout, runtime.groups.dp, self.shard_rank, dims.dp, tied, overlap)
        runtime.grad_buffer = self
        # the owned pieces: fp32 main parameters (views of the flat storage when that is fp32), fp32 grads
        self.pieces: dict[int, tuple[int, int, torch.Tensor]] = {}
        for i in range(len(self.params)):
            span = self.layout.owned_piece(i, self.shard_rank)
            if span is not None:
                lo, hi = span
                main = self.flat[lo:hi] if dtype == torch.float32 else self.flat[lo:hi].float()
                main.requires_grad_(True)
                main.grad = self.grads.data[lo:hi]
                self.pieces[i] = (lo, hi, main)
        self.optimizer = optimizer_class([m for _, _, m in self.pieces.values()], **defaults)

    # ---- what the runtime calls ----------------------------------------------------------------
    def begin(self, microbatches: int, scale: float | torch.Tensor, origin: float) -> None:
        if self.grads.reduced:
            raise ShardingError("DistributedOptimizer: the gradient buffer still holds the last step's reduced "
                                "gradients; call opt.step() and opt.zero_grad() before the next train_step "
                                "(accumulating over several train_steps is done with microbatches)")
        current = dict(self.runtime.named_parameters())
        for i, p in enumerate(self.params):
            if current.get(self.names[i]) is not p or p.data_ptr() != self.flat[self.layout.offsets[i]:].data_ptr():
                raise ShardingError(f"DistributedOptimizer: parameter {self.names[i]} was replaced after the "
                                    f"optimizer was built (set_tensors, .to(), load_state_dict with assign?); "
                                    f"build the optimizer after moving or loading the runtime")
        self.grads.begin(microbatches, scale, origin)

    def reduce_records(self) -> list:
        """The last step's bucket reductions (runtime/grad_buffer.py's ReduceRecord)."""
        return self.grads.records

    def finish(self, max_norm: float | None) -> torch.Tensor | None:
        """Reduce the step's gradients; clip by the global norm if `max_norm`; return the norm."""
        self.grads.finish()
        if max_norm is None:
            return None
        weighted = []
        for i, (lo, hi, main) in self.pieces.items():
            w = self.runtime._prog.param_weight(self.names[i], self.runtime.tp_rank)
            if isinstance(w, torch.Tensor):       # per row: spread over the parameter, then cut like the piece
                o = self.layout.offsets[i]
                w = w.expand(self.params[i].shape).reshape(-1)[lo - o: hi - o]
            weighted.append((main.grad, w))
        norm = global_grad_norm(weighted, self.runtime.dims, replicas=self.runtime.dims.dp // self.shards)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for _, _, main in self.pieces.values():
            main.grad.mul_(coef.to(main.grad.dtype))
        return norm

    # ---- the optimizer's interface -------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        for lo, hi, main in self.pieces.values():
            if main.data_ptr() != self.flat[lo:hi].data_ptr():
                self.flat[lo:hi].copy_(main)
        if self.shards > 1:
            for b in self.layout.buckets:
                a, z = b.owned(self.shard_rank, self.shards)
                dist.all_gather_into_tensor(self.flat[b.start: b.stop], self.flat[a:z].clone(), group=self.runtime.groups.dp)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads.zero()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for: the optimizer's state, fp32 main parameters apart from the
        parameters themselves, fp32 gradients, the parameters (padding included)."""
        state = sum(v.numel() * v.element_size() for s in self.optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        main = sum(m.numel() * m.element_size() for lo, hi, m in self.pieces.values()
                   if m.data_ptr() != self.flat[lo:hi].data_ptr())
        return {"optimizer_state": state, "main_params": main, "grads": self.grads.data.numel() * 4,
                "params": self.flat.numel() * self.flat.element_size()}

    # ---- checkpoints: the state whole per parameter ----------------------------------------------
    def checkpoint_view(self) -> SimpleNamespace:
        """An optimizer-like view (`state` by parameter, `param_groups`) with each tensor state whole
        and scalar state as this rank's pieces have it; every dp rank must call it (it all-reduces)."""
        keys = sorted({k for s in self.optimizer.state.values() for k in s})
        state: dict = {p: {} for p in self.params}
        for k in keys:
            sample = next(s[k] for s in self.optimizer.state.values() if k in s)
            if isinstance(sample, torch.Tensor) and sample.dim() > 0:
                full = torch.zeros(self.layout.numel, dtype=sample.dtype, device=self.flat.device)
                for i, (lo, hi, main) in self.pieces.items():
                    full[lo:hi] = self.optimizer.state[main][k]
                if self.shards > 1:
                    dist.all_reduce(full, group=self.runtime.groups.dp)   # owned ranges are disjoint
                for i, p in enumerate(self.params):
                    o = self.layout.offsets[i]
                    state[p][k] = full[o: o + p.numel()].view(p.shape)
            else:
                value = torch.tensor(float(sample), dtype=torch.float64, device=self.flat.device)
                if self.shards > 1:
                    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.runtime.groups.dp)
                for p in self.params:
                    state[p][k] = value.to(sample.dtype) if isinstance(sample, torch.Tensor) else float(value)
        return SimpleNamespace(state=state, param_groups=self.optimizer.param_groups)

    def empty_view(self) -> SimpleNamespace:
        return SimpleNamespace(state={}, param_groups=self.optimizer.param_groups)

    def load_checkpoint_view(self, view: SimpleNamespace) -> None:
        """Take the owned pieces of a whole-per-parameter state (what checkpoint.load filled in)."""
        for i, (lo, hi, main) in self.pieces.items():
            p, o = self.params[i], self.layout.offsets[i]
            whole = view.state.get(p, {})
            self.optimizer.state[main] = {
                k: (v.reshape(-1)[lo - o: hi - o].clone().to(main.dtype)
                    if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in whole.items()}
            if main.data_ptr() != self.flat[lo:hi].data_ptr():
                main.copy_(self.flat[lo:hi])
