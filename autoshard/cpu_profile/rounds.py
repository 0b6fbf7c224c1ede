"""The `cpu` profile's compute measurements (autoshard/cpu_profile/__init__.py), taken in rounds.

    rounds = measure_rounds(x, tiny)           # [Round(gemm_rate, attention_rate, tiny_layer, layer), ...]

Each round times, back to back: the layer's GEMMs, the fused attention kernel, one layer of a tiny
GPT and one layer at the given shapes (each layer: a 4-layer step less a 2-layer one, halved). The
profile's rates are then derived per round, from the four numbers of one round, and the median
over rounds taken. Why rounds: this machine moves between speeds for seconds at a time (one
process's Llama steps ran 44 ms, then 60, then 50 within 40 steps, 2026-11-27), and a rate derived
from a layer timed in one of them and a GEMM rate timed in another took the shift twice over (the
non-matmul remainder is a small difference of large times).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from autoshard.planning.gemm_timing import GEMMS, LayerShape
from autoshard.planning.op_cost import OpWork

__all__ = ["ROUNDS", "Round", "measure_rounds", "timed", "per_layer", "layer_work"]

ROUNDS = 7               # rounds of the compute measurements (their median)


@dataclass(frozen=True)
class Round:
    gemm_rate: float         # FLOP/s of the layer's GEMMs, forward and backward
    attention_rate: float    # FLOP/s of the fused attention kernel, forward and backward
    tiny_layer: float        # seconds of one tiny layer's forward and backward: its ops' dispatch
    layer: float             # seconds of one layer's forward and backward at the given shapes


def timed(fn, repeat: int = 5) -> float:
    """The median seconds of `repeat` calls of `fn`, after one untimed call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gemm_rate(x: LayerShape, repeat: int) -> float:
    """FLOP/s of the layer's GEMMs, forward and backward, in the layouts a linear layer uses: y = x W^T
    (W stored [out, in]), dx = dy W, dW = dy^T x."""
    flops, seconds = 0.0, 0.0
    for _, shape, _ in GEMMS:
        m, n, k, batch = shape(x)
        xs, w, dy = torch.randn(batch, m, k), torch.randn(batch, n, k), torch.randn(batch, m, n)
        for a, b in ((xs, w.transpose(1, 2)), (dy, w), (dy.transpose(1, 2), xs)):
            seconds += timed(lambda: torch.bmm(a, b) if batch > 1 else torch.mm(a[0], b[0]), repeat=repeat)
        flops += 3 * 2 * batch * m * n * k
    return flops / seconds


def _attention_rate(x: LayerShape, repeat: int) -> float:
    """FLOP/s of the CPU's fused attention kernel, forward and backward, on [b, heads, s, h / heads]
    (causal, as the models call it), the FLOPs planning/op_flops.py counts for the same calls."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    q, k, v = (torch.randn(x.b, x.a, x.s, x.h // x.a) for _ in range(3))
    out, lse = forward(q, k, v, 0.0, True)
    grad = torch.randn_like(out)
    seconds = timed(lambda: forward(q, k, v, 0.0, True), repeat=repeat)
    seconds += timed(lambda: backward(grad, q, k, v, out, lse, 0.0, True), repeat=repeat)
    flops = sdpa_flop_count(q.shape, k.shape, v.shape) + sdpa_backward_flop_count(out.shape, q.shape, k.shape, v.shape)
    return flops / seconds


def _layer_step(x: LayerShape, layers: int, *, dropout: float = 0.1, with_optimizer: bool = False):
    """One step (forward and backward, and AdamW if asked) of an autoshard-compiled GPT of `layers`
    layers with x's shapes (vocabulary 64), as a function to time."""
    from autoshard import autoshard
    from autoshard.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, n_head=x.a, n_embd=x.h, vocab_size=64, block_size=x.s, dropout=dropout))
    ids = torch.randint(0, 64, (x.b, x.s))
    rank = autoshard(model, example_inputs=(ids, ids)).rank(0)
    opt = torch.optim.AdamW(rank.parameters())

    def step():
        rank(ids, ids)[1].backward()
        if with_optimizer:
            opt.step()
            opt.zero_grad()
    return step


def _one_layer(two, four) -> tuple[float, float]:
    """(one layer's seconds, the rest's) from a 2-layer and a 4-layer step timed now."""
    t2, t4 = timed(two), timed(four)
    layer = max(0.0, (t4 - t2) / 2)
    return layer, max(0.0, t2 - 2 * layer)


def per_layer(x: LayerShape, rounds: int = ROUNDS, **kw) -> tuple[float, float]:
    """(one layer's seconds, the rest's): a 4-layer step against a 2-layer one, timed in `rounds`
    alternating rounds, the median of each round's difference."""
    two, four = _layer_step(x, 2, **kw), _layer_step(x, 4, **kw)
    pairs = [_one_layer(two, four) for _ in range(rounds)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def measure_rounds(x: LayerShape, tiny: LayerShape, rounds: int = ROUNDS) -> list[Round]:
    """`rounds` rounds of the four compute measurements (the module doc), each GEMM and attention
    call the median of 5 runs within its round."""
    steps = {shape: (_layer_step(shape, 2), _layer_step(shape, 4)) for shape in (tiny, x)}
    out = []
    for _ in range(rounds):
        gemm, attention = _gemm_rate(x, repeat=5), _attention_rate(x, repeat=5)
        out.append(Round(gemm, attention, _one_layer(*steps[tiny])[0], _one_layer(*steps[x])[0]))
    return out


def layer_work(x: LayerShape) -> OpWork:
    """One layer's aten ops, forward and backward, of the GPT the rounds time, counted on meta
    tensors (planning/op_cost.py): a 4-layer step's less a 2-layer one's, halved."""
    from autoshard import autoshard
    from autoshard.models import GPT, GPTConfig
    from autoshard.planning.graph_memory import walk
    works = []
    for layers in (2, 4):
        with torch.device("meta"):
            model = GPT(GPTConfig(n_layer=layers, n_head=x.a, n_embd=x.h, vocab_size=64, block_size=x.s, dropout=0.1))
        ids = torch.zeros(x.b, x.s, dtype=torch.long)
        total = OpWork()
        for a in walk(autoshard(model, example_inputs=(ids, ids)), device="cpu").step.actions:
            total = total.add(a.work)
        works.append(total)
    two, four = works
    return four.minus(two).scaled(0.5)
