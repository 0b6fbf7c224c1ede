"""Activation memory per rank and layer, measured, against autoshard.planning.memory_model's terms.

    python benchmarks/activation_memory.py                                        # tp=1
    torchrun --standalone --nproc-per-node 2 benchmarks/activation_memory.py --tp 2 [--sp]

The GPT of Korthikanti et al.'s accounting, small: s=512, h=512, a=8, b=4, dropout 0.1, fp32 on the
CPU, attention written out ("manual") or through SDPA ("sdpa"). Bytes autograd saves in one forward
(distinct storages, parameters and buffers left out; autoshard.testing.memory.SavedBytes) with 4
layers minus those with 2, halved: one layer's bytes on this rank. Prints a markdown table with the
model's prediction and the error, per recompute mode.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from autoshard import autoshard
from autoshard.models import GPT, GPTConfig
from autoshard.planning.memory_model import ActivationShape, layer_activation_bytes
from autoshard.testing.memory import SavedBytes

S, H, A, B, VOCAB = 512, 512, 8, 4, 256


def saved_per_rank(layers: int, attention: str, mode: str, tp: int, sp: bool) -> int:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, n_head=A, n_embd=H, vocab_size=VOCAB, block_size=S, dropout=0.1,
                          flash=attention == "sdpa")).train()
    ids = torch.randint(0, VOCAB, (B, S))
    prog = autoshard(model, tp=tp, recompute=mode, sequence_parallel=sp, example_inputs=(ids, ids))
    rank = prog.distributed() if dist.is_initialized() else prog.rank(0)
    with SavedBytes(exclude=rank) as saved:
        rank(ids, ids)[1]
    return saved.bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    args = ap.parse_args()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rows = []
    for attention in ("manual", "sdpa"):
        for mode in ("none", "selective", "full"):
            per_layer = (saved_per_rank(4, attention, mode, args.tp, args.sp)
                         - saved_per_rank(2, attention, mode, args.tp, args.sp)) / 2
            shape = ActivationShape(s=S, b=B, h=H, a=A, t=args.tp, sp=args.sp, e=4, m=4, resid_dropouts=1)
            want = layer_activation_bytes(shape, mode)
            rows.append((attention, mode, per_layer, want))
    if not dist.is_initialized() or dist.get_rank() == 0:
        sbh = S * B * H
        print("| attention | recompute | tp | sp | measured MiB/layer | model MiB/layer | measured bytes / sbh | error |")
        print("|---|---|---|---|---|---|---|---|")
        for attention, mode, got, want in rows:
            print(f"| {attention} | {mode} | {args.tp} | {args.sp} | {got / 2**20:.2f} | {want / 2**20:.2f} | "
                  f"{got / sbh:.2f} | {100 * (got - want) / want:+.1f}% |")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
