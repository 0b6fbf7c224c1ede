"""ShardedProgram: the result of `autoshard()`: per-rank programs, simulation and reassembly."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from tabulate import tabulate
from torch import nn

from .capture import Captured, InputBinder, capture, fetch_attr
from .collectives import write_rows
from .errors import ShardingError
from .mesh import MeshGroups, ParallelDims
from .passes.annotate import ShardingPlan, ShardOptions, annotate
from .passes.fuse import fuse
from .passes.index_sets import is_partition
from .passes.partition import StageGraph, split_stages
from .passes.retarget import retarget_device
from .passes.rewrite import RankGraph, rewrite_rank
from .pipeline import PipelineRuntime
from .rank import RankProgram, assign_attr
from .schedules import bubble_fraction, check, make_schedule
from .new_signature import new_plan_refusal, sharding_clash
from .simulate import join_replicated, run_lockstep
from .weights import WeightSource, check_state_dict, copy_into_rank, meta_like, rank_slice

__all__ = ["ShardedProgram"]


@dataclass
class _Compiled:
    captured: Captured
    plan: ShardingPlan


class ShardedProgram:
    """Per-rank programs for one model over a tp x pp x dp mesh (see `autoshard`)."""

    def __init__(self, model: nn.Module, tp: int, named_inputs: dict[str, object],
                 options: ShardOptions | None = None, *, pp: int = 1, dp: int = 1, virtual: int = 1,
                 microbatches: int = 1, schedule: str | None = None):
        self.tp, self.options = tp, options or ShardOptions()
        self._source = WeightSource(model)
        self.model_name = type(model).__name__
        self.param_shapes: dict[str, torch.Size] = {n: p.shape for n, p in model.named_parameters()}
        self.param_aliases: dict[str, list[str]] = {}        # parameter -> every name it has (tied weights)
        by_id: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            self.param_aliases.setdefault(by_id.setdefault(id(p), n), []).append(n)
        self._names_with_ties = {n for names in self.param_aliases.values() for n in names}
        self._bind = InputBinder.of(model)
        self.dims = ParallelDims(tp, pp, dp)
        self.virtual, self.microbatches = virtual, microbatches
        self.schedule_name = schedule or ("interleaved" if virtual > 1 else "1f1b")
        if virtual > 1 and pp == 1:
            raise ShardingError(f"virtual={virtual} chunks per rank need pp > 1")
        self.schedule = make_schedule(self.schedule_name, pp, virtual, microbatches)
        check(self.schedule, virtual, microbatches)     # complete and deadlock-free, or it raises
        self.estimate = None    # the planner's Estimate when autoshard chose the split (world_size=)
        self.example_inputs = named_inputs
        self._seed = 0
        self._training = model.training     # the ranks' mode: they start in the model's
        self._ranks: dict[int, RankProgram] = {}
        self._compiled: list[_Compiled] = []
        self._stages: dict[int, tuple[fx.GraphModule, list[StageGraph]]] = {}   # id(rank graph) -> split
        self._sim_modules: dict[int, list[fx.GraphModule]] = {}
        self._weights: dict[tuple[str, int], torch.Tensor | float] = {}
        self._compile(named_inputs)
        self._rank0: RankGraph | None = self._rank_graph(self._compiled[0], 0)   # rank 0's code, no weights cut
        self._graph0 = self._rank0.graph
        self._find_shared_params()

    @property
    def model(self) -> nn.Module:
        """The single-device model this program was compiled from (held weakly after distributed())."""
        return self._source.model

    # ---- compile -----------------------------------------------------------------------------
    def _compile(self, named: dict[str, object], training: bool | None = None) -> _Compiled:
        model, device = self._source.for_capture()
        cap = capture(model, named, dynamic=not self.options.sequence_parallel, training=training)
        if device is not None:       # traced from the released model's meta skeleton
            retarget_device(cap.gm, device)
        plan = annotate(cap.gm, self.tp, cap.param_names, self.options)   # analysis: writes node.meta
        if self._compiled:
            first = self._compiled[0]
            clash = sharding_clash(first.captured, first.plan, cap, plan)
            if clash is not None:
                raise ShardingError(new_plan_refusal(named, self.example_inputs, self.plan, plan, clash))
        entry = _Compiled(cap, plan)
        self._compiled.append(entry)
        for rank in self._ranks.values():
            self._add_graph(rank, entry)
        return entry

    @property
    def plan(self) -> ShardingPlan:
        return self._compiled[0].plan

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def dp(self) -> int:
        return self.dims.dp

    # ---- pipeline stages ---------------------------------------------------------------------
    def stage_graphs(self, gm: fx.GraphModule | fx.Graph) -> list[StageGraph]:
        """The pp * virtual stage graphs cut from one rank graph `gm` (cached)."""
        if id(gm) not in self._stages:
            is_f = lambda n: n.op == "call_module" and n.target == "f"     # noqa: E731  (identity forward)
            self._stages[id(gm)] = (gm, split_stages(gm, self.pp * self.virtual, self._names_with_ties, late=is_f))
        return self._stages[id(gm)][1]

    def stage_modules(self, tp_rank: int = 0) -> list[fx.GraphModule]:
        """Tensor-parallel rank `tp_rank`'s program cut into stages (example inputs' graph): one module
        per stage, stage s running on pipeline rank s % pp as its chunk s // pp; print `.code`."""
        rank = self.rank(tp_rank)
        return [fx.GraphModule(rank, sg.graph, class_name=f"Stage{sg.index}")
                for sg in self.stage_graphs(rank.graph_module)]

    def _find_shared_params(self) -> None:
        """Parameters that stages on several pipeline ranks read (tied embeddings)."""
        holders: dict[str, set[int]] = {}
        for sg in self.stage_graphs(self._graph0):
            for n in sg.graph.nodes:
                if n.op == "get_attr":
                    holders.setdefault(n.target, set()).add(sg.index % self.pp)
        self.shared_params: dict[tuple[int, ...], list[str]] = {}
        self.param_holders: dict[str, set[int]] = holders      # parameter -> pipeline ranks reading it
        for name, h in holders.items():
            if len(h) > 1:
                self.shared_params.setdefault(tuple(sorted(h)), []).append(name)

    def param_weight(self, name: str, tp_rank: int) -> torch.Tensor | float:
        """The share of a parameter's local gradient rank `tp_rank` counts in the global norm:
        1 / (ranks holding the same element), per row for sharded parameters (cached: clipping
        asks on every step)."""
        if (name, tp_rank) not in self._weights:
            self._weights[(name, tp_rank)] = self._param_weight(name, tp_rank)
        return self._weights[(name, tp_rank)]

    def _param_weight(self, name: str, tp_rank: int) -> torch.Tensor | float:
        share = 1.0 / len(self.param_holders.get(name, (0,)))
        use = self.plan.params.get(name)
        if use is None:
            return share / self.tp
        rows = [i for a, b in use.layout[tp_rank] for i in range(a, b)]
        held = torch.zeros(max(b for rs in use.layout for _, b in rs))
        for ranges in use.layout:
            for a, b in ranges:
                held[a:b] += 1
        weight = share / held[rows]
        shape = [1] * len(self.param_shapes[name])
        shape[use.dim] = len(rows)
        return weight.view(shape)

    def _rank_graph(self, entry: _Compiled, r: int) -> RankGraph:
        cap = entry.captured
        k = self._compiled.index(entry)
        rg = rewrite_rank(cap.gm, entry.plan, cap.param_names, r, f"_s{k}" if k else "")   # rewrite
        if self.options.fuse:        # after the rewrite: fused ops see the shards and the collectives
            fuse(rg.graph, lambda target: fetch_attr(cap.gm, target), captured=cap.gm.graph, modules=rg.modules)
        return rg

    def _add_graph(self, rank: RankProgram, entry: _Compiled) -> None:
        cap = entry.captured
        if rank.rank == 0 and entry is self._compiled[0] and self._rank0 is not None:
            rg, self._rank0 = self._rank0, None      # rewritten at compile time already: not twice
        else:
            rg = self._rank_graph(entry, rank.rank)
        attrs: dict[str, object] = dict(rg.restrict_buffers)
        for n in cap.gm.graph.nodes:
            if n.op in ("get_attr", "call_module") and n.target not in cap.param_names and n.target not in attrs:
                obj = cap.gm.get_submodule(n.target) if n.op == "call_module" else fetch_attr(cap.gm, n.target)
                attrs[n.target] = obj.detach().clone() if isinstance(obj, torch.Tensor) else obj
        rank.add_graph(cap.signature, rg.graph, attrs, rg.modules, cap.out_spec)

    # ---- ranks -------------------------------------------------------------------------------
    def rank(self, r: int) -> RankProgram:
        """Rank r's module: its parameter shards and its graph(s); `.code` prints them."""
        if not 0 <= r < self.tp:
            raise IndexError(f"rank {r} out of range for world size {self.tp}")
        if r not in self._ranks:
            full = self._source.tensors(cut=sorted(self._ranks))     # one state of the model for every rank
            trainable = {name: p.requires_grad for name, p in self.model.named_parameters()}
            params = {name: nn.Parameter(rank_slice(full[name], self.plan.params.get(name), r).clone(),
                                         requires_grad=grad) for name, grad in trainable.items()}
            rank = RankProgram(r, self.tp, params, self._bind)
            rank.train(self._training)
            rank.rng.manual_seed(self._seed)
            object.__setattr__(rank, "_compile_for", self._compile)
            for entry in self._compiled:
                self._add_graph(rank, entry)
            copy_into_rank(rank, self.plan.params, {n: t for n, t in full.items() if n not in params})   # buffers
            self._ranks[r] = rank
            if len(self._ranks) == self.tp:
                self._source.all_cut()
        return self._ranks[r]

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load full-size weights (the model's own names, as `model.state_dict()` gives them) into
        every rank: the ranks built so far get their shards copied in, and ranks built later are
        cut from `state_dict` (held by reference until then). strict: every parameter must be
        given and every given name must be a parameter or buffer of the model."""
        state_dict = dict(state_dict)
        for name, aliases in self.param_aliases.items():     # a tied weight given under another of its names
            given = next((a for a in aliases if a in state_dict), None)
            if name not in state_dict and given is not None:
                state_dict[name] = state_dict[given]
        check_state_dict(state_dict, self.param_shapes, self._names_with_ties | self._source.buffer_names(), strict)
        for rank in self._ranks.values():
            copy_into_rank(rank, self.plan.params, state_dict)
        self._source.load(state_dict, all_cut=len(self._ranks) == self.tp)

    def ranks(self) -> list[RankProgram]:
        return [self.rank(r) for r in range(self.tp)]

    def train(self, mode: bool = True) -> "ShardedProgram":
        """Put every rank (those built later too) in training (`mode=True`) or evaluation mode, as
        `model.train(mode)` does: dropout and batch norm follow, each mode with its own graph
        (captured in that mode the first time a call needs it)."""
        self._training = mode
        for rank in self._ranks.values():
            rank.train(mode)
        return self

    def eval(self) -> "ShardedProgram":
        return self.train(False)

    def manual_seed(self, seed: int) -> None:
        """Seed every rank's dropout generators: same masks outside tensor-parallel regions on every
        rank, a different stream per rank inside them; the same seed gives the same masks again."""
        for rank in self._ranks.values():
            rank.rng.manual_seed(seed)
        self._seed = seed

    def distributed(self, group: dist.ProcessGroup | None = None) -> RankProgram | PipelineRuntime:
        """This process's part of the program (inside torchrun).

        tp only: rank module called like the model, its collectives on `group` (default: WORLD).
        With pp, dp or microbatches > 1: a `PipelineRuntime` for the WORLD group, whose
        `train_step(batch..., labels=...)` runs the schedule and returns the loss.
        """
        size = dist.get_world_size(group)
        if size != self.world_size:
            raise ShardingError(f"the process group has {size} ranks but the program was built for "
                                f"tp={self.tp} x pp={self.pp} x dp={self.dp} = {self.world_size}")
        if self.world_size == self.tp and self.microbatches == 1:
            mine = self.rank(dist.get_rank(group)).bind(group)
            self._release()
            return mine
        if group is not None and group is not dist.group.WORLD:
            raise ShardingError("a pipeline or data-parallel program runs on the WORLD group")
        rank = dist.get_rank()
        groups = MeshGroups(self.dims, rank, list(self.shared_params))
        runtime = PipelineRuntime(self, rank, groups, self.schedule)
        self._release()
        return runtime

    def _release(self) -> None:
        """This process's rank is cut: hold nothing more of the model's weights (the captured
        graphs' copies of them become meta tensors; the model itself is held weakly)."""
        self._source.release()
        for entry in self._compiled:
            gm = entry.captured.gm
            for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
                if not t.is_meta:
                    assign_attr(gm, name, meta_like(t))

    # ---- simulation and reassembly -----------------------------------------------------------
    def simulate(self, *args, **kwargs):
        """Run all ranks in this process; returns what `model(*args, **kwargs)` returns.

        Outputs are replicated, so every rank holds the same values; a loss computed from the result
        back-propagates into every rank, as each rank's own loss does under torch.distributed.
        """
        outs, out_spec = self._run_all(args, kwargs)
        return pytree.tree_unflatten([join_replicated(list(leaf)) for leaf in zip(*outs)], out_spec)

    def simulate_all(self, *args, **kwargs) -> list[object]:
        """Every rank's own output, unjoined (for checking that the copies agree)."""
        outs, out_spec = self._run_all(args, kwargs)
        return [pytree.tree_unflatten(list(o), out_spec) for o in outs]

    def _run_all(self, args: tuple, kwargs: dict):
        picked = [rank.graph_for(args, kwargs) for rank in self.ranks()]
        flat, out_spec = picked[0][1], picked[0][2]
        if self.pp * self.virtual == 1:
            return run_lockstep([p[0] for p in picked], flat), out_spec
        carried: list[list[object]] = [[] for _ in picked]     # each tp rank's values between stages
        stage_gms = [self._sim_stages(rank, gm) for rank, (gm, _, _) in zip(self.ranks(), picked)]
        for s in range(self.pp * self.virtual):
            carried = run_lockstep([gms[s] for gms in stage_gms], [list(flat) + list(c) for c in carried], per_rank=True)
        return carried, out_spec

    def _sim_stages(self, rank: RankProgram, gm: fx.GraphModule) -> list[fx.GraphModule]:
        if id(gm) not in self._sim_modules:
            self._sim_modules[id(gm)] = [fx.GraphModule(rank, sg.graph, class_name=f"Stage{sg.index}")
                                         for sg in self.stage_graphs(gm)]
        return self._sim_modules[id(gm)]

    def _assemble(self, read) -> dict[str, torch.Tensor | None]:
        out = {}
        for name, shape in self.param_shapes.items():
            locals_ = [read(dict(rank.named_parameters())[name]) for rank in self.ranks()]
            use = self.plan.params.get(name)
            if any(t is None for t in locals_):
                out[name] = None
            elif use is None:
                out[name] = locals_[0]
            else:
                padded = list(shape)
                padded[use.dim] = use.padded or shape[use.dim]
                full = locals_[0].new_zeros(padded)
                for t, ranges in zip(locals_, use.layout):     # rows held twice are equal: copy, not add
                    write_rows(full, t, use.dim, ranges)
                out[name] = full.narrow(use.dim, 0, shape[use.dim])
        return out

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Gradients reassembled to full shapes, keyed by the model's own parameter names."""
        return self._assemble(lambda p: None if p.grad is None else p.grad.detach())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters reassembled to full shapes, keyed by the model's own parameter names."""
        return self._assemble(lambda p: p.detach())

    # ---- printing ----------------------------------------------------------------------------
    def __str__(self) -> str:
        rows = []
        for name, shape in self.param_shapes.items():
            p = torch.empty(shape, device="meta")
            use = self.plan.params.get(name)
            where = [",".join(map(str, sorted(self.param_holders.get(name, ()))))] if self.pp > 1 else []
            if use is None:
                rows.append([name, tuple(p.shape), "replicated", tuple(p.shape), *where])
                continue
            local = list(p.shape)
            local[use.dim] = sum(b - a for a, b in use.layout[0])
            kind = "split" if is_partition(use.layout, use.padded or p.shape[use.dim]) else "shared rows"
            rows.append([name, tuple(p.shape), f"{kind} dim {use.dim}", tuple(local), *where])
        head = (f"autoshard program: tp={self.tp} x pp={self.pp} x dp={self.dp}, world size {self.world_size}")
        headers = ["parameter", "full shape", "sharding", "per-rank shape"] + (["pipeline ranks"] if self.pp > 1 else [])
        table = tabulate(rows, headers=headers)
        gm = self._graph0
        counts = {k: sum(1 for n in gm.nodes if n.op == "call_module" and n.target.startswith(k))
                  for k in ("f", "g", "sync_")}
        notes = [f"collectives per rank per step: {counts['f']} f (all-reduce in backward), {counts['g']} g "
                 f"(all-reduce in forward), {counts['sync_']} replica gradient syncs"]
        notes += [f"fallback (replicated): {', '.join(f.modules)}: {f.reason}" for f in self.plan.fallbacks]
        notes += [f"not sharded: {s}" for s in self.plan.skipped]
        if self.pp * self.virtual > 1:
            timeline = check(self.schedule, self.virtual, self.microbatches)
            notes.append(f"pipeline: {self.schedule_name} schedule, {self.virtual} chunk(s) per rank, "
                         f"{self.microbatches} microbatches, bubble {bubble_fraction(timeline):.3f} of ideal time")
            for sg in self.stage_graphs(gm):
                notes.append(f"  stage {sg.index} (pipeline rank {sg.index % self.pp}, chunk {sg.index // self.pp}): "
                             f"layers {sg.layers.start}-{sg.layers.stop - 1}, receives {sg.receives or '-'}")
        return "\n".join([head, table, *notes])

    __repr__ = __str__

