"""The `cpu` profile's collectives (autoshard/cpu_profile/__init__.py): what a gloo all-reduce, reduce-scatter,
all-gather and send of a layer's activation cost two ranks of this machine where a training step pays
them, between halves of a tensor-parallel layer's GEMMs, and the link rate and start-ups fitted to
those costs as planning/graph_time.py charges them.

    costs, small_bytes, big_bytes = gloo_costs(x, spawned)         # medians over PAIRS fresh pairs
    link, latency, startup_us = link_and_startups(costs, small_bytes, big_bytes, notes)
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from autoshard.planning.gemm_timing import GEMMS, LayerShape

__all__ = ["PAIRS", "gloo_costs", "link_and_startups"]

PAIRS = 5               # fresh process pairs measuring the collectives (their median)


def _half_layers(x: LayerShape) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """A tensor-parallel pair's forward GEMMs of one layer at x's shapes, as two halves (attention:
    qkv, scores, context, projection; MLP: the two linears), each followed by a collective in a step."""
    halves: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
    pair = LayerShape(x.b, x.s, x.h, max(2, x.a), 2)
    for name, shape, _ in GEMMS:
        m, n, k, batch = shape(pair)
        halves[name.startswith("fc")].append((torch.randn(max(1, batch), m, k), torch.randn(max(1, batch), k, n)))
    return halves


def _gloo_worker(rank: int, store: str, x: LayerShape, out) -> None:
    """Each collective's cost where a step pays it: rounds of half a tensor-parallel layer's GEMMs
    (x's shapes) and one collective of a layer's activation (x.b * x.s * x.h values), timed against
    the same rounds without it. The ranks' gloo threads share the cores with the compute, which
    makes a collective in a training step cost several times its idle ping (RESULTS.md). Measured:
    an all-reduce of that message and of a large one (the link's rate), a reduce-scatter of it, an
    all-gather into it and a send of it (gloo's reduce-scatter costs about an all-reduce, its
    all-gather and a send about half: the planner times each kind by its own)."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    # measured from a rank of a torchrun job (autoshard train --hardware cpu): this pair's store is its
    # own, not the job's agent store that torchrun's environment points to
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    # a file store: a port chosen here and bound by the children can be taken in between by another
    # process of the machine (a test suite's launches: "EADDRINUSE"), a file in a fresh folder cannot
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    halves = _half_layers(x)
    message = 2 * ((x.b * x.s * x.h + 1) // 2)                  # even: a reduce-scatter halves it
    small, big, half = torch.ones(message), torch.ones(max(2**20, 8 * message)), torch.ones(message // 2)
    kinds = {
        "all_reduce": lambda: dist.all_reduce(small),
        "all_reduce_big": lambda: dist.all_reduce(big),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(half, small),
        "all_gather": lambda: dist.all_gather_into_tensor(small, half),
        "send": (lambda: dist.send(small, 1)) if rank == 0 else (lambda: dist.recv(small, 0)),
    }

    def rounds(collective, n: int = 30) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(n):
            for a, b in halves[i % 2]:
                torch.bmm(a, b)
            if collective is not None:
                collective()
        return (time.perf_counter() - t0) / n
    costs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)          # torch 2.13 renames the *_tensor collectives
        for kind, collective in kinds.items():
            rounds(collective, 3)
            # a call's cost on this machine ranges over 3x from one round of 30 to the next: the median of 9
            costs[kind] = statistics.median([rounds(collective) - rounds(None) for _ in range(9)])
    if rank == 0:
        out.put((costs, small.numel() * 4, big.numel() * 4))
    dist.barrier()
    dist.destroy_process_group()


def _floored(value: float, floor: float, what: str, notes: list[str]) -> float:
    if value < floor:
        notes.append(f"{what} measured {value * 1e6:.3g} us, under its floor of {floor * 1e6:.3g} us; the floor is used")
        return floor
    return value


def gloo_costs(x: LayerShape, spawned, pairs: int = PAIRS) -> tuple[dict[str, float], int, int]:
    """Each collective's cost (s) measured by `pairs` fresh pairs of processes, the median per kind,
    with the two message sizes (bytes). Where the OS puts a pair's gloo threads differs from one
    launch to the next, and with it a collective's cost: one pair measured a GPT-2 layer's all-reduce
    at 0.55 ms start-up, the next at 1.39 (RESULTS.md), as the training runs' own steps vary."""
    measured = []
    for _ in range(pairs):
        with tempfile.TemporaryDirectory(prefix="autoshard-gloo-") as folder:
            measured.append(spawned(_gloo_worker, (os.path.join(folder, "store"), x), 2))
    costs = {kind: statistics.median(m[0][kind] for m in measured) for kind in measured[0][0]}
    return costs, measured[0][1], measured[0][2]


def link_and_startups(costs: dict[str, float], small_bytes: int, nbytes: int, notes: list[str]
                       ) -> tuple[float, float, tuple[tuple[str, float], ...]]:
    """gloo's link rate (bytes/s), an all-reduce's start-up (s) and every kind's start-up (us), from
    the measured costs of a layer's message (`small_bytes`) and of a large all-reduce (`nbytes`):
    cost = start-up + bytes over the link, as planning/graph_time.py charges each kind (a ring of 2
    ranks moves an all-reduce's buffer through each link once, a reduce-scatter's or all-gather's
    larger side half of it, a send its message)."""
    small = _floored(costs["all_reduce"], 1e-6, "a small all-reduce", notes)
    bulk = _floored(costs["all_reduce_big"], small + 1e-6, "a large all-reduce (beyond the small one's)", notes)
    link = (nbytes - small_bytes) / (bulk - small)
    lat = _floored(small - small_bytes / link, 1e-6, "gloo's latency", notes)
    moved = {"reduce_scatter": small_bytes / 2, "all_gather": small_bytes / 2, "send": small_bytes}
    startup = [("all_reduce", lat * 1e6)]
    for kind, nbytes_moved in moved.items():
        startup.append((kind, 1e6 * _floored(costs[kind] - nbytes_moved / link, 1e-6, f"a {kind}'s start-up", notes)))
    return link, lat, tuple(startup)
