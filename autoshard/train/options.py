"""`autoshard train`'s command line: the options, their defaults, and the checks that need no model."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from autoshard.passes.recompute import RECOMPUTE_MODES
from autoshard.planning.hardware import PRESETS

__all__ = ["TrainError", "TrainOptions", "add_rendezvous_flags", "parser", "parse", "rendezvous_problem"]


class TrainError(Exception):
    """A bad input to `autoshard train`, said in one line."""


@dataclass
class TrainOptions:
    model: str
    data: str
    out: str
    text_field: str
    layers: int | None
    hidden: int | None
    heads: int | None
    kv_heads: int | None
    ffn: int | None
    vocab: int | None
    max_positions: int | None
    tp: int
    pp: int
    virtual: int
    dp: int | None
    ep: int
    cp: int
    microbatches: int | None
    plan: bool
    sequence_parallel: bool
    fuse: bool
    recompute: str | None
    distributed_optimizer: bool
    zero: int | None
    precision: str | None
    fp8_recipe: str
    device: str
    seq_len: int
    batch: int
    steps: int
    lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    clip: float
    seed: int
    save_every: int
    resume: bool
    export: str | None
    log_every: int
    hardware: str | None
    nproc_per_node: int | None
    in_process: bool
    halt_after: int | None
    verify: bool
    nnodes: int | None
    node_rank: int
    rdzv_endpoint: str | None
    rdzv_id: str
    rdzv_conf: str | None
    max_restarts: int
    allow_cross_node_tp: bool
    slurm_script: str | None


def add_rendezvous_flags(group, restarts: bool) -> None:
    """torchrun's flags for several machines, on `group` of a parser: `autoshard train`'s and
    `autoshard verify --gloo`'s (`restarts`: --max-restarts too, for a run that resumes)."""
    group.add_argument("--nnodes", type=int, default=None, help="machines, each running this command with "
                       "--nproc-per-node processes; they meet at --rdzv-endpoint (default: this machine alone)")
    group.add_argument("--node-rank", type=int, default=0, help="this machine's place, checked against --nnodes "
                       "(c10d's rendezvous numbers the nodes in the order they join)")
    group.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous, the same on every machine")
    group.add_argument("--rdzv-id", default="autoshard", help="the run's name at the rendezvous, the same on every "
                       "machine")
    group.add_argument("--rdzv-conf", default=None, help="torchrun's rendezvous settings, KEY=VALUE,... (e.g. "
                       "join_timeout=900 for nodes that start slowly, keep_alive_interval=1 to notice a lost node "
                       "sooner)")
    if restarts:
        group.add_argument("--max-restarts", type=int, default=0, help="times torchrun's agents restart the group "
                           "after a process or a node fails; implies --resume (each start continues from --out's "
                           "newest complete checkpoint)")


def rendezvous_problem(args, endpoint_needed: bool = True) -> str | None:
    """What is wrong with `args`' --nnodes, --node-rank, --rdzv-endpoint (and --max-restarts), or None."""
    restarts = getattr(args, "max_restarts", 0)
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes or restarts < 0:
        return (f"--nnodes {args.nnodes} --node-rank {args.node_rank} --max-restarts {restarts}: nnodes must be "
                f"positive, the node rank in 0..nnodes-1, restarts >= 0")
    if args.nnodes > 1 and not args.rdzv_endpoint and endpoint_needed:
        return (f"--nnodes {args.nnodes}: the machines meet at --rdzv-endpoint HOST:PORT (the same on each, e.g. the "
                f"first machine's address and a free port)")
    return None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="autoshard train", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a model on text, sharded tp x pp x dp, under torchrun (or launching it with "
                    "--nproc-per-node). Checkpoints, metrics.csv and loss.png go to --out.")
    m = ap.add_argument_group("model")
    m.add_argument("--model", required=True, help="a transformers model type (llama, gpt2, mistral, qwen2, ...) "
                   "built from its config with the size options below, a local Hugging Face folder (config + "
                   "safetensors, and its tokenizer if present), or module:factory returning an nn.Module whose forward "
                   "takes the token ids and `labels` (shifted inside, as Hugging Face's) or `targets` (the next "
                   "tokens, as nanoGPT's) and returns the loss")
    for flag, what in (("--layers", "num_hidden_layers"), ("--hidden", "hidden_size"), ("--heads", "num_attention_heads"),
                       ("--kv-heads", "num_key_value_heads"),
                       ("--ffn", "intermediate size (default with --hidden: the config's ratio to the hidden size)"),
                       ("--vocab", "vocab_size (default for the byte tokenizer: 384)"),
                       ("--max-positions", "max_position_embeddings")):
        m.add_argument(flag, type=int, default=None, help=f"config override: {what}")
    d = ap.add_argument_group("data")
    d.add_argument("--data", required=True, help="a text file, a JSONL file, or a folder of them")
    d.add_argument("--text-field", default="text", help="the field of each JSONL record that holds its text")
    d.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    d.add_argument("--batch", type=int, default=8, help="sequences per step, over all data-parallel ranks")
    p = ap.add_argument_group("parallelism")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--virtual", "--virtual-pipeline", dest="virtual", type=int, default=1,
                   help="pipeline chunks per rank (interleaved 1F1B when > 1); under torchrun spell it "
                        "--virtual-pipeline (torchrun takes --virtual for its own --virtual-local-rank)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default: the rest of the world)")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism for MoE models: each layer's experts divided "
                                                     "over this many data-parallel ranks (divides dp)")
    p.add_argument("--cp", type=int, default=1, help="context parallelism: each of cp ranks holds 1/cp of every "
                                                     "sequence's tokens (--seq-len a multiple of 2 x cp)")
    p.add_argument("--microbatches", type=int, default=None, help="per data-parallel rank and step (default: 2 x pp)")
    p.add_argument("--plan", action="store_true", help="let the planner choose tp, pp, dp, virtual and microbatches")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=False,
                   help="fused ops (CUDA kernels on a GPU; default: off, on GPUs too: on an H200 they made a "
                        "406M Llama's step 1.50x slower, benchmarks/RESULTS.md)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="where each rank runs: cuda (the GPU of its local rank, NCCL), cpu (gloo); auto: cuda "
                        "when a GPU is visible")
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, default=None,
                   help="activation recomputation (default: none; with --plan, the planner's choice)")
    p.add_argument("--verify", action="store_true",
                   help="before the first step, certify the split against the single-device model (autoshard verify, "
                        "on rank 0, in simulation; a large model on its reduced twin) and stop if it fails")
    p.add_argument("--nproc-per-node", type=int, default=None, help="launch torchrun with this many processes")
    p.add_argument("--in-process", action="store_true",
                   help="with --nproc-per-node N: run the N ranks as threads of this one process, their "
                        "collectives meeting in a local world (autoshard/world/local.py) instead of gloo: the "
                        "same schedule, buckets, optimizer and checkpoints, to try a split on one CPU; CPU only")
    c = ap.add_argument_group("more than one machine (torchrun's rendezvous; see the README)")
    add_rendezvous_flags(c, restarts=True)
    c.add_argument("--allow-cross-node-tp", action="store_true",
                   help="let a tensor-parallel group span two machines (refused by default: its all-reduces would "
                        "cross the network every layer)")
    c.add_argument("--slurm-script", default=None, help="write a SLURM job file that runs this training on --nnodes "
                   "nodes x --nproc-per-node processes (through srun and this command's launcher), then stop")
    o = ap.add_argument_group("optimization")
    o.add_argument("--steps", type=int, default=100)
    o.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW)")
    o.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine decays to lr x this")
    o.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    o.add_argument("--weight-decay", type=float, default=0.1)
    o.add_argument("--clip", type=float, default=1.0, help="gradient clipping by global norm (0: off)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--distributed-optimizer", action="store_true",
                   help="AdamW's state and fp32 gradients' reduction sharded over data-parallel ranks (ZeRO-1)")
    o.add_argument("--zero", type=int, choices=[1, 2, 3], default=None,
                   help="what the data-parallel ranks divide: 1 AdamW's state (as --distributed-optimizer), 2 the "
                        "gradients too, 3 the parameters too (fully sharded data parallelism: each layer gathered "
                        "before its forward and backward, released after)")
    o.add_argument("--precision", choices=["fp32", "bf16", "fp16", "fp8"], default=None,
                   help="compute dtype; bf16/fp16 keep fp32 main weights and gradients in the optimizer "
                        "(fp16: dynamic loss scaling); fp8: the linears' matmuls in float8, bf16 elsewhere "
                        "(autoshard(precision=\"fp8\")). Default: bf16 on GPUs, fp32 on the CPU")
    o.add_argument("--fp8-recipe", choices=["tensorwise", "rowwise"], default="tensorwise",
                   help="with --precision fp8: one scale per tensor (default) or per row (torchao's recipes)")
    r = ap.add_argument_group("output")
    r.add_argument("--out", required=True, help="the run's folder: checkpoints/, metrics.csv, loss.png")
    r.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and at the end)")
    r.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    r.add_argument("--export", default=None, help="at the end, write a single-device Hugging Face folder here")
    r.add_argument("--log-every", type=int, default=1)
    r.add_argument("--hardware", choices=[*sorted(PRESETS), "cpu"], default=None,
                   help="the cost model's hardware, for the estimated step time and --plan: a GPU preset, or cpu "
                        "(this machine, measured once for the model's shapes and kept; 1-2 minutes the first time) "
                        "(default: the GPU this runs on when a preset describes it; on the CPU no estimate, and "
                        "--plan plans for a100-80gb)")
    r.add_argument("--halt-after", type=int, default=None,
                   help="stop abruptly after this step, as a crash would (to test --resume)")
    return ap


def parse(argv: list[str]) -> TrainOptions:
    """The options, checked: positive sizes, and files that exist."""
    args = parser().parse_args(argv)
    opts = TrainOptions(**vars(args))
    for name in ("tp", "pp", "cp", "virtual", "seq_len", "batch", "steps", "save_every", "log_every"):
        if getattr(opts, name) < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(opts, name)}")
    for name in ("dp", "microbatches", "nproc_per_node", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab",
                 "max_positions"):
        if getattr(opts, name) is not None and getattr(opts, name) < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(opts, name)}")
    if opts.warmup < 0 or opts.clip < 0 or opts.lr <= 0 or not 0 <= opts.min_lr_ratio <= 1:
        raise TrainError("--warmup and --clip must be >= 0, --lr > 0, --min-lr-ratio in [0, 1]")
    if not os.path.exists(opts.data):
        raise TrainError(f"--data {opts.data}: no such file or folder")
    looks_like_path = os.sep in opts.model or opts.model.startswith(".")
    if looks_like_path and not os.path.isdir(opts.model):
        raise TrainError(f"--model {opts.model}: no such folder")
    if os.path.isdir(opts.model) and not os.path.isfile(os.path.join(opts.model, "config.json")):
        raise TrainError(f"--model {opts.model}: the folder has no config.json (a Hugging Face model folder needs one)")
    if opts.seq_len % (2 * opts.cp):
        raise TrainError(f"--cp {opts.cp} cuts each sequence in 2 x cp = {2 * opts.cp} equal pieces: --seq-len "
                         f"{opts.seq_len} is not a multiple of {2 * opts.cp}")
    if opts.in_process and (opts.nproc_per_node is None or opts.device == "cuda"):
        raise TrainError("--in-process runs the --nproc-per-node ranks on this CPU: give --nproc-per-node, and "
                         "not --device cuda")
    if opts.nnodes is not None:
        if opts.nproc_per_node is None or opts.in_process:
            raise TrainError("--nnodes launches --nproc-per-node processes on each machine: give --nproc-per-node "
                             "(and not --in-process)")
        if (problem := rendezvous_problem(opts, endpoint_needed=not opts.slurm_script)) is not None:
            raise TrainError(problem)
    if opts.slurm_script and (opts.nnodes is None or opts.nproc_per_node is None):
        raise TrainError("--slurm-script writes a job for --nnodes nodes x --nproc-per-node processes: give both")
    given = opts.dp is not None or opts.microbatches is not None or \
        (opts.tp, opts.pp, opts.cp, opts.virtual) != (1, 1, 1, 1)
    if opts.plan and given:
        raise TrainError("--plan chooses tp, pp, dp, virtual and microbatches itself; give none of them (nor --cp) "
                         "with it")
    return opts
