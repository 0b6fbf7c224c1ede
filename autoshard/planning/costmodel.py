"""An analytic performance model of Megatron-style training (tp x pp x dp, interleaving, recompute).

    >>> from autoshard.planning.costmodel import estimate
    >>> e = estimate(hidden=25600, layers=128, heads=160, vocab=51200, seq=2048,
    ...              tp=8, pp=64, dp=6, global_batch=3072)
    >>> 150 < e.tflops_per_gpu < 175      # the paper measured 163 on A100s
    True

One iteration on the busiest pipeline rank is

    (m + (p - 1)/v) * W  +  point-to-point  +  data-parallel all-reduce  +  optimizer step

where W is that rank's work per microbatch: its layers (GEMMs by `gemm_timing`, fused elementwise
kernels by bytes, two tensor-parallel all-reduces per pass), forward, backward and the recomputed
forward, plus the embedding (first rank) or LM head and loss (last rank). Nothing overlaps, as in
the Megatron of the papers. Closed forms (FLOPs, bytes, volumes) live in `cost_formulas`, hardware
in `hardware`; this file puts them together.
"""
from __future__ import annotations

import dataclasses
import math

from autoshard.errors import expert_split_problem, require_positive_int
from autoshard.planning.collective_timing import allreduce_seconds, tp_allreduce_seconds
from autoshard.planning.context_cost import ring_seconds
from autoshard.planning.cost_formulas import evaluate
from autoshard.planning.gemm_timing import (
    LayerShape,
    bytes_seconds,
    gemm_seconds,
    layer_elementwise_seconds,
    layer_gemm_seconds,
)
from autoshard.planning.hardware import Hardware, get_hardware
from autoshard.planning.estimate import RESERVED, Estimate
from autoshard.planning.memory_model import busiest_rank
from autoshard.planning.moe_cost import MoELayerCosts, MoEShape, moe_layer_costs
from autoshard.planning.node_links import link_gb_s
from autoshard.planning.schedule_choice import StageTimes, bubble_of
from autoshard.runtime.mesh import ParallelDims
from autoshard.runtime.schedules import schedule_spec

__all__ = ["Estimate", "estimate", "candidates", "RECOMPUTE"]

RECOMPUTE = ("full", "selective", "none")


def _layer_seconds(x: LayerShape, hw: Hardware, recompute: str, fp8: bool = False) -> tuple[float, float, float]:
    """(forward compute, backward compute with recomputation, tensor-parallel communication) seconds
    of one layer for one microbatch (`fp8`: its linears in float8)."""
    gf, gb = layer_gemm_seconds(x, hw, fp8=fp8)
    ef, eb = layer_elementwise_seconds(x, hw)
    dispatch = hw.layer_overhead_s / 3          # of a layer's fixed cost: a third forward, two backward
    backward = gb + eb + 2 * dispatch
    passes = 4                                  # two all-reduces forward, two backward
    if recompute == "full":
        backward += gf + ef + dispatch
        passes += 2
    elif recompute == "selective":
        backward += layer_gemm_seconds(x, hw, attention_core_only=True)[0]
        backward += layer_elementwise_seconds(x, hw, attention_core_only=True)[0]
    # sequence parallelism: each all-reduce becomes an all-gather and a reduce-scatter (the same
    # bytes, two start-up costs), and the norms' weights and the row-parallel biases, read through f,
    # get their gradients summed: six small all-reduces per layer in backward
    sp = x.sp and x.t > 1
    per_pass = tp_allreduce_seconds(x, hw) + (hw.latency_us * 1e-6 if sp else 0.0)
    synced = 6 * allreduce_seconds(x.h * hw.reduce_bytes, x.t, hw.nvlink_gb_s, hw) if sp else 0.0
    return gf + ef + dispatch, backward, passes * per_pass + synced


def _ends_seconds(x: LayerShape, vocab: int, hw: Hardware) -> tuple[float, float, float]:
    """(first rank compute, last rank compute, first rank communication) per microbatch."""
    tokens = x.b * x.s * x.h / (x.t if x.sp else 1)
    logits = x.b * x.s * vocab / x.t
    rows = x.b * x.s
    head = (gemm_seconds(rows, vocab // x.t, x.h, hw) + gemm_seconds(rows, x.h, vocab // x.t, hw)
            + gemm_seconds(x.h, vocab // x.t, rows, hw)
            + bytes_seconds(14 * logits + 10 * tokens, hw))    # fp32 cross-entropy both ways, final norm
    embed = bytes_seconds(8 * tokens, hw)                      # lookup and gradient scatter
    # the vocab-parallel embedding's sum; the vocab-parallel loss's three small all-reduces (max,
    # sum of exponentials, target logit)
    loss_comm = 3 * allreduce_seconds(4 * x.b * x.s, x.t, hw.nvlink_gb_s, hw)
    return embed, head, tp_allreduce_seconds(x, hw) + loss_comm


def candidates(*, layers: int, pp: int, dp: int, global_batch: int, microbatch: int | None = None,
               virtual: int | None = None, max_microbatch: int = 64) -> list[tuple[int, int]]:
    """Legal (microbatch, virtual) pairs: microbatch divides the per-replica batch; virtual > 1 needs
    pp > 1, layers divisible by pp * virtual and microbatches divisible by pp (the interleaved schedule)."""
    v = virtual
    per_replica = global_batch // dp
    bs = [microbatch] if microbatch else [x for x in range(1, min(per_replica, max_microbatch) + 1)
                                          if per_replica % x == 0 and (x & (x - 1) == 0 or x == per_replica)]
    vs = [v] if v else [1] + [x for x in range(2, layers // pp + 1) if pp > 1 and layers % (pp * x) == 0]
    return [(mb, vv) for mb in bs for vv in vs if vv == 1 or (per_replica // mb) % pp == 0]


def estimate(*, hidden: int, layers: int, heads: int, vocab: int, seq: int, tp: int, pp: int, dp: int,
             global_batch: int, microbatch: int | None = None, virtual: int | None = None,
             hardware: str | Hardware = "a100-80gb", recompute: str = "full",
             sequence_parallel: bool = False, overlap_grad_reduce: bool = False, gather_logits: bool = False,
             distributed_optimizer: bool = False, moe: MoEShape | None = None,
             ep: int = 1, cp: int = 1, kv_heads: int | None = None, cp_overlap: bool = True,
             attention: str = "math", schedules: tuple[str, ...] | None = None, zero: int = 1,
             precision: str = "bf16") -> Estimate:
    """Predicted time, throughput and memory of one training iteration.

    gather_logits: the last stage all-gathers the vocabulary-sharded logits each microbatch (autoshard's
    `gather_output=True` for a model that returns them; Megatron keeps them sharded).
    overlap_grad_reduce: the data-parallel gradient all-reduce runs during the backward pass (torch
    DDP, the 2019 Megatron, autoshard's DistributedOptimizer); False is the PTD-P paper's Megatron,
    which reduces after the backward.
    distributed_optimizer: main parameters and AdamW's moments divided over dp (memory_model.param_bytes;
    the reduce-scatter and all-gather move what the all-reduce does, so time is unchanged).
    precision: "fp8" runs each layer's linears (not attention's core products, not the LM head)
    at the hardware's FP8 rate (`fp8_tflops`; refused where it is 0) on float8 operands, adding their
    casts' memory traffic (gemm_timing.FP8_CAST_BYTES); "bf16" (default) everything at peak_tflops.
    zero: 2 also divides the gradients (each layer's reduce-scattered after every microbatch's
    backward), 3 the weights too (each layer's all-gathered before its forward and again before its
    backward, every microbatch): `breakdown["fsdp_comm"]`, the part of those collectives the layer's
    compute does not hide (the next layer's gather is issued before this one computes), and the
    first layer's gather, which nothing hides. Implies the distributed optimizer.
    moe: every layer's MLP is E experts (planning/moe_cost.py), divided over `ep` data-parallel
    ranks (ep divides dp and E); their all-to-alls are `breakdown["ep_comm"]`.
    cp: context-parallel ranks (each holds seq / cp tokens; planning/context_cost.py): the ring's
    exposed sends are `breakdown["cp_comm"]` (`cp_overlap=False`: none hidden); `kv_heads` sizes
    the blocks (default: heads). Activations are those of seq / cp tokens; gradients are reduced
    over dp x cp ranks; GPUs are tp x pp x dp x cp. attention: "math" (the attention core keeps its
    s^2 scores, as the papers' Megatron) or "flash" (a fused kernel: memory_model.py).

    `microbatch=None` or `virtual=None` (pipeline chunks per rank, the paper's v) choose the fastest
    legal value that fits memory (if none fits, the configuration with the least memory, marked
    `fits=False`). `schedules`: the pipeline schedules to weigh (runtime/schedules.py's names; their
    bubbles from the event simulator, planning/schedule_choice.py, their memory from each schedule's
    own peak of activations held); None: the papers' Megatron, 1F1B or interleaved 1F1B when v > 1.
    """
    v = virtual
    for name, x in dict(hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq=seq, tp=tp, pp=pp,
                        dp=dp, global_batch=global_batch).items():
        require_positive_int(name, x)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if hidden % heads or heads % tp:
        raise ValueError(f"tp={tp} must divide heads={heads}, and heads must divide hidden={hidden}")
    if global_batch % dp:
        raise ValueError(f"dp={dp} does not divide global_batch={global_batch}")
    if pp > layers:
        raise ValueError(f"pp={pp} is more pipeline stages than layers={layers}")
    if microbatch is not None:
        require_positive_int("microbatch", microbatch)
        if (global_batch // dp) % microbatch:
            raise ValueError(f"microbatch={microbatch} does not divide the per-replica batch "
                             f"global_batch/dp = {global_batch}/{dp} = {global_batch // dp}")
    require_positive_int("ep", ep)
    require_positive_int("cp", cp)
    if zero not in (1, 2, 3):
        raise ValueError(f"zero must be 1, 2 or 3, got {zero!r}")
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"precision must be 'bf16' or 'fp8', got {precision!r}")
    if precision == "fp8" and get_hardware(hardware).fp8_tflops <= 0:
        raise ValueError(f"precision='fp8' on {get_hardware(hardware).name}: it has no FP8 tensor cores")
    distributed_optimizer = distributed_optimizer or zero > 1
    if seq % (2 * cp):
        raise ValueError(f"cp={cp} cuts the sequence in 2 * cp = {2 * cp} pieces, which seq={seq} is not a multiple of")
    if ep > 1 and moe is None:
        raise ValueError(f"ep={ep} needs experts: a dense model has ep=1")
    if (problem := expert_split_problem(dp, ep, moe.experts if moe else None, cp=cp)) is not None:
        raise ValueError(problem)
    if v is not None:
        require_positive_int("virtual", v)
        if v > 1 and (pp == 1 or layers % (pp * v)):
            raise ValueError(f"virtual={v} needs pp > 1 and layers={layers} divisible by pp*virtual={pp * v}")
    hw = get_hardware(hardware)
    pairs = candidates(layers=layers, pp=pp, dp=dp, global_batch=global_batch, microbatch=microbatch, virtual=v)
    if not pairs:
        raise ValueError(f"virtual={v} needs the {global_batch // dp // (microbatch or 1)} microbatches per "
                         f"replica divisible by pp={pp} (interleaved schedule)")
    shape = dict(hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq=seq, tp=tp, pp=pp, dp=dp,
                 global_batch=global_batch, recompute=recompute, sequence_parallel=sequence_parallel,
                 overlap_grad_reduce=overlap_grad_reduce, gather_logits=gather_logits,
                 distributed_optimizer=distributed_optimizer, moe=moe, ep=ep, cp=cp, kv_heads=kv_heads,
                 cp_overlap=cp_overlap, attention=attention, zero=zero, fp8=precision == "fp8")
    # zero=3 does not run the zero-bubble schedules (the runtime refuses them: W would need B's gathers)
    runs = [(mb, vv, s) for mb, vv in pairs for s in _schedules_for(vv, pp, schedules)
            if not (zero == 3 and schedule_spec(s).split)]
    if not runs:
        raise ValueError(f"zero=3 runs none of the schedules {schedules} (the zero-bubble ones are not built with it)")
    results = [_one(hw, microbatch=mb, v=vv, schedule=s, **shape) for mb, vv, s in runs]
    fitting = [e for e in results if e.fits]
    best = min(fitting, key=lambda e: e.seconds_per_iteration) if fitting else \
        min(results, key=lambda e: e.memory_gib_per_gpu)
    if schedules is None or pp == 1:
        return best
    # why this schedule: the others weighed at the same microbatch size
    others = tuple(f"{e.schedule} v={e.virtual}: {e.seconds_per_iteration:.2f} s, {e.memory_gib_per_gpu:.1f} GiB"
                   + ("" if e.fits else " (does NOT fit)") for e in results if e.microbatch == best.microbatch)
    return dataclasses.replace(best, schedules_weighed=others)


def _schedules_for(v: int, pp: int, names: tuple[str, ...] | None) -> list[str]:
    """The schedules that run v chunks per rank among `names` (None: Megatron's for v)."""
    if names is None or pp == 1:
        return ["interleaved" if v > 1 else "1f1b"]
    out = []
    for name in names:
        chunks = schedule_spec(name).chunks
        if chunks == v or (chunks is None and v > 1):
            out.append(name)
    return out


def _one(hw: Hardware, *, hidden, layers, heads, vocab, seq, tp, pp, dp, global_batch, microbatch, v,
         recompute, sequence_parallel, overlap_grad_reduce, gather_logits, distributed_optimizer, moe, ep, cp,
         kv_heads, cp_overlap, attention, zero: int = 1, schedule: str = "1f1b", fp8: bool = False) -> Estimate:
    sym = dict(h=hidden, l=layers, a=heads, V=vocab, s=seq, b=microbatch, B=global_batch, t=tp, p=pp,
               d=dp, v=v)
    x = LayerShape(microbatch, seq // cp, hidden, heads, tp, sequence_parallel)     # this rank's tokens
    m = global_batch // (dp * microbatch)
    layer_forward, layer_backward, layer_comm = _layer_seconds(x, hw, recompute, fp8)
    dims = ParallelDims(tp=tp, pp=pp, dp=dp, ep=ep if moe else 1, cp=cp)      # the runtime's mesh: node_links.py
    ring = ring_seconds(x, hw, cp=cp, kv_heads=kv_heads, recompute=recompute, overlap=cp_overlap,
                        link_gb_s=link_gb_s(hw, dims, "cp"))
    layer_forward, layer_backward = layer_forward + ring.forward, layer_backward + ring.backward
    experts = moe_layer_costs(x, hw, moe, ep, link_gb_s(hw, dims, "ep")) \
        if moe else MoELayerCosts(0.0, 0.0, 0.0, 0.0, 0.0)
    layer_forward += experts.forward
    layer_backward += experts.backward + (experts.forward if recompute == "full" else 0.0)
    layer_ep = experts.all_to_all * (3 if recompute == "full" else 2)     # forward, backward, recomputed
    # ranks sharing fewer CPU cores than there are ranks run in turns: compute, and every message,
    # which waits for its peer's turn
    share = max(1.0, tp * pp * dp * cp / hw.cores) if hw.cores else 1.0
    layer_forward, layer_backward = share * layer_forward, share * layer_backward
    layer_compute = layer_forward + layer_backward
    embed, head, embed_comm = _ends_seconds(x, vocab, hw)
    embed, head = share * embed, share * head
    per_rank = math.ceil(layers / pp)
    ends = embed + head if pp == 1 else max(embed, head)
    work_compute = per_rank * layer_compute + ends
    work_comm = per_rank * layer_comm + embed_comm
    if gather_logits:       # an all-gather moves half an all-reduce's bytes
        work_comm += allreduce_seconds(2 * microbatch * seq * vocab, tp, hw.nvlink_gb_s, hw) / 2 * (tp > 1)
    work_comm *= share
    work_ep = share * per_rank * layer_ep
    work_cp = share * per_rank * ring.comm_exposed
    work = work_compute + work_comm + work_ep + work_cp
    split = 0.0
    if schedule_spec(schedule).split and pp > 1:
        # B and W: half the backward each (a layer's weight-gradient matmuls are as long as its
        # input-gradient ones); under full recompute the runtime computes a recomputed region's weight
        # gradients in B (runtime/backward_split.py), so W is empty. Split, they cost the hardware's
        # split_backward times one whole backward.
        f = per_rank * layer_forward
        rest = work - f
        w = 0.0 if recompute == "full" else rest / 2
        split = (hw.split_backward - 1.0) * rest
        bubble = bubble_of(schedule, pp, v, m, StageTimes(f, (rest - w) * hw.split_backward, w * hw.split_backward))
    else:
        bubble = evaluate("bubble_fraction", p=pp, v=v, m=m)
    breakdown = {"compute": m * work_compute, "tp_comm": m * work_comm, "bubble": bubble * m * (work + split)}
    if split:
        breakdown["backward_split"] = m * split
    if moe is not None:
        breakdown["ep_comm"] = m * work_ep
    if cp > 1:
        breakdown["cp_comm"] = m * work_cp
    tied = 0.0
    if pp > 1:
        link = link_gb_s(hw, dims, "pp")
        sent = evaluate("p2p_bytes_per_gpu", **sym) * hw.activation_bytes / 2
        hop = (hw.latency_us * 1e-6 + sent / (link * 1e9 * hw.network_efficiency)
               + tp_allreduce_seconds(x, hw) / 2)          # the all-gather: half an all-reduce
        breakdown["p2p"] = 2 * v * m * hop * share
        # GPT's tied embedding: the first and last stage add their gradients.
        tied = allreduce_seconds(2 * vocab * hidden / tp, 2, link_gb_s(hw, dims, "shared"), hw)
    grads = evaluate("dp_allreduce_bytes", **sym) * hw.reduce_bytes / 2    # formula: fp16 gradients
    expert_grads = 0.0 if moe is None else \
        per_rank * 3 * hidden * moe.ffn * moe.experts / (tp * ep) * hw.reduce_bytes
    dp_link = link_gb_s(hw, dims, "dp")
    grads += per_rank * experts.params * hw.reduce_bytes - expert_grads      # the dense part, over dp
    grad_reduce = allreduce_seconds(grads, dp * cp, dp_link, hw) + allreduce_seconds(expert_grads, dp * cp // ep, dp_link, hw)
    if overlap_grad_reduce:     # bucketed all-reduce hidden behind the last microbatch's backward
        grad_reduce = max(grad_reduce - per_rank * layer_backward, 0.0)
    if zero > 1:                # reduce-scattered per microbatch instead (fsdp_comm)
        grad_reduce = 0.0
        breakdown["fsdp_comm"] = share * m * _fsdp_seconds(grads / per_rank if per_rank else 0.0, hw, dp * cp, dp_link,
                                                           per_rank, layer_forward, layer_backward, zero)
    breakdown["dp_comm"] = (tied + grad_reduce) * share
    params = evaluate("parameters_per_gpu", **sym) + per_rank * experts.params
    tensors = 12 * per_rank + 4        # GPT: 12 per layer; embeddings and the final norm's 2
    if distributed_optimizer:          # each rank steps its share: dense over dp x cp, experts over dp x cp / ep
        held_experts = per_rank * experts.expert_params
        params = (params - held_experts) / (dp * cp) + held_experts * ep / (dp * cp)
    breakdown["optimizer"] = share * hw.optimizer_seconds(params, tensors)
    if hw.step_overhead_s:
        breakdown["fixed"] = share * hw.step_overhead_s
    seconds = sum(breakdown.values())

    flops = evaluate({"full": "flops_full_recompute", "selective": "flops_selective_recompute",
                      "none": "flops_no_recompute"}[recompute], **sym)
    model_flops = evaluate("flops_no_recompute", **sym)
    moe_flops = experts.flops * layers * global_batch / microbatch      # forward, the whole batch
    flops += moe_flops * {"full": 4, "selective": 3, "none": 3}[recompute]
    model_flops += 3 * moe_flops
    gpus = tp * pp * dp * cp
    busiest, held = busiest_rank(hw, hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq=seq // cp, tp=tp, pp=pp,
                                 microbatch=microbatch, microbatches=m, virtual=v, recompute=recompute,
                                 sequence_parallel=sequence_parallel, dp=dp * cp, ep=ep, expert_params=experts.expert_params,
                                 attention=attention,
                                 distributed_optimizer=distributed_optimizer, layer_params_added=experts.params,
                                 schedule=schedule, zero=zero,
                                 ffn=4.0 if moe is None else 2 * moe.top_k * moe.ffn / hidden)
    memory = held.peak
    return Estimate(hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq=seq, tp=tp, pp=pp, dp=dp,
                    global_batch=global_batch, microbatch=microbatch, virtual=v, hardware=hw.name, recompute=recompute,
                    sequence_parallel=sequence_parallel, seconds_per_iteration=seconds,
                    tflops_per_gpu=flops / seconds / gpus / 1e12,
                    model_tflops_per_gpu=model_flops / seconds / gpus / 1e12,
                    memory_gib_total=hw.memory_gib, memory_gib_per_gpu=memory / 2**30, fits=memory <= (1 - RESERVED) * hw.memory_gib * 2**30,
                    peak_tflops=hw.peak_tflops, breakdown=breakdown, memory=held, busiest_pp_rank=busiest, ep=ep, moe=moe,
                    cp=cp, schedule=schedule, distributed_optimizer=distributed_optimizer, zero=zero)


def _fsdp_seconds(layer_grad_bytes: float, hw: Hardware, ranks: int, link_gb_s: float, layers: int,
                  forward: float, backward: float, zero: int) -> float:
    """One microbatch's exposed fully-sharded collectives on a rank of `layers` layers: each layer's
    gradients reduce-scattered after its backward (zero 2, 3) and its weights all-gathered before its
    forward and its backward (3), each hidden behind the layer's compute where it is shorter; the
    first gather of a forward is exposed whole. An all-gather or a reduce-scatter moves half an
    all-reduce's bytes."""
    if ranks == 1 or layers == 0:
        return 0.0
    scatter = allreduce_seconds(layer_grad_bytes, ranks, link_gb_s, hw) / 2
    if zero < 3:
        return layers * max(scatter - backward, 0.0)
    weights = layer_grad_bytes / hw.reduce_bytes * hw.weight_bytes
    gather = allreduce_seconds(weights, ranks, link_gb_s, hw) / 2
    return gather + layers * (max(gather - forward, 0.0) + max(gather + scatter - backward, 0.0))
