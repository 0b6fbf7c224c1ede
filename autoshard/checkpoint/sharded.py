"""Sharded checkpoints: each rank writes its own shards, any (tp, pp) reads them back.

- `save(folder, prog, module, optimizer)`: inside torchrun every rank calls it; each writes the rows
  it is the first holder of (data-parallel replica 0, the lowest pipeline and tensor rank holding
  them) to its own safetensors file, with the optimizer state that has the parameter's shape
  (Adam's moments) sliced the same way; rank 0 then writes `index.json` (checkpoint_index.py).
  Files and index are written to a temporary name and renamed.
- `load(folder, prog, module, optimizer)`: reads exactly the rows this rank's program holds, from
  whichever files have them, so a checkpoint written at (tp, pp) loads at any other (tp', pp').
  Expert parameters under expert parallelism are written and read on their experts dim
  (checkpoint/expert_rows.py), so the ep may change too.
  Everything is read and checked before any parameter is touched.
- `latest(root)`: the newest complete checkpoint under a folder (what a restarted job resumes from).

Conversions to and from single-device checkpoints are in checkpoint_convert.py.
"""
from __future__ import annotations

import contextlib

import os

import torch
from safetensors.torch import save_file
from torch import nn

from autoshard.checkpoint.expert_rows import ExpertRows
from autoshard.checkpoint.index import (
    FORMAT,
    INDEX,
    SEP,
    CheckpointError,
    PieceReader,
    file_digest,
    read_checked_json,
    read_index,
    write_index_atomic,
)
from autoshard.compile.program import ShardedProgram
from autoshard.runtime.json_gather import all_gather_json
from autoshard.world import current

__all__ = ["save", "save_ranks", "load", "latest", "layout_of"]


def layout_of(prog: ShardedProgram, name: str, tp_rank: int):
    """(dim, this rank's ranges along it, full size) or None for a whole (replicated) tensor."""
    use = prog.sharding.params.get(name)
    if use is None:
        return None
    return use.dim, use.layout[tp_rank], prog.param_shapes[name][use.dim]


def _owned_pieces(prog: ShardedProgram, name: str, pp_rank: int, dp_rank: int, tp_rank: int) -> list[tuple[int, int, int]] | None:
    """(start, stop, local offset) of the rows this rank writes; [] when another rank writes them;
    None when it writes the whole tensor."""
    if dp_rank != 0 or pp_rank != min(prog.param_holders.get(name, {0})):
        return []
    lay = layout_of(prog, name, tp_rank)
    if lay is None:
        return None if tp_rank == 0 else []
    dim, ranges, n = lay
    use = prog.sharding.params[name]
    earlier = {r for t in range(tp_rank) for r in use.layout[t]}
    out, offset = [], 0
    for a, b in ranges:
        if (a, b) not in earlier and a < n:      # rows shared with a lower rank (GQA) are written once
            out.append((a, min(b, n), offset))
        offset += b - a
    return out


def _tensors_of(name: str, p: torch.Tensor, optimizer: torch.optim.Optimizer | None):
    """(index key, tensor) for a parameter and its same-shaped optimizer state; other state as scalars."""
    yield name, p.detach()
    scalars = {}
    if optimizer is not None:
        for k, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                yield f"{name}{SEP}{k}", v.detach()
            else:
                scalars[k] = [float(v), isinstance(v, torch.Tensor)]
    yield None, scalars


def _write_rank(folder: str, prog: ShardedProgram, module: nn.Module, optimizer) -> dict:
    pp_rank, dp_rank, tp_rank = module.pp_rank, module.dp_rank, module.tp_rank
    fname = f"rank-pp{pp_rank}-{f'dp{dp_rank}-' if dp_rank else ''}tp{tp_rank}.safetensors"
    tensors, entries, scalars = {}, {}, {}
    experts = ExpertRows(prog, module)
    for name, p in module.named_parameters():
        pieces = _owned_pieces(prog, name, pp_rank, dp_rank, tp_rank)
        lay = layout_of(prog, name, tp_rank)
        for key, t in _tensors_of(name, p, optimizer):
            if name in experts.names and key is not None:     # rows of experts, whole over tp
                pieces, lay, t = experts.piece(name, t, pp_rank == min(prog.param_holders.get(name, {0})))
            if key is None:
                if t and pieces != []:
                    scalars[name] = t
                continue
            entries[key] = {"shape": list(prog.param_shapes[name]), "dtype": str(t.dtype).split(".")[-1],
                            "dim": lay[0] if lay else None, "pieces": []}
            for a, b, off in ([(0, 0, 0)] if pieces is None else pieces):
                skey = key if pieces is None else f"{key}@{a}"
                tensors[skey] = (t if pieces is None else t.narrow(lay[0], off, b - a)).contiguous().clone()
                entries[key]["pieces"].append({"file": fname, "key": skey, "start": a, "stop": b})
    manifest = {"entries": entries, "scalars": scalars, "files": {}}
    if tensors:
        path = os.path.join(folder, fname)
        save_file(tensors, path + ".tmp", metadata={"format": FORMAT})
        os.replace(path + ".tmp", path)
        manifest["files"][fname] = file_digest(path)
    if optimizer is not None:
        manifest["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return manifest


def _write_index(folder: str, prog: ShardedProgram, manifests: list[dict], step: int, extra: dict | None) -> None:
    tensors: dict[str, dict] = {}
    for m in manifests:
        for key, e in m["entries"].items():
            tensors.setdefault(key, {**e, "pieces": []})["pieces"] += e["pieces"]
    for key, e in tensors.items():
        e["pieces"] = sorted(e["pieces"], key=lambda p: p["start"])
        if not e["pieces"]:
            raise CheckpointError(f"no rank wrote {key}; the checkpoint would be incomplete")
    groups = next((m["param_groups"] for m in manifests if "param_groups" in m), [])
    write_index_atomic(os.path.join(folder, INDEX), {
        "format": FORMAT, "step": step, "model": prog.model_name,
        "mesh": {"tp": prog.tp, "pp": prog.pp, "dp": prog.dp, "ep": prog.dims.ep, "cp": prog.cp}, "tensors": tensors,
        "scalars": {k: v for m in manifests for k, v in m["scalars"].items()}, "param_groups": groups,
        "files": {k: v for m in manifests for k, v in m["files"].items()}, "extra": extra or {}})


def _start_over(folder: str) -> None:
    """Make `folder` and drop an index left by an earlier save into it: until the new index is
    written, the folder is not a checkpoint."""
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(os.path.join(folder, INDEX)):
        os.remove(os.path.join(folder, INDEX))


def save(folder: str, prog: ShardedProgram, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int = 0, extra: dict | None = None) -> None:
    """Write this rank's shards; inside torchrun every rank must call it (rank 0 writes the index)."""
    world = current()
    distributed = world.size() > 1
    if not distributed or world.rank() == 0:
        _start_over(folder)
    if distributed:
        world.barrier()          # nobody writes a file while an old index still describes the folder
    gathered = optimizer.gathered() if hasattr(optimizer, "gathered") else contextlib.nullcontext()
    if hasattr(optimizer, "checkpoint_view"):      # a DistributedOptimizer: its state whole per parameter
        optimizer = optimizer.checkpoint_view()
    with gathered:                                 # zero=3 holds 1/dp of each parameter between steps
        manifest = _write_rank(folder, prog, module, optimizer)
    if distributed:
        everyone = all_gather_json(manifest)
        if world.rank() == 0:
            _write_index(folder, prog, everyone, step, extra)
        world.barrier()
    else:
        _write_index(folder, prog, [manifest], step, extra)


def save_ranks(folder: str, prog: ShardedProgram, modules: list[nn.Module], optimizers: list | None = None, *,
               step: int = 0, extra: dict | None = None) -> None:
    """Write a checkpoint of rank modules held in one process (e.g. `prog.ranks()`)."""
    _start_over(folder)
    opts = optimizers or [None] * len(modules)
    _write_index(folder, prog, [_write_rank(folder, prog, m, o) for m, o in zip(modules, opts)], step, extra)


def complete(root: str) -> list[str]:
    """The checkpoint folders under `root` that have an index (written last, so the rest was
    written), newest step first. A folder can still fail to load (a shard cut short or changed
    afterwards): `load` reads and checks every piece."""
    found = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name, INDEX)
        if os.path.isfile(path):
            found.append((read_checked_json(path).get("step", -1), os.path.join(root, name)))
    return [folder for _, folder in sorted(found, key=lambda sf: -sf[0])]


def latest(root: str) -> str | None:
    """The newest complete checkpoint folder under `root` (by its index's step), or None."""
    found = complete(root)
    return found[0] if found else None


def _check_model(prog: ShardedProgram, index: dict, names: list[str]) -> None:
    model_names = set(prog.param_shapes)
    saved = {k for k in index["tensors"] if SEP not in k}
    if saved != model_names:
        missing, unknown = sorted(model_names - saved), sorted(saved - model_names)
        raise CheckpointError(f"checkpoint of {index.get('model')} does not fit {prog.model_name}: "
                              f"{len(missing)} parameters missing (e.g. {missing[:3]}), {len(unknown)} unknown "
                              f"(e.g. {unknown[:3]})")
    for name in names:
        want, got = list(prog.param_shapes[name]), index["tensors"][name]["shape"]
        if want != got:
            raise CheckpointError(f"parameter {name} has shape {tuple(got)} in the checkpoint, {tuple(want)} in the model")


def load(folder: str, prog: ShardedProgram, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load this rank's parameters (and optimizer state) from a checkpoint written at any (tp, pp).
    Returns {"step": ..., "extra": ...}. Nothing is changed unless everything reads and checks out."""
    index = read_index(folder, verify=False)
    try:
        if hasattr(optimizer, "load_checkpoint_view"):     # a DistributedOptimizer takes its pieces
            view = optimizer.empty_view()
            with optimizer.gathered():                     # zero=3: written whole, kept as this rank's shards
                result = _load(folder, index, prog, module, view)
            optimizer.load_checkpoint_view(view)
            return result
        return _load(folder, index, prog, module, optimizer)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{os.path.join(folder, INDEX)} is malformed ({type(e).__name__}: {e}); "
                              f"nothing was loaded") from None


def _load(folder: str, index: dict, prog: ShardedProgram, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    params = dict(module.named_parameters())
    _check_model(prog, index, list(params))
    tp_rank = module.tp_rank
    reader = PieceReader(folder, index)
    experts = ExpertRows(prog, module)
    new, state = {}, {}
    for name, p in params.items():
        lay = layout_of(prog, name, tp_rank)
        read = experts.reader_for(name, reader)
        new[name] = read(name, lay)
        if new[name].shape != p.shape:
            raise CheckpointError(f"{name}: read {tuple(new[name].shape)}, rank holds {tuple(p.shape)}")
        if optimizer is not None:
            moments = [k for k in index["tensors"] if k.startswith(name + SEP)]
            state[name] = {k.split(SEP, 1)[1]: read(k, lay) for k in moments}
            for k, (value, is_tensor) in index["scalars"].get(name, {}).items():
                state[name][k] = torch.tensor(value) if is_tensor else value
    groups = []
    if optimizer is not None:
        if len(index["param_groups"]) != len(optimizer.param_groups):
            raise CheckpointError(f"the checkpoint has {len(index['param_groups'])} optimizer parameter groups, "
                                  f"the optimizer {len(optimizer.param_groups)}")
        groups = [{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()} for saved in index["param_groups"]]
    result = {"step": index["step"], "extra": index["extra"], "elements_read": reader.elements}
    with torch.no_grad():        # everything read and checked: only now is anything changed
        for name, p in params.items():
            p.copy_(new[name])
    if optimizer is not None:
        for name, p in params.items():
            optimizer.state[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) else v for k, v in state[name].items()}
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)
    return result
