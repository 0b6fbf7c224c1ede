"""The cost model's context-parallel speedups beside NeMo's published ones (Llama3-8B, FP8, DGX-B200).

    .venv/bin/python benchmarks/context_nemo.py

NeMo's "Long Sequence Performance" page (container NeMo 25.04.rc2) lists, per sequence length, the
GPU count, the global batch, TFLOP/s per GPU of the best configuration without CP ("the most
performant model- and data-parallel configurations without CP given the memory capacity
constraint"; the configuration itself is not listed), the configuration with CP (TP, PP, DP, CP)
and its TFLOP/s per GPU; the speedup is their ratio. The tokens per step are constant (4M): the
batch halves as the sequence doubles. Note on the table: TP x PP x DP x CP is a quarter of the
listed GPU count on every row (e.g. 4 x 1 x 4 x 8 = 128 of 512 at 512K); the ratio is per GPU,
so it is compared as is, with the listed configuration on TP x PP x DP x CP GPUs.

Here, for each row: the with-CP configuration as listed, its recompute mode the fastest that fits
(`estimate`), against `plan(..., context_parallel=False)`'s fastest fitting configuration of the
same GPUs and batch, both on the `b200` preset at its fp8 rate (4.5 PFLOP/s; activations 2 bytes),
both with the distributed optimizer and fused attention (no s^2 scores kept), as NeMo runs.
Llama3-8B as the cost model's GPT shape: hidden 4096, 32 layers, 32 heads (8 key/value heads for
the ring's blocks), vocabulary 128256; its MLP is counted as GPT's 4h (16384) where Llama's is
14336 (3 matrices of 3.5h: 10.5h^2 against 8h^2 per token and layer).
"""
from __future__ import annotations

from autoshard.planning.costmodel import RECOMPUTE, estimate
from autoshard.planning.hardware import get_hardware
from autoshard.planning.planner import ModelShape, plan

# seq (K), GPUs, batch, without-CP TFLOP/s, with CP: TP, PP, DP, CP, TFLOP/s, speedup (NeMo's table)
NEMO_LLAMA3_8B_B200 = [
    (8, 8, 512, 1671, 1, 1, 2, 1, 1671, 1.00),
    (16, 16, 256, 1717, 1, 1, 4, 1, 1717, 1.00),
    (32, 32, 128, 1549, 1, 1, 4, 2, 1624, 1.05),
    (64, 64, 64, 1481, 1, 1, 4, 4, 1600, 1.08),
    (128, 128, 32, 1438, 2, 1, 4, 4, 1588, 1.10),
    (256, 256, 16, 1162, 4, 1, 4, 4, 1590, 1.37),
    (512, 512, 8, 607, 4, 1, 4, 8, 1619, 2.67),
]
SHAPE = dict(hidden=4096, layers=32, heads=32, vocab=128256)


def rows() -> list[dict]:
    hw = get_hardware("b200", peak_tflops=4500, name="b200-fp8")
    out = []
    for k, _, batch, _, tp, pp, dp, cp, nemo_cp, nemo_speedup in NEMO_LLAMA3_8B_B200:
        seq = k * 1024
        gpus = tp * pp * dp * cp
        with_cp = min((estimate(**SHAPE, seq=seq, tp=tp, pp=pp, dp=dp, cp=cp, kv_heads=8, global_batch=batch,
                                hardware=hw, recompute=mode, distributed_optimizer=True, attention="flash")
                       for mode in RECOMPUTE),
                      key=lambda e: (not e.fits, e.seconds_per_iteration))
        try:
            without = plan(ModelShape(**SHAPE, seq=seq), gpus=gpus, global_batch=batch, hardware=hw,
                           distributed_optimizer=True, attention="flash")[0]
        except ValueError:
            without = None
        out.append({"seq_k": k, "gpus": gpus, "batch": batch, "cp_config": f"tp={tp} pp={pp} dp={dp} cp={cp}",
                    "cp_tflops": with_cp.tflops_per_gpu, "cp_fits": with_cp.fits, "cp_recompute": with_cp.recompute,
                    "cp_comm_share": with_cp.breakdown.get("cp_comm", 0.0) / with_cp.seconds_per_iteration,
                    "no_cp": None if without is None else
                    f"tp={without.tp} pp={without.pp} dp={without.dp} {without.recompute}",
                    "no_cp_tflops": None if without is None else without.tflops_per_gpu,
                    "speedup": None if without is None else
                    without.seconds_per_iteration / with_cp.seconds_per_iteration,
                    "nemo_speedup": nemo_speedup, "nemo_cp_tflops": nemo_cp})
    return out


def main() -> None:
    print("| seq | GPUs (TPxPPxDPxCP) | batch | with CP (NeMo's) | predicted TFLOP/s | NeMo TFLOP/s | "
          "cp_comm share | best without CP (planner) | predicted speedup | NeMo speedup |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows():
        speed = "none fits" if r["speedup"] is None else f"{r['speedup']:.2f}"
        no_cp = "none fits" if r["no_cp"] is None else f"{r['no_cp']} ({r['no_cp_tflops']:.0f} TFLOP/s)"
        print(f"| {r['seq_k']}K | {r['gpus']} | {r['batch']} | {r['cp_config']} {r['cp_recompute']}"
              f"{'' if r['cp_fits'] else ' (does not fit)'} | {r['cp_tflops']:.0f} | {r['nemo_cp_tflops']} | "
              f"{100 * r['cp_comm_share']:.1f}% | {no_cp} | {speed} | {r['nemo_speedup']:.2f} |")


if __name__ == "__main__":
    main()
