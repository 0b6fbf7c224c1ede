"""Fully sharded data parallelism (zero=3: runtime/sharded_params.py, passes/unit_gathers.py) on the
one-process mesh against the model on one device: ten AdamW steps with clipping, on Hugging Face
decoders with a padding mask, -100 labels, a tied embedding, one frozen layer and norm weights moved
off their initial values, at dp=4, tp2 x dp2, pp2 x dp2 (interleaved), cp2 x dp2 and Mixtral at dp=4
ep=2; and what each rank holds: 1/dp of the parameters and gradients between steps, units gathered
only while they are used."""
import pytest
import torch

from autoshard import autoshard
from autoshard.errors import ShardingError
from autoshard.runtime.batching import pick_loss
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.testing.context_models import build_context, context_batch
from autoshard.testing.metrics import max_rel, norm_rel
from autoshard.verify.runtime import local_slice

LR = 1e-3
STEPS = 10


def _pair(name: str, layers: int, **overrides) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model and its one-device reference: tied embedding, layer 1 frozen, norm weights moved."""
    models = []
    for _ in range(2):
        m = build_context(name, num_hidden_layers=layers, tie_word_embeddings=True, **overrides).train()
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "norm" in n:
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
        m.model.layers[1].requires_grad_(False)
        models.append(m)
    return models[0], models[1]


def _batches(rows: int) -> list[dict[str, torch.Tensor]]:
    return [context_batch(batch=rows, seq=16, seed=s) for s in range(1, STEPS + 1)]


def _train(prog, reference, batches, zero: int = 3):
    """STEPS steps on the mesh (DistributedOptimizer at `zero`) and on one device; the worst relative
    loss and parameter differences, the mesh and its optimizers."""
    mesh = prog.local_mesh()
    opts = mesh.each(lambda rt: DistributedOptimizer(rt, torch.optim.AdamW, lr=LR, zero=zero))
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR)
    worst = 0.0
    for batch in batches:
        losses = mesh.train_step(**batch, max_norm=1.0)
        mesh.each(lambda rt, opt: (opt.step(), opt.zero_grad()), opts)
        ref_opt.zero_grad()
        ref_loss = pick_loss(reference(**batch))
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        worst = max(worst, max_rel(losses[0], ref_loss))
    whole = {n: p.detach() for n, p in reference.named_parameters()}

    def param_rel(rt, opt):
        with opt.gathered():
            mine = {n: p.detach().clone() for n, p in rt.named_parameters()}
        return norm_rel(mine, {n: local_slice(prog, rt, n, whole[n]) for n in mine})
    return worst, max(mesh.each(param_rel, opts)), mesh, opts


def _holds_a_shard(mesh, opts, data: int) -> None:
    """Between steps: no unit gathered, parameters and gradients 1/data of zero=1's (padding aside)."""
    for rt, opt in zip(mesh.runtimes, opts):
        assert all(s == "free" for flat in opt.parts for s in flat.state), "a unit stayed gathered"
        assert rt.unit_gathers.gathers >= 2 * len(rt.unit_gathers.where)      # forward and backward each step
        held = opt.state_bytes()
        whole = sum(p.numel() * p.element_size() for part in opt.grads.parts for p in part.params)
        pad = 4 * data * sum(len(part.buffer.layout.buckets) for part in opt.grads.parts)
        assert held["params"] <= whole / data + pad and held["grads"] <= whole / data + pad, (held, whole)


# (model, split, rows a batch, layers: 4 stages need 4 layers, the rest 2, the second frozen)
MESHES = {
    "dp4": ("llama", dict(dp=4, microbatches=2), 8, 2),
    "tp2-dp2": ("llama", dict(tp=2, dp=2, microbatches=2), 4, 2),
    "pp2-dp2-interleaved": ("llama", dict(pp=2, dp=2, virtual=2, microbatches=2), 4, 4),
    "cp2-dp2": ("llama", dict(cp=2, dp=2), 2, 2),
}


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_ten_adamw_steps_equal_one_device(mesh_name):
    name, split, rows, layers = MESHES[mesh_name]
    model, reference = _pair(name, layers=layers)
    batches = _batches(rows)
    prog = autoshard(model, example_kwargs={k: v[:1] for k, v in batches[0].items()}, **split)
    loss_rel, param_rel, mesh, opts = _train(prog, reference, batches)
    assert loss_rel < 1e-5 and param_rel < 1e-5, (loss_rel, param_rel)
    _holds_a_shard(mesh, opts, prog.dims.data)


def test_moe_at_dp4_ep2_equals_one_device():
    """Mixtral's experts are sharded over the ranks holding the same experts (data / ep = 2 of them),
    the rest over dp = 4."""
    model, reference = _pair("mixtral", layers=2)
    batches = _batches(4)
    prog = autoshard(model, dp=4, ep=2, example_kwargs={k: v[:1] for k, v in batches[0].items()})
    loss_rel, param_rel, mesh, opts = _train(prog, reference, batches)
    assert loss_rel < 1e-5 and param_rel < 1e-5, (loss_rel, param_rel)
    assert all(len(opt.parts) == 2 for opt in opts)             # experts a part of their own


def test_checkpoints_move_between_zero3_and_zero1_meshes(tmp_path):
    """Saved whole per parameter: a zero=3 run at dp=4 resumes at tp2 x dp2 with zero=1, and that one
    again at dp=4 with zero=3, with the losses of the run that never stopped."""
    from autoshard import checkpoint
    batches = _batches(8)[:4]
    example = {k: v[:1] for k, v in batches[0].items()}

    def start(split: dict, zero: int):
        prog = autoshard(_pair("llama", layers=2)[0], example_kwargs=example, microbatches=2, **split)
        mesh = prog.local_mesh()
        return prog, mesh, mesh.each(lambda rt: DistributedOptimizer(rt, torch.optim.AdamW, lr=LR, zero=zero))

    def step(mesh, opts, batch):
        loss = mesh.train_step(**batch, max_norm=1.0)[0]
        mesh.each(lambda rt, opt: (opt.step(), opt.zero_grad()), opts)
        return loss
    prog, mesh, opts = start(dict(dp=4), 3)
    for b in batches[:2]:
        step(mesh, opts, b)
    mesh.each(lambda rt, opt: checkpoint.save(str(tmp_path / "a"), prog, rt, opt, step=2), opts)
    straight = [step(mesh, opts, b) for b in batches[2:]]
    prog, mesh, opts = start(dict(tp=2, dp=2), 1)
    mesh.each(lambda rt, opt: checkpoint.load(str(tmp_path / "a"), prog, rt, opt), opts)
    resumed = [step(mesh, opts, batches[2])]
    mesh.each(lambda rt, opt: checkpoint.save(str(tmp_path / "b"), prog, rt, opt, step=3), opts)
    prog, mesh, opts = start(dict(dp=4), 3)
    mesh.each(lambda rt, opt: checkpoint.load(str(tmp_path / "b"), prog, rt, opt), opts)
    resumed.append(step(mesh, opts, batches[3]))
    assert max(max_rel(a, b) for a, b in zip(resumed, straight)) < 1e-6, (resumed, straight)


def test_zero2_shards_the_gradients_and_keeps_the_parameters():
    model, reference = _pair("llama", layers=2)
    batches = _batches(4)[:3]
    prog = autoshard(model, dp=4, example_kwargs={k: v[:1] for k, v in batches[0].items()})
    loss_rel, param_rel, mesh, opts = _train(prog, reference, batches, zero=2)
    assert loss_rel < 1e-5 and param_rel < 1e-5, (loss_rel, param_rel)
    held = opts[0].state_bytes()
    assert held["grads"] * 4 <= held["params"] + 64 and mesh.runtimes[0].unit_gathers is None, held


def test_refusals_name_the_reason():
    model, _ = _pair("llama", layers=2)
    batch = _batches(2)[0]
    example = {k: v[:1] for k, v in batch.items()}
    prog = autoshard(model, pp=2, dp=2, microbatches=2, schedule="zb-h1", example_kwargs=example)
    with pytest.raises(ShardingError, match=r"\(zero=3\) with a zero-bubble schedule"):
        prog.local_mesh().each(lambda rt: DistributedOptimizer(rt, zero=3))
    with pytest.raises(ShardingError, match="zero=4; 1 shards the optimizer state"):
        autoshard(model, dp=2, example_kwargs=example).local_mesh().each(lambda rt: DistributedOptimizer(rt, zero=4))


def test_the_program_carries_zero_to_the_optimizer_and_the_printout():
    model, _ = _pair("llama", layers=2)
    example = {k: v[:1] for k, v in _batches(2)[0].items()}
    prog = autoshard(model, dp=2, zero=3, example_kwargs=example)
    assert "zero=3: parameters, gradients and optimizer state divided over the 2 data-parallel ranks" in str(prog)
    opts = prog.local_mesh().each(lambda rt: DistributedOptimizer(rt))
    assert all(o.zero == 3 for o in opts)
    with pytest.raises(ShardingError, match="zero=3 with schedule 'zb-h1'"):
        autoshard(model, pp=2, dp=2, microbatches=2, schedule="zb-h1", zero=3, example_kwargs=example)
    with pytest.raises(ShardingError, match="zero=0: 1 divides"):
        autoshard(model, dp=2, zero=0, example_kwargs=example)


def test_the_planner_may_choose_zero3_and_the_program_takes_it():
    """autoshard(world_size=) with the optimizer searched: the plan's zero goes into the program (and
    a zero given keeps the planner to it)."""
    model, _ = _pair("llama", layers=2)
    example = {k: v[:1] for k, v in _batches(2)[0].items()}
    prog = autoshard(model, world_size=2, global_batch=2, zero=3, distributed_optimizer=None, example_kwargs=example)
    assert prog.planned.zero == 3 and prog.zero == 3 and prog.dp == 2


def test_recompute_gathers_each_layer_once_for_its_recomputation_and_backward():
    """recompute="full": a layer's region call is where the batch meets its weights, so its unit is
    gathered before the region's backward, which runs the forward again and then its backward under
    that one gather; the last unit kept from forward to backward (keep_last=1) saves two collectives
    and changes no number."""
    batches = _batches(2)[:3]
    example = {k: v[:1] for k, v in batches[0].items()}
    model, reference = _pair("llama", layers=2)
    prog = autoshard(model, dp=2, recompute="full", example_kwargs=example)
    loss_rel, param_rel, mesh, opts = _train(prog, reference, batches)
    assert loss_rel < 1e-5 and param_rel < 1e-5, (loss_rel, param_rel)
    units = len(mesh.runtimes[0].unit_gathers.where)
    assert mesh.runtimes[0].unit_gathers.gathers == 3 * 2 * units       # 3 steps, forward and backward each
    first = {}
    for keep in (0, 1):
        prog = autoshard(_pair("llama", layers=2)[0], dp=2, recompute="full", example_kwargs=example)
        mesh = prog.local_mesh()
        mesh.each(lambda rt: DistributedOptimizer(rt, torch.optim.AdamW, lr=LR, zero=3, keep_last=keep))
        first[keep] = mesh.train_step(**batches[0], max_norm=1.0)[0]
        assert mesh.runtimes[0].unit_gathers.gathers == 2 * units - keep
    assert torch.equal(first[0], first[1])


def test_bf16_gathers_bf16_and_reduces_fp32_as_zero1_does():
    """Half-precision weights: the units are gathered in bf16, each pass's gradients reduce-scattered
    in fp32, the optimizer steps fp32 main pieces: the losses of zero=1's run within bf16's rounding."""
    batches = _batches(2)[:4]
    example = {k: v[:1] for k, v in batches[0].items()}
    runs = {}
    for zero in (1, 3):
        model = _pair("llama", layers=2)[0].to(torch.bfloat16)
        prog = autoshard(model, dp=2, example_kwargs=example)
        mesh = prog.local_mesh()
        opts = mesh.each(lambda rt: DistributedOptimizer(rt, torch.optim.AdamW, lr=LR, zero=zero))
        losses = []
        for b in batches:
            losses.append(float(mesh.train_step(**b, max_norm=1.0)[0]))
            mesh.each(lambda rt, opt: (opt.step(), opt.zero_grad()), opts)
        runs[zero] = losses
        if zero == 3:
            flat = opts[0].parts[0]
            assert flat.units[0].dtype == torch.bfloat16 and opts[0].grads.parts[0].buffer.data.dtype == torch.float32
            assert all(m.dtype == torch.float32 for _, _, m in flat.pieces.values())
    assert max(abs(a - b) / abs(b) for a, b in zip(runs[3], runs[1])) < 1e-2, runs


def test_two_train_steps_per_optimizer_step_and_a_new_shape():
    """Gradients accumulated over two train_step calls before a step, then a longer sequence (a new
    graph, whose chunks get their gather calls too), then both in one step: as on one device."""
    model, reference = _pair("llama", layers=2)
    short = [context_batch(batch=4, seq=16, seed=s) for s in (1, 2, 3)]
    long = [context_batch(batch=4, seq=24, seed=s) for s in (4, 5)]
    prog = autoshard(model, dp=2, zero=3, example_kwargs={k: v[:1] for k, v in short[0].items()})
    mesh = prog.local_mesh()
    opts = mesh.each(lambda rt: DistributedOptimizer(rt, torch.optim.AdamW, lr=LR))
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR)
    for group in ([short[0], short[1]], [long[0]], [short[2], long[1]]):
        losses = [mesh.train_step(**b)[0] for b in group]
        mesh.each(lambda rt, opt: (opt.step(), opt.zero_grad()), opts)
        ref_opt.zero_grad()
        for b, loss in zip(group, losses):
            ref_loss = pick_loss(reference(**b))
            ref_loss.backward()
            assert max_rel(loss, ref_loss) < 1e-5, (loss, ref_loss)
        ref_opt.step()
    whole = {n: p.detach() for n, p in reference.named_parameters()}

    def param_rel(rt, opt):                  # gathered() is a collective: every rank at once
        with opt.gathered():
            mine = {n: p.detach().clone() for n, p in rt.named_parameters()}
        return norm_rel(mine, {n: local_slice(prog, rt, n, whole[n]) for n in mine})
    assert max(mesh.each(param_rel, opts)) < 1e-5
