"""A `cpu` hardware profile, measured here by short micro-benchmarks, so the cost model and planner
predict autoshard's own CPU gloo runs (one thread per rank, as torchrun sets it).

    from autoshard.cpu_profile import measure_cpu
    hw = measure_cpu(hidden=256, heads=8, seq=128, microbatch=2)      # about a minute on 2 cores, then cached
    autoshard.plan(model, gpus=2, global_batch=8, hardware=hw)

What is measured, each on the shapes given (fp32, denormals flushed as the runs do):
- GEMM rate: the layer's GEMMs (gemm_timing.GEMMS), forward and both backward products;
- attention rate: the CPU's fused attention kernel (SDPA's, causal) forward and backward on the
  layer's heads, FLOPs as torch's counter counts them;
- fixed costs: a tiny GPT's step (forward, backward, AdamW) with 2 and 4 layers through
  autoshard: half the difference is one layer's dispatch cost, the rest the step's;
- element-wise rate: the same GPT at the given shapes, one layer's forward and backward less its
  GEMMs and dispatch, against the bytes gemm_timing.ELEMENTWISE counts for that layer (fp32): an
  effective rate for the unfused CPU ops;
- AdamW seconds per parameter (a few million) and per parameter tensor (64 tiny ones);
- for step times read off a program's ops (planning/graph_time.py): the seconds per aten op (the
  tiny layer's time over its ops, counted on meta tensors by planning/op_cost.py) and the rate of
  the non-matmul ops' bytes (the layer at the given shapes less its matmuls, attention kernels
  and op overhead);
- gloo: all-reduce latency and bandwidth between 2 processes on this machine, fitted through a
  layer's activation message and a larger one, and the start-up of a reduce-scatter, an all-gather
  and a send of that message, each measured between halves of a tensor-parallel layer's GEMMs, as
  collectives run in a step.

Robustness: the GEMMs, the attention kernel, the tiny layer and the layer are timed back to back
in 7 rounds (autoshard/cpu_profile/rounds.py), each rate derived within one round and the median
over rounds taken: the machine's speed shifts for seconds at a time, and a remainder derived
across two speeds is off by twice the shift. Each collective is the median over 5 fresh process
pairs of medians of 9 rounds. benchmarks/profile_stability.py measures the profile twice and
compares 13 step predictions (RESULTS.md).
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
from autoshard.cpu_profile.cache import load_profile, profile_key, save_profile
from autoshard.cpu_profile.collectives import PAIRS, gloo_costs, link_and_startups
from autoshard.errors import require_positive_int
from autoshard.cpu_profile.rounds import ROUNDS, Round, layer_work, measure_rounds, per_layer, timed
from autoshard.planning.hardware import Hardware

__all__ = ["measure_cpu", "CPU_DEFAULTS"]

_REST_FLOOR = 0.05      # the element-wise remainder's floor, as a fraction of the layer's time
_BUSY = 0.5             # load average per core above which the machine counts as busy
_SPREAD = 0.25          # the GEMM rate's spread over the rounds above which the machine counts as unsteady

CPU_DEFAULTS = dict(sms=1, tile=(1, 1), matmul_efficiency=1.0, memory_efficiency=1.0, network_efficiency=1.0,
                    activation_bytes=4, mask_bytes=4, weight_bytes=4, grad_bytes=4, reduce_bytes=4,
                    gemm_traffic=False)


def _median_rest(rounds: list[Round], rest_of, what: str) -> tuple[float, float, str | None]:
    """(the median over rounds of `rest_of(round)`, what is left of a layer after its terms: floored
    at 5% of the median layer, 1 us at least; the median layer; a note when the floor was used)."""
    layer = statistics.median(r.layer for r in rounds)
    rest = statistics.median(rest_of(r) for r in rounds)
    floor = max(_REST_FLOOR * layer, 1e-6)     # a layer measured at 0 (4 layers no slower than 2) too
    if rest >= floor:
        return rest, layer, None
    note = (f"{what}: the layer's {layer * 1e3:.3g} ms less its terms left {rest * 1e3:.3g} ms, under the "
            f"floor of {_REST_FLOOR:.0%} of the layer (1 us at least); the floor is used")
    return floor, layer, note


def _speed_note(rounds: list[Round]) -> str | None:
    """A note when the machine's speed moved across the rounds: the GEMM rate's fastest round over
    its slowest more than 1 + _SPREAD. A shared machine does this without any load of its own (a
    single-threaded GEMM here ran 68 to 145 GFLOP/s from one second to the next, 2026-11-27); the
    medians hold against a few slow rounds, not against a machine that is slow for the whole
    measurement, which another measurement then disagrees with."""
    rates = [r.gemm_rate for r in rounds]
    if max(rates) <= (1 + _SPREAD) * min(rates):
        return None
    return (f"the machine's speed moved during the measurement (the GEMM rate {min(rates) / 1e9:.0f} to "
            f"{max(rates) / 1e9:.0f} GFLOP/s over {len(rates)} rounds)")


def _elementwise_rate(x: LayerShape, rounds: list[Round]) -> tuple[float, str | None, float]:
    """Bytes per second: ELEMENTWISE's bytes for one layer (fp32) / what is left of the layer's time
    after its GEMMs (at the round's rate) and its dispatch (the round's tiny layer). Unfused on the
    CPU, a layer moves more than the table's fused kernels count (copies for the attention's
    batched products, separate bias, scale and mask ops): the rate is an effective one, for these
    shapes. With it, a note when the remainder fell under its floor, and the layer's seconds."""
    flops = sum(3 * 2 * b * m * n * k for m, n, k, b in (shape(x) for _, shape, _ in GEMMS))
    rest, layer, note = _median_rest(rounds, lambda r: r.layer - flops / r.gemm_rate - r.tiny_layer,
                                     "element-wise rate")
    return sum(layer_elementwise_bytes(x, activation_bytes=4)) / rest, note, layer


def _op_rates(x: LayerShape, tiny: LayerShape, rounds: list[Round]) -> tuple[float, float, str | None]:
    """(seconds per aten op, bytes per second of the non-matmul ops) for planning/graph_time.py: the
    tiny layer's time over its op count; what is left of the layer at x after its matmuls, attention
    kernels and ops' overhead (each at its round's rates), over the bytes its other ops move. With
    a note when that remainder fell under its floor."""
    tiny_ops, work = layer_work(tiny).ops, layer_work(x)

    def rest_of(r: Round) -> float:
        return (r.layer - work.matmul_flops / r.gemm_rate - work.attention_flops / r.attention_rate
                - work.ops * r.tiny_layer / tiny_ops)
    rest, _, note = _median_rest(rounds, rest_of, "op-bytes rate")
    return statistics.median(r.tiny_layer for r in rounds) / tiny_ops, work.other_bytes / rest, note


def _adam_costs(n: int = 4_000_000, small: int = 64) -> tuple[float, float]:
    """(seconds per parameter, seconds per parameter tensor) of AdamW.step."""
    def seconds(count: int, size: int) -> float:
        params = [torch.nn.Parameter(torch.randn(size)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p)
        return timed(torch.optim.AdamW(params).step)
    per_tensor = seconds(small, 16) / small
    return max((seconds(8, n // 8) - 8 * per_tensor) / n, 0.0), per_tensor


def _local_worker(x: LayerShape, n_rounds: int, out) -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    tiny = LayerShape(1, 8, 16, 2, 1)
    dispatch, step = per_layer(tiny, rounds=n_rounds, with_optimizer=True)
    rounds = measure_rounds(x, tiny, rounds=n_rounds)
    gemm = statistics.median(r.gemm_rate for r in rounds)
    attention = statistics.median(r.attention_rate for r in rounds)
    elementwise, note, layer = _elementwise_rate(x, rounds)
    op_overhead, op_bytes, op_note = _op_rates(x, tiny, rounds)
    notes = "; ".join(n for n in (note, op_note, _speed_note(rounds)) if n) or None
    out.put((gemm, attention, elementwise, notes, dispatch, step, *_adam_costs(), op_overhead, op_bytes))


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
                name: str = "cpu", cache: bool = True, rounds: int = ROUNDS, pairs: int = PAIRS) -> Hardware:
    """The profile of this machine for a model of these shapes (see the module docstring); measured
    in spawned processes, one thread each, in 30-60 s on 2 cores. With `cache`, a profile
    measured before on this machine for these arguments is read back instead
    (autoshard/cpu_profile/cache.py), and a new one stored. Warns when the machine was busy as it
    started (load average over half the cores) or a value fell under its floor, and again each
    time such a profile is read back: it is unreliable (measure it again on a quiet machine:
    delete the stored file). `rounds` (compute) and `pairs` (process pairs timing the collectives):
    fewer measure faster and hold less well on a machine whose speed moves."""
    require_positive_int("rounds", rounds)
    require_positive_int("pairs", pairs)
    key = profile_key(hidden=hidden, heads=heads, seq=seq, microbatch=microbatch, memory_gib=memory_gib, name=name,
                      rounds=rounds, pairs=pairs)
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
    gemm, attention, elementwise, note, layer, step, adam, adam_tensor, op_overhead, op_bytes = \
        _spawned(_local_worker, (x, rounds), 1)
    notes += [note] if note else []
    costs, small_bytes, nbytes = gloo_costs(x, _spawned, pairs)
    link, lat, startup = link_and_startups(costs, small_bytes, nbytes, notes)
    if memory_gib is None:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    hw = Hardware(name, peak_tflops=gemm / 1e12, hbm_gb_s=elementwise / 1e9, memory_gib=memory_gib,
                  gpus_per_node=os.cpu_count() or 1, nvlink_gb_s=link / 1e9, network_gb_s=link / 1e9,
                  latency_us=lat * 1e6, layer_overhead_s=layer, step_overhead_s=step,
                  cores=os.cpu_count() or 1, optimizer_s_per_param=adam,
                  optimizer_s_per_tensor=adam_tensor, op_overhead_s=op_overhead, op_bytes_gb_s=op_bytes / 1e9,
                  startup_us=startup, attention_tflops=attention / 1e12, **CPU_DEFAULTS)
    seconds = time.perf_counter() - t0
    where = f"; stored in {save_profile(key, hw, seconds, notes)}" if cache else ""
    print(f"autoshard: measured the {name} profile in {seconds:.0f} s{where}", file=sys.stderr, flush=True)
    if notes:
        warnings.warn("the measured cpu profile may be off: " + "; ".join(notes), stacklevel=2)
    return hw
