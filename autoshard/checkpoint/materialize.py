"""Deferred initialization: build the model on the meta device, give each rank real tensors for
its own shards only.

Each parameter (and buffer) is initialized on its own: the tensor alone is made real (filled with
NaN), every module from its owner up to the root runs the model's own initialization on it, in the
order Hugging Face's `init_weights` applies them (children first; GPT-2's attention re-draws its
c_proj weight after the Linear did), each call under a generator seeded by (seed, tensor name,
module path). Other tensors stay on the meta device, where initializers draw nothing. A tensor's
value therefore depends only on the seed and its name, and a rank's slice equals the same slice
of `materialize_full(model, seed)`. Peak memory is one full tensor, not the model.

The initializer is the model's `_init_weights` for Hugging Face models, else each module's
`reset_parameters()` (torch's own layers); pass `init=` for anything else. A tensor no initializer
writes completely is refused by name rather than left as garbage. The rank's graphs, captured on the
meta device, are retargeted to the CPU (passes/rewrite/retarget.py); move the module afterwards as usual.
"""
from __future__ import annotations

import hashlib
from typing import Callable

import torch
from torch import nn

from autoshard.checkpoint.expert_rows import ExpertRows
from autoshard.compile.program import ShardedProgram
from autoshard.compile.rank import slice_layout
from autoshard.errors import ShardingError
from autoshard.passes.rewrite.retarget import retarget_device

__all__ = ["default_init", "full_tensor", "materialize", "materialize_full"]


def default_init(model: nn.Module) -> Callable[[nn.Module], None]:
    if hasattr(model, "_init_weights") and hasattr(model, "config"):
        return model._init_weights

    def reset(module: nn.Module) -> None:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return reset


def _seed(seed: int, name: str, path: str) -> int:
    return int(hashlib.sha256(f"{seed}|{name}|{path}".encode()).hexdigest()[:15], 16)


def full_tensor(model: nn.Module, name: str, seed: int = 0, init: Callable[[nn.Module], None] | None = None,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Parameter or buffer `name` of a meta-device `model`, initialized at full size."""
    init = init or default_init(model)
    path, _, leaf = name.rpartition(".")
    owner = model.get_submodule(path)
    table = owner._parameters if leaf in owner._parameters else owner._buffers
    if leaf not in table:
        raise ShardingError(f"{type(model).__name__} has no parameter or buffer {name}")
    old = table[leaf]
    if not old.dtype.is_floating_point:
        raise ShardingError(f"cannot initialize {name} ({old.dtype}) on its own: build {path or 'the model'} "
                            f"on a real device")
    real = torch.full(old.shape, float("nan"), dtype=old.dtype, device=device)
    table[leaf] = nn.Parameter(real, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else real
    chain = [path[:i] for i in range(len(path), 0, -1) if i == len(path) or path[i] == "."] + [""]
    try:
        for mpath in chain:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_seed(seed, name, mpath))
                init(model.get_submodule(mpath))
        value = table[leaf].detach()
    finally:
        table[leaf] = old
    if torch.isnan(value).any():
        raise ShardingError(f"{name} ({type(owner).__name__} at {path or '<root>'}) is not fully set by the "
                            f"model's initialization; pass init= or build that module on a real device")
    return value


def materialize(prog: ShardedProgram, module: nn.Module, *, seed: int = 0, init: Callable[[nn.Module], None] | None = None) -> int:
    """Give a rank module (`prog.rank(r)`) or pipeline runtime (`prog.distributed()`) of a program
    compiled from a meta-device model real tensors for its shards. Returns the number of tensors set."""
    tp_rank = module.tp_rank
    experts = ExpertRows(prog, module)                      # expert parallelism: this rank's experts only
    new: dict[str, torch.Tensor] = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if not t.is_meta:
            continue
        full = full_tensor(prog.model, name, seed, init)
        use = prog.sharding.params.get(name) if isinstance(t, nn.Parameter) else None
        local = slice_layout(full, use.dim, use.layout[tp_rank]) if use else full
        if name in experts.names:                           # [experts, ...] -> [per_rank, ...]
            local = local.narrow(0, experts.lo, experts.per)
        if local.shape != t.shape:
            raise ShardingError(f"materialize: {name} comes out {tuple(local.shape)} on this rank but the program "
                                f"holds it as {tuple(t.shape)}")
        local = local.clone() if local is not full else full
        new[name] = nn.Parameter(local, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else local
    module.set_tensors(new)
    for gm in module.graph_modules():       # export wrote device=meta into the graphs
        retarget_device(gm, "cpu")
    return len(new)


def materialize_full(model: nn.Module, *, seed: int = 0, init: Callable[[nn.Module], None] | None = None) -> None:
    """Initialize every meta tensor of `model` in place, the same way (the single-device reference).
    Tied parameters stay tied."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    values = {id(t): full_tensor(model, n, seed, init) for n, t in named if t.is_meta}
    made: dict[int, torch.Tensor] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if id(t) not in values:
            continue
        if id(t) not in made:
            made[id(t)] = nn.Parameter(values[id(t)], requires_grad=t.requires_grad) \
                if isinstance(t, nn.Parameter) else values[id(t)]
        path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(path)
        (owner._parameters if leaf in owner._parameters else owner._buffers)[leaf] = made[id(t)]
