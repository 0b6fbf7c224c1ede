"""What rank 0 reports each step: a progress line (tokens/s, loss, learning rate, gradient norm,
measured and estimated step time), a row of metrics.csv, and TensorBoard scalars where the
tensorboard package is installed."""
from __future__ import annotations

import csv
import io
import os
import sys
from dataclasses import asdict, dataclass

from autoshard.planning.costmodel import estimate
from autoshard.planning.hardware import Hardware
from autoshard.train.options import TrainOptions

__all__ = ["StepMetrics", "Reporter", "estimated_step_seconds"]


@dataclass
class StepMetrics:
    step: int                       # 1-based: the number of optimizer steps taken
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    step_s: float
    estimated_step_s: float | None
    cuda_peak_gib: float | None = None      # this rank's peak CUDA memory so far (rank 0's), None on the CPU


class Reporter:
    """Writes `out/metrics.csv` (rows after `start` are dropped first when resuming, so the file
    holds each step once) and prints progress; does nothing on ranks other than 0."""

    def __init__(self, out: str, total: int, start: int, active: bool, hardware: str | None):
        self.active, self.total, self.hardware = active, total, hardware
        self.path = os.path.join(out, "metrics.csv")
        self.tensorboard = None
        if not active:
            return
        kept = []
        if start > 0 and os.path.isfile(self.path):
            with open(self.path, newline="") as fh:
                kept = [row for row in csv.DictReader(fh) if int(row["step"]) <= start]
        fields = list(StepMetrics.__dataclass_fields__)
        with open(self.path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fields)
            w.writeheader()
            w.writerows(kept)
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(os.path.join(out, "tensorboard"))
        except ImportError:             # the tensorboard package is optional
            self.tensorboard = None
        self.tty = sys.stdout.isatty()

    def step(self, m: StepMetrics, show: bool) -> None:
        if not self.active:
            return
        row = io.StringIO()
        csv.DictWriter(row, list(StepMetrics.__dataclass_fields__)).writerow(asdict(m))
        with open(self.path, "a", newline="") as fh:
            fh.write(row.getvalue())            # one write per row: an interrupted run leaves whole rows
        if self.tensorboard is not None:
            for k in ("loss", "lr", "grad_norm", "tokens_per_s", "step_s", "cuda_peak_gib"):
                if getattr(m, k) is not None:
                    self.tensorboard.add_scalar(f"train/{k}", getattr(m, k), m.step)
        if show or m.step == self.total:
            print(self.line(m), end="\r" if self.tty and m.step < self.total else "\n", flush=True)

    def line(self, m: StepMetrics) -> str:
        done = m.step / self.total
        bar = "#" * int(20 * done) + "." * (20 - int(20 * done))
        est = "" if m.estimated_step_s is None else f" (cost model: {m.estimated_step_s:.3g} s on {self.hardware})"
        memory = "" if m.cuda_peak_gib is None else f"  {m.cuda_peak_gib:.2f} GiB peak"
        return (f"[{bar}] step {m.step}/{self.total}  loss {m.loss:.4f}  lr {m.lr:.2e}  grad norm {m.grad_norm:.3f}  "
                f"{m.tokens_per_s:,.0f} tok/s  {m.step_s:.3f} s/step{memory}{est}")

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()

    def history(self) -> tuple[list[int], list[float]]:
        """(steps, losses) from metrics.csv: the whole run, resumed parts included."""
        with open(self.path, newline="") as fh:
            rows = list(csv.DictReader(fh))
        return [int(r["step"]) for r in rows], [float(r["loss"]) for r in rows]


def estimated_step_seconds(opts: TrainOptions, cfg, split: dict, hardware: str | Hardware | None) -> float | None:
    """The cost model's step time for this run's split on `hardware` (None: no hardware to say it for,
    or a config the cost model does not read)."""
    if hardware is None:
        return None
    try:
        return estimate(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                        vocab=cfg.vocab_size, seq=opts.seq_len, tp=split["tp"], pp=split["pp"], dp=split["dp"],
                        global_batch=opts.batch, microbatch=opts.batch // (split["dp"] * split["microbatches"]),
                        virtual=split["virtual"], hardware=hardware, recompute=split.get("recompute", "none"),
                        sequence_parallel=opts.sequence_parallel, cp=split.get("cp", 1)).seconds_per_iteration
    except (AttributeError, ValueError, TypeError):     # not a transformer config the cost model reads
        return None
