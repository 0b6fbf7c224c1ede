"""precision="fp8" in the runtime: tp=2 ranks (or cp=2 ranks) on a local world, their amaxes taken
with the world's all-reduce (max) over the tp group (or the cp group), step to the single-device FP8
program's loss and gradients (the model in fp32 around its FP8 linears: tests/simulation/test_fp8.py
says why)."""
import copy

import pytest
import torch

from autoshard import autoshard
from autoshard.world import LocalWorld
from tests.simulation.test_fp8 import FP32_TOL, _llama


@pytest.mark.parametrize("split", [{"tp": 2}, {"tp": 1, "cp": 2}], ids=["tp2", "cp2"])
def test_the_runtimes_fp8_ranks_step_as_one_device(split):
    model = _llama().float()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    kw = dict(example_kwargs={"input_ids": ids, "labels": ids}, precision="fp8")
    one = autoshard(copy.deepcopy(model), tp=1, **kw)
    want = one.simulate(input_ids=ids, labels=ids).loss
    want.backward()
    grads = one.full_grads()
    prog = autoshard(copy.deepcopy(model), **split, **kw)

    def rank(r):
        rt = prog.distributed(mesh=True)
        loss = rt.train_step(input_ids=ids, labels=ids)
        return loss.item(), {n: p.grad.clone() for n, p in rt.named_parameters()}
    out = LocalWorld(2).run(rank)
    assert all(abs(loss - want.item()) / want.item() <= FP32_TOL for loss, _ in out)
    for r, (_, got) in enumerate(out):
        for name, g in got.items():          # column-parallel rows, row-parallel columns, replicated whole
            full = grads[name]
            use = prog.sharding.params.get(name)
            if use is not None:
                full = full.narrow(use.dim, r * g.shape[use.dim], g.shape[use.dim])
            assert (g - full).norm() <= FP32_TOL * full.norm() + 1e-12, name


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_zero_bubble_schedules_run_fp8_as_1f1b_does(schedule):
    """The zero-bubble schedules split each stage's backward into B (input gradients) and W (weight
    gradients, runtime/backward_split.py): an Fp8Linear's backward computes both at once, so its
    node is a frontier W runs again for the weight side (its tp and cp maxima included). The losses
    and every gradient equal 1F1B's bit for bit at pp=2, 4 microbatches (ZBV: 2 chunks per rank)."""
    model = _llama(layers=4).float()
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    out = {}
    for name in ("1f1b", schedule):
        prog = autoshard(copy.deepcopy(model), pp=2, microbatches=4, schedule=name, precision="fp8",
                         virtual=2 if name == "zbv" else 1, example_kwargs={"input_ids": ids[:1], "labels": ids[:1]})

        def rank(r, prog=prog):
            rt = prog.distributed(mesh=True)
            loss = rt.train_step(input_ids=ids, labels=ids)
            return float(loss), {n: p.grad.clone() for n, p in rt.named_parameters() if p.grad is not None}
        out[name] = LocalWorld(2).run(rank)
    # every parameter's gradient, from whichever rank holds it (ZBV places the chunks in a V)
    grads_a, grads_b = ({n: g for _, grads in out[k] for n, g in grads.items()} for k in ("1f1b", schedule))
    assert [loss for loss, _ in out["1f1b"]] == [loss for loss, _ in out[schedule]]
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == len(dict(model.named_parameters()))
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def test_verify_rows_read_the_runtimes_own_graphs_where_the_weights_are_released():
    """Regression: `autoshard verify --precision fp8 --gloo` at dp=2 x ep=2 failed in every process
    (and said only torchrun's closing banner): the single-device FP8 reference weighs its microbatches'
    losses by token counts read off a rank program's graphs, and it asked `prog.rank(0)`, which a
    torchrun process cannot cut once distributed() has released the model's weights. It now reads
    its own runtime's program. Here the release is done by hand in a local world, as a torchrun
    process does it; the rows still compare."""
    from autoshard.testing.models import build_moe
    from autoshard.verify.fp8_model import to_fp8_model
    from autoshard.verify.runtime import rank_rows
    from autoshard.world import current
    model = build_moe("mixtral")
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(1))
    prog = autoshard(copy.deepcopy(model), dp=2, ep=2, precision="fp8",
                     example_kwargs={"input_ids": ids[:2], "labels": ids[:2]})

    def rank(r):
        reference = copy.deepcopy(model)
        to_fp8_model(reference, prog.fp8[1], prog.fp8[0])
        rt = prog.distributed(mesh=True)
        current().barrier()
        if r == 0:
            prog._release()                      # what distributed() does in a torchrun process
        current().barrier()
        return rank_rows(prog, rt, reference, [("step", {"input_ids": ids, "labels": ids})], sharded=False,
                         run="runtime", by_microbatch=True)
    rows = [row for rows in LocalWorld(2).run(rank) for row in rows]
    assert rows and all(err <= 1e-2 for _, _, err, _ in rows), rows
