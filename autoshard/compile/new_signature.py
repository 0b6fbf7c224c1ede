"""A call whose inputs need a new graph (another shape, mode or path through the model): whether
that graph reads every parameter as the ranks already hold it, and the refusal when it does not.

Ranks hold their shards as the first graph's plan cut them (a parameter that graph does not read
is held whole). A later graph may take another path (an optional input given or left out, a branch
on a size): it fits if every parameter it reads is cut the same way there.
"""
from __future__ import annotations

import torch

from autoshard.compile.capture import Captured
from autoshard.passes.sharding.annotate import ShardingPlan

__all__ = ["sharding_clash", "new_plan_refusal"]


def _describe_use(use) -> str:
    return "replicated" if use is None else f"split dim {use.dim} as {[list(r) for r in use.layout]}"


def sharding_clash(first_cap: Captured, first_plan: ShardingPlan, cap: Captured, plan: ShardingPlan) -> str | None:
    """A parameter the new graph reads cut otherwise than the ranks hold it (their shards follow
    the first graph's plan; a parameter that graph does not read is held whole)."""
    read_first, read_new = set(first_cap.param_names.values()), set(cap.param_names.values())
    for name in sorted(read_new):
        held = first_plan.params.get(name) if name in read_first else None
        if plan.params.get(name) != held:
            return name
    return None


def new_plan_refusal(named: dict[str, object], example: dict[str, object], old: ShardingPlan,
                     new: ShardingPlan, name: str) -> str:
    """Why a call's inputs cannot reuse the program: they take another path through the model
    (an input left out, another branch on a size) that shards a parameter differently."""
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in named.items()}
    given = lambda d: {k for k, v in d.items() if v is not None}    # noqa: E731
    left_out, added = sorted(given(example) - given(named)), sorted(given(named) - given(example))
    why = "; ".join([f"{', '.join(left_out)} given at compile time, left out here"] * bool(left_out)
                    + [f"{', '.join(added)} given here, not at compile time"] * bool(added)) or "a branch on a size"
    return (f"inputs {shapes} take another path through the model than the example inputs ({why}), "
            f"and it shards parameter {name} differently: "
            f"{_describe_use(new.params.get(name))} for these inputs, {_describe_use(old.params.get(name))} "
            f"in this program; pass inputs like the example inputs, or compile a separate program for these")
