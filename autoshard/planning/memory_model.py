"""Memory per rank as autoshard's runtime holds it: activations saved for backward, term by term,
times the microbatches in flight on each pipeline rank, plus parameters, gradients and optimizer.

Activation terms (Korthikanti et al. 2022, section 4, re-derived for the tensors our rank graphs
save; e bytes per activation element, m per dropout-mask element, sbh = seq x microbatch x hidden,
t tensor-parallel ranks, "/t*" divided by t only under sequence parallelism):

    term                                   bytes             kept by
    layer input (first norm's input)       e sbh /t*         none, selective, full
    first norm output (QKV's input)        e sbh             none, selective
    Q, K, V                                3 e sbh /t        none, selective
    attention output (out-proj's input)    e sbh /t          none, selective
    attention residual dropout mask        m sbh /t*         none, selective (models that have it)
    second norm input                      e sbh /t*         none, selective
    second norm output (FC1's input)       e sbh             none, selective
    FC1 output (activation's input)        f e sbh /t        none, selective    (f = ffn / hidden)
    activation output (FC2's input)        f e sbh /t        none, selective
    MLP residual dropout mask              m sbh /t*         none, selective
    softmax output                         e a s^2 b /t      none
    attention dropout mask                 m a s^2 b /t      none
    attention dropout output               e a s^2 b /t      none

With e=2, m=1, f=4 and both residual dropouts this is Korthikanti's sbh (10 + 24/t + 5as/(ht)).
Where ours differ: under sequence parallelism the norm outputs are all-gathered before the column
matmul and the matmul saves the gathered (full) copy (Megatron saves the shard and gathers again
in backward), so sbh (4 + 30/t) at 16 bits rather than 34/t. On the CPU, dropout is aten's
decomposition (input x mask with the mask in the input's dtype: m = e = 4 in fp32) where CUDA's
fused kernel keeps 1-byte masks. SDPA with dropout on the CPU runs the math kernel, which saves
the three s^2 terms as written-out attention does; a flash kernel (no dropout) keeps only a
log-sum-exp, e a s b / t (`attention="flash"`).

Layernorm statistics (2 x 4 bytes per token), the causal mask buffer and integer inputs are small
and left out (under 0.5% of a layer at the sizes we measure).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from autoshard.runtime.schedules import frozen_schedule, held_at_peak, peak_in_flight, schedule_spec, stage_owner

__all__ = ["ActivationShape", "ParamBytes", "param_bytes", "in_flight", "RankMemory", "busiest_rank", "gpt_rank_memory", "gpt_params_on_rank", "rank_memory", "TERMS", "layer_activation_bytes", "activation_terms", "inflight_microbatches",
           "inflight_layers", "RECOMPUTE_KEEPS"]


@dataclass(frozen=True)
class ActivationShape:
    """What one layer's saved activations depend on. e: bytes per activation element; m: per mask
    element; ffn: FFN width / hidden; resid_dropouts: residual dropouts per layer (GPT-2 and
    Megatron's GPT: 2; nanoGPT: 1, after the MLP); attention: "math" (s^2 terms saved) or "flash"."""
    s: int
    b: int
    h: int
    a: int
    t: int = 1
    sp: bool = False
    e: int = 2
    m: int = 1
    ffn: float = 4.0
    resid_dropouts: int = 2
    attention: str = "math"
    dropout: bool = True


# name -> (bytes as a function of the shape, the recompute modes that keep it)
_ALL, _NOT_FULL, _NONE = ("none", "selective", "full"), ("none", "selective"), ("none",)


def _spt(x: ActivationShape) -> int:
    return x.t if x.sp else 1


TERMS: dict[str, tuple[object, tuple[str, ...]]] = {
    "layer input": (lambda x: x.e * x.s * x.b * x.h / _spt(x), _ALL),
    "first norm output": (lambda x: x.e * x.s * x.b * x.h, _NOT_FULL),
    "q, k, v": (lambda x: 3 * x.e * x.s * x.b * x.h / x.t, _NOT_FULL),
    "attention output": (lambda x: x.e * x.s * x.b * x.h / x.t, _NOT_FULL),
    "attention residual dropout mask": (lambda x: x.m * x.s * x.b * x.h / _spt(x) * (x.resid_dropouts >= 2) * x.dropout,
                                        _NOT_FULL),
    "second norm input": (lambda x: x.e * x.s * x.b * x.h / _spt(x), _NOT_FULL),
    "second norm output": (lambda x: x.e * x.s * x.b * x.h, _NOT_FULL),
    "fc1 output": (lambda x: x.ffn * x.e * x.s * x.b * x.h / x.t, _NOT_FULL),
    "activation output": (lambda x: x.ffn * x.e * x.s * x.b * x.h / x.t, _NOT_FULL),
    "mlp residual dropout mask": (lambda x: x.m * x.s * x.b * x.h / _spt(x) * (x.resid_dropouts >= 1) * x.dropout,
                                  _NOT_FULL),
    "softmax output": (lambda x: x.e * x.a * x.s * x.s * x.b / x.t if x.attention == "math"
                       else x.e * x.a * x.s * x.b / x.t, _NONE),
    "attention dropout mask": (lambda x: x.m * x.a * x.s * x.s * x.b / x.t * (x.attention == "math") * x.dropout,
                               _NONE),
    "attention dropout output": (lambda x: x.e * x.a * x.s * x.s * x.b / x.t * (x.attention == "math") * x.dropout,
                                 _NONE),
}
RECOMPUTE_KEEPS = {mode: [n for n, (_, keeps) in TERMS.items() if mode in keeps] for mode in _ALL}


def weight_gradient_inputs(x: ActivationShape, recompute: str) -> float:
    """Bytes one layer's B leaves for its W in a zero-bubble schedule (runtime/backward_split.py):
    the gradient arriving at each op that reads a weight: the two norms' outputs, Q/K/V, the
    out-projection's partial sums, FC1 and FC2's outputs. None under full recomputation: a
    recomputed region's weight gradients are computed in B."""
    if recompute == "full":
        return 0.0
    return x.e * x.s * x.b * x.h * (2 / _spt(x) + (3 + x.ffn) / x.t + 2)


def activation_terms(x: ActivationShape, recompute: str) -> dict[str, float]:
    """Bytes of each term one layer keeps for one microbatch under `recompute`."""
    if recompute not in RECOMPUTE_KEEPS:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_KEEPS)}, got {recompute!r}")
    return {name: float(TERMS[name][0](x)) for name in RECOMPUTE_KEEPS[recompute]}


def layer_activation_bytes(x: ActivationShape, recompute: str) -> float:
    return sum(activation_terms(x, recompute).values())


def inflight_microbatches(schedule: str, pp: int, rank: int, microbatches: int, virtual: int = 1) -> float:
    """Microbatches whose activations pipeline rank `rank` holds at once, at its peak (in chunks of
    l/(p v) layers when virtual > 1, else of l/p layers): GPipe all m; 1F1B min(p - rank, m);
    interleaved 1F1B Megatron's warm-up, (p - rank - 1) * 2 + (v - 1) * p chunk forwards, plus the
    one that starts the steady state, at most m v (all of them when m = p: every forward runs first).
    The zero-bubble schedules hold a chunk from its F to its W: read from the schedule itself."""
    if schedule_spec(schedule).split:
        return _split_peaks(schedule, pp, virtual, min(microbatches, 4 * pp))[rank]
    if schedule == "gpipe":
        return microbatches * virtual
    if virtual == 1:
        return min(pp - rank, microbatches)
    if microbatches == pp:
        return microbatches * virtual
    warmup = (pp - rank - 1) * 2 + (virtual - 1) * pp
    return min(warmup + 1, microbatches * virtual)


@lru_cache(maxsize=1024)
def _split_peaks(schedule: str, pp: int, virtual: int, microbatches: int) -> tuple[int, ...]:
    """Each rank's peak of chunks held; it stops growing once m reaches 4 pp (the schedules' caps
    bind well before: tests/unit/test_zero_bubble_schedules.py), so the planner asks at most that."""
    return tuple(peak_in_flight(frozen_schedule(schedule, pp, virtual, microbatches)))


@lru_cache(maxsize=4096)
def _split_held(schedule: str, pp: int, virtual: int, microbatches: int, ratio: float) -> tuple[tuple[int, int], ...]:
    return tuple(held_at_peak(frozen_schedule(schedule, pp, virtual, microbatches), ratio))


def inflight_layers(schedule: str, pp: int, rank: int, microbatches: int, layers_here: int, virtual: int = 1) -> float:
    """Layer-microbatches of activations rank `rank` holds at its peak (`layers_here`: its layers, all chunks)."""
    return inflight_microbatches(schedule, pp, rank, microbatches, virtual) * layers_here / virtual


def gpt_params_on_rank(*, h: int, layers_here: int, vocab: int, positions: int, t: int, first: bool, last: bool,
                       padded_vocab: int | None = None) -> int:
    """Parameters a GPT rank holds (GPT-2 / nanoGPT layout: biases everywhere, learned positions,
    tied embedding): per layer 12h^2/t + 7h/t (split weights and biases) + 6h (two norms, the two
    row-parallel biases); the first stage the embedding's vocabulary shard and the position table;
    the last the final norm and, unless it is also the first, its copy of the tied embedding."""
    per_layer = 12 * h * h // t + 7 * h // t + 6 * h
    rows = (padded_vocab or vocab) // t
    return layers_here * per_layer + (rows * h + positions * h if first else 0) + \
        ((2 * h + (0 if first else rows * h)) if last else 0)


@dataclass(frozen=True)
class ParamBytes:
    """Bytes a rank holds per parameter, by what: Megatron's accounting (and the runtime's, checked
    in benchmarks/distributed_optimizer.py). bf16 weights with AdamW: 2 + 4 + 4 + 8 = 18, and with
    the distributed optimizer 2 + 4 + (4 + 8) / dp = 6 + 12/dp; fp32 (the CPU runs here): 16, and
    8 + 8/dp, the fp32 weights being their own main copy."""
    weights: float      # the parameters in the compute dtype
    grads: float        # the gradients as held (the distributed optimizer's fp32 buffer)
    main: float         # fp32 main parameters apart from the weights (0 when the weights are fp32)
    moments: float      # the optimizer's state

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.main + self.moments


def param_bytes(weight_bytes: int, grad_bytes: int, *, dp: int = 1, distributed_optimizer: bool = False,
                moments: int = 2, zero: int = 1) -> ParamBytes:
    """`moments` fp32 tensors of optimizer state per parameter (AdamW: 2); the main parameters and
    moments are divided over the dp ranks by the distributed optimizer, the gradients too at
    `zero` 2 and the weights too at 3 (what is gathered for a step is the memory model's
    `in_flight`)."""
    shards = dp if distributed_optimizer or zero > 1 else 1
    return ParamBytes(weight_bytes / (shards if zero == 3 else 1), grad_bytes / (shards if zero > 1 else 1),
                      (0 if weight_bytes == 4 else 4) / shards, 4 * moments / shards)


def in_flight(largest: float, layer: float, weight_bytes: int, grad_bytes: int, zero: int) -> float:
    """Bytes fully sharded data parallelism holds beyond the shards at a backward's peak, from the
    parameters of the rank's largest unit (a layer, or the embedding's or head's rows) and of a
    layer: at zero=3 two units gathered (the one computing and the next, prefetched), and at zero 2
    and 3 three units' gradients of one backward pass (the one filling and two being
    reduce-scattered: runtime/grad_buffer.py keeps at most two in flight)."""
    return (largest + layer) * (weight_bytes if zero == 3 else 0) + \
        (largest + 2 * layer) * (grad_bytes if zero > 1 else 0)


@dataclass(frozen=True)
class RankMemory:
    """Predicted peak bytes of one rank, by cause (see `rank_memory`)."""
    state: float            # weights and optimizer state, live all step
    gradients: float        # allocated in the rank's first backward, kept to the optimizer step
    activations: float      # saved for backward by the microbatches in flight at the peak
    working: float          # one layer recomputed, gradients in flight, the loss's logits
    peak: float

    def explain(self) -> str:
        mib = 2 ** 20
        return (f"{self.peak / mib:.1f} MiB = state {self.state / mib:.1f} + gradients {self.gradients / mib:.1f} + "
                f"activations {self.activations / mib:.1f} + working {self.working / mib:.1f}")


def rank_memory(x: ActivationShape, *, params: int, per_param: ParamBytes, recompute: str, layers_here: int, inflight: float, chunk_microbatches: int, virtual: int = 1,
                vocab_here: int = 0, waiting_for_w: float = 0.0, gathered: float = 0.0) -> RankMemory:
    """Peak bytes of one rank during a training step.

    The peak is at the start of a backward: the in-flight microbatches' saved activations (each
    `layers_here / virtual` layers' worth), plus what that backward needs at once (one layer's full
    activations when recomputing, two FFN-sized gradients, and on the last stage the loss's logits,
    their softmax and gradient: 3 x 4 bytes x b s V/t). Gradients are allocated by the rank's first
    backward and kept; they add to the peak of a later backward when more chunk-microbatches than
    `inflight` run (else the first backward is the peak, and its own freed activations make room
    for them: at most one chunk fewer in flight with the gradients). `waiting_for_w`: chunks whose B
    has run and whose W has not, at that peak (zero-bubble schedules), each keeping
    `weight_gradient_inputs` per layer besides its activations. `gathered`: fully sharded data
    parallelism's units and gradients in flight (`in_flight`), working memory too."""
    chunk = layers_here / virtual * layer_activation_bytes(x, recompute)
    working = 2 * x.ffn * x.e * x.s * x.b * x.h / x.t + 12 * x.b * x.s * vocab_here + gathered
    if recompute != "none":      # what the recomputation makes again, for one layer
        working += layer_activation_bytes(x, "none") - layer_activation_bytes(x, recompute)
    grads = per_param.grads * params
    state = (per_param.total - per_param.grads) * params
    later = inflight * chunk + grads if chunk_microbatches > inflight else max(0.0, inflight - 1) * chunk + grads
    acts = inflight * chunk + waiting_for_w * layers_here / virtual * weight_gradient_inputs(x, recompute)
    later += acts - inflight * chunk
    peak = state + working + max(acts, later)
    return RankMemory(state, grads, acts, working, peak)


def gpt_rank_memory(hw, *, hidden: int, layers: int, heads: int, vocab: int, seq: int, tp: int, pp: int,
                    pp_rank: int, microbatch: int, microbatches: int, virtual: int, recompute: str,
                    sequence_parallel: bool, resid_dropouts: int = 2, dp: int = 1,
                    distributed_optimizer: bool = False, layer_params_added: float = 0.0,
                    ffn: float = 4.0, expert_params: float = 0.0, ep: int = 1, attention: str = "math",
                    schedule: str | None = None, zero: int = 1) -> RankMemory:
    """Peak of pipeline rank `pp_rank` for a GPT of these shapes on `hw` (its activation, mask,
    weight and gradient bytes) under 1F1B (interleaved when virtual > 1), with AdamW's state whole or
    divided over `dp` ranks (`distributed_optimizer`). A mixture-of-experts layer: its parameters
    beyond the dense layer's on this rank (`layer_params_added`) and its MLP activations as an FFN
    width `ffn` x hidden (planning/moe_cost.py); `expert_params` of them per layer are experts, whose
    optimizer state the distributed optimizer divides over dp / ep ranks only. `attention`: "math"
    (the s^2 scores kept) or "flash" (a fused kernel: a log-sum-exp per row). `schedule`: another
    pipeline schedule (runtime/schedules.py) than 1F1B / interleaved; a V schedule puts the first and
    the last stage on pipeline rank 0. `zero`: 2 and 3 divide the gradients, 3 the weights too,
    over dp (fully sharded data parallelism), with what they gather in flight."""
    x = ActivationShape(s=seq, b=microbatch, h=hidden, a=heads, t=tp, sp=sequence_parallel,
                        e=hw.activation_bytes, m=hw.mask_bytes, resid_dropouts=resid_dropouts, ffn=ffn,
                        attention=attention)
    schedule = schedule or ("interleaved" if virtual > 1 else "1f1b")
    here = -(-layers // pp)
    last_rank = stage_owner(pp * virtual - 1, pp, schedule_spec(schedule).placement)[0]
    first, last = pp_rank == 0, pp_rank == last_rank
    params = gpt_params_on_rank(h=hidden, layers_here=here, vocab=vocab, positions=seq, t=tp, first=first, last=last)
    params += int(here * layer_params_added)
    per_param = param_bytes(hw.weight_bytes, hw.grad_bytes, dp=dp, distributed_optimizer=distributed_optimizer,
                            zero=zero)
    if (distributed_optimizer or zero > 1) and ep > 1 and expert_params:      # bytes per parameter, both kinds
        experts = here * expert_params
        held = param_bytes(hw.weight_bytes, hw.grad_bytes, dp=dp // ep, distributed_optimizer=True, zero=zero)
        mix = lambda a, b: (a * (params - experts) + b * experts) / params        # noqa: E731
        per_param = ParamBytes(*(mix(getattr(per_param, f), getattr(held, f))
                                 for f in ("weights", "grads", "main", "moments")))
    if schedule_spec(schedule).split:
        ratio = weight_gradient_inputs(x, recompute) / layer_activation_bytes(x, recompute)
        inflight, waiting = _split_held(schedule, pp, virtual, min(microbatches, 4 * pp), round(ratio, 2))[pp_rank]
    else:
        inflight, waiting = inflight_microbatches(schedule, pp, pp_rank, microbatches, virtual), 0
    # the largest unit: a layer, or the embedding's or head's vocabulary rows on the first / last stage
    layer = 12 * hidden * hidden / tp + layer_params_added
    largest = max(layer, hidden * vocab / tp if first or last else 0)
    return rank_memory(x, params=params, per_param=per_param, recompute=recompute, layers_here=here,
                       inflight=inflight, waiting_for_w=waiting,
                       gathered=in_flight(largest, layer, hw.weight_bytes, hw.grad_bytes, zero),
                       chunk_microbatches=microbatches * virtual, virtual=virtual,
                       vocab_here=-(-vocab // tp) if last else 0)


def busiest_rank(hw, *, pp: int, **shape) -> tuple[int, RankMemory]:
    """The pipeline rank with the most memory and its peak (`gpt_rank_memory`'s arguments)."""
    return max(((r, gpt_rank_memory(hw, pp=pp, pp_rank=r, **shape)) for r in range(pp)), key=lambda f: f[1].peak)
