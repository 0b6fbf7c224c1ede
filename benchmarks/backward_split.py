"""What splitting a backward into B and W costs (runtime/backward_split.py): B + W over one whole
backward of the same layers, in one process, at several widths.

    python benchmarks/backward_split.py [--hidden 128 256 512 1024] [--layers 4] [--iters 30] [--append]

Hugging Face Llama decoder layers (4 heads' worth of width per 256, 2 x 64 tokens, fp32, one
thread, glibc told to keep freed memory as benchmarks/zero_bubble.py's ranks are) run forward on
the same input; then either one `torch.autograd.backward` from a fixed output gradient, or
`backward_input` (B, the input's gradient) and `backward_weight` (W, every weight's). The two are
timed alternately, medians over `--iters`. With `--append` the table goes to benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOCATOR = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(32 * 2 ** 20),
             "MALLOC_TRIM_THRESHOLD_": str(8 * 2 ** 30), "MALLOC_TOP_PAD_": str(256 * 2 ** 20)}


def measure(hidden: int, layers: int, iters: int) -> dict[str, float]:
    import torch
    import transformers as hf
    sys.path.insert(0, str(ROOT))
    from autoshard.runtime.backward_split import backward_input, backward_weight
    torch.set_num_threads(1)
    cfg = hf.LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                         max_position_embeddings=64)
    torch.manual_seed(0)
    model = hf.LlamaModel(cfg)
    x0 = torch.randn(2, 64, hidden)
    positions = torch.arange(64)[None]
    rotary = model.rotary_emb(x0, positions)
    params = list(model.layers.parameters())
    grad = torch.randn(2, 64, hidden)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x = x0.clone().requires_grad_()
        h = x
        for layer in model.layers:
            h = layer(h, position_embeddings=rotary, position_ids=positions)
            h = h[0] if isinstance(h, tuple) else h
        return x, h

    def whole() -> float:
        _, out = forward()
        t = time.perf_counter()
        torch.autograd.backward([out], [grad])
        return time.perf_counter() - t

    def split() -> tuple[float, float]:
        x, out = forward()
        t0 = time.perf_counter()
        _, work = backward_input([out], [grad], [x], params)
        t1 = time.perf_counter()
        backward_weight(work)
        return t1 - t0, time.perf_counter() - t1
    for _ in range(3):
        whole(), split()
    w, b_w = [], []
    for _ in range(iters):
        w.append(whole())
        b_w.append(split())
    return {"whole": statistics.median(w), "b": statistics.median(b for b, _ in b_w),
            "w": statistics.median(x for _, x in b_w),
            "ratio": statistics.median((b + x) / y for (b, x), y in zip(b_w, w))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)    # a child: one width
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.layers, args.iters)))
        return
    rows = ["| hidden | whole backward ms | B ms | W ms | (B + W) / whole (median of per-iteration ratios) |",
            "| --- | --- | --- | --- | --- |"]
    for h in args.hidden:       # each width in a fresh process with the allocator's settings
        out = subprocess.run([sys.executable, __file__, "--one", str(h), "--layers", str(args.layers),
                              "--iters", str(args.iters)], capture_output=True, text=True, check=True,
                             env={**os.environ, **ALLOCATOR}).stdout
        r = json.loads(out.strip().splitlines()[-1])
        rows.append(f"| {h} | {1e3 * r['whole']:.2f} | {1e3 * r['b']:.2f} | {1e3 * r['w']:.2f} | {r['ratio']:.3f} |")
    table = "\n".join(rows)
    print(table)
    if args.append:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from results import append_result
        append_result("B + W against one backward", "python benchmarks/backward_split.py " + " ".join(sys.argv[1:]),
                      f"HF Llama, {args.layers} decoder layers, 2 x 64 tokens, fp32, one thread", table)


if __name__ == "__main__":
    main()
