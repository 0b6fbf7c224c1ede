"""Single-device training-step time and model FLOP utilization of a ~1.3B GPT (tp=1).

    .venv/bin/python benchmarks/mfu.py [--batch 8] [--steps 10] [--fused] [--fp8] [--append]   # on a CUDA GPU
    .venv/bin/python benchmarks/mfu.py --quick                                   # tiny, CPU or GPU

The model is autoshard's nanoGPT at GPT-3 XL's shape (24 layers, hidden 2048, 16 heads, sequence
2048, vocabulary 50304: 1.31B parameters), built on the device, compiled by `autoshard(model, tp=1)`
and trained with fused AdamW under bf16 autocast (fp32 weights), next to the plain model in the
same run (alternating steps; with --fused also the program compiled with fuse=True; with --fp8 the
program compiled with precision="fp8", its linears' matmuls in float8, the LM head in bf16: the
issue's target is FP8 step / bf16 step <= 0.75 on an H100-class GPU). In the same
run the device's bf16 matrix-multiply rate is measured (8192^3 products on random data, rotating
over three operand sets, median). MFU counts the model's
FLOPs as Megatron does without recomputation (`flops_no_recompute` in autoshard/planning/cost_formulas.py)
and divides the achieved rate by that measured matmul rate. Target (issue 6): >= 50%.
On the CPU everything runs in fp32; the numbers check the script, they measure nothing useful.
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import torch
from results import report
from tabulate import tabulate
from timing import median_seconds

from autoshard import autoshard
from autoshard.models import GPT, GPTConfig
from autoshard.planning.cost_formulas import evaluate


def matmul_tflops(device: torch.device, n: int, dtype: torch.dtype, reps: int = 20) -> float:
    """Measured dense matmul rate (TFLOP/s): n x n x n products, three operand sets in turn."""
    sets = [(torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype))
            for _ in range(3)]
    out = torch.empty(n, n, device=device, dtype=dtype)
    for a, b in sets:                                     # warm-up: handles, kernel selection
        torch.matmul(a, b, out=out)
    turn = itertools.cycle(sets)
    t = median_seconds(lambda: torch.matmul(*next(turn), out=out), device, reps)
    return 2 * n**3 / t / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and matmul; checks the script only")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--fused", action="store_true",
                    help="also time the program compiled with fuse=True (the fused ops, opt-in since the "
                         "first GPU run: `autoshard train --fuse`) beside the unfused one")
    ap.add_argument("--fp8", action="store_true",
                    help="also time the program compiled with precision=\"fp8\" (float8 linears) beside the bf16 one")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    cfg = (GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=512, block_size=64) if args.quick else
           GPTConfig(n_layer=24, n_head=16, n_embd=2048, vocab_size=50304, block_size=2048))
    batch = 2 if args.quick else args.batch
    dtype = torch.bfloat16 if cuda else torch.float32
    peak = matmul_tflops(device, 512 if args.quick else 8192, dtype)

    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    gen = torch.Generator(device="cpu").manual_seed(1)
    batches = [tuple(torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=gen).to(device)
                     for _ in range(2)) for _ in range(3)]
    programs = {"autoshard": autoshard(model, tp=1, example_inputs=batches[0]).rank(0), "plain": model}
    if args.fused:
        programs["autoshard fused"] = autoshard(model, tp=1, fuse=True, example_inputs=batches[0]).rank(0)
    if args.fp8:
        programs["autoshard fp8"] = autoshard(model, tp=1, precision="fp8", example_inputs=batches[0]).rank(0)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=cuda) for name, m in programs.items()}

    def step(name: str, i: int) -> None:
        idx, targets = batches[i % 3]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            _, loss = programs[name](idx, targets)
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {name: [] for name in programs}
    for i in range(args.warmup + args.steps):
        order = list(programs)
        for name in order[i % len(order):] + order[:i % len(order)]:     # each program first in turn
            t = median_seconds(lambda name=name: step(name, i), device, 1)
            if i >= args.warmup:
                times[name].append(t)
    flops = evaluate("flops_no_recompute", B=batch, s=cfg.block_size, l=cfg.n_layer, h=cfg.n_embd,
                     V=cfg.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for name, ts in times.items():
        sec = statistics.median(ts)
        rows.append([name, f"{1e3 * sec:.1f}", f"{flops / sec / 1e12:.1f}", f"{100 * flops / sec / 1e12 / peak:.1f}"])
    table = tabulate(rows, headers=["program", "step ms", "model TFLOP/s", "MFU % of measured matmul"],
                     tablefmt="github")
    ratios = {name: statistics.median(times[name]) / statistics.median(times["plain"])
              for name in programs if name != "plain"}
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    summary = (f"{device_name}; measured {'bf16' if cuda else 'fp32'} matmul {peak:.1f} TFLOP/s; "
               f"model {params / 1e9:.2f}B parameters, batch {batch} x {cfg.block_size}, "
               f"{flops / 1e12:.1f} TFLOP per step; step time against plain: "
               + ", ".join(f"{name} {r:.3f}" for name, r in ratios.items())
               + (f"; fp8 / bf16 step {ratios['autoshard fp8'] / ratios['autoshard']:.3f}" if args.fp8 else ""))
    report(table, summary, append=args.append and not args.quick, title="Single-device MFU",
           command=".venv/bin/python benchmarks/mfu.py " + ("--quick" if args.quick else f"--batch {batch}")
           + (" --fused" if args.fused else "") + (" --fp8" if args.fp8 else ""),
           what=f"{args.steps} alternating steps after {args.warmup} warm-up, median")


if __name__ == "__main__":
    main()
