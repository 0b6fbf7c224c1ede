"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018; torch.amp.GradScaler's rule).

The loss is multiplied by `scale` before backward so that small fp16 gradients do not flush to
zero; the reduced fp32 gradients are divided by it again. If any gradient on any rank is inf or
NaN, the step is skipped on every rank (the flag is all-reduced over the whole job, so tensor- and
pipeline-parallel ranks skip together) and the scale is multiplied by `backoff`; after
`growth_interval` clean steps in a row it is multiplied by `growth`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.errors import ShardingError
from autoshard.world import current

__all__ = ["LossScaler"]


@dataclass
class LossScaler:
    scale: float = 2.0 ** 16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 1000
    clean_steps: int = 0          # clean steps since the scale last changed
    skipped: int = 0              # steps skipped so far

    def __post_init__(self):
        if not (self.scale > 0 and self.growth > 1 and 0 < self.backoff < 1 and self.growth_interval >= 1):
            raise ShardingError(f"LossScaler needs scale > 0, growth > 1, 0 < backoff < 1, growth_interval >= 1; "
                                f"got scale={self.scale}, growth={self.growth}, backoff={self.backoff}, "
                                f"growth_interval={self.growth_interval}")

    def found_inf(self, grads: list[torch.Tensor]) -> bool:
        """Whether any of `grads` on any rank of the job holds inf or NaN (every rank must call it)."""
        device = grads[0].device if grads else None
        bad = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            if not torch.isfinite(g).all():
                bad.fill_(1.0)
                break
        current().all_reduce(bad, op="max")
        return bool(bad.item())

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff
            self.clean_steps = 0
            self.skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth
            self.clean_steps = 0

    def state(self) -> dict[str, float]:
        return {"loss_scale": self.scale, "loss_scale_clean_steps": self.clean_steps, "loss_scale_skipped": self.skipped}

    def load(self, state: dict) -> None:
        self.scale = float(state.get("loss_scale", self.scale))
        self.clean_steps = int(state.get("loss_scale_clean_steps", self.clean_steps))
        self.skipped = int(state.get("loss_scale_skipped", self.skipped))
