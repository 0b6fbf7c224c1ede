"""The README's expert-parallel picture, from a real routing:

    python -m autoshard.testing.expert_picture docs/expert_parallel.png

The small Mixtral the tests use (8 experts, top-2), one microbatch of 12 tokens per data-parallel
rank at dp=4, ep=2; the first MoE layer's routing drawn by autoshard/runtime/expert_picture.py.
"""
from __future__ import annotations

import sys

from autoshard.png import write
from autoshard.runtime.expert_picture import expert_parallel_picture

__all__ = ["mixtral_routing"]


def mixtral_routing(dp: int, experts: int) -> list[list[int]]:
    """The first MoE layer's routing of one microbatch per dp rank, from the small Mixtral the tests use."""
    import torch

    from autoshard.regions.experts_call import expert_modules
    from autoshard.testing.models import VOCAB, build_moe
    model = build_moe("mixtral", experts=experts)
    seen: list = []
    first = next(iter(expert_modules(model).values()))
    first.register_forward_pre_hook(lambda mod, args: seen.append(args[1].reshape(-1).tolist()))
    ids = torch.randint(0, VOCAB, (dp, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for d in range(dp):
            model(input_ids=ids[d:d + 1])
    return seen


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "expert_parallel.png"
    write(expert_parallel_picture(mixtral_routing(4, 8), 8, 2), out)
    print(f"wrote {out}")
