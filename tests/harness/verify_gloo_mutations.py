"""Runtime bugs, each a patch of one part of the runtime that the lockstep simulation never runs (the
gradient buffer's reductions, the loss's token counts over data-parallel ranks, the pipeline's
backward transfers, the distributed optimizer's gathers). tests/local/test_verify_runtime.py plants
each while `verify_model` runs (the runtime on a local world); here, one launch runs them all in
`autoshard verify --gloo`'s processes, each on its own split of 2, and rank 0 prints one JSON line
per bug with the certificate's items:

    torchrun --standalone --nproc-per-node 2 -m tests.harness.verify_gloo_mutations --spec FILE

`python -m tests.harness.mutations` launches it for its table (`launch_all`, which writes FILE).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
from unittest import mock

import torch

import autoshard.runtime.loss_tokens as loss_tokens
from autoshard.runtime.executor import MeshRuntime
from autoshard.runtime.flat_params import FlatParams
from autoshard.runtime.grad_buffer import GradBuffer
from autoshard.runtime.p2p import Transfer
from autoshard.testing.launch import init_gloo, leave, torchrun
from autoshard.verify.gloo import gather_and_write, worker
from autoshard.world import current

ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def _tied_not_summed():
    original = GradBuffer.reduce

    def reduce(self):
        self.tied_groups = {}
        return original(self)
    return mock.patch.object(GradBuffer, "reduce", reduce)


def _dp_scale_doubled():
    original = GradBuffer.begin

    def begin(self, microbatches, scale, origin, uses=None):
        return original(self, microbatches, scale * 2, origin, uses)
    return mock.patch.object(GradBuffer, "begin", begin)


def _backward_transfer_zeroed():
    original = Transfer.recv_backward

    def recv(self, like, src, stage, microbatch):
        return [torch.zeros_like(t) for t in original(self, like, src, stage, microbatch)]
    return mock.patch.object(Transfer, "recv_backward", recv)


def _token_count_not_summed():
    def scales(self, gm, flats, goals, loss_fn, reduction, ignore_index):
        counter = loss_tokens.loss_tokens_of(gm)
        return loss_tokens.loss_factors(counter, flats, goals, loss_fn is not None, reduction, ignore_index, None,
                                        self.device)
    return mock.patch.object(MeshRuntime, "_loss_scales", scales)


def _pieces_not_published():
    return mock.patch.object(FlatParams, "publish", lambda self: None)


# name -> (what it plants, model arguments' changes, split of 2 processes, patch); a "+do" name steps
# with the distributed optimizer
GLOO_MUTATIONS = {
    "tied-not-summed": ("a tied embedding's gradient not summed over its pipeline stages",
                        dict(model="gpt2"), dict(pp=2, microbatches=2), _tied_not_summed),
    "dp-scale-doubled": ("the data-parallel gradient scaled by 2/dp instead of 1/dp", dict(model="llama"),
                         dict(dp=2), _dp_scale_doubled),
    "backward-transfer-zeroed": ("the pipeline's backward transfer delivers zeros", dict(model="llama"),
                                 dict(pp=2, microbatches=2), _backward_transfer_zeroed),
    "token-count-not-summed": ("each data-parallel rank's token count not summed over the group",
                               dict(model="llama"), dict(dp=2, microbatches=2), _token_count_not_summed),
    "pieces-not-published+do": ("the distributed optimizer's updated pieces not all-gathered", dict(model="llama"),
                                dict(dp=2), _pieces_not_published),
}
# the same runs without a bug: they must pass, or the bugs' failures would mean nothing
CONTROLS = {"control-pp2": (dict(model="gpt2"), dict(pp=2, microbatches=2)),
            "control-dp2+do": (dict(model="llama"), dict(dp=2, microbatches=2))}


SMALL_LLAMA = dict(model="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=None, vocab=128, max_positions=64,
                   factory_args=None, twin=False, full=False, seed=0)


def launch_all(folder: str, tolerance: float = 1e-5) -> dict[str, list]:
    """One launch of every bug and control above (2 processes); each one's rows (kind, group, error, where)."""
    spec = {"model_args": SMALL_LLAMA, "seq": None, "tolerance": tolerance, "dtype": "float64",
            "result": os.path.join(folder, "items")}
    path = os.path.join(folder, "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    proc = torchrun("tests.harness.verify_gloo_mutations", ["--spec", path], 2, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = {}
    for name in [*GLOO_MUTATIONS, *CONTROLS]:
        with open(f"{spec['result']}.{name}") as f:
            out[name] = json.load(f)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    args = ap.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    init_gloo()
    torch.set_num_threads(1)
    runs = [(name, changes, split, patch) for name, (_, changes, split, patch) in GLOO_MUTATIONS.items()]
    runs += [(name, changes, split, contextlib.nullcontext) for name, (changes, split) in CONTROLS.items()]
    for name, model_changes, split, patch in runs:
        one = {**spec, "model_args": {**spec["model_args"], **model_changes}, "split": split,
               "distributed_optimizer": name.endswith("+do"), "result": f"{spec['result']}.{name}"}
        with patch():
            gather_and_write(worker(one), one["result"])
        current().barrier()
    leave(0)


if __name__ == "__main__":
    main()
