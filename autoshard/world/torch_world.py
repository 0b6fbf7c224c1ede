"""The world of a torchrun job: torch.distributed on its default process group (gloo on CPU, NCCL on
GPU). The only module of autoshard that calls torch.distributed to communicate; process-group
setup (init_process_group, the launch) lives with the launchers."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autoshard.world.protocol import P2P, Group, Work

__all__ = ["TorchWorld", "initialized"]

# torch 2.13 renamed all_gather_into_tensor (which now warns on every call) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class TorchWorld:
    """torch.distributed's collectives under the World names (world/protocol.py)."""

    @property
    def backend(self) -> str:
        return str(dist.get_backend())

    def rank(self, group: Group = None) -> int:
        return dist.get_rank(group)

    def size(self, group: Group = None) -> int:
        return dist.get_world_size(group)

    def global_rank(self, group: Group, group_rank: int) -> int:
        return group_rank if group is None else dist.get_global_rank(group, group_rank)

    def new_group(self, ranks: list[int]) -> Group:
        return dist.new_group(ranks)

    def all_reduce(self, t: torch.Tensor, op: str = "sum", group: Group = None, async_op: bool = False) -> Work | None:
        return dist.all_reduce(t, op=_OPS[op], group=group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, group: Group = None,
                       async_op: bool = False) -> Work | None:
        return dist.reduce_scatter_tensor(out, t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, group: Group = None,
                   async_op: bool = False) -> Work | None:
        return _all_gather_single(out, t, group=group, async_op=async_op)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   group: Group = None) -> None:
        dist.all_to_all_single(out, t, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)

    def broadcast(self, t: torch.Tensor, src: int, group: Group = None) -> None:
        dist.broadcast(t, src=src, group=group)

    def p2p(self, ops: list[P2P]) -> list[Work]:
        if not ops:
            return []
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if o.send else dist.irecv, o.tensor, o.peer, o.group,
                                                  tag=o.tag) for o in ops])

    def barrier(self, group: Group = None) -> None:
        dist.barrier(group=group)

    def gather_objects(self, obj: Any, group: Group = None) -> list:
        out: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
