"""DistributedOptimizer on a one-rank process group: single-device AdamW with clipping over several
steps, its records in the trace, and the errors for misuse (nothing silently wrong)."""
import pytest
import torch

from autoshard import ShardingError, autoshard
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.runtime.trace import REDUCE, chrome_trace
from autoshard.testing.metrics import max_rel, scaled_errors
from autoshard.testing.models import build_model


def _batch(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (4, 16), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100
    return {"input_ids": ids, "labels": labels}


def test_equals_plain_adamw_and_single_device_losses_with_clipping(one_process_group):
    """Same microbatches, same clipping: the plain runtime's AdamW and the distributed optimizer give
    equal parameters (Adam amplifies the float noise of other summation orders, so the single-device
    model is compared on losses and gradient norms)."""
    model, plain_model, ref = (build_model("llama", layers=2) for _ in range(3))
    rt = autoshard(model, microbatches=2, example_kwargs=_batch(0)).distributed(mesh=True)
    plain_rt = autoshard(plain_model, microbatches=2, example_kwargs=_batch(0)).distributed(mesh=True)
    opt = DistributedOptimizer(rt, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, bucket_bytes=32 * 1024, overlap=True)
    plain = torch.optim.AdamW(plain_rt.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(4):
        b = _batch(step)
        loss, plain_loss = rt.train_step(**b, max_norm=0.5), plain_rt.train_step(**b, max_norm=0.5)
        ref_loss = ref(**b).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert max_rel(loss, ref_loss) < 1e-5 and max_rel(rt.last_grad_norm.float(), ref_norm) < 1e-5
        assert torch.equal(loss, plain_loss)
        assert all(p.grad is None for p in rt.parameters())          # gradients live in the fp32 buffer
        for o in (opt, plain, ref_opt):
            o.step()
            o.zero_grad()
    errs = scaled_errors({n: p.detach() for n, p in rt.named_parameters()},
                         {n: p.detach() for n, p in plain_rt.named_parameters()})
    assert max(errs.values()) < 1e-6
    reduces = [r for r in rt.records if r.action.kind == REDUCE]
    assert len(reduces) == opt.buckets >= 2
    assert {e["cat"] for e in chrome_trace(rt.records)["traceEvents"] if "cat" in e} == {"forward", "backward",
                                                                                         "grad-reduce"}
    sizes = opt.state_bytes()
    n = sum(p.numel() for p in rt.parameters())
    assert sizes["optimizer_state"] == 8 * n and sizes["main_params"] == 0 and sizes["grads"] >= 4 * n


def test_misuse_is_refused(one_process_group):
    rt = autoshard(build_model("llama", layers=2), example_kwargs=_batch(0)).distributed(mesh=True)
    opt = DistributedOptimizer(rt, torch.optim.AdamW, lr=1e-2)
    rt.train_step(**_batch(1))
    opt.step()
    opt.zero_grad()
    name, p = next(iter(rt.named_parameters()))
    rt.set_tensors({name: torch.nn.Parameter(p.detach().clone())})
    with pytest.raises(ShardingError, match="parameters were replaced or moved after the optimizer was built"):
        rt.train_step(**_batch(3))
    frozen = autoshard(build_model("llama", layers=2), example_kwargs=_batch(0)).distributed(mesh=True)
    DistributedOptimizer(frozen, torch.optim.AdamW)
    next(iter(frozen.parameters())).requires_grad_(False)
    with pytest.raises(ShardingError, match=r"parameters were frozen or unfrozen \(\['model.embed_tokens.weight'\]"):
        frozen.train_step(**_batch(3))
    mixed = autoshard(build_model("llama", layers=2), example_kwargs=_batch(0)).distributed(mesh=True)
    first = next(iter(mixed.parameters()))
    first.data = first.data.double()
    with pytest.raises(ShardingError, match="needs one parameter dtype; this rank's trainable parameters are"):
        DistributedOptimizer(mixed, torch.optim.AdamW)
    with pytest.raises(ShardingError, match="only an element-wise optimizer does exactly; got 'LBFGS'"):
        DistributedOptimizer(mixed, torch.optim.LBFGS)       # it would step flat pieces, silently otherwise
    for call in (opt.state_dict, lambda: opt.load_state_dict({})):    # before: AttributeError
        with pytest.raises(ShardingError, match=r"no state_dict.*autoshard.checkpoint: checkpoint.save\(folder, prog"):
            call()


def test_an_fp64_model_keeps_fp64_gradients_and_main_weights(one_process_group):
    """The buffer and main weights are never narrower than the parameters: an fp64 model's AdamW state
    stays fp64, and the distributed optimizer equals plain AdamW to fp64 rounding (before: fp32
    gradients and main weights, 1e-7 apart)."""
    model, plain_model = (build_model("llama", layers=2).double() for _ in range(2))
    rt = autoshard(model, example_kwargs=_batch(0)).distributed(mesh=True)
    plain_rt = autoshard(plain_model, example_kwargs=_batch(0)).distributed(mesh=True)
    opt = DistributedOptimizer(rt, torch.optim.AdamW, lr=1e-2)
    plain = torch.optim.AdamW(plain_rt.parameters(), lr=1e-2)
    for step in range(3):
        rt.train_step(**_batch(step), max_norm=0.5)
        plain_rt.train_step(**_batch(step), max_norm=0.5)
        for o in (opt, plain):
            o.step()
            o.zero_grad()
    assert {v.dtype for s in opt.optimizer.state.values() for v in s.values() if v.dim() > 0} == {torch.float64}
    errs = scaled_errors({n: p.detach() for n, p in rt.named_parameters()},
                         {n: p.detach() for n, p in plain_rt.named_parameters()})
    assert max(errs.values()) < 1e-12


def test_a_checkpoint_with_frozen_parameters_resumes_exactly(one_process_group, tmp_path):
    """The distributed optimizer holds no state for a frozen embedding; its checkpoint saves the
    frozen weight as a parameter and the rest's state, and a run loaded from it continues exactly
    as the uninterrupted one (frozen weight unchanged throughout)."""
    from autoshard import checkpoint

    def build():
        model = build_model("llama", layers=2)
        model.get_input_embeddings().weight.requires_grad_(False)
        prog = autoshard(model, example_kwargs=_batch(0))
        rt = prog.distributed(mesh=True)
        return prog, rt, DistributedOptimizer(rt, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)

    prog, rt, opt = build()
    frozen = rt.get_parameter("model.embed_tokens.weight").detach().clone()
    for step in range(2):
        rt.train_step(**_batch(step))
        opt.step()
        opt.zero_grad()
    checkpoint.save(str(tmp_path), prog, rt, opt, step=2)
    prog2, rt2, opt2 = build()
    checkpoint.load(str(tmp_path), prog2, rt2, opt2)
    for r, o in ((rt, opt), (rt2, opt2)):
        r.train_step(**_batch(2))
        o.step()
        o.zero_grad()
    for (name, p), (_, q) in zip(rt.named_parameters(), rt2.named_parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(rt2.get_parameter("model.embed_tokens.weight"), frozen)
    assert "model.embed_tokens.weight" not in opt.names
