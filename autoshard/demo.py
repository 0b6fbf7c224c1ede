"""The quickstart demo: shard a GPT-2-shaped model at tp=2, look at it, and prove it.

    python -m autoshard.demo

1. compiles Hugging Face GPT2LMHeadModel (random weights, from a config) with autoshard(tp=2):
   attention and MLP split Megatron-style, the tied word embedding / LM head split by vocabulary;
2. prints the per-rank table and rank 0's rewritten attention block;
3. runs all ranks in one process (simulation) and compares outputs and gradients with the model;
4. runs the same program for real on 2 gloo processes under torchrun, each process holding only
   its own rank, and compares losses and parameters over a few training steps;
5. pipeline parallelism: prints the interleaved 1F1B schedule for pp=2 with 2 chunks per rank and
   trains GPT-2 with it on 2 gloo processes (AdamW, gradient clipping) against one device.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from autoshard import autoshard
from autoshard.runtime.schedules import bubble_fraction, check, interleaved_1f1b
from autoshard.runtime.trace import text_timeline
from autoshard.testing import grad_errors, max_rel
from autoshard.testing.launch import torchrun


def gpt2_shaped():
    import transformers as hf
    torch.manual_seed(0)
    cfg = hf.GPT2Config(n_layer=4, n_head=8, n_embd=256, vocab_size=1024, n_positions=128,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return hf.GPT2LMHeadModel(cfg)


def attention_block(code: str) -> str:
    """Rank code from the first f to the bias added after the first g: one attention block."""
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if "self.f(" in line)
    end = next(i for i, line in enumerate(lines) if "self.g(" in line and i > start) + 2
    return "\n".join(line.split(";")[0] for line in lines[start:end])


def _torchrun(nproc: int, module: str, *args: str) -> bool:
    proc = torchrun(module, list(args), nproc, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            print("  " + line)
    if proc.returncode != 0:
        print(proc.stderr[-2000:])
    return proc.returncode == 0


def pipeline_part() -> bool:
    timeline = check(interleaved_1f1b(2, 2, 4), 2, 4)
    print("\ninterleaved 1F1B, pp=2, 2 chunks per rank, 4 microbatches (F/B chunk 0, f/b chunk 1; "
          f"bubble {bubble_fraction(timeline):.3f} = (p-1)/(v m)):\n")
    print(text_timeline(timeline), "\n")
    print("real run: GPT-2 (4 layers) cut into 4 stages on 2 gloo processes, 5 AdamW steps ...", flush=True)
    ok = _torchrun(2, "autoshard.testing.pipeline_check", "--pp", "2", "--virtual-pipeline", "2", "--microbatches", "4",
                   "--models", "gpt2", "--steps", "5", "--layers", "4", "--hidden", "256")
    print(f"pipeline run: {'MATCH' if ok else 'MISMATCH'} (per-step losses, global gradient norm, parameters)")
    return ok


def main() -> int:
    model = gpt2_shaped()
    ids = torch.randint(0, 1024, (4, 64), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 1024, (4, 64), generator=torch.Generator().manual_seed(2))

    prog = autoshard(model, tp=2, example_kwargs={"input_ids": ids})
    print(prog, "\n")
    print("rank 0, transformer.h.0.attn after the rewrite (f before the column-parallel c_attn,\n"
          "heads per rank in the views, g and the bias after the row-parallel c_proj):\n")
    print(attention_block(prog.rank(0).code), "\n")

    ref = model(input_ids=ids).logits
    F.cross_entropy(ref.reshape(-1, 1024), labels.reshape(-1)).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    out = prog.simulate(input_ids=ids).logits
    F.cross_entropy(out.reshape(-1, 1024), labels.reshape(-1)).backward()
    out_err = max_rel(out, ref)
    grad_err = max(grad_errors(prog.full_grads(), ref_grads).values())
    sim_ok = out_err <= 1e-5 and grad_err <= 1e-4
    print(f"simulation, 2 ranks in one process: logits rel. error {out_err:.1e}, "
          f"worst gradient rel. error {grad_err:.1e}  ->  {'MATCH' if sim_ok else 'MISMATCH'}\n")

    print("real run: torchrun --nproc-per-node 2, gloo, one rank per process ...", flush=True)
    real_ok = _torchrun(2, "autoshard.testing.dist_check", "--models", "gpt2", "llama", "--steps", "3",
                        "--layers", "4", "--hidden", "256", "--heads", "8")
    print(f"real gloo run: {'MATCH' if real_ok else 'MISMATCH'} (losses and every rank's parameter shards "
          f"after 4 SGD steps, the last on a new input shape)")
    pipe_ok = pipeline_part()
    return 0 if sim_ok and real_ok and pipe_ok else 1


if __name__ == "__main__":
    sys.exit(main())
