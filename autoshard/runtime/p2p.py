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

Receiving ahead (`ahead`, on gloo): gloo moves a message only once its receive is posted (an 8 MiB
message sent well before its receive still took 10-12 ms after it), so a receive posted when its
action starts waits for the whole transfer. Given the step's receives in the order the rank's
actions take them (`expect`), the next receive is posted as soon as the one before it is complete
and its shapes are known (a forward's once its stage's microbatch 0 arrived, a backward's once its
stage sent a forward this step), and its message can arrive while the rank computes. One receive
ahead at most: one more buffer. Measured on 2 busy cores (benchmarks/receive_ahead.py): a 0.5 MiB
message's mean wait about halves; an 8 MiB one's does not move (its copies need a core, and neither
is free). Not on NCCL, where a posted receive holds up the sends queued behind it on the same stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.world import P2P, Work, World, current

__all__ = ["Transfer", "Receive", "FORWARD", "BACKWARD", "header", "read_tag"]

FORWARD, BACKWARD = 0, 1
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]
_MAX_DIMS = 8


def _tag(stage: int, microbatch: int, n_stages: int, direction: int, slot: int) -> int:
    return (((microbatch * n_stages + stage) * 2 + direction) * 512 + slot) % (2 ** 31 - 1)


def read_tag(tag: int, n_stages: int) -> tuple[int, int, int, int]:
    """(sending stage, microbatch, direction, slot) of a tag below the modulus; slot 2i is the header
    of the i-th tensor sent, 2i + 1 its payload."""
    rest, slot = divmod(tag, 512)
    rest, direction = divmod(rest, 2)
    microbatch, stage = divmod(rest, n_stages)
    return stage, microbatch, direction, slot


def header(shape, dtype: torch.dtype) -> torch.Tensor:
    """The header sent ahead of a tensor of `shape` and `dtype` on a step's first microbatch."""
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"cannot send a {len(shape)}-d tensor between stages (at most {_MAX_DIMS} dims)")
    sizes = list(shape) + [0] * (_MAX_DIMS - len(shape))
    return torch.tensor([len(shape), _DTYPES.index(dtype), *sizes], dtype=torch.int64)


@dataclass(frozen=True)
class Receive:
    """One receive of a step: `stage`'s inputs (FORWARD) or its outputs' gradients (BACKWARD) of
    `microbatch`, from global rank `src`."""
    direction: int
    stage: int
    microbatch: int
    src: int


class Transfer:
    """Sends and receives of one pipeline rank; keeps in-flight sends alive until `wait_sends`."""

    def __init__(self, n_stages: int, device: torch.device | str = "cpu", rank: int | None = None,
                 world: World | None = None):
        self.n_stages, self.device = n_stages, torch.device(device)
        self.world = current() if world is None else world
        self._works: list[Work] = []
        self._buffers: list[torch.Tensor] = []        # what in-flight sends read
        self._shapes: dict[int, list[tuple[list[int], torch.dtype]]] = {}   # stage -> its inputs' shapes
        self.bytes_sent = self.messages_sent = 0
        self._local: dict[tuple[int, int, int], list[torch.Tensor]] = {}   # (stage, microbatch, direction)
        self._me = rank           # this process's global rank: a transfer to it stays local
        self.ahead = False        # receive ahead (see the module doc): the runtime turns it on for gloo
        self._plan: list[Receive] = []                # this step's receives still to come, in order
        self._posted: dict[Receive, tuple[list, list[torch.Tensor]]] = {}   # posted ahead: works, buffers
        self._grad_shapes: dict[int, list[tuple[list[int], torch.dtype]]] = {}   # stage -> its sent floats
        self.received_ahead = 0   # receives whose message was posted before its action asked for it

    @property
    def _head_device(self) -> torch.device:
        """Where headers live: with the tensors, except when those are shapes alone (meta: the
        planner's walk), whose headers are read on the host."""
        return torch.device("cpu") if self.device.type == "meta" else self.device

    def send(self, tensors: list[torch.Tensor], dst: int, stage: int, microbatch: int, direction: int) -> None:
        """Post sends of `tensors` (outputs of `stage` going forward, or gradients of `stage`'s
        inputs going back) to global rank `dst`; returns at once."""
        if direction == FORWARD:   # what the gradients coming back will be (only floats go back)
            self._grad_shapes[stage] = [(list(t.shape), t.dtype) for t in tensors if t.is_floating_point()]
        if dst == self._me:
            self._local[(stage, microbatch, direction)] = [t.detach().clone() for t in tensors]
        else:
            self._send_remote(tensors, dst, stage, microbatch, direction)
        if direction == FORWARD:
            self._post_next()      # the gradients of what just went forward may be the next receive

    def _send_remote(self, tensors: list[torch.Tensor], dst: int, stage: int, microbatch: int, direction: int) -> None:
        """The wire of `send`: one isend per tensor (a header first on a forward's microbatch 0),
        each tensor kept until `wait_sends`."""
        ops = []
        for i, t in enumerate(tensors):
            payload = t.detach().contiguous()
            if direction == FORWARD and microbatch == 0:
                head = header(payload.shape, payload.dtype).to(self._head_device)
                ops.append(P2P(True, head, dst, _tag(stage, microbatch, self.n_stages, direction, 2 * i)))
                self._buffers.append(head)
            ops.append(P2P(True, payload, dst, _tag(stage, microbatch, self.n_stages, direction, 2 * i + 1)))
            self._buffers.append(payload)
            self.bytes_sent += payload.numel() * payload.element_size()
        self.messages_sent += len(ops)
        if ops:
            self._works += self.world.p2p(ops)

    def recv_forward(self, count: int, src: int, stage: int, microbatch: int) -> list[torch.Tensor]:
        """Receive the `count` activations `stage` takes from global rank `src`."""
        if src == self._me:
            return self._local.pop((stage - 1, microbatch, FORWARD))
        if microbatch == 0:
            self._shapes[stage] = self._receive_headers(count, src, stage)
        elif stage not in self._shapes:
            raise RuntimeError(f"stage {stage} received microbatch {microbatch} before microbatch 0; "
                               f"the schedule must run each stage's microbatches in order")
        return self._take(Receive(FORWARD, stage, microbatch, src))

    def recv_backward(self, like: list[torch.Tensor], src: int, stage: int, microbatch: int) -> list[torch.Tensor]:
        """Receive gradients for `stage`'s outputs `like` (same shapes) from global rank `src`."""
        if src == self._me:
            return self._local.pop((stage + 1, microbatch, BACKWARD))
        out = self._take(Receive(BACKWARD, stage, microbatch, src), [(list(t.shape), t.dtype) for t in like])
        if [(o.shape, o.dtype) for o in out] != [(t.shape, t.dtype) for t in like]:
            raise RuntimeError(f"stage {stage}'s gradients of microbatch {microbatch} were received ahead as "
                               f"{[(tuple(o.shape), o.dtype) for o in out]}, but its outputs are "
                               f"{[(tuple(t.shape), t.dtype) for t in like]}")
        return out

    def _receive_headers(self, count: int, src: int, stage: int) -> list[tuple[list[int], torch.dtype]]:
        """The shapes and dtypes of `stage`'s `count` inputs, from the headers of microbatch 0."""
        heads = [torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self._head_device) for _ in range(count)]
        self._wait([P2P(False, h, src, _tag(stage - 1, 0, self.n_stages, FORWARD, 2 * i)) for i, h in enumerate(heads)])
        return [(sizes[:ndim], _DTYPES[code]) for ndim, code, *sizes in (h.tolist() for h in heads)]

    def expect(self, receives: list[Receive]) -> None:
        """This step's receives from other ranks, in the order the actions take them (see the module
        doc); forgets the shapes of the step before, which may differ."""
        self._plan, self._posted, self._grad_shapes = list(receives), {}, {}
        self._post_next()

    def _shapes_of(self, r: Receive) -> list[tuple[list[int], torch.dtype]] | None:
        """The buffers' shapes `r` receives into, or None while unknown this step."""
        if r.direction == FORWARD:
            return self._shapes.get(r.stage) if r.microbatch > 0 else None
        return self._grad_shapes.get(r.stage)

    def _post(self, r: Receive, shapes: list[tuple[list[int], torch.dtype]]) -> tuple[list, list[torch.Tensor]]:
        sender = r.stage - 1 if r.direction == FORWARD else r.stage + 1
        out = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in shapes]
        ops = [P2P(False, t, r.src, _tag(sender, r.microbatch, self.n_stages, r.direction, 2 * i + 1))
               for i, t in enumerate(out)]
        return self.world.p2p(ops), out

    def _post_next(self) -> None:
        if self.ahead and self._plan and self._plan[0] not in self._posted:
            shapes = self._shapes_of(self._plan[0])
            if shapes is not None:
                self._posted[self._plan[0]] = self._post(self._plan[0], shapes)

    def _take(self, r: Receive, shapes: list[tuple[list[int], torch.dtype]] | None = None) -> list[torch.Tensor]:
        """Receive `r`: from its receive posted ahead if there is one, else posted now; then post the
        next receive of the plan."""
        posted = self._posted.pop(r, None)
        if posted is not None:
            self.received_ahead += 1
        else:
            posted = self._post(r, shapes if shapes is not None else self._shapes[r.stage])
        works, out = posted
        for w in works:
            w.wait()
        if r in self._plan:
            del self._plan[:self._plan.index(r) + 1]
        self._post_next()
        return out

    def _wait(self, ops: list[P2P]) -> None:
        for w in self.world.p2p(ops):
            w.wait()

    def wait_sends(self) -> None:
        for work in self._works:
            work.wait()
        self._works.clear()
        self._buffers.clear()
