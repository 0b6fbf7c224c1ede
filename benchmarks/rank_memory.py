"""Resident memory of a torchrun process around `prog.distributed()` and `del model`.

    torchrun --standalone --nproc-per-node 2 benchmarks/rank_memory.py [--tp 2]

Each process builds a ~23M-parameter Llama (hidden 256, 8 layers, vocabulary 32000), compiles it,
takes its rank, lets the model go, and runs one forward and backward with labels (a call the
example inputs did not have, so it is traced again from the model's meta-device skeleton). Rank 0
prints RSS (MiB) at each point and the process's peak.
"""
from __future__ import annotations

import argparse
import gc
import os
import resource

import torch
import torch.distributed as dist


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def main() -> None:
    import transformers as hf

    from autoshard import autoshard
    from autoshard.testing.launch import leave
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cfg = hf.LlamaConfig(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                         intermediate_size=688, vocab_size=32000)
    model = hf.LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    marks = {"model built": rss_mib()}
    rank = autoshard(model, tp=args.tp).distributed()
    marks["after distributed()"] = rss_mib()
    del model
    gc.collect()
    marks["after del model"] = rss_mib()
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    rank(input_ids=ids, labels=ids).loss.backward()
    marks["after a step"] = rss_mib()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if dist.get_rank() == 0:
        print(f"{params / 1e6:.1f}M parameters, tp={args.tp}; RSS MiB: "
              + ", ".join(f"{k} {v:.0f}" for k, v in marks.items()) + f"; peak {peak:.0f}")
    leave(0)          # not a plain exit: gloo's threads can abort the interpreter's finalization


if __name__ == "__main__":
    main()
