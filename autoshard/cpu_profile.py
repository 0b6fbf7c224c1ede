"""A `cpu` hardware profile, measured here by short micro-benchmarks, so the cost model and planner
predict autoshard's own CPU gloo runs (one thread per rank, as torchrun sets it).

    from autoshard.cpu_profile import measure_cpu
    hw = measure_cpu(hidden=256, heads=8, seq=128, microbatch=2)      # about a minute on 2 cores, then cached
    autoshard.plan(model, gpus=2, global_batch=8, hardware=hw)

What is measured, each on the shapes given (fp32, denormals flushed as the runs do):
- GEMM rate: the layer's GEMMs (gemm_timing.GEMMS), forward and both backward products;
- fixed costs: a tiny GPT's step (forward, backward, AdamW) with 2 and 4 layers through
  autoshard: half the difference is one layer's dispatch cost, the rest the step's;
- element-wise rate: the same GPT at the given shapes, one layer's forward and backward less its
  GEMMs and dispatch, against the bytes gemm_timing.ELEMENTWISE counts for that layer (fp32): an
  effective rate for the unfused CPU ops;
- AdamW seconds per parameter (a few million) and per parameter tensor (64 tiny ones);
- for step times read off a program's ops (planning/graph_time.py): the seconds per aten op (the
  tiny layer's time over its ops, counted on meta tensors by planning/op_cost.py) and the rate of
  the non-matmul ops' bytes (the layer at the given shapes less its matmuls and op overhead);
- gloo: all-reduce latency and bandwidth between 2 processes on this machine, fitted through a
  layer's activation message and a larger one, and the start-up of a reduce-scatter, an all-gather
  and a send of that message, each measured between halves of a tensor-parallel layer's GEMMs, as
  collectives run in a step.

Robustness: a layer's time is the median over 7 alternating rounds of the 2- and 4-layer steps,
each GEMM the median of 15 runs, each collective the median over 5 fresh process pairs of medians
of 9 rounds. Measured twice, the profiles moved 13 step predictions by at most about 10%
(benchmarks/profile_stability.py; RESULTS.md).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

import torch
import torch.multiprocessing as mp

from autoshard.planning.gemm_timing import GEMMS, LayerShape, layer_elementwise_bytes
from autoshard.cpu_profile_cache import load_profile, profile_key, save_profile
from autoshard.cpu_profile_collectives import gloo_costs, link_and_startups
from autoshard.planning.hardware import Hardware
from autoshard.planning.op_cost import OpWork

__all__ = ["measure_cpu", "CPU_DEFAULTS"]

_REST_FLOOR = 0.05      # the element-wise remainder's floor, as a fraction of the layer's time
_BUSY = 0.5             # load average per core above which the machine counts as busy

CPU_DEFAULTS = dict(sms=1, tile=(1, 1), matmul_efficiency=1.0, memory_efficiency=1.0, network_efficiency=1.0,
                    activation_bytes=4, mask_bytes=4, weight_bytes=4, grad_bytes=4, reduce_bytes=4,
                    gemm_traffic=False)


def _timed(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gemm_rate(x: LayerShape) -> float:
    """FLOP/s of the layer's GEMMs, forward and backward, in the layouts a linear layer uses: y = x W^T
    (W stored [out, in]), dx = dy W, dW = dy^T x."""
    flops, seconds = 0.0, 0.0
    for _, shape, _ in GEMMS:
        m, n, k, batch = shape(x)
        xs, w, dy = torch.randn(batch, m, k), torch.randn(batch, n, k), torch.randn(batch, m, n)
        for a, b in ((xs, w.transpose(1, 2)), (dy, w), (dy.transpose(1, 2), xs)):
            seconds += _timed(lambda: torch.bmm(a, b) if batch > 1 else torch.mm(a[0], b[0]), repeat=15)
        flops += 3 * 2 * batch * m * n * k
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


def _per_layer(x: LayerShape, rounds: int = 7, **kw) -> tuple[float, float]:
    """(one layer's seconds, the rest's): a 4-layer step against a 2-layer one, timed in `rounds`
    alternating rounds, the median of each round's difference. One pair of medians moved the
    element-wise remainder by 2x between two measurements of the same machine (RESULTS.md): the
    layer is a difference of two noisy times, and what is left of it after the matmuls a smaller one."""
    two, four = _layer_step(x, 2, **kw), _layer_step(x, 4, **kw)
    layers, rests = [], []
    for _ in range(rounds):
        t2, t4 = _timed(two), _timed(four)
        layer = max(0.0, (t4 - t2) / 2)
        layers.append(layer)
        rests.append(max(0.0, t2 - 2 * layer))
    return statistics.median(layers), statistics.median(rests)


def _elementwise_rate(x: LayerShape, gemm_rate: float, dispatch: float) -> tuple[float, str | None, float]:
    """Bytes per second: ELEMENTWISE's bytes for one layer (fp32) / the layer's measured time less its
    GEMMs (at the measured rate) and its dispatch cost. Unfused on the CPU, a layer moves more than
    the table's fused kernels count (copies for the attention's batched products, separate bias,
    scale and mask ops): the rate is an effective one, for these shapes. With it, a note when the
    remainder fell under its floor, and the layer's seconds."""
    layer, _ = _per_layer(x)
    flops = sum(3 * 2 * b * m * n * k for m, n, k, b in (shape(x) for _, shape, _ in GEMMS))
    rest = layer - flops / gemm_rate - dispatch
    floor = max(_REST_FLOOR * layer, 1e-6)     # a layer measured at 0 (4 layers no slower than 2) too
    note = None
    if rest < floor:        # the remainder is lost in the noise of its three terms: say so
        note = (f"element-wise rate: the layer's {layer * 1e3:.3g} ms less its GEMMs and dispatch left "
                f"{rest * 1e3:.3g} ms, under the floor of {_REST_FLOOR:.0%} of the layer (1 us at least); "
                "the floor is used")
        rest = floor
    return sum(layer_elementwise_bytes(x, activation_bytes=4)) / rest, note, layer


def _layer_work(x: LayerShape) -> OpWork:
    """One layer's aten ops, forward and backward, of the GPT `_layer_step` times, counted on meta
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
    return OpWork(*((getattr(four, f) - getattr(two, f)) / 2 for f in ("matmul_flops", "matmul_bytes", "other_bytes", "ops")))


def _op_rates(x: LayerShape, tiny: LayerShape, layer: float, tiny_layer: float, gemm_rate: float
              ) -> tuple[float, float, str | None]:
    """(seconds per aten op, bytes per second of the non-matmul ops) for planning/graph_time.py: a
    tiny layer's time over its op count; the layer's time at x less its matmuls and ops' overhead,
    over the bytes its other ops move. With a note when that remainder fell under its floor."""
    per_op = tiny_layer / _layer_work(tiny).ops
    work = _layer_work(x)
    rest = layer - work.matmul_flops / gemm_rate - work.ops * per_op
    floor, note = max(_REST_FLOOR * layer, 1e-6), None
    if rest < floor:
        note = (f"op-bytes rate: the layer's {layer * 1e3:.3g} ms less its matmuls and op overhead left "
                f"{rest * 1e3:.3g} ms, under the floor of {_REST_FLOOR:.0%} of the layer; the floor is used")
        rest = floor
    return per_op, work.other_bytes / rest, note


def _adam_costs(n: int = 4_000_000, small: int = 64) -> tuple[float, float]:
    """(seconds per parameter, seconds per parameter tensor) of AdamW.step."""
    def seconds(count: int, size: int) -> float:
        params = [torch.nn.Parameter(torch.randn(size)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p)
        return _timed(torch.optim.AdamW(params).step)
    per_tensor = seconds(small, 16) / small
    return max((seconds(8, n // 8) - 8 * per_tensor) / n, 0.0), per_tensor


def _local_worker(x: LayerShape, out) -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    tiny = LayerShape(1, 8, 16, 2, 1)
    dispatch, step = _per_layer(tiny, with_optimizer=True)
    gemm = _gemm_rate(x)
    dispatch_fb, _ = _per_layer(tiny)        # forward and backward only
    elementwise, note, layer = _elementwise_rate(x, gemm, dispatch_fb)
    op_overhead, op_bytes, op_note = _op_rates(x, tiny, layer, dispatch_fb, gemm)
    out.put((gemm, elementwise, note, dispatch, step, *_adam_costs(), op_overhead, op_bytes, op_note))


def _spawned(target, args: tuple, n: int) -> tuple:
    """Run `target(rank?, *args, queue)` in `n` fresh processes (this process's threads, denormal mode
    and process group untouched); rank 0's result. A spawned child re-imports the caller's main
    module: a script calling this needs the `if __name__ == "__main__":` guard."""
    import queue
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=((r,) if n > 1 else ()) + args + (out,)) for r in range(n)]
    for p in procs:
        p.start()
    while True:
        try:
            got = out.get(timeout=1)
            break
        except queue.Empty:
            codes = [p.exitcode for p in procs]
            if any(c not in (None, 0) for c in codes) or all(c is not None for c in codes):
                raise RuntimeError(f"the measurement's processes ended without a result (exit codes {codes})") from None
    for p in procs:
        p.join()
    return got


def measure_cpu(*, hidden: int, heads: int, seq: int, microbatch: int, memory_gib: float | None = None,
                name: str = "cpu", cache: bool = True) -> Hardware:
    """The profile of this machine for a model of these shapes (see the module docstring); measured
    in spawned processes, one thread each, in 30-60 s on 2 cores. With `cache`, a profile
    measured before on this machine for these arguments is read back instead
    (autoshard/cpu_profile_cache.py), and a new one stored. Warns when the machine was busy as it
    started (load average over half the cores) or a value fell under its floor, and again each
    time such a profile is read back: it is unreliable (measure it again on a quiet machine:
    delete the stored file)."""
    key = profile_key(hidden=hidden, heads=heads, seq=seq, microbatch=microbatch, memory_gib=memory_gib, name=name)
    if cache and (found := load_profile(key)) is not None:
        hw, _, notes = found
        if notes:
            warnings.warn("the stored cpu profile may be off: " + "; ".join(notes), stacklevel=2)
        return hw
    notes: list[str] = []
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > _BUSY * cores:
        notes.append(f"the machine was busy as the measurement started (load average {load:.1f} on {cores} cores)")
    t0 = time.perf_counter()
    x = LayerShape(microbatch, seq, hidden, heads, 1)
    gemm, elementwise, note, layer, step, adam, adam_tensor, op_overhead, op_bytes, op_note = \
        _spawned(_local_worker, (x,), 1)
    notes += [n for n in (note, op_note) if n]
    costs, small_bytes, nbytes = gloo_costs(x, _spawned)
    link, lat, startup = link_and_startups(costs, small_bytes, nbytes, notes)
    if memory_gib is None:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    hw = Hardware(name, peak_tflops=gemm / 1e12, hbm_gb_s=elementwise / 1e9, memory_gib=memory_gib,
                  gpus_per_node=os.cpu_count() or 1, nvlink_gb_s=link / 1e9, network_gb_s=link / 1e9,
                  latency_us=lat * 1e6, layer_overhead_s=layer, step_overhead_s=step,
                  cores=os.cpu_count() or 1, optimizer_s_per_param=adam,
                  optimizer_s_per_tensor=adam_tensor, op_overhead_s=op_overhead, op_bytes_gb_s=op_bytes / 1e9,
                  startup_us=startup, **CPU_DEFAULTS)
    seconds = time.perf_counter() - t0
    where = f"; stored in {save_profile(key, hw, seconds, notes)}" if cache else ""
    print(f"autoshard: measured the {name} profile in {seconds:.0f} s{where}", file=sys.stderr, flush=True)
    if notes:
        warnings.warn("the measured cpu profile may be off: " + "; ".join(notes), stacklevel=2)
    return hw
