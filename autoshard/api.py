"""`autoshard()`: the compile, as a straight line of passes.

capture (torch.export) -> annotate (sharding analysis, writes node.meta) -> rewrite (rank 0's graph;
the other ranks' when they are built) -> fuse -> split into pipeline stages -> schedule. Annotation
comes before any rewrite so that every rank's program is cut from one decision; rewriting is per
rank so that ranks can be built lazily (a torchrun process builds only its own).
"""
from __future__ import annotations

import torch
from torch import nn

from autoshard.compile.capture import infer_example_inputs, normalize_inputs
from autoshard.compile.compiler import Compiler
from autoshard.regions.experts_call import EXPERT_MODULES, expert_modules
from autoshard.compile.program import ShardedProgram
from autoshard.compile.stage_layout import StageLayout
from autoshard.compile.weights import WeightSource
from autoshard.errors import ShardingError, expert_split_problem, require_positive_int
from autoshard.parallel.fp8_linear import FP8_RECIPES
from autoshard.passes.fp8_linears import Fp8Options
from autoshard.passes.recompute import RECOMPUTE_MODES
from autoshard.passes.sharding.options import ShardOptions
from autoshard.passes.stage_balance import Rates, balanced_counts, layer_costs
from autoshard.passes.stages import counts_from_cuts
from autoshard.planning.context_cost import choose_attention
from autoshard.planning.costmodel import Estimate
from autoshard.planning.hardware import Hardware, get_hardware
from autoshard.planning.planner import plan
from autoshard.planning.schedule_choice import choose_from_graph
from autoshard.planning.graph_fit import fastest_that_fits
from autoshard.runtime.mesh import ParallelDims
from autoshard.runtime.schedules import check, make_schedule, schedule_spec

__all__ = ["autoshard"]


def autoshard(model: nn.Module, *, tp: int | None = None, pp: int | None = None, dp: int | None = None,
              ep: int | None = None, cp: int | None = None, cp_attention: str = "auto", virtual: int | None = None, microbatches: int | None = None, schedule: str | None = None,
              stage_cuts: list[int] | None = None, example_inputs: tuple | None = None, example_kwargs: dict | None = None,
              vocab_parallel: bool = True, gather_output: bool = True, sequence_parallel: bool = False,
              fuse: bool = False, recompute: str | None = None,
              world_size: int | None = None, global_batch: int | None = None,
              hardware: str | Hardware = "a100-80gb", distributed_optimizer: bool | None = False,
              zero: int | None = None, precision: str | None = None, fp8_recipe: str = "tensorwise") -> ShardedProgram:
    """Shard an unmodified single-device model Megatron-style over tp x pp x dp ranks.

    tp: tensor-parallel ranks (Megatron's column/row splits). pp: pipeline ranks; the repeated
    layers are cut into pp * virtual stages and rank r runs stages r, r + pp, ... (`virtual` > 1
    is the interleaved schedule). dp: data-parallel replicas. ep: expert parallelism for
    mixture-of-experts models (Hugging Face's experts modules): each MoE layer's experts divided over
    ep data-parallel ranks, tokens exchanged with all-to-all (ep divides dp; runtime/mesh.py draws the
    mesh; `simulate()` runs the program as ep=1). microbatches: per data-parallel rank
    and step. schedule: "1f1b" (default), "gpipe" or "interleaved" (default when virtual > 1;
    needs microbatches divisible by pp), or a zero-bubble schedule, which splits each backward into
    input and weight gradients (runtime/backward_split.py): "zb-h1" (one chunk per rank), "zbv" and
    "v-half" (two chunks per rank in a V; virtual defaults to 2). runtime/schedules.py says what each
    costs and holds. "auto": the fastest of 1f1b, interleaved, zb-h1, zbv and v-half predicted from
    the captured graph's F, B and W times on `hardware` (planning/schedule_choice.choose_from_graph),
    the split's own cost included (Hardware.split_backward); `prog.schedule_choice.explain()` and
    print(prog) say why; a `virtual` or `stage_cuts` given keeps it to the candidates with that many
    chunks a rank or stages. Memory is not weighed (the zero-bubble schedules hold what 1F1B holds or
    less; interleaved a little more). See `ShardedProgram.distributed` for training.
    stage_cuts: the first layer of every stage after the first (pp * virtual - 1 of them: [5] cuts 8
    layers into 0-4 and 5-7). Default: balanced by cost (passes/stage_balance.py): each layer, and
    the embedding before the layers and the head and loss after them, priced from the rank graph's
    ops on `hardware`; the even layer counts unless a cut lowers the largest stage by 5%.
    `print(prog)` shows each stage's predicted forward time.
    cp: context parallelism (long sequences): each of cp ranks holds 1/cp of every sequence's tokens
    from the embedding to the loss, in 2 * cp load-balanced pieces (rank c: pieces c and 2cp-1-c);
    attention gathers keys and values over the cp ranks (passes/context/split.py). Every rank is
    given the whole batch and cuts it; the sequence length must be a multiple of 2 * cp. Parameters
    are replicated over cp and their gradients summed over cp x dp. World size tp x cp x dp x pp.
    cp_attention: how an SDPA call meets the other ranks' keys: "ring" (blocks passed around the
    group with point-to-point sends overlapped with the block's compute, merged by log-sum-exp;
    only the rank's own keys are saved), "all_gather" (every token's keys and values gathered,
    then SDPA), or "auto" (default: the cost model's pick for the example's sizes on `hardware`,
    planning/context_cost.py's choose_attention: the all-gather where the ring's steps would cost
    more than they hide, short sequences at larger cp). Attention written out as ops (matmul,
    softmax, matmul) always gathers.

    vocab_parallel: split input embeddings, LM heads and a cross-entropy loss by vocabulary rows.
    gather_output: return full tensors where the model returns vocab-sharded ones (logits); with
    False each rank returns its own shard and no rank materializes full logits.
    fuse: replace LayerNorm / RMSNorm, bias+GeLU, SiLU*up (SwiGLU), rotary, written-out causal
    softmax and bias+dropout+residual subgraphs of every rank graph by autoshard.kernels' fused ops
    (CuPy kernels on CUDA, exact torch code elsewhere; passes/fusion/rules.py lists the patterns);
    a fused training dropout draws its own masks (same p, same RNG regions, not torch's masks);
    default: off, on GPUs too (on an H200 each fused op cost the host 200-470 us a call and a 406M
    Llama's step took 1.50x as long: benchmarks/RESULTS.md, "the first GPU session").
    recompute: "none" (default), "selective" or "full" activation recomputation (Korthikanti et al.
    2022): "full" keeps only each repeated layer's inputs and runs the layer again in backward;
    "selective" does that for the attention core only (scores, softmax, dropout, probabilities x
    values: the part whose memory grows as s^2). Each recomputed region is a checkpointed submodule
    call in the rank code (`recompute_<layer>`); dropout redraws the forward's masks. With
    world_size, the planner's choice is used unless given. A Hugging Face model on which
    `gradient_checkpointing_enable()` was called gets "full" unless `recompute` is given (its own
    checkpointing does not survive capture: the numbers would be right and no memory saved).
    world_size: instead of tp/pp/dp/virtual/microbatches, let `autoshard.plan` choose them for this
    many GPUs of `hardware` and a step of `global_batch` sequences (default: one per GPU), at the
    example call's sequence length: its first three candidates are compiled and the one whose own
    graphs say it fits and steps fastest is kept (planning/graph_fit.py); the chosen
    costmodel.Estimate is `prog.planned`, its ranks' peaks `prog.planned_memory` and its step's
    seconds `prog.planned_seconds`, both read off its graphs.
    distributed_optimizer: with world_size, whether the plan's memory and time count AdamW's state
    divided over the data-parallel ranks (False, the default: a plain optimizer); None lets the
    planner choose, and `prog.planned.distributed_optimizer` then says whether to build
    autoshard.runtime.DistributedOptimizer(runtime, torch.optim.AdamW, shard=True).
    zero: what the data-parallel ranks divide among them when training with
    autoshard.runtime.DistributedOptimizer (its default; ZeRO's stages, Rajbhandari et al. 2020): 1
    (default; with world_size, the planner's choice unless given) the optimizer state and fp32 main
    weights; 2 the gradients too (each unit's gradients
    reduce-scattered after every backward pass, as FSDP does); 3 the parameters too (fully sharded
    data parallelism: each layer's parameters gathered just before its forward and again before its
    backward, released after each: runtime/sharded_params.py). 3 is refused with the zero-bubble
    schedules.
    precision: "fp8" runs the linears' matmuls (forward and both backward) in float8 through
    torch._scaled_mm, with dynamic scales (`fp8_recipe`: "tensorwise", the default, or "rowwise";
    parallel/fp8_linear.py says what each scales and which amaxes are taken over the tp and cp
    groups), and transformers' grouped_mm experts' matmuls too, per expert (parallel/fp8_experts.py);
    the rest runs in the model's dtype (bf16 for training). Which linears stay in the model's dtype,
    and why (the LM head, routers, experts split over tp, features not multiples of 16), is
    passes/fp8_linears.py's table, printed by print(prog). Composes with fuse (the FP8 pass runs
    first). Default None: every op in the model's dtype.
    sequence_parallel: between tensor-parallel regions (norms, dropout, residuals) each rank keeps
    1/tp of the sequence (Korthikanti et al. 2022); the sequence length must be divisible by tp,
    and each new input shape is compiled once (sizes are exported static).

    >>> from autoshard.models import GPT, GPTConfig
    >>> import torch
    >>> model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=32))
    >>> prog = autoshard(model, tp=2)
    >>> ids = torch.randint(0, 128, (2, 16))
    >>> torch.allclose(prog.simulate(ids)[0], model(ids)[0], atol=1e-5)
    True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"autoshard expects an nn.Module, got {type(model).__name__}")
    if zero not in (None, 1, 2, 3):
        raise ShardingError(f"zero={zero!r}: 1 divides the optimizer state over the data-parallel ranks, 2 the "
                            f"gradients too, 3 the parameters too")
    if recompute is not None and recompute not in RECOMPUTE_MODES:
        raise ShardingError(f"recompute must be one of {', '.join(map(repr, RECOMPUTE_MODES))}, got {recompute!r}")
    if recompute is None and getattr(model, "is_gradient_checkpointing", False) is True:
        recompute = "full"          # Hugging Face's gradient_checkpointing_enable(): capture drops it, so honour it here
    if world_size is not None and cp not in (None, 1):
        raise ShardingError(f"cp={cp} with world_size={world_size}: world_size plans tp, pp and dp without "
                            "context parallelism; see autoshard.plan(..., context_parallel=True) and give "
                            "tp/pp/dp/cp yourself")
    fp8 = _fp8_options(model, precision, fp8_recipe)
    args, kwargs = _example_call(model, example_inputs, example_kwargs)
    common = dict(cp=cp, cp_attention=cp_attention, vocab_parallel=vocab_parallel, gather_output=gather_output,
                  sequence_parallel=sequence_parallel, fuse=fuse, hardware=hardware, stage_cuts=stage_cuts, fp8=fp8)
    if world_size is None:
        return _program(model, args, kwargs, tp=tp, pp=pp, dp=dp, ep=ep, virtual=virtual, microbatches=microbatches,
                        schedule=schedule, recompute=recompute, zero=zero or 1, **common)
    # the planner ranks the splits (and the recompute mode, unless given); of its first few, compiled,
    # the fastest whose every pipeline rank fits, both read off its own graphs, is kept
    given_example = example_inputs is not None or example_kwargs is not None
    candidates = _planned_split(model, world_size, global_batch, hardware, sequence_parallel, recompute,
                                dict(tp=tp, pp=pp, dp=dp, ep=ep, virtual=virtual, microbatches=microbatches),
                                None if schedule == "auto" else schedule,
                                seq=_sequence_length(args, kwargs) if given_example else None,
                                distributed_optimizer=distributed_optimizer, zero=zero,
                                precision="fp8" if fp8 is not None else "bf16")

    def build(chosen: Estimate) -> ShardedProgram:
        return _program(model, args, kwargs, tp=chosen.tp, pp=chosen.pp, dp=chosen.dp, ep=chosen.ep, zero=chosen.zero,
                        virtual=chosen.virtual, microbatches=chosen.microbatches, recompute=chosen.recompute,
                        schedule=(None if schedule == "auto" else schedule) or (chosen.schedule if chosen.pp > 1 else None),
                        **common)
    return fastest_that_fits(candidates, get_hardware(hardware), build, world_size)


def _fp8_options(model: nn.Module, precision: str | None, recipe: str) -> Fp8Options | None:
    """precision="fp8"'s options: the recipe, and the weights the model's structure keeps in its
    dtype: the output embedding (the LM head), the linears beside an MoE block's experts (routers) and
    the experts' stacked weights."""
    if precision is None:
        return None
    if precision != "fp8":
        raise ShardingError(f"precision={precision!r}: \"fp8\" runs the linears in float8; for bf16 or fp16, cast "
                            f"the model (model.to(torch.bfloat16)) and leave precision unset")
    if recipe not in FP8_RECIPES:
        raise ShardingError(f"fp8_recipe={recipe!r}: one of {', '.join(map(repr, FP8_RECIPES))}")
    names = {id(p): n for n, p in model.named_parameters()}
    keep = {}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and id(getattr(head, "weight", None)) in names:
        keep[names[id(head.weight)]] = "lm_head"
    for path, module in model.named_modules():
        if hasattr(module, "experts"):            # an MoE block: its other linears route the tokens
            for child in module.children():      # nn.Linear, or a router module holding its [experts, H] weight
                weight = child._parameters.get("weight") if child is not module.experts else None
                if weight is not None and weight.dim() == 2 and id(weight) in names:
                    keep[names[id(weight)]] = "router"
    for module in expert_modules(model).values():     # listed even where no grouped matmul reads them
        for p in module.parameters():
            if p.dim() == 3 and id(p) in names:
                keep[names[id(p)]] = "experts"
    return Fp8Options(recipe, keep)


def _program(model: nn.Module, args: tuple, kwargs: dict, *, tp: int | None, pp: int | None, dp: int | None,
             ep: int | None, cp: int | None, virtual: int | None, microbatches: int | None, schedule: str | None,
             recompute: str | None, cp_attention: str, vocab_parallel: bool, gather_output: bool,
             sequence_parallel: bool, fuse: bool, hardware: str | Hardware,
             stage_cuts: list[int] | None = None, zero: int = 1, fp8: Fp8Options | None = None) -> ShardedProgram:
    """The compile of one split (autoshard's arguments, the example call as `args` and `kwargs`)."""
    recompute = "none" if recompute is None else recompute
    auto = schedule == "auto"
    given_virtual = virtual                              # "auto" keeps to a virtual given
    if virtual is None and schedule is not None and not auto:
        virtual = schedule_spec(schedule).chunks         # a V schedule's two chunks
    tp, pp, dp, ep, cp, virtual, microbatches = (1 if x is None else x
                                                 for x in (tp, pp, dp, ep, cp, virtual, microbatches))
    for name, x in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep), ("cp", cp), ("virtual", virtual),
                    ("microbatches", microbatches)):
        require_positive_int(name, x)
    _check_expert_parallel(model, ep, dp, cp, sequence_parallel)
    _check_context_attention(cp_attention)
    if sequence_parallel and not vocab_parallel:
        raise ShardingError("sequence_parallel=True needs vocab_parallel=True: the sequence is split "
                            "where the vocabulary-parallel embedding's partial sums are reduced")
    options = ShardOptions(vocab_parallel=vocab_parallel, gather_output=gather_output,
                           sequence_parallel=sequence_parallel)
    named = normalize_inputs(model, args, kwargs)
    dims = ParallelDims(tp, pp, dp, ep, cp)
    if virtual > 1 and pp == 1:
        raise ShardingError(f"virtual={virtual} chunks per rank need pp > 1")
    if not auto:
        schedule_name, steps, placement = _schedule(schedule or ("interleaved" if virtual > 1 else "1f1b"),
                                                    pp, virtual, microbatches)

    # The passes, in order.
    compiler = Compiler(WeightSource(model), tp, options, fuse=bool(fuse), example_inputs=named, recompute=recompute,
                        ep=ep, cp=cp, cp_attention=cp_attention, fp8=fp8,
                        cp_choose=lambda sizes: choose_attention(**sizes, cp=cp, tp=tp, hw=get_hardware(hardware)))
    first = compiler.compile_signature(named)               # capture -> annotate
    choice = None
    if auto:                                                # the schedule, priced on the captured graph
        hw = get_hardware(hardware)
        choice = choose_from_graph(first.captured.gm.graph, pp=pp, virtual=given_virtual, microbatches=microbatches,
                                   rates=_rates(hw, tp), split_backward=hw.split_backward,
                                   link_bytes_s=tp * hw.nvlink_gb_s * 1e9, latency_s=hw.latency_us * 1e-6,
                                   stage_cuts=stage_cuts)
        virtual = choice.chosen.virtual if choice else 1
        schedule_name, steps, placement = _schedule(choice.name if choice else "1f1b", pp, virtual, microbatches)
    rank0 = compiler.rank_graph(first, 0)                   # rewrite -> fuse (rank 0: printing, stages)
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}     # tied weights' too
    counts, predicted = _stage_counts(first.captured.gm.graph, pp * virtual, stage_cuts, hardware, tp)
    stages = StageLayout(pp, virtual, all_names, rank0.graph, placement, counts, predicted)   # stages; who holds each parameter
    prog = ShardedProgram(compiler, rank0, stages, dims, model=model, example_inputs=named, virtual=virtual,
                          microbatches=microbatches, schedule_name=schedule_name, schedule=steps,
                          schedule_choice=choice)
    if zero == 3 and any(a.kind == "W" for actions in steps for a in actions):
        raise ShardingError(f"zero=3 with schedule {schedule_name!r}: a zero-bubble schedule computes weight "
                            f"gradients (W) after the input gradients (B), and fully sharded parameters are not "
                            f"kept gathered from B until W; use schedule='1f1b' or 'interleaved', or zero=1 or 2")
    prog.zero = zero
    return prog


def _schedule(name: str, pp: int, virtual: int, microbatches: int) -> tuple[str, list, str]:
    """A schedule's name, steps and placement, checked complete and deadlock-free (or it raises)."""
    steps = make_schedule(name, pp, virtual, microbatches)
    placement = schedule_spec(name).placement
    check(steps, virtual, microbatches, placement=placement)
    return name, steps, placement


def _rates(hardware: str | Hardware, tp: int) -> Rates:
    """What one rank's share of the model runs at: each of tp ranks does 1/tp of every op."""
    hw = get_hardware(hardware)
    return Rates(flops=tp * hw.peak_tflops * 1e12 * hw.matmul_efficiency,
                 bytes=tp * hw.hbm_gb_s * 1e9 * hw.memory_efficiency)


def _stage_counts(graph, n_stages: int, cuts: list[int] | None, hardware: str | Hardware, tp: int
                  ) -> tuple[list[int] | None, list[float] | None]:
    """Layers per pipeline stage (the cuts given, else balanced by cost) and each stage's predicted
    forward seconds on `hardware`; (None, None) without a pipeline. Priced on the captured graph
    (the whole model, its values' shapes kept), each rank doing 1/tp of it."""
    if n_stages == 1:
        if cuts:
            raise ShardingError(f"stage_cuts={cuts} need a pipeline (pp > 1)")
        return None, None
    costs = layer_costs(graph, _rates(hardware, tp))
    counts = balanced_counts(costs, n_stages) if cuts is None else counts_from_cuts(list(cuts), len(costs.layers), n_stages)
    return counts, costs.stage_seconds(counts)


def _check_expert_parallel(model: nn.Module, ep: int, dp: int, cp: int, sequence_parallel: bool) -> None:
    """ep > 1 needs experts modules, an ep dividing dp x cp, and (for now) no sequence parallelism."""
    if ep == 1:
        return
    if (problem := expert_split_problem(dp, ep, cp=cp)) is not None:
        raise ShardingError(f"{problem} (dp x cp = ep: one group of every replica)")
    if not expert_modules(model):
        raise ShardingError(f"ep={ep}: {type(model).__name__} has no experts module expert parallelism knows "
                            f"(autoshard/regions/experts_call.py's EXPERT_MODULES: {[f.name for f in EXPERT_MODULES]})")
    if sequence_parallel:
        raise ShardingError(f"ep={ep} is not built with sequence_parallel=True yet (untested: refused rather than "
                            "risk a wrong result)")


def _check_context_attention(attention: str) -> None:
    """cp_attention names one of the context pass's ways for SDPA to meet the other ranks' keys."""
    if attention not in ("ring", "all_gather", "auto"):
        raise ShardingError(f"cp_attention must be 'ring', 'all_gather' or 'auto', got {attention!r}")


def _planned_split(model: nn.Module, world_size: int, global_batch: int | None, hardware: str | Hardware,
                   sequence_parallel: bool, recompute: str | None, given: dict[str, int | None],
                   schedule: str | None = None, seq: int | None = None,
                   distributed_optimizer: bool | None = False, zero: int | None = None,
                   precision: str = "bf16") -> list[Estimate]:
    """The planner's splits of `world_size` GPUs at `seq` tokens per sequence (the example call's;
    None: the config's maximum, which plan() warns of), fastest first; refused when the caller also
    fixed one."""
    fixed = {k: x for k, x in given.items() if x is not None}
    if fixed:
        raise ShardingError(f"world_size={world_size} asks the planner to choose tp, pp, dp, virtual and "
                            f"microbatches; drop {', '.join(f'{k}={x}' for k, x in fixed.items())} or world_size")
    try:
        return plan(model, gpus=world_size, global_batch=global_batch or world_size, hardware=hardware,
                    sequence_parallel=sequence_parallel, recompute=recompute, seq=seq,
                    distributed_optimizer=distributed_optimizer, zero=zero, precision=precision,
                    **({"schedules": (schedule,)} if schedule else {}))
    except ValueError as e:
        raise ShardingError(f"world_size={world_size}: {e}. Or rank splits yourself with "
                            "autoshard.plan(ModelShape(...), gpus=..., global_batch=...) and pass tp/pp/dp/"
                            "virtual/microbatches") from None


def _sequence_length(args: tuple, kwargs: dict) -> int | None:
    """Tokens per sequence in an example call: dim 1 of its first input of two or more dims (token
    ids [batch, seq], or embeddings [batch, seq, hidden]), positional inputs first; None if none has."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    return None


def _example_call(model: nn.Module, example_inputs: tuple | torch.Tensor | None,
                  example_kwargs: dict | None) -> tuple[tuple, dict]:
    """The example call's positional and named inputs, as given or inferred from the model."""
    if isinstance(example_inputs, torch.Tensor):      # one input given bare: the model's first argument
        example_inputs = (example_inputs,)
    elif example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        raise ShardingError(f"example_inputs must be a tuple of the model's positional inputs, got "
                            f"{type(example_inputs).__name__}; pass example_kwargs={{...}} for named ones")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise ShardingError(f"example_kwargs must be a dict of the model's named inputs, got "
                            f"{type(example_kwargs).__name__}")
    if example_inputs is None and example_kwargs is None:
        return infer_example_inputs(model)
    return tuple(example_inputs or ()), dict(example_kwargs or {})
