"""The runtime itself, every rank in one process (`prog.local_mesh()`: world/local.py's LocalWorld):
the schedule's actions, pipeline transfers, gradient buckets, token counts, the distributed
optimizer, expert all-to-alls and the context-parallel ring, against the model on one device over
several optimizer steps."""
import time

import pytest
import torch

from autoshard import autoshard
from autoshard.runtime.batching import pick_loss
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.runtime.schedules import Action
from autoshard.runtime.trace import REDUCE
from autoshard.testing.context_models import build_context, context_batch
from autoshard.testing.metrics import max_rel, norm_rel
from autoshard.testing.models import VOCAB, build_model
from autoshard.verify.runtime import local_slice
from autoshard.world import DeadlockError

LR = 1e-2


def _batches(n: int, rows: int, seq: int = 16, seed: int = 1, names: tuple[str, str] = ("input_ids", "labels")
             ) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
        labels = torch.randint(0, VOCAB, (rows, seq), generator=g)
        labels[0, :3] = -100
        out.append(dict(zip(names, (ids, labels))))
    return out


def _train_both(prog, reference, batches, max_norm: float | None):
    """Each batch: a train_step on every rank of the mesh and a DistributedOptimizer (AdamW) step;
    the reference: the same batches, clipped alike, torch's AdamW on one device."""
    mesh = prog.local_mesh()
    opts = mesh.each(lambda rt: DistributedOptimizer(rt, torch.optim.AdamW, lr=LR, bucket_bytes=8 * 1024))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    worst_loss = 0.0
    for batch in batches:
        losses = mesh.train_step(**batch, max_norm=max_norm)
        mesh.each(lambda rt, opt: (opt.step(), opt.zero_grad()), opts)
        ref_opt.zero_grad()
        ref_loss = pick_loss(reference(**batch))
        ref_loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        ref_opt.step()
        assert all(torch.equal(loss, losses[0]) for loss in losses)       # every rank returns the batch's loss
        worst_loss = max(worst_loss, max_rel(losses[0], ref_loss))
    whole = {n: p.detach() for n, p in reference.named_parameters()}
    worst_param = max(norm_rel({n: p.detach() for n, p in rt.named_parameters()},
                               {n: local_slice(prog, rt, n, whole[n]) for n, _ in rt.named_parameters()})
                      for rt in mesh.runtimes)
    return mesh, worst_loss, worst_param


def test_interleaved_tp2_pp2_dp2_with_the_distributed_optimizer_equals_one_device():
    """Eight ranks: two chunks per pipeline rank (interleaved 1F1B), tensor-parallel pairs, data-parallel
    pairs reduce-scattering their gradient buckets, AdamW state 1/dp per rank; float64 (nanoGPT, which
    casts nothing to float32), so that the mesh's other summation orders stay far below what is compared."""
    model, reference = (build_model("nanogpt", layers=4).double() for _ in range(2))
    batches = _batches(3, rows=4, names=("idx", "targets"))
    prog = autoshard(model, tp=2, pp=2, dp=2, virtual=2, microbatches=2,
                     example_kwargs={k: v[:1] for k, v in batches[0].items()})
    mesh, loss_rel, param_rel = _train_both(prog, reference, batches, max_norm=1.0)
    assert loss_rel < 1e-12 and param_rel < 1e-10, (loss_rel, param_rel)
    rt = mesh.runtimes[0]
    assert rt.virtual == 2 and {r.action.chunk for r in rt.records if r.action.kind == "F"} == {0, 1}
    assert sum(r.action.kind == REDUCE for r in rt.records) >= 2          # buckets, reduce-scattered
    assert rt.transfer.messages_sent > 0


def test_context_and_expert_parallel_moe_equals_one_device():
    """cp=2 x ep=2 on Mixtral: each context-parallel rank holds half of every sequence (the ring of keys
    and values) and half of the experts (tokens exchanged by all-to-all), with padding and -100 labels."""
    model, reference = (build_context("mixtral", num_hidden_layers=2).train() for _ in range(2))
    batches = [context_batch(batch=2, seq=16, seed=s) for s in (1, 2, 3)]
    prog = autoshard(model, cp=2, ep=2, example_kwargs=batches[0])
    mesh, loss_rel, param_rel = _train_both(prog, reference, batches, max_norm=None)
    assert loss_rel < 1e-5 and param_rel < 1e-5, (loss_rel, param_rel)
    assert all(rt.expert_group is not None and rt.expert_group.sent_bytes > 0 for rt in mesh.runtimes)


def test_a_schedule_that_receives_before_its_peer_sends_is_reported_as_a_deadlock():
    """Planted: pipeline rank 0 waits for microbatch 0's gradient before sending microbatch 1, while
    rank 1 runs both forwards before any backward: each waits on a message the other has not sent."""
    model = build_model("llama", layers=2)
    batch = _batches(1, rows=2)[0]
    prog = autoshard(model, pp=2, microbatches=2, example_kwargs={k: v[:1] for k, v in batch.items()})
    mesh = prog.local_mesh()
    mesh.runtimes[0].actions = [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)]
    mesh.runtimes[1].actions = [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1)]
    start = time.perf_counter()
    with pytest.raises(DeadlockError, match=r"rank 0 waits on a message from rank 1 .*; rank 1 waits on a message "
                                            r"from rank 0"):
        mesh.train_step(**batch)
    assert time.perf_counter() - start < 10


def test_schedule_auto_with_a_free_split_trains_as_one_device():
    """schedule="auto" on hardware whose split costs nothing picks a zero-bubble schedule (W computed
    from the saved tensors, the first stage's backward whole where its W follows its B); three AdamW
    steps of an HF Llama with a padding mask, -100 labels and norm weights off their initial values
    equal one device's."""
    from autoshard.planning.hardware import get_hardware
    from autoshard.runtime.schedules import schedule_spec
    model, reference = (build_model("llama", layers=4) for _ in range(2))
    with torch.no_grad():
        for m in (model, reference):
            for n, p in m.named_parameters():
                if "norm" in n:
                    p.add_(0.1 * torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) / p.numel())
    batches = _batches(3, rows=4)
    for b in batches:
        b["attention_mask"] = torch.ones_like(b["input_ids"])
        b["attention_mask"][1, -5:] = 0
    prog = autoshard(model, pp=2, microbatches=4, schedule="auto", example_kwargs={k: v[:1] for k, v in batches[0].items()},
                     hardware=get_hardware("a100-80gb", split_backward=1.0))
    assert schedule_spec(prog.schedule_name).split, prog.schedule_choice.explain()
    _, loss_rel, param_rel = _train_both(prog, reference, batches, max_norm=None)
    assert loss_rel < 1e-5 and param_rel < 1e-5, (loss_rel, param_rel)
