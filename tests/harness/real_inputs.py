"""A sweep of what users really pass, each case against the single-device model.

`sweep(name, tp=..., pp=...)` compiles GPT-2, Llama or BERT (small, dropout 0.1, compiled in eval
mode) and runs it the ways real training and evaluation do: right and left padding masks with -100
labels on the padding, labels ignored for whole rows, explicit `position_ids`, extra `**kwargs`
(`output_hidden_states`, and `num_items_in_batch` for causal LMs), a new batch and sequence
length, length 1, a train/eval switch, and bf16 autocast. Each case returns its worst relative
error (outputs at unmasked positions, the loss, every gradient), or the refusal's message; the
test (tests/simulation/test_real_inputs.py) requires every case to match or refuse clearly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from autoshard import autoshard
from autoshard.errors import AutoshardError
from autoshard.testing.metrics import grad_errors, max_rel
from autoshard.testing.models import VOCAB, build_model

__all__ = ["Case", "sweep", "CASES", "BF16_TOLERANCE"]

BF16_TOLERANCE = 2e-2     # bf16 keeps 8 bits; sharded sums round differently


@dataclass
class Case:
    name: str
    error: float | None = None       # worst relative error; None when refused
    refusal: str | None = None
    tolerance: float = 1e-5


def _batch(name: str, b: int = 2, t: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=gen)
    labels = torch.randint(0, VOCAB, (b, t), generator=gen)
    return {"input_ids": ids, "labels": labels}


def _right_padding(name: str) -> dict:
    kw = _batch(name)
    mask = torch.ones_like(kw["input_ids"])
    mask[1, 11:] = 0
    kw["labels"][mask == 0] = -100
    return {**kw, "attention_mask": mask}


def _left_padding(name: str) -> dict:
    kw = _batch(name)
    mask = torch.ones_like(kw["input_ids"])
    mask[0, :5] = 0
    kw["labels"][mask == 0] = -100
    kw = {**kw, "attention_mask": mask}
    if name != "bert":          # as generation does: positions count only real tokens
        kw["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0)
    return kw


def _ignored_rows(name: str) -> dict:
    kw = _batch(name, b=3)
    kw["labels"][1] = -100
    kw["labels"][2, :9] = -100
    return kw


def _position_ids(name: str) -> dict:
    kw = _batch(name)
    kw["position_ids"] = torch.arange(3, 19).expand(2, 16).clone()
    return kw


def _kwargs(name: str) -> dict:
    kw = {**_batch(name), "output_hidden_states": True}
    if name != "bert":
        kw["num_items_in_batch"] = torch.tensor(23)
    return kw


CASES: dict[str, Callable[[str], dict]] = {
    "right padding": _right_padding,
    "left padding": _left_padding,
    "ignored rows": _ignored_rows,
    "position_ids": _position_ids,
    "kwargs": _kwargs,
    "new shape": lambda name: _batch(name, b=3, t=12, seed=1),
    "length 1": lambda name: _batch(name, b=2, t=1, seed=2),
}


def _compare(prog, model, kw: dict) -> float:
    """Worst relative error of outputs (where the mask keeps them), loss and every gradient."""
    model.zero_grad()
    for rank in prog.ranks():
        rank.zero_grad()
    ref, out = model(**kw), prog.simulate(**kw)
    keep = kw.get("attention_mask", torch.ones_like(kw["input_ids"])).bool()
    errs = [max_rel(out.logits[keep], ref.logits[keep]), max_rel(out.loss, ref.loss)]
    for mine, theirs in zip(out.hidden_states or (), ref.hidden_states or ()):
        errs.append(max_rel(mine[keep], theirs[keep]))
    if (out.hidden_states is None) != (ref.hidden_states is None):
        errs.append(float("inf"))
    ref.loss.backward()
    out.loss.backward()
    errs += list(grad_errors(prog.full_grads(), {n: p.grad for n, p in model.named_parameters()}).values())
    return max(errs)


def _run(case: Case, fn: Callable[[], float]) -> Case:
    try:
        case.error = fn()
    except AutoshardError as e:
        case.refusal = str(e)
    return case


def sweep(name: str, *, tp: int = 1, pp: int = 1) -> list[Case]:
    """Every case for one model and split; see the module docstring."""
    model = build_model(name, dropout=0.1).eval()
    example = _batch(name)
    prog = autoshard(model, tp=tp, pp=pp, microbatches=pp, example_kwargs=example).eval()
    cases = [_run(Case(case), lambda make=make: _compare(prog, model, make(name))) for case, make in CASES.items()]

    def mode_switch() -> float:
        kw = _batch(name)
        prog.train()
        first, second = prog.simulate(**kw).logits, prog.simulate(**kw).logits
        prog.eval()
        evaluated = model(**kw).logits
        if max_rel(first, second) < 1e-3 or max_rel(first, evaluated) < 1e-3:
            return float("inf")     # training mode did not turn dropout on
        return _compare(prog, model, kw)
    cases.append(_run(Case("train/eval switch"), mode_switch))

    def autocast() -> float:
        kw = _batch(name)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, ref = prog.simulate(**kw), model(**kw)
        if out.logits.dtype != ref.logits.dtype:
            return float("inf")
        return max(max_rel(out.logits.float(), ref.logits.float()), max_rel(out.loss, ref.loss))
    cases.append(_run(Case("bf16 autocast", tolerance=BF16_TOLERANCE), autocast))
    return cases
