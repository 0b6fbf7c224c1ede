"""One process's part of `autoshard train`: build the model, shard it, resume, train, checkpoint,
report, export. Every rank runs this under torchrun (or one process alone, its own gloo group)."""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import sys
import time

import torch
import torch.distributed as dist

from autoshard import autoshard
from autoshard import checkpoint as ck
from autoshard.checkpoint.convert import consolidate, load_from_file
from autoshard.checkpoint.index import INDEX, CheckpointError
from autoshard.checkpoint.materialize import materialize
from autoshard.errors import expert_split_problem
from autoshard.planning.hardware import Hardware
from autoshard.runtime.distributed_optimizer import DistributedOptimizer
from autoshard.runtime.json_gather import all_gather_json
from autoshard.train import model_source
from autoshard.train.cluster import check_shared_folder, node_layout
from autoshard.train.device import Placement, move_runtime, placement
from autoshard.train.data import Batches, ByteTokenizer, HFTokenizer, prepare_tokens, tokenizer_for
from autoshard.train.lr import learning_rate
from autoshard.train.metrics import Reporter, StepMetrics, estimated_step_seconds
from autoshard.train.options import TrainError, TrainOptions
from autoshard.train.plot import loss_curve
from autoshard.train.run_hardware import hardware_name, run_hardware
from autoshard.train.verify_first import verify_first
from autoshard.world import current

# what --plan plans for where no preset describes the machine (the CPU): said on the run's first line
PLAN_DEFAULT = "a100-80gb"

__all__ = ["run", "split_of", "check_data"]

# what a checkpoint records of the run, checked on --resume (the data and the schedule must match
# for the continuation to be the same run)
_RUN_KEYS = ("seq_len", "batch", "seed", "steps", "lr", "warmup", "min_lr_ratio", "data_key")


def _in_process() -> bool:
    """A rank thread of --in-process's local world (a lone process's default world is a local world
    of one, and needs its process group all the same)."""
    world = current()
    return world.backend == "local" and world.size() > 1


def _init(backend: str) -> None:
    if dist.is_initialized() or _in_process():      # --in-process: the local world is the group
        return
    if "RANK" in os.environ:
        dist.init_process_group(backend)
        return
    with socket.socket() as s:                  # one process, no torchrun: its own group of one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _on_rank0(fn):
    """fn() on rank 0, its result (or its TrainError) given to every rank."""
    box: list = [None, None]
    if current().rank() == 0:
        try:
            box[0] = fn()
        except TrainError as e:
            box[1] = str(e)
    box = current().broadcast_object(box, src=0)
    if box[1] is not None:
        raise TrainError(box[1])
    return box[0]


# what the banner says the data-parallel ranks divide, by zero stage
_ZERO_WORDS = {1: "AdamW state", 2: "AdamW state and gradients (zero=2)",
               3: "parameters, gradients and AdamW state (zero=3)"}


def split_of(opts: TrainOptions, world: int) -> dict:
    """tp, pp, dp, cp, virtual, microbatches from the options and the world size (not with --plan)."""
    tp, pp, cp = opts.tp, opts.pp, opts.cp
    with_cp = f" x cp={cp}" if cp > 1 else ""
    if world % (tp * pp * cp):
        raise TrainError(f"the world has {world} processes, not a multiple of tp={tp} x pp={pp}{with_cp} = "
                         f"{tp * pp * cp}")
    dp = opts.dp or world // (tp * pp * cp)
    if tp * pp * dp * cp != world:
        raise TrainError(f"the world has {world} processes but tp={tp} x pp={pp} x dp={dp}{with_cp} = "
                         f"{tp * pp * dp * cp}")
    micro = opts.microbatches or (2 * pp if pp > 1 else 1)
    if opts.batch % (dp * micro):
        raise TrainError(f"--batch {opts.batch} cannot be split into dp={dp} x microbatches={micro} equal parts")
    if (problem := expert_split_problem(dp, opts.ep, cp=cp)) is not None:
        raise TrainError(f"--ep: {problem}")
    split = dict(tp=tp, pp=pp, dp=dp, ep=opts.ep, cp=cp, virtual=opts.virtual, microbatches=micro)
    return {**split, "zero": opts.zero} if opts.zero else split


def _peak_gib(place: Placement) -> float | None:
    """This rank's peak CUDA memory so far (GiB), or None on the CPU."""
    return torch.cuda.max_memory_allocated(place.device) / 2**30 if place.is_cuda else None


def check_data(opts: TrainOptions, tokenizer) -> str:
    """The token file of --data (tokenized once, cached under --out), after checking it holds at
    least one sequence of --seq-len; TrainError otherwise. (A model that reads one token past each
    sequence for its targets needs one more: said when the ranks open their batches.)"""
    token_file = prepare_tokens(opts.data, tokenizer, opts.text_field, os.path.join(opts.out, "data"))
    Batches.open(token_file, seq_len=opts.seq_len, global_batch=opts.batch, dp=1, dp_rank=0, seed=opts.seed)
    return token_file


def _check_fit(opts: TrainOptions, source: model_source.ModelSource, tokenizer) -> None:
    if source.max_positions is not None and opts.seq_len > source.max_positions:
        raise TrainError(f"--seq-len {opts.seq_len} is beyond the model's {source.max_positions} positions")
    if source.vocab is not None and tokenizer.vocab > source.vocab:
        raise TrainError(f"the {tokenizer.name} tokenizer has {tokenizer.vocab} ids but the model's vocabulary "
                         f"has {source.vocab} (--vocab)")


def _fp8(opts: TrainOptions) -> dict:
    return dict(precision="fp8", fp8_recipe=opts.fp8_recipe) if opts.precision == "fp8" else {}


def _compile(opts: TrainOptions, source, world: int, hardware: str | Hardware | None, device: str):
    """The compiled program and its split. The example batch is made on `device`, where the model
    was put for capture: torch.export refuses an embedding whose weight and ids sit on two devices."""
    example = torch.zeros((2, opts.seq_len), dtype=torch.long, device=device)  # 2: a size 1 would be specialized
    if opts.plan:       # planned at --seq-len tokens: the example's
        prog = autoshard(source.model, world_size=world, global_batch=opts.batch, hardware=hardware or PLAN_DEFAULT,
                         sequence_parallel=opts.sequence_parallel, fuse=opts.fuse, recompute=opts.recompute, **_fp8(opts),
                         distributed_optimizer=True if opts.distributed_optimizer or opts.zero else None,
                         zero=opts.zero or 1, example_kwargs={source.input_name: example, source.label_name: example})
        split = dict(tp=prog.tp, pp=prog.pp, dp=prog.dp, ep=prog.dims.ep, virtual=prog.virtual,
                     microbatches=prog.microbatches, recompute=prog.recompute,
                     distributed_optimizer=prog.planned.distributed_optimizer, zero=prog.zero)
        if opts.batch % (split["dp"] * split["microbatches"]):
            raise TrainError(f"the planner's dp={split['dp']} x microbatches={split['microbatches']} does not divide "
                             f"--batch {opts.batch}")
        return prog, split
    split = split_of(opts, world)
    micro_batch = opts.batch // (split["dp"] * split["microbatches"])
    example = torch.zeros((micro_batch, opts.seq_len), dtype=torch.long, device=device)
    prog = autoshard(source.model, **split, sequence_parallel=opts.sequence_parallel, fuse=opts.fuse,
                     recompute=opts.recompute or "none", **_fp8(opts),
                     example_kwargs={source.input_name: example, source.label_name: example})
    return prog, {**split, "recompute": prog.recompute}


def _restartable() -> bool:
    """Whether torchrun's agents may restart this group (--max-restarts > 0, theirs or a hand-written
    torchrun's): then every start resumes from --out's newest complete checkpoint, --resume or not,
    the first start finding none. Not the restart count: an agent restarts its ranks without counting
    when a node joins (a lost node's replacement), and a replacement agent's count starts at 0, so the
    count would start some groups again from step 0 over their checkpoints. Decided together: every
    rank must resume from the same step."""
    mine = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and not _in_process()
    return any(all_gather_json(mine))


def _resume(opts: TrainOptions, ckdir: str, prog, rt, optimizer, run_info: dict) -> int:
    """The step to start at: the newest checkpoint every rank can load, loaded. Ranks decide
    together, checkpoint by checkpoint, newest first: one rank's unreadable shard moves every rank
    to the next older one (a run whose ranks resumed from different steps would not be one run;
    on NCCL it would hang at the first collective). None readable: every rank stops, one line."""
    skipped = []
    for found in ck.complete(ckdir):
        try:
            info, problem = ck.load(found, prog, rt, optimizer), None
        except (CheckpointError, OSError) as e:
            info, problem = None, f"{type(e).__name__}: {e}"
        problems = [p for p in all_gather_json(problem) if p is not None]
        if problems:
            skipped.append(f"{os.path.basename(found)} ({problems[0]})")
            continue
        saved = (info.get("extra") or {}).get("run", {})
        for key in _RUN_KEYS:
            if key in saved and saved[key] != run_info[key]:
                raise TrainError(f"{found} was written by a run with {key}={saved[key]!r}; this run has "
                                 f"{run_info[key]!r} (a resumed run must keep the data and schedule)")
        if current().rank() == 0:
            passed = f" (skipped, unreadable on some rank: {'; '.join(skipped)})" if skipped else ""
            print(f"resumed from {found} at step {info['step']}{passed}", flush=True)
        return int(info["step"])
    if skipped:
        raise TrainError(f"--resume: no checkpoint under {ckdir} loads on every rank: {'; '.join(skipped)}")
    if current().rank() == 0:
        print(f"--resume: no complete checkpoint under {ckdir}; starting at step 0", flush=True)
    return 0


def _export(opts: TrainOptions, source, tokenizer, final: str) -> None:
    """A single-device model from the final checkpoint: a Hugging Face folder (save_pretrained) or
    model.safetensors for a factory model, with the tokenizer training used: the model folder's, or
    the byte tokenizer written as a Hugging Face one (and the config's special ids set to its 256)."""
    if source.kind == "factory":
        model = model_source.build(opts, isinstance(tokenizer, ByteTokenizer)).model
    else:
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(source.config)
    if isinstance(tokenizer, ByteTokenizer) and hasattr(model, "config"):
        # documents ended with the byte tokenizer's id, not the model type's special tokens
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(model.config, key, tokenizer.eos)
        if getattr(model, "generation_config", None) is not None:
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                setattr(model.generation_config, key, tokenizer.eos)
    consolidate(final, model, opts.export)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.tok.save_pretrained(opts.export)
    else:                       # a tokenizer that encodes as training did (bytes, 256 ends a document)
        tokenizer.save_pretrained(opts.export)
    print(f"exported a single-device model to {opts.export}", flush=True)


def run(opts: TrainOptions) -> int:
    place = placement(opts, os.environ, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    opts = dataclasses.replace(opts, precision=place.precision, fuse=place.fuse)
    if place.is_cuda:
        torch.cuda.set_device(place.device)     # before NCCL's group: each rank its own GPU
    _init(place.backend)
    rank, world = current().rank(), current().size()
    local = world if _in_process() else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))     # ranks on this machine
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    ckdir = os.path.join(opts.out, "checkpoints")
    # Everything that can be wrong with the options, data and tokenizer is found before the model is
    # sharded and compiled on every rank (minutes): the split, the fit of model and tokenizer, the data.
    # --plan's split is the planner's; until it is known, the cpu profile's shapes take all ranks as dp
    given = {"dp": world, "microbatches": 1} if opts.plan else split_of(opts, world)
    nodes = node_layout({} if _in_process() else os.environ, world)     # which ranks share a machine
    if not opts.plan:
        nodes.check_tp(given["tp"], opts.allow_cross_node_tp)
    if rank == 0 and nodes.nodes > 1:
        print(f"autoshard train: {nodes.describe()}", flush=True)
    check_shared_folder(opts.out, nodes)
    tokenizer = tokenizer_for(opts.model)
    token_file = _on_rank0(lambda: check_data(opts, tokenizer))     # the launcher tokenized it already
    source = model_source.build(opts, isinstance(tokenizer, ByteTokenizer))
    _check_fit(opts, source, tokenizer)
    if opts.precision != "fp32":        # compiled as cast (Megatron's way); fp32 main weights in the optimizer
        source.model.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}[opts.precision])
    # captured on its device; a folder's model stays on meta (its example on the CPU), loaded and moved below
    capture_device = place.device if source.weights is None else "cpu"
    if source.weights is None:
        source.model.to(capture_device)
    hardware = run_hardware(opts, place, source.config, max(1, opts.batch // (given["dp"] * given["microbatches"])))
    if _in_process():
        # --in-process: rank 0 compiles, every other rank takes a deep copy (the local world's
        # broadcast_object): one export instead of one per rank, and no state shared between ranks
        prog, split = _on_rank0(lambda: _compile(opts, source, world, hardware, capture_device))
    else:
        prog, split = _compile(opts, source, world, hardware, capture_device)
    if opts.plan:                                 # the planner's tp, placed as the split given is above
        nodes.check_tp(split["tp"], opts.allow_cross_node_tp)
    if opts.verify:
        verify_first(source, prog, rank)
    rt = prog.distributed(mesh=True)
    if source.weights is not None:
        materialize(prog, rt, seed=opts.seed)
        load_from_file(source.weights, prog, rt)
        if place.is_cuda:
            move_runtime(rt, place.device)
    adamw = dict(lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)
    # given (--zero too), or --plan's
    shard = opts.distributed_optimizer or bool(opts.zero) or split.get("distributed_optimizer", False)
    optimizer = (DistributedOptimizer(rt, torch.optim.AdamW, shard=shard, **adamw)
                 if shard or opts.precision != "fp32"
                 else torch.optim.AdamW(rt.parameters(), **adamw))
    # the cp ranks of a replica read the same sequences (data rank = replica x cp + cp rank)
    batches = Batches.open(token_file, seq_len=opts.seq_len, global_batch=opts.batch, dp=split["dp"],
                           dp_rank=rt.dp_rank // split.get("cp", 1), seed=opts.seed, extra=int(source.shifted))
    run_info = {"seq_len": opts.seq_len, "batch": opts.batch, "seed": opts.seed, "steps": opts.steps, "lr": opts.lr,
                "warmup": opts.warmup, "min_lr_ratio": opts.min_lr_ratio,
                "data_key": os.path.basename(token_file), "split": split}
    start = _resume(opts, ckdir, prog, rt, optimizer, run_info) if opts.resume or _restartable() else 0
    reporter = Reporter(opts.out, opts.steps, start, rank == 0, hardware_name(hardware))
    est = estimated_step_seconds(opts, source.config, split, hardware)
    if rank == 0 and opts.plan and hardware is None:
        print(f"autoshard train: --plan planned for {PLAN_DEFAULT} (no preset describes this machine; "
              "--hardware to choose)", flush=True)
    if rank == 0:
        count = sum(p.numel() for p in source.model.parameters())
        print(f"autoshard train: {type(source.model).__name__} ({count / 1e6:.2f}M parameters), tp={split['tp']} pp={split['pp']} dp={split['dp']} "
              + (f"ep={split['ep']} " if split.get("ep", 1) > 1 else "")
              + (f"cp={split['cp']} " if split.get("cp", 1) > 1 else "") + f"virtual={split['virtual']} microbatches={split['microbatches']} recompute={split['recompute']}, "
              + (f"{_ZERO_WORDS[prog.zero]} sharded over dp={split['dp']}"
                 + (f" (experts' over dp/ep={split['dp'] // split['ep']})" if split.get("ep", 1) > 1 else "") + ", "
                 if shard else "")
              + (f"{opts.precision} with fp32 main weights, " if opts.precision not in ("fp32", "fp8") else "")
              + (f"fp8 linears ({opts.fp8_recipe}), bf16 elsewhere, fp32 main weights, " if opts.precision == "fp8"
                 else "") +
              f"{batches.sequences} sequences of "
              f"{opts.seq_len} tokens, " + (f"steps {start + 1}-{opts.steps}" if start < opts.steps else
                                             f"all {opts.steps} steps already done"), flush=True)
    saving = None
    try:
        for step in range(start, opts.steps):
            lr = learning_rate(step, peak=opts.lr, warmup=opts.warmup, total=opts.steps, min_ratio=opts.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            prog.manual_seed(opts.seed * 1_000_003 + step)       # dropout: a function of the step, so resumes agree
            torch.manual_seed(opts.seed * 1_000_003 + step)
            rows = batches.batch(step).to(place.device)
            ids, labels = (rows[:, :-1].contiguous(), rows[:, 1:].contiguous()) if source.shifted else (rows, rows)
            began = time.perf_counter()
            loss = rt.train_step(**{source.input_name: ids, source.label_name: labels}, local_batch=True,
                                 max_norm=opts.clip or float("inf"))
            optimizer.step()
            optimizer.zero_grad()
            took = time.perf_counter() - began
            reporter.step(StepMetrics(step + 1, loss.item(), lr, float(rt.last_grad_norm),
                                      opts.batch * opts.seq_len / took, took, est, _peak_gib(place)),
                          show=(step + 1) % opts.log_every == 0)
            if (step + 1) % opts.save_every == 0 or step + 1 == opts.steps:
                saving = os.path.join(ckdir, f"step-{step + 1:08d}")
                ck.save(saving, prog, rt, optimizer, step=step + 1, extra={"run": run_info})
                saving = None
            if opts.halt_after == step + 1:
                sys.stdout.flush()
                os._exit(3)                     # as a crash would: no clean-up, no final checkpoint
    except KeyboardInterrupt:
        if saving is not None and rank == 0 and not os.path.isfile(os.path.join(saving, INDEX)):
            shutil.rmtree(saving, ignore_errors=True)       # a checkpoint cut short: leave none of it
        if rank == 0:
            print(f"\ninterrupted; the newest complete checkpoint is {ck.latest(ckdir)} (continue with --resume)",
                  file=sys.stderr, flush=True)
        return 130
    reporter.close()
    if rank == 0:
        steps, losses = reporter.history()
        if steps:                   # none when a resumed run found every step done
            loss_curve(steps, losses, os.path.join(opts.out, "loss.png"))
            print(f"done: loss {losses[0]:.4f} at step {steps[0]} -> {losses[-1]:.4f} at step {steps[-1]}; "
                  f"{opts.out}/metrics.csv, {opts.out}/loss.png, checkpoints in {ckdir}", flush=True)
        if opts.export:
            _export(opts, source, tokenizer, ck.latest(ckdir))
    current().barrier()
    return 0
