"""Memory read off a rank's own graphs (planning/graph_memory.py): Korthikanti's layer where the model
is Megatron's GPT, planner-sized models on meta tensors, and the program left as it was.
The gloo runs it is measured against: tests/distributed/test_memory_prediction.py."""
import pytest
import torch

from autoshard import autoshard
from autoshard.planning.meta_ops import sdpa_on
from autoshard.models import GPT, GPTConfig
from autoshard.parallel.expert_parallel import dispatch_combine
from autoshard.parallel.comm import CommHandle, distributed_reducer
from autoshard.parallel.shape_comm import ShapeComm
from autoshard.planning.graph_memory import program_memory, rank_memory_of
from autoshard.planning.memory_model import ActivationShape, layer_activation_bytes

H, A, S, B = 128, 4, 64, 2


def _gpt_activations(layers: int, **options) -> float:
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=layers, n_head=A, n_embd=H, vocab_size=256, block_size=S, dropout=0.1,
                              flash=False)).train()
    ids = torch.zeros(B, S, dtype=torch.long)
    return rank_memory_of(autoshard(model, example_inputs=(ids, ids), **options)).activations


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_layer_of_megatrons_gpt_saves_korthikantis_bytes(recompute):
    """Two layers more add two of the table's layers (fp32 on the CPU: e = m = 4, nanoGPT's one
    residual dropout), within the layer norms' statistics (8 bytes a token), which it leaves out."""
    per_layer = (_gpt_activations(4, tp=2, recompute=recompute) - _gpt_activations(2, tp=2, recompute=recompute)) / 2
    table = layer_activation_bytes(ActivationShape(s=S, b=B, h=H, a=A, t=2, e=4, m=4, resid_dropouts=1), recompute)
    assert table <= per_layer <= table + 2 * 8 * S * B


def test_a_planner_sized_model_is_read_on_meta_tensors():
    """hidden 4096, 2 layers, pp=2 with 4 microbatches: gigabytes predicted, none allocated."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=32, n_embd=4096, vocab_size=32000, block_size=2048)).train()
    ids = torch.zeros(1, 2048, dtype=torch.long)
    first, last = program_memory(autoshard(model, pp=2, microbatches=4, example_inputs=(ids, ids)))
    assert first.peak > 2 ** 30 and last.peak > 2 ** 30
    assert first.activations > last.activations      # 1F1B: the first stage holds more microbatches
    assert "MiB = state" in first.explain()


def test_the_1t_shape_fully_sharded_over_1024_ranks_holds_a_1024th():
    """Two layers of the 1T shape (hidden 25600, 160 heads) on meta at dp=1024, zero=3: 16 bytes a
    parameter / 1024 held between steps (benchmarks/compile_scaling.py walks all 128 layers), and the
    step gathers a layer at a time: two layers' weights and their fp32 gradients in flight, far more
    than what is held."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=160, n_embd=25600, vocab_size=50304, block_size=64)).train()
    ids = torch.zeros(1, 64, dtype=torch.long)
    prog = autoshard(model, dp=1024, zero=3, example_inputs=(ids, ids))
    memory = rank_memory_of(prog)
    params = sum(p.numel() for p in model.parameters())
    assert abs(memory.state + memory.gradients - 16 * params / 1024) <= 0.01 * 16 * params / 1024, memory.explain()
    layer = 12 * 25600 ** 2
    assert memory.working >= 2 * 4 * layer, memory.explain()


def test_the_program_is_left_as_it_was():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16)).train()
    ids = torch.randint(0, 64, (2, 16))
    prog = autoshard(model, tp=2, example_inputs=(ids, ids))
    before = {n: p.detach().clone() for n, p in prog.rank(0).named_parameters()}
    rank_memory_of(prog, tp_rank=0)
    rank = prog.rank(0)
    assert rank.handle.comm is None
    for n, p in rank.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p, before[n]), n
    out = prog.simulate(ids, ids)[1]
    assert torch.isfinite(out).all()


def test_shape_comm_allocates_what_the_real_collectives_return():
    comm = ShapeComm(4)
    x = torch.empty(2, 8, 6, device="meta")
    assert comm.reduce_scatter(x, 1).shape == (2, 2, 6)
    assert comm.all_gather(x, 2).shape == (2, 8, 24)
    assert comm.all_to_all(x, [1, 1, 0, 0], [3, 3, 1, 1]).shape == (8, 8, 6)
    assert comm.all_reduce(x).shape == x.shape
    with pytest.raises(ValueError, match="does not divide over 4 ranks"):
        comm.reduce_scatter(torch.empty(2, 6, device="meta"), 1)


def test_experts_route_evenly_on_meta():
    """No expert ids on meta: a rank's n * k pairs are spread evenly over the group's ranks."""
    handle = CommHandle(0, 4)
    handle.comm = ShapeComm(4)
    seen = []

    def run_local(x, ids, w):
        seen.append(x.shape[0])
        return x * w
    x = torch.empty(10, 16, device="meta", requires_grad=True)
    idx = torch.empty(10, 2, dtype=torch.long, device="meta")
    out, = dispatch_combine(distributed_reducer(handle), [x], [idx], [torch.empty(10, 2, device="meta")],
                            [run_local], 2, 4)
    assert out.shape == (10, 16) and seen == [20]


def test_attention_on_meta_saves_what_the_cpu_kernel_saves():
    """Without dropout the CPU runs its flash kernel (a log-sum-exp per row is saved, not the scores)."""
    q = torch.empty(2, 4, 256, 32, device="meta", requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        sdpa_on(torch.device("cpu"))(q, q, q, is_causal=True)
    assert max(saved) == q.numel() and 2 * 4 * 256 in saved


def test_a_program_compiled_in_eval_mode_is_read_in_training():
    """Regression: the read needs the training graph; a model compiled in eval mode (or at another
    batch size, as autoshard(world_size=) plans one) had none, and the read was refused."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16)).eval()
    ids = torch.randint(0, 64, (2, 16))
    prog = autoshard(model, example_inputs=(ids, ids))
    two, one = rank_memory_of(prog), rank_memory_of(prog, batch=1)
    assert one.activations < two.activations and not prog.rank(0).training
