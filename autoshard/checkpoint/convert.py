"""Single-device checkpoints to and from autoshard programs.

- `load_full_state_dict(folder)`: a sharded checkpoint's parameters at full size, by the model's names.
- `consolidate(folder, model, out)`: a folder the model's own class loads (`from_pretrained` for
  Hugging Face models, else `out/model.safetensors` for `load_state_dict`).
- `load_from_file(source, prog, module)`: a rank's slices from a single-device safetensors
  checkpoint (a file, or a Hugging Face folder), read with safetensors' slicing, never whole.

As a command: `python -m autoshard.checkpoint.convert CHECKPOINT OUT --factory pkg.module:make_model`
(the factory returns the model, on the meta device if you like; only its class and config matter).
"""
from __future__ import annotations

import argparse
import json
import os
from contextlib import contextmanager

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from autoshard.checkpoint.expert_layouts import legacy_name, read_legacy_experts
from autoshard.checkpoint.expert_rows import ExpertRows
from autoshard.checkpoint.index import SEP, CheckpointError, PieceReader, read_index
from autoshard.checkpoint.sharded import layout_of
from autoshard.compile.rank import slice_layout
from autoshard.factory import load_factory, one_line_errors

__all__ = ["load_full_state_dict", "consolidate", "load_from_file"]


def load_full_state_dict(folder: str) -> dict[str, torch.Tensor]:
    """Every parameter at full size, under the model's own names."""
    index = read_index(folder)
    reader = PieceReader(folder, index)
    return {k: reader.rows(k, None) for k in index["tensors"] if SEP not in k}


def consolidate(folder: str, model: nn.Module, out: str) -> None:
    """Write a single-device checkpoint of `folder` to `out`: a Hugging Face model is saved with
    `save_pretrained` (load it with `from_pretrained(out)`), any other model as
    `out/model.safetensors` (load with `safetensors.torch.load_file` + `load_state_dict`)."""
    state = load_full_state_dict(folder)
    groups: dict[int, list[str]] = {}       # tied parameters: one object under several names
    for n, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    on_meta = any(p.is_meta for p in model.parameters())
    missing, unexpected = model.load_state_dict(state, strict=False, assign=on_meta)
    aliases = {n for names in groups.values() for n in names[1:]}
    if unexpected or set(missing) - aliases - {n for n, _ in model.named_buffers()}:
        raise CheckpointError(f"checkpoint does not fit {type(model).__name__}: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    for names in groups.values():           # assign=True replaced the first name's Parameter only
        first = model.get_parameter(names[0])
        for alias in names[1:]:
            path, _, leaf = alias.rpartition(".")
            setattr(model.get_submodule(path), leaf, first)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(out)
    else:       # every name strict loading asks for: tied aliases (own copies) and persistent buffers
        full = dict(state)
        for names in groups.values():
            for alias in names[1:]:
                full[alias] = state[names[0]].clone()
        for name, buf in model.state_dict().items():
            if name not in full and not buf.is_meta:
                full[name] = buf
        os.makedirs(out, exist_ok=True)
        save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(out, "model.safetensors"))


def load_from_file(source: str, prog, module: nn.Module) -> int:
    """Load this rank's slices from a single-device safetensors checkpoint (a file, or a folder with
    model.safetensors or model.safetensors.index.json); returns the number of elements read."""
    weight_map = _weight_map(source)
    stored = set(weight_map)
    aliases = prog.param_aliases
    experts = ExpertRows(prog, module)                 # expert parallelism: this rank's experts only
    tp_rank = module.tp_rank
    index = {"tensors": {}, "files": {}}
    assembled: dict[str, torch.Tensor] = {}            # experts stored one module each (expert_layouts.py)
    for name in dict(module.named_parameters()):
        want = list(prog.param_shapes[name])
        stored_as = next((a for a in aliases.get(name, [name]) if a in weight_map), None) or legacy_name(name, stored)
        if stored_as is None:
            t = read_legacy_experts(name, want, experts.range_of(name, want[0]), stored,
                                    lambda key: _read(weight_map[key], key))
            if t is None:
                raise CheckpointError(f"{source} has no tensor for parameter {name}")
            lay = layout_of(prog, name, tp_rank)
            assembled[name] = slice_layout(t, lay[0], lay[1]) if lay else t
            continue
        with _open(weight_map[stored_as]) as fh:
            sl = fh.get_slice(stored_as)
            shape, dtype = sl.get_shape(), sl.get_dtype()
        if shape != want:
            raise CheckpointError(f"{stored_as} has shape {tuple(shape)} in {source}, the model's {name} is {tuple(want)}")
        dtypes = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
        index["tensors"][name] = {"shape": shape, "dtype": dtypes.get(dtype, "float32"), "dim": None,
                                  "pieces": [{"file": weight_map[stored_as], "key": stored_as, "start": 0, "stop": 0}]}
    reader = PieceReader("", index, verify=False)
    new = {name: experts.reader_for(name, reader)(name, layout_of(prog, name, tp_rank)) for name in index["tensors"]}
    new.update(assembled)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if new[name].shape != p.shape:
                raise CheckpointError(f"{name}: read {tuple(new[name].shape)} from {source}, this rank holds "
                                      f"{tuple(p.shape)}")
            p.copy_(new[name])
    return reader.elements + sum(t.numel() for t in assembled.values())


def _weight_map(source: str) -> dict[str, str]:
    if os.path.isfile(source):
        files = [source]
    elif os.path.isfile(os.path.join(source, "model.safetensors.index.json")):
        with open(os.path.join(source, "model.safetensors.index.json")) as fh:
            wm = json.load(fh)["weight_map"]
        return {k: os.path.join(source, v) for k, v in wm.items()}
    elif os.path.isfile(os.path.join(source, "model.safetensors")):
        files = [os.path.join(source, "model.safetensors")]
    else:
        raise CheckpointError(f"{source} is neither a safetensors file nor a folder with model.safetensors")
    out = {}
    for f in files:
        with _open(f) as fh:
            out.update({k: f for k in fh.keys()})
    return out


def _read(path: str, key: str) -> torch.Tensor:
    with _open(path) as fh:
        return fh.get_tensor(key)


@contextmanager
def _open(path: str):
    """safe_open, with a broken file (truncated, not safetensors) named in the error."""
    try:
        handle = safe_open(path, framework="pt")
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read it as safetensors ({type(e).__name__}: {e})") from None
    with handle as fh:
        yield fh


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Consolidate a sharded autoshard checkpoint into one "
                                             "single-device checkpoint the model's class loads.")
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--factory", required=True, help="module:callable that returns the model (meta device is fine)")
    ap.add_argument("--debug", action="store_true", help="on an error, show the whole traceback")
    args = ap.parse_args(argv)
    command = "autoshard.checkpoint.convert"
    make = load_factory(args.factory, command)
    with one_line_errors(command, args.debug):
        with torch.device("meta"):
            model = make()
        if not isinstance(model, nn.Module):
            raise CheckpointError(f"{args.factory} returned a {type(model).__name__}, not an nn.Module")
        consolidate(args.checkpoint, model, args.out)
    print(f"wrote {args.out} ({sum(p.numel() for p in model.parameters()):,} parameters)")


if __name__ == "__main__":
    main()
