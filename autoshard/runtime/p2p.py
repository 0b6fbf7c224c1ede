"""Point-to-point transfers between pipeline stages (batched isend / irecv).

Activations go forward with a small header per tensor (rank, dtype, sizes) on a step's first
microbatch, so a receiver needs no shape inference: shapes follow the microbatch, and stages may
carry several values (hidden states and pass-through tensors). Later microbatches of the step have
the same shapes (the batch is cut evenly) and go without headers; every schedule runs microbatch 0
of a stage first. Gradients go back without headers: their receiver made the activations they
belong to. Every message carries a tag naming (stage, microbatch, direction, slot); gloo
matches by tag, NCCL matches sends and receives between a pair in issue order, which the
schedules keep (both sides walk microbatches in the same order).

When both stages live on this rank (the turn of a V schedule: stage pp - 1 feeds stage pp on rank
pp - 1) nothing is sent: the tensors are copied into a local mailbox the receive reads from (a copy,
so a later stage writing into its input in place cannot change what the earlier one saved).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Transfer", "FORWARD", "BACKWARD"]

FORWARD, BACKWARD = 0, 1
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]
_MAX_DIMS = 8


def _tag(stage: int, microbatch: int, n_stages: int, direction: int, slot: int) -> int:
    return (((microbatch * n_stages + stage) * 2 + direction) * 512 + slot) % (2 ** 31 - 1)


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _MAX_DIMS:
        raise ValueError(f"cannot send a {t.dim()}-d tensor between stages (at most {_MAX_DIMS} dims)")
    sizes = list(t.shape) + [0] * (_MAX_DIMS - t.dim())
    return torch.tensor([t.dim(), _DTYPES.index(t.dtype), *sizes], dtype=torch.int64)


class Transfer:
    """Sends and receives of one pipeline rank; keeps in-flight sends alive until `wait_sends`."""

    def __init__(self, n_stages: int, device: torch.device | str = "cpu", rank: int | None = None):
        self.n_stages, self.device = n_stages, torch.device(device)
        self._works: list[dist.Work] = []
        self._buffers: list[torch.Tensor] = []        # what in-flight sends read
        self._shapes: dict[int, list[tuple[list[int], torch.dtype]]] = {}   # stage -> its inputs' shapes
        self.bytes_sent = self.messages_sent = 0
        self._local: dict[tuple[int, int, int], list[torch.Tensor]] = {}   # (stage, microbatch, direction)
        self._me = rank           # this process's global rank: a transfer to it stays local

    def send(self, tensors: list[torch.Tensor], dst: int, stage: int, microbatch: int, direction: int) -> None:
        """Post sends of `tensors` (outputs of `stage` going forward, or gradients of `stage`'s
        inputs going back) to global rank `dst`; returns at once."""
        if dst == self._me:
            self._local[(stage, microbatch, direction)] = [t.detach().clone() for t in tensors]
            return
        ops = []
        for i, t in enumerate(tensors):
            payload = t.detach().contiguous()
            if direction == FORWARD and microbatch == 0:
                head = _header(payload).to(self.device)
                ops.append(dist.P2POp(dist.isend, head, dst, tag=_tag(stage, microbatch, self.n_stages, direction, 2 * i)))
                self._buffers.append(head)
            ops.append(dist.P2POp(dist.isend, payload, dst, tag=_tag(stage, microbatch, self.n_stages, direction, 2 * i + 1)))
            self._buffers.append(payload)
            self.bytes_sent += payload.numel() * payload.element_size()
        self.messages_sent += len(ops)
        if ops:
            self._works += dist.batch_isend_irecv(ops)

    def recv_forward(self, count: int, src: int, stage: int, microbatch: int) -> list[torch.Tensor]:
        """Receive the `count` activations `stage` takes from global rank `src`."""
        if src == self._me:
            return self._local.pop((stage - 1, microbatch, FORWARD))
        if microbatch == 0:
            heads = [torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device) for _ in range(count)]
            self._wait([dist.P2POp(dist.irecv, h, src, tag=_tag(stage - 1, 0, self.n_stages, FORWARD, 2 * i))
                        for i, h in enumerate(heads)])
            self._shapes[stage] = [(sizes[:ndim], _DTYPES[code]) for ndim, code, *sizes in (h.tolist() for h in heads)]
        elif stage not in self._shapes:
            raise RuntimeError(f"stage {stage} received microbatch {microbatch} before microbatch 0; "
                               f"the schedule must run each stage's microbatches in order")
        out = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self._shapes[stage]]
        self._wait([dist.P2POp(dist.irecv, t, src, tag=_tag(stage - 1, microbatch, self.n_stages, FORWARD, 2 * i + 1))
                    for i, t in enumerate(out)])
        return out

    def recv_backward(self, like: list[torch.Tensor], src: int, stage: int, microbatch: int) -> list[torch.Tensor]:
        """Receive gradients for `stage`'s outputs `like` (same shapes) from global rank `src`."""
        if src == self._me:
            return self._local.pop((stage + 1, microbatch, BACKWARD))
        out = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
        self._wait([dist.P2POp(dist.irecv, t, src, tag=_tag(stage + 1, microbatch, self.n_stages, BACKWARD, 2 * i + 1))
                    for i, t in enumerate(out)])
        return out

    @staticmethod
    def _wait(ops: list) -> None:
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    def wait_sends(self) -> None:
        for work in self._works:
            work.wait()
        self._works.clear()
        self._buffers.clear()
