"""Sharded-checkpoint index: which file holds which rows of which parameter, and its validation.

A checkpoint is a folder of safetensors files, one per writing rank, plus `index.json`:

    {"format": "autoshard-checkpoint/1", "step": 10, "mesh": {"tp": 2, "pp": 2, "dp": 1},
     "tensors": {"h.0.attn.c_attn.weight": {"shape": [64, 192], "dtype": "float32", "dim": 1,
                 "pieces": [{"file": "rank-pp0-tp0.safetensors", "key": "...", "start": 0, "stop": 96}, ...]},
                 "h.0.attn.c_attn.weight::exp_avg": {...}, ...},
     "scalars": {"h.0.attn.c_attn.weight": {"step": 10.0}}, "param_groups": [{"lr": 0.001, ...}],
     "files": {"rank-pp0-tp0.safetensors": {"bytes": 123, "sha256": "..."}}, "extra": {...}}

`dim` is the split dimension (None: the piece is the whole tensor); `start`/`stop` index the full
tensor along it. The index is written last and atomically, so a folder without one (a save cut
short) is not a checkpoint. Loading checks every file's size and hash before reading anything.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors import safe_open

from autoshard.compile.rank import slice_layout
from autoshard.errors import AutoshardError

__all__ = ["CheckpointError", "FORMAT", "INDEX", "SEP", "PieceReader", "write_json_atomic", "write_index_atomic",
           "read_index", "read_checked_json",
           "file_digest", "verify_file"]

FORMAT = "autoshard-checkpoint/2"      # /2: the index carries its own sha256
INDEX = "index.json"
SEP = "::"       # "name::exp_avg": optimizer state of parameter `name`


class CheckpointError(AutoshardError):
    """A checkpoint is missing, incomplete, corrupted, or does not fit the program it is loaded into."""


def file_digest(path: str) -> dict[str, object]:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}


CHECKSUM = "index_sha256"


def _canonical_digest(index: dict) -> str:
    """sha256 of the index without its checksum, as canonical JSON (key order and spacing do not count)."""
    body = {k: v for k, v in index.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_index_atomic(path: str, index: dict) -> None:
    """Write the index with its own checksum (an edited index is refused, not loaded)."""
    write_json_atomic(path, {**index, CHECKSUM: _canonical_digest(index)})


def write_json_atomic(path: str, obj: object) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_index(folder: str, *, verify: bool = True) -> dict:
    """The checkpoint's index, after checking that it is complete and its files are intact."""
    path = os.path.join(folder, INDEX)
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder} is not a complete checkpoint: it has no {INDEX} (a save that did not finish?)")
    index = read_checked_json(path)
    if verify:
        for name, want in index["files"].items():
            verify_file(os.path.join(folder, name), want)
    return index


def read_checked_json(path: str) -> dict:
    """An index file's content, after checking that it parses, has this format and its checksum."""
    try:
        with open(path, "rb") as fh:
            index = json.loads(fh.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is corrupted") from None
    if not isinstance(index, dict):
        raise CheckpointError(f"{path} holds a {type(index).__name__}, not a checkpoint index")
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {index.get('format')!r}, expected {FORMAT!r}")
    got, want = _canonical_digest(index), index.get(CHECKSUM)
    if got != want:
        raise CheckpointError(f"{path} was edited or corrupted: its content hashes to sha256 {got[:12]}..., "
                              f"its checksum says {str(want)[:12]}...")
    if not isinstance(index.get("tensors"), dict) or not isinstance(index.get("files"), dict):
        raise CheckpointError(f"{path} is malformed: no tensors or files table")
    return index


def verify_file(path: str, want: dict) -> None:
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = os.path.getsize(path)
    if size != want["bytes"]:
        raise CheckpointError(f"checkpoint file {path} has {size} bytes, the index says {want['bytes']} "
                              f"(truncated or overwritten)")
    got = file_digest(path)["sha256"]
    if got != want["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupted: sha256 {got[:12]}... != {want['sha256'][:12]}...")


class PieceReader:
    """Rows of full tensors from pieces, each file opened once (and checked against the index
    first, when `verify`); counts the elements it reads."""

    def __init__(self, folder: str, index: dict, verify: bool = True):
        self.folder, self.index, self.verify = folder, index, verify
        self.handles: dict[str, object] = {}
        self.elements = 0

    def _open(self, fname: str):
        if fname not in self.handles:
            path = os.path.join(self.folder, fname)
            if self.verify:
                verify_file(path, self.index["files"][fname])
            try:
                self.handles[fname] = safe_open(path, framework="pt")
            except Exception as e:          # truncated or not safetensors: name the file
                raise CheckpointError(f"{path}: cannot read it as safetensors ({type(e).__name__}: {e})") from None
        return self.handles[fname]

    def rows(self, key: str, lay) -> torch.Tensor:
        """The whole tensor (`lay` None) or a rank's rows `lay` = (dim, ranges, size)."""
        e = self.index["tensors"][key]
        if lay is None:
            if e["dim"] is None:
                t = self._open(e["pieces"][0]["file"]).get_tensor(e["pieces"][0]["key"])
                self.elements += t.numel()
                return t
            return self._range(key, e, 0, e["shape"][e["dim"]])
        dim, ranges, n = lay
        if e["dim"] is None:        # saved whole: one piece covering every row along our split
            e = {**e, "dim": dim, "pieces": [{**e["pieces"][0], "start": 0, "stop": n}]}
        elif e["dim"] != dim:
            return slice_layout(self._range(key, e, 0, e["shape"][e["dim"]]), dim, ranges)
        parts = []
        for a, b in ranges:
            if a < n:
                parts.append(self._range(key, e, a, min(b, n)))
            if b > max(a, n):       # vocabulary padding
                shape = list(e["shape"])
                shape[dim] = b - max(a, n)
                parts.append(torch.zeros(shape, dtype=getattr(torch, e["dtype"])))
        return torch.cat(parts, dim) if len(parts) > 1 else parts[0]

    def _range(self, key: str, e: dict, a: int, b: int) -> torch.Tensor:
        parts, pos, dim = [], a, e["dim"]
        while pos < b:
            piece = next((p for p in e["pieces"] if p["start"] <= pos < p["stop"]), None)
            if piece is None:
                raise CheckpointError(f"rows {pos}.. of {key} are in no file of the checkpoint")
            end = min(b, piece["stop"])
            sl = self._open(piece["file"]).get_slice(piece["key"])
            index = (slice(None),) * dim + (slice(pos - piece["start"], end - piece["start"]),)
            parts.append(sl[index])
            self.elements += parts[-1].numel()
            pos = end
        return torch.cat(parts, dim) if len(parts) > 1 else parts[0]
