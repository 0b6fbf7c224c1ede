"""ShardedProgram: what `autoshard()` returns. It holds the compile's results and offers the user's
methods, each delegating to the part that owns it: the compiler (new signatures), the cut ranks
(compile/cut_ranks.py, from the weight source), the stage layout (pipeline stages), the simulator,
reassembly and printing."""
from __future__ import annotations

import copy
from typing import Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from autoshard.compile.capture import InputBinder
from autoshard.compile.compiler import Compiled, Compiler
from autoshard.compile.cut_ranks import CutRanks, building, experts_per_rank
from autoshard.compile.describe import describe
from autoshard.compile.data_replicas import DataReplicas
from autoshard.compile.norm_weights import NormWeights
from autoshard.compile.rank import RankProgram
from autoshard.compile.reassemble import assemble
from autoshard.compile.simulate import ProgramSimulator, join_replicated
from autoshard.compile.stage_layout import StageLayout
from autoshard.compile.weights import check_state_dict, copy_into_rank, meta_like
from autoshard.errors import ShardingError
from autoshard.module_paths import assign_attr, fetch_attr
from autoshard.passes.rewrite.rank_rewrite import RankGraph
from autoshard.passes.sharding.annotate import ShardingPlan
from autoshard.passes.stages import StageGraph
from autoshard.runtime.executor import MeshRuntime
from autoshard.runtime.local_mesh import LocalMesh
from autoshard.runtime.mesh import MeshGroups, ParallelDims
from autoshard.runtime.schedules import Action, schedule_spec
from autoshard.world import Group, World, current

__all__ = ["ShardedProgram"]


class ShardedProgram:
    """Per-rank programs for one model over a tp x pp x dp mesh (see `autoshard`)."""

    def __init__(self, compiler: Compiler, rank0: RankGraph, stages: StageLayout, dims: ParallelDims, *,
                 model: nn.Module, example_inputs: dict[str, object], virtual: int, microbatches: int,
                 schedule_name: str, schedule: list[list[Action]], schedule_choice: object | None = None):
        self._compiler, self._source = compiler, compiler.source
        self.tp, self.dims, self.virtual, self.microbatches = compiler.tp, dims, virtual, microbatches
        self.options, self.fuse, self.recompute = compiler.options, compiler.fuse, compiler.recompute
        # precision="fp8": the recipe and each linear weight -> None (FP8) or why it stays in the model's dtype
        self.fp8 = None if compiler.fp8 is None else (compiler.fp8.recipe, compiler.fp8_table(compiler.compiled[0]))
        self.schedule_name, self.schedule = schedule_name, schedule
        # schedule="auto": planning/schedule_choice.py's ScheduleChoice, what was weighed and why this one
        # (typed loosely: compile does not import planning)
        self.schedule_choice = schedule_choice
        self.placement = schedule_spec(schedule_name).placement     # where each stage lives (pipeline_actions.py)
        self.example_inputs = example_inputs
        self.model_name = type(model).__name__
        self.param_shapes: dict[str, torch.Size] = {n: p.shape for n, p in model.named_parameters()}
        self.param_aliases: dict[str, list[str]] = {}        # parameter -> every name it has (tied weights)
        by_id: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            self.param_aliases.setdefault(by_id.setdefault(id(p), n), []).append(n)
        self._bind = InputBinder.of(model)
        self.zero = 1           # what DistributedOptimizer divides over dp by default (autoshard's `zero`)
        self.planned = None     # the planner's Estimate when autoshard chose the split (world_size=)
        self.planned_memory = None      # then each pipeline rank's peak read off its graphs (planning/graph_fit.py)
        self.planned_seconds = None     # and its step's seconds read off them
        self._seed = 0
        self._training = model.training     # the ranks' mode: they start in the model's
        self._rank0: RankGraph | None = rank0     # rank 0's graph, rewritten at compile time: not twice
        self.rank0_graph: fx.Graph = rank0.graph
        # the modules it calls, those of the regions outlined from it (recomputed layers, experts
        # calls, tables) too: their collectives run as the rank runs them (printing counts them)
        regions = [r.graph for r in (*rank0.regions, *rank0.experts)] + ([rank0.tables.graph] if rank0.tables else [])
        self.rank0_calls: list[tuple[str, str | None]] = [   # (module, the experts path it runs, if any)
            (n.target, n.meta.get("experts")) for g in (rank0.graph, *regions) for n in g.nodes if n.op == "call_module"]
        # parameters stacked on their experts dim [experts, ...], cut over the ep ranks next to the tp
        # cut (compile/cut_ranks.py): the one list of them that ranks, runtime, checkpoints and printing read
        self.expert_params: set[str] = {name for region in rank0.experts for name in region.params}
        self.experts_per_rank = experts_per_rank(rank0, dims.ep)
        self._cut = CutRanks(self)           # the rank programs cut so far
        self._stages = stages
        self._names_with_ties = stages.names_with_ties
        self._simulator = ProgramSimulator(stages)
        self._data_replicas: DataReplicas | None = None      # prog.simulate() at ep > 1 or cp > 1
        self.param_weight = NormWeights(self.sharding, stages.param_holders, self.param_shapes)

    @property
    def model(self) -> nn.Module:
        """The single-device model this program was compiled from (held weakly after distributed())."""
        return self._source.model

    @property
    def sharding(self) -> ShardingPlan:
        """The sharding decided on the example inputs: each parameter's dim and per-rank layout."""
        return self._compiler.compiled[0].plan

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def param_holders(self) -> dict[str, set[int]]:
        """Parameter -> the pipeline ranks whose stages read it."""
        return self._stages.param_holders

    @property
    def predicted_stage_seconds(self) -> list[float] | None:
        """Each pipeline stage's forward seconds as the stage cut priced them (None without a pipeline)."""
        return self._stages.predicted

    @property
    def stage_counts(self) -> list[int] | None:
        """Layers per pipeline stage, in stage order (None without a pipeline)."""
        return self._stages.counts

    @property
    def shared_params(self) -> dict[tuple[int, ...], list[str]]:
        """Pipeline ranks -> the parameters they all read (a tied embedding: first and last stage)."""
        return self._stages.shared_params

    @property
    def captured_graph(self) -> fx.Graph:
        """The model's graph as captured, before any rewrite (its nodes keep their values' meta)."""
        return self._compiler.compiled[0].captured.gm.graph

    def split(self) -> dict[str, object]:
        """This program's split as autoshard() takes it (tp, pp, ..., fuse), to compile it again."""
        return dict(tp=self.tp, pp=self.pp, virtual=self.virtual, dp=self.dp, ep=self.dims.ep, cp=self.cp,
                    microbatches=self.microbatches, schedule=self.schedule_name,
                    sequence_parallel=self.options.sequence_parallel, vocab_parallel=self.options.vocab_parallel,
                    gather_output=self.options.gather_output, recompute=self.recompute, fuse=self.fuse)

    def verify(self, **options):
        """A certificate that this split of the model equals the model (autoshard/verify/): a float64
        copy of the model compiled with the same split, every rank run in this process against
        another copy for outputs, gradients and one AdamW step on a batch with padding and ignored
        labels. This program is left untouched. `options`: verify_model's (seq=...)."""
        from autoshard.verify.run import verify_program       # the user layer, at call time (tests/harness/imports.py's CALLS_UP)
        return verify_program(self, **options)

    # ---- compile and pipeline stages ---------------------------------------------------------
    def _compile(self, named: dict[str, object], training: bool | None = None) -> Compiled:
        with building():
            entry = self._compiler.compile_signature(named, training)
            for rank in self._cut.all():
                self._add_graph(rank, entry)
        return entry

    def stage_graphs(self, gm: fx.GraphModule | fx.Graph, cache: bool = True) -> list[StageGraph]:
        """The pp * virtual stage graphs cut from one rank graph `gm` (cached unless `cache` is False:
        a graph read once, as planning/graph_memory.py reads a meta copy's)."""
        return self._stages.stage_graphs(gm, cache)

    def stage_modules(self, tp_rank: int = 0) -> list[fx.GraphModule]:
        """Tensor-parallel rank `tp_rank`'s program cut into stages (example inputs' graph): one module
        per stage, stage s running on pipeline rank s % pp as its chunk s // pp; print `.code`."""
        rank = self.rank(tp_rank)
        return [fx.GraphModule(rank, sg.graph, class_name=f"Stage{sg.index}")
                for sg in self.stage_graphs(rank.graph_module)]

    def _add_graph(self, rank: RankProgram, entry: Compiled) -> None:
        cap = entry.captured
        if rank.rank == 0 and rank.cp_rank == 0 and entry.index == 0 and self._rank0 is not None:
            rg, self._rank0 = self._rank0, None
        else:
            rg = self._compiler.rank_graph(entry, rank.rank, rank.cp_rank)
        attrs: dict[str, object] = dict(rg.restrict_buffers)
        for n in cap.gm.graph.nodes:
            if n.op in ("get_attr", "call_module") and n.target not in cap.param_names and n.target not in attrs:
                obj = cap.gm.get_submodule(n.target) if n.op == "call_module" else fetch_attr(cap.gm, n.target)
                attrs[n.target] = obj.detach().clone() if isinstance(obj, torch.Tensor) else obj
        rank.expert_templates = self._compiler.expert_templates
        regions = [*rg.experts, *rg.regions, *([rg.tables] if rg.tables is not None else [])]
        gm = rank.add_graph(cap.signature, rg.graph, attrs, rg.modules, cap.out_spec, regions)
        gm.meta["context"] = rg.context         # cp > 1: which outputs hold the rank's tokens (DataReplicas)

    # ---- ranks -------------------------------------------------------------------------------
    def rank(self, r: int, ep_rank: int | None = None, cp_rank: int | None = None, *, copy: int = 0) -> RankProgram:
        """Rank r's module: its parameter shards and its graph(s); `.code` prints them. With
        `ep_rank` (ep > 1): tensor-parallel rank r of expert-parallel rank `ep_rank`, holding only
        that rank's experts, its experts calls bound to a simulated group until the runtime binds
        its process group (compile/cut_ranks.py). With `cp_rank` (cp > 1): the graph of that
        context-parallel rank (the same shards; `prog.rank(r)` is context-parallel rank 0). `copy`
        k > 0: an instance of its own of the same rank (parameters of its own, graphs shared), as
        each mesh rank of a local world takes (compile/cut_ranks.py)."""
        return self._cut.get(r, ep_rank, cp_rank, copy)

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
        for rank in self._cut.all():
            copy_into_rank(rank, self.sharding.params, state_dict)
        self._source.load(state_dict)
        self._cut.check_all_cut()

    def ranks(self) -> list[RankProgram]:
        return [self.rank(r) for r in range(self.tp)]

    def train(self, mode: bool = True) -> "ShardedProgram":
        """Put every rank (those built later too) in training (`mode=True`) or evaluation mode, as
        `model.train(mode)` does: dropout and batch norm follow, each mode with its own graph
        (captured in that mode the first time a call needs it)."""
        self._training = mode
        for rank in self._cut.all():
            rank.train(mode)
        return self

    def eval(self) -> "ShardedProgram":
        return self.train(False)

    def zero_grad(self) -> None:
        """Every built rank's gradients set to None (data replicas' too), as `model.zero_grad()`."""
        for rank in self._cut.all():
            rank.zero_grad(set_to_none=True)

    def manual_seed(self, seed: int) -> None:
        """Seed every rank's dropout generators: same masks outside tensor-parallel regions on every
        rank, a different stream per rank inside them; the same seed gives the same masks again."""
        for rank in self._cut.all():
            rank.rng.manual_seed(seed)
        self._seed = seed

    def distributed(self, group: Group = None, *, mesh: bool = False) -> RankProgram | MeshRuntime:
        """This rank's part of the program, in the calling thread's world (world/: inside torchrun,
        torch.distributed; in a rank thread of a LocalWorld, that world's rank).

        tp only: rank module called like the model, its collectives on `group` (default: the whole
        world). With pp, dp, cp or microbatches > 1, or `mesh=True`: a `MeshRuntime` for the whole
        world, whose `train_step(batch..., labels=...)` runs the schedule and returns the loss.
        """
        world = current()
        size = world.size(group)
        if size != self.world_size:
            raise ShardingError(f"the process group has {size} ranks but the program was built for "
                                f"tp={self.tp}{f' x cp={self.cp}' if self.cp > 1 else ''} x pp={self.pp} x "
                                f"dp={self.dp} = {self.world_size}")
        if self.world_size == self.tp and self.microbatches == 1 and not mesh:
            mine = self.rank(world.rank(group)).bind(group)
            self._release(world)
            return mine
        if group is not None and world.size(group) != world.size():
            raise ShardingError("a pipeline or data-parallel program runs on the whole world")
        rank = world.rank()
        groups = MeshGroups(self.dims, rank, list(self.shared_params), world)
        runtime = MeshRuntime(self, rank, groups, self.schedule)
        self._release(world)
        return runtime

    def local_mesh(self) -> LocalMesh:
        """Every rank of the mesh in this process, each running the runtime a torchrun process runs
        (`distributed(mesh=True)`), their collectives and transfers meeting in a LocalWorld
        (runtime/local_mesh.py). Each rank gets its own copy of this program."""
        return LocalMesh(self)

    def _release(self, world: World | None = None) -> None:
        """This process's rank is cut: hold nothing more of the model's weights (the captured
        graphs' copies of them become meta tensors; the model itself is held weakly). Not in a
        local world, whose other ranks are cut from the same program in this process."""
        if world is not None and world.backend == "local":
            return
        self._source.release()
        for entry in self._compiler.compiled:
            gm = entry.captured.gm
            for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
                if not t.is_meta:
                    assign_attr(gm, name, meta_like(t))

    # ---- simulation and reassembly -----------------------------------------------------------
    def simulate(self, *args, **kwargs):
        """Run all ranks in this process; returns what `model(*args, **kwargs)` returns.

        Outputs are replicated, so every rank holds the same values; a loss computed from the result
        back-propagates into every rank, as each rank's own loss does under torch.distributed. At
        ep > 1 or cp > 1 the data ranks that meet run too (compile/data_replicas.py): expert-parallel
        ranks each on its slice of the batch, exchanging tokens; context-parallel ranks each on its
        tokens of the same sequences."""
        if self.dims.ep > 1 or self.cp > 1:
            replicas = self._replicas()
            return replicas.join(*replicas.run(self._simulator, args, kwargs))
        outs, out_spec = self._simulator.run(self.ranks(), [(args, kwargs)] * self.tp)
        return pytree.tree_unflatten([join_replicated(list(leaf)) for leaf in zip(*outs)], out_spec)

    def simulate_all(self, *args, **kwargs) -> list[object]:
        """Every rank's own output, unjoined (for checking that the copies agree; at ep > 1 every
        expert-parallel rank's on its slice of the batch, expert-parallel rank major)."""
        if self.dims.ep > 1 or self.cp > 1:
            outs, out_spec = self._replicas().run(self._simulator, args, kwargs)
        else:
            outs, out_spec = self._simulator.run(self.ranks(), [(args, kwargs)] * self.tp)
        return [pytree.tree_unflatten(list(o), out_spec) for o in outs]

    def _replicas(self) -> DataReplicas:
        if self._data_replicas is None:
            with building():
                self._data_replicas = DataReplicas(self)
        return self._data_replicas

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Gradients reassembled to full shapes, keyed by the model's own parameter names."""
        def read(p):
            return None if p.grad is None else p.grad.detach()
        if self.cp > 1 or self._data_replicas is not None:
            return self._replicas().assemble(read, summed=True)
        return assemble(self.ranks(), self.sharding, self.param_shapes, read)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters reassembled to full shapes, keyed by the model's own parameter names."""
        if self.cp > 1 or self._data_replicas is not None:
            return self._replicas().assemble(lambda p: p.detach(), summed=False)
        return assemble(self.ranks(), self.sharding, self.param_shapes, lambda p: p.detach())

    def __reduce_ex__(self, protocol):
        # A program holds the model weakly once distributed() cut its rank, its graphs' collectives
        # bound to process groups, and closures over both: no pickle of it would load into a working
        # program. Each rank compiles its own (autoshard() is deterministic); weights travel as state.
        raise ShardingError("a ShardedProgram cannot be pickled (torch.save, pickle, multiprocessing): compile it on "
                            "each rank with the same autoshard(model, ...) call, and move weights with "
                            "prog.full_state_dict() / prog.load_state_dict() or autoshard.checkpoint")

    def __deepcopy__(self, memo: dict) -> "ShardedProgram":
        """copy.deepcopy as before the pickling refusal above (deepcopy also asks __reduce_ex__)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __str__(self) -> str:
        return describe(self)

    __repr__ = __str__
