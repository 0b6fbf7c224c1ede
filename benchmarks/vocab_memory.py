"""Peak memory of one rank on the loss path: vocabulary-parallel head and loss against plain TP.

    .venv/bin/python benchmarks/vocab_memory.py [--tp 4] [--seq 1024] [--append]

A GPT-2-small-shaped loss head (hidden 768, vocabulary 50257, untied) takes replicated hidden states
[1, T, 768] and labels, and returns the cross-entropy loss. It is compiled twice by autoshard at the
same tp: with vocab_parallel=True (column-parallel head, cross-entropy on vocabulary shards) and
with vocab_parallel=False (plain tensor parallelism: the head stays whole, every rank holds full
logits). Rank 0's module runs forward and backward with a loopback communicator: the numbers it
computes are not the model's, but it allocates exactly what rank 0 allocates in a real run.

Peak bytes are counted by a dispatch mode: every storage an op creates counts until its last tensor
dies (autograd's saved tensors included); parameters and inputs, made before, do not count.
"""
from __future__ import annotations

import argparse
import weakref

import torch
import torch.nn.functional as F
from results import report
from tabulate import tabulate
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoshard import autoshard


class LossHead(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


class Loopback:
    """Same allocations as an all-reduce, no peers."""

    def all_reduce(self, t):
        return t.contiguous().clone()

    all_reduce_max = all_reduce


class PeakBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages: dict[int, list[int]] = {}

    def _release(self, ptr: int) -> None:
        entry = self.storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.storages:
                    self.storages[ptr] = [t.untyped_storage().nbytes(), 0]
                    self.live += self.storages[ptr][0]
                    self.peak = max(self.peak, self.live)
                self.storages[ptr][1] += 1
                weakref.finalize(t, self._release, ptr)
        return out


def rank0_peak(model: nn.Module, tp: int, vocab_parallel: bool, hidden, labels) -> tuple[int, dict]:
    prog = autoshard(model, tp=tp, example_inputs=(hidden, labels), vocab_parallel=vocab_parallel)
    rank = prog.rank(0).bind(Loopback())
    with PeakBytes() as meter:
        loss = rank(hidden, labels)
        loss.backward()
        del loss
    shapes = {n: tuple(p.shape) for n, p in rank.named_parameters()}
    return meter.peak, shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = LossHead(args.hidden, args.vocab)
    hidden = torch.randn(1, args.seq, args.hidden, requires_grad=True)
    labels = torch.randint(0, args.vocab, (1, args.seq))
    logits_bytes = args.seq * args.vocab * 4
    rows = []
    peaks = {}
    for vp in (False, True):
        peak, shapes = rank0_peak(model, args.tp, vp, hidden, labels)
        peaks[vp] = peak
        rows.append(["vocabulary-parallel" if vp else "plain tp (head whole)", shapes["lm_head.weight"],
                     f"{peak / 2**20:.1f}", f"{peak / logits_bytes:.2f}"])
    ratio = peaks[True] / peaks[False]
    table = tabulate(rows, headers=["rank 0 loss path", "lm_head on rank 0", "peak MiB", "x full fp32 logits"],
                     tablefmt="github")
    summary = (f"full fp32 logits [{args.seq}, {args.vocab}] = {logits_bytes / 2**20:.1f} MiB; vocabulary-parallel / "
               f"plain peak = {ratio:.3f} (1/tp = {1 / args.tp:.3f})")
    report(table, summary, append=args.append, title="Loss-path memory",
           command=f".venv/bin/python benchmarks/vocab_memory.py --tp {args.tp} --seq {args.seq} --append",
           what=f"GPT-2-small head: hidden {args.hidden}, V={args.vocab}, tp={args.tp}, batch 1")


if __name__ == "__main__":
    main()
