"""`autoshard verify --gloo`: the certificate's runtime run (verify/runtime.py) in real processes.

By default verify runs every rank's runtime in one process, on a local world; `--gloo` runs the same
comparisons (`rank_rows`) with the real backend: every rank of the split is a process under
torchrun, rebuilds the same seeded model (the same command-line arguments) with its weights moved
as the simulation moves them, compiles the split and takes the same steps on the same batches
(verify/batch.py's step_batches). Rank 0 gathers every rank's worst errors, each naming its step,
into the items the certificate prints.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import tempfile

import torch

from autoshard.api import autoshard
from autoshard.runtime.json_gather import all_gather_json
from autoshard.testing.launch import init_gloo, leave, torchrun
from autoshard.verify.batch import boundary_ids, label_classes, step_batches, verification_batch, vocab_of
from autoshard.verify.certificate import Item
from autoshard.verify.dropout import without_dropout
from autoshard.verify.fp8_model import to_fp8_model
from autoshard.verify.perturb import perturb_weights
from autoshard.verify.run import rows_and_seq
from autoshard.verify.runtime import rank_rows, worst_rows
from autoshard.verify.source import model_from_args
from autoshard.world import current

__all__ = ["run_in_processes", "worker", "gather_and_write"]

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _failure(proc) -> str:
    """The line that says why a torchrun job failed: its last exception (a rank's traceback's last
    line), not torchrun's closing banner; else its last line, else its exit code."""
    lines = [line.strip() for line in (proc.stderr or proc.stdout or "").splitlines() if line.strip()]
    raised = [line for line in lines if re.search(r"(^|: )[\w.]*(Error|Exception)\b:", line)]
    return (raised or lines or [f"exit code {proc.returncode}"])[-1]


def run_in_processes(spec: dict, world: int, *, target: str = "autoshard.verify.gloo", timeout: int = 600,
                     rendezvous: list[str] | None = None) -> tuple[list[Item], str | None]:
    """Launch `world` gloo processes of `target` (a module whose main calls `worker`) on `spec`
    (model_args: verify's model arguments; split; seq; dtype; tolerance); returns the items, or the
    reason there are none. `rendezvous`: torchrun's flags to meet the other machines' agents (each
    running this with the same spec; `world` then counts this machine's processes)."""
    with tempfile.TemporaryDirectory(prefix="autoshard-verify-") as folder:
        path = os.path.join(folder, "spec.json")
        result = os.path.join(folder, "items.json")
        with open(path, "w") as f:
            json.dump({**spec, "result": result}, f)
        proc = torchrun(target, ["--spec", path], world, timeout=timeout, rendezvous=rendezvous)
        if not os.path.isfile(result):
            return [], f"the gloo run failed: {_failure(proc)[:300]}"
        with open(result) as f:
            rows = json.load(f)
    return [Item(kind, group, err, where, spec["tolerance"]) for kind, group, err, where in rows], None


def worker(spec: dict) -> list[tuple[str, str, float, str]]:
    """One process's comparisons (see the module doc); call inside a gloo process group."""
    split, rank = spec["split"], current().rank()
    model, _ = model_from_args(spec["model_args"], split)
    perturb_weights(model)                    # as the simulation does: every process moves them alike
    without_dropout(model)
    model = model.to(_DTYPES[spec["dtype"]])
    reference = copy.deepcopy(model)
    rows, seq = rows_and_seq(split, spec["seq"])
    vocab = vocab_of(model)
    classes = label_classes(model, rows, seq, vocab)
    first = verification_batch(model, rows, seq, vocab, classes=classes).inputs
    pieces = split.get("dp", 1) * split.get("microbatches", 1)
    prog = autoshard(model, example_kwargs={k: v[: rows // pieces] for k, v in first.items()}, **split)
    if prog.fp8 is not None:                  # the single-device FP8 model, as verify_model makes it
        to_fp8_model(reference, prog.fp8[1], prog.fp8[0])
    steps = step_batches(model, rows, seq, vocab, boundary_ids(prog, vocab), classes)
    rt = prog.distributed(mesh=True)
    return rank_rows(prog, rt, reference, [(label, b.inputs) for label, b in steps],
                     sharded=bool(spec.get("distributed_optimizer")), run="gloo", by_microbatch=prog.fp8 is not None)


def gather_and_write(rows: list[tuple[str, str, float, str]], path: str) -> None:
    """Every rank's rows to every rank; each machine's first rank keeps the worst per (kind, group)
    and writes them to `path` (its machine's: each machine's verify reads its own and certifies)."""
    every = all_gather_json(rows)
    if os.environ.get("LOCAL_RANK", str(current().rank())) == "0":
        with open(path, "w") as f:
            json.dump(worst_rows(tuple(r) for rs in every for r in rs), f)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one process of autoshard verify --gloo")
    ap.add_argument("--spec", required=True)
    args = ap.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    init_gloo()
    torch.set_num_threads(1)
    gather_and_write(worker(spec), spec["result"])
    leave(0)


if __name__ == "__main__":
    main()
