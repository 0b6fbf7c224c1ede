"""The single-device FP8 model an FP8 split is certified against: the model's own nn.Linear (and
GPT-2's Conv1D) modules whose weights the program runs in float8 (its table, `prog.fp8`) swapped
for Float8Linear, which computes the same recipe on the whole tensors (parallel/fp8_linear.py with
no group: each amax is the whole tensor's), the weights and biases the same parameters; nothing else changed. The
sharded program is built by the compile's pass, this model by swapping modules: two ways to the
same arithmetic, so a pass that scaled a shard by its own amax, or put a linear in float8 that the
table keeps, is seen by the comparison. Experts: the module's own grouped matmuls run in float8
(parallel/fp8_experts.py's mode), where the program's graph calls fp8_grouped_mm."""
from __future__ import annotations

import torch
from torch import nn

from autoshard.parallel.comm import CommHandle
from autoshard.parallel.fp8_experts import Fp8GroupedMatmuls
from autoshard.parallel.fp8_linear import Fp8Linear

__all__ = ["Float8Linear", "to_fp8_model"]


class Float8Linear(nn.Module):
    """nn.Linear's x @ w.T + b with the matmuls in float8 (one device: no group); or, `in_out`, GPT-2's
    Conv1D's x @ w + b (its weight stored [in, out])."""

    def __init__(self, linear: nn.Module, recipe: str, in_out: bool = False):
        super().__init__()
        self.weight, self.bias, self.in_out = linear.weight, linear.bias, in_out
        self.fp8 = Fp8Linear(CommHandle(0), recipe, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fp8(x, self.weight.t() if self.in_out else self.weight)
        return y if self.bias is None else y + self.bias


def _conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2 and its kin): a linear layer whose weight is [in, out]."""
    return type(m).__name__ == "Conv1D" and isinstance(getattr(m, "nf", None), int) \
        and getattr(m, "weight", None) is not None and m.weight.dim() == 2


def to_fp8_model(model: nn.Module, table: dict[str, str | None], recipe: str) -> list[str]:
    """Swap, in place, each nn.Linear or Conv1D whose weight `table` runs in FP8 (None) for a Float8Linear,
    and run each experts module whose stacked weights it runs in FP8 with its grouped matmuls in float8;
    returns the FP8 weights neither holds (a functional linear: not swapped, said by the caller)."""
    fp8 = {name for name, why in table.items() if why is None}
    swapped = set()
    for path, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            name = f"{path}.{child_name}.weight" if path else f"{child_name}.weight"
            if (isinstance(child, nn.Linear) or _conv1d(child)) and name in fp8:
                setattr(module, child_name, Float8Linear(child, recipe, in_out=_conv1d(child)))
                swapped.add(name)
        stacked = {f"{path}.{n}" if path else n for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
        if stacked & fp8:                    # an experts module: its grouped matmuls in float8
            _grouped_in_fp8(module, path, recipe)
            swapped |= stacked & fp8
    return sorted(fp8 - swapped)


def _grouped_in_fp8(experts: nn.Module, path: str, recipe: str) -> None:
    """The experts module, in place, made an instance of a subclass whose forward runs the class's
    inside Fp8GroupedMatmuls (its grouped matmuls in float8, as the program's fp8_grouped_mm); one
    that runs none refuses. A subclass, not a wrapped bound method: a deep copy of the model (verify
    copies its reference) must run its own parameters."""
    base = type(experts)

    def forward(self, *args, **kwargs):
        with Fp8GroupedMatmuls(recipe) as mode:
            out = base.forward(self, *args, **kwargs)
        if mode.calls == 0:
            raise RuntimeError(f"{path}: the program runs its grouped matmuls in float8, but the module ran none "
                               f"(the single-device FP8 model cannot be built for it)")
        return out
    experts.__class__ = type(f"Float8{base.__name__}", (base,), {"forward": forward})
