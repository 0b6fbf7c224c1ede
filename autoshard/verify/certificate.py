"""The certificate `autoshard verify` prints: what was compared, how closely, and one verdict.

Every item is one comparison of the sharded program with the single-device model on the same
batch: an output (the loss, the logits), a parameter group's gradients, or its weights after one
optimizer step. A parameter group is the parameters whose names differ only in layer numbers
(`model.layers.*.self_attn.q_proj.weight`); its item holds the worst error of any of them, on any
rank, and names where it was. The verdict holds when every item is within the tolerance.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["Item", "Fallback", "Certificate", "group_of", "worst_by_group"]


def group_of(name: str) -> str:
    """The parameter group of `name`: its layer numbers replaced by `*`."""
    return re.sub(r"\.\d+\.", ".*.", name)


def worst_by_group(errors: dict[str, tuple[float, str]]) -> dict[str, tuple[float, str]]:
    """Parameter name -> (error, where) folded to group -> the worst (a NaN counts as the worst)."""
    groups: dict[str, tuple[float, str]] = {}
    for name, (err, where) in errors.items():
        g = group_of(name)
        if g not in groups or err > groups[g][0] or err != err:
            groups[g] = (err, where)
    return groups


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Item:
    kind: str           # "output", "gradient" or "weight" (after one optimizer step)
    group: str          # the output's name or the parameter group
    error: float        # worst relative error (metrics.scaled_errors' measure)
    where: str          # the parameter (and rank) or output holding the worst error
    tolerance: float

    @property
    def holds(self) -> bool:
        return self.error <= self.tolerance


@dataclass(frozen=True)
class Fallback:
    modules: tuple[str, ...]
    reason: str
    by_design: bool
    extra_bytes: int        # per tensor-parallel rank: the replicated weights' bytes beyond a 1/tp share


@dataclass
class Certificate:
    model: str
    split: dict[str, object]            # tp, pp, virtual, dp, ep, cp, sp, recompute, fuse, schedule, microbatches
    dtype: str
    tolerance: float
    tolerance_reason: str
    batch: str                          # what the batch held (rows, length, padding, ignored labels)
    runs: list[str] = field(default_factory=list)        # "simulation", "gloo, 4 processes"
    items: list[Item] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    twin: list[str] = field(default_factory=list)        # what the reduced twin changed; empty: the model itself
    refusals: list[str] = field(default_factory=list)     # a run that could not be made, said why
    notes: list[str] = field(default_factory=list)        # what else the reader must know (precision, ...)
    split_refused: bool = False         # the compile refused the split for this model: a bad input, not a verdict
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.items) and not self.refusals and all(i.holds for i in self.items)

    def failures(self) -> list[Item]:
        return [i for i in self.items if not i.holds]

    def first_failure(self) -> Item | None:
        """The first item that does not hold, in the order compared (outputs, gradients, weights)."""
        bad = self.failures()
        return bad[0] if bad else None

    def verdict(self) -> str:
        if self.passed:
            return (f"VERIFIED: {len(self.items)} comparisons within {self.tolerance:.0e} "
                    f"({', '.join(self.runs)})")
        if self.refusals:
            return f"NOT VERIFIED: {self.refusals[0]}"
        bad = self.failures()
        first = bad[0]
        return (f"NOT VERIFIED: {len(bad)} of {len(self.items)} comparisons differ; first: {first.kind} of "
                f"{first.where}, error {first.error:.3g} > {first.tolerance:.0e}")

    def render(self) -> str:
        from tabulate import tabulate
        split = " ".join(f"{k}={v}" for k, v in self.split.items())
        lines = [f"autoshard verify: {self.model}", f"  split: {split}",
                 f"  compared in {self.dtype}; tolerance {self.tolerance:.0e}: {self.tolerance_reason}",
                 f"  batch: {self.batch}", f"  runs: {', '.join(self.runs) or 'none'}"]
        if self.twin:
            lines.append("  reduced twin (the model is too large to run here):")
            lines += [f"    {t}" for t in self.twin]
            lines.append("    proves: the passes' rank programs are right for this graph structure and split (the "
                         "full-size programs are the same passes' outputs at other sizes); does not prove what "
                         "depends on sizes alone: memory, speed, a size the split divides at one size and not another")
        rows = [(i.kind, i.group, f"{i.error:.2e}", "ok" if i.holds else "DIFFERS", i.where) for i in self.items]
        lines.append(tabulate(rows, headers=("compared", "output / parameter group", "worst rel. error", "", "where")))
        if self.fallbacks:
            lines.append("fallbacks (left whole on every tensor-parallel rank):")
            for f in self.fallbacks:
                kind = "by design" if f.by_design else "fallback"
                lines.append(f"  {kind}: {', '.join(f.modules)}: {f.reason}; costs {_bytes(f.extra_bytes)} "
                             f"more per rank than a 1/tp share (fp32 weights)")
        else:
            lines.append("fallbacks: none")
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"refused: {r}" for r in self.refusals]
        lines.append(f"({self.seconds:.1f} s)")
        lines.append(self.verdict())
        return "\n".join(lines)
