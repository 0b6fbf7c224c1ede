"""Capture: an nn.Module -> one FX graph with parameters as get_attr nodes, shapes in node.meta.

torch.export (non-strict) traces with fake tensors, so a model built on the meta device compiles
without materializing anything. Batch and sequence dims are exported dynamic (Dim.AUTO) where the
model allows; whatever export had to specialize is recorded in `Signature`, and a call whose inputs
do not match is compiled again for them (the program keeps one graph per signature).
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export import Dim

from autoshard.compile import trace_cache
from autoshard.compile.dense_experts import dense_experts
from autoshard.compile.export_refusal import export_refusal
from autoshard.errors import CaptureError
from autoshard.module_paths import fetch_attr

__all__ = ["Captured", "InputBinder", "Signature", "autocast_state", "capture", "normalize_inputs", "infer_example_inputs"]


@dataclass(frozen=True)
class Signature:
    """What a call must look like to reuse a graph: the pytree spec, static dims, constant values,
    and torch.export's guards (the size conditions the model's Python code took its branches,
    loops and asserts on, and the dynamic sizes' ranges)."""

    spec: pytree.TreeSpec
    leaves: tuple[tuple, ...]   # per leaf: ("tensor", dtype, dims) with dims int or str symbol; ("const", v)
    training: bool = True       # the mode it was captured in: dropout and batch norm differ
    autocast: tuple = ()        # autocast_state() at capture: a cast that was a no-op is not one then
    guards: Callable[..., None] | None = field(default=None, compare=False)   # raises AssertionError

    def matches(self, flat: list[object], spec: pytree.TreeSpec, training: bool, autocast: tuple = ()) -> bool:
        if (spec != self.spec or len(flat) != len(self.leaves) or training != self.training
                or autocast != self.autocast):
            return False
        if not self._leaves_match(flat):
            return False
        if self.guards is not None:
            try:
                self.guards(*flat)
            except AssertionError:     # another branch of the model's code: compile again
                return False
        return True

    def _leaves_match(self, flat: list[object]) -> bool:
        symbols: dict[str, int] = {}
        for leaf, want in zip(flat, self.leaves):
            if want[0] == "const":
                if isinstance(leaf, torch.Tensor) or leaf != want[1]:
                    return False
                continue
            if not isinstance(leaf, torch.Tensor) or leaf.dtype != want[1] or leaf.dim() != len(want[2]):
                return False
            for size, d in zip(leaf.shape, want[2]):
                if isinstance(d, int):
                    if size != d:
                        return False
                elif size < 2 or symbols.setdefault(d, size) != size:   # export's dims start at 2
                    return False
        return True


@dataclass
class Captured:
    gm: fx.GraphModule
    param_names: dict[str, str]      # get_attr target -> canonical parameter name
    signature: Signature
    out_spec: pytree.TreeSpec


@dataclass(frozen=True)
class InputBinder:
    """Binds a call to a model's `forward` parameter names, without holding the model."""

    model_name: str
    signature: inspect.Signature
    hf: bool
    cache_default: bool = False      # an HF model whose config says use_cache: called without it, it uses a cache

    @classmethod
    def of(cls, model: nn.Module) -> "InputBinder":
        sig, hf = inspect.signature(model.forward), _is_hf(model)
        cache = hf and "use_cache" in sig.parameters and bool(getattr(getattr(model, "config", None), "use_cache", False))
        return cls(type(model).__name__, sig, hf, cache)

    def __call__(self, args: tuple, kwargs: dict) -> dict[str, object]:
        """Named inputs; HF models get use_cache=False (training)."""
        sig = self.signature
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise CaptureError(f"inputs do not match {self.model_name}.forward{sig}: {e}") from None
        named = dict(bound.arguments)
        for name, param in sig.parameters.items():    # **kwargs: each extra argument under its own name
            if param.kind is inspect.Parameter.VAR_KEYWORD and name in named:
                named.update(named.pop(name))
        if "use_cache" in sig.parameters and "use_cache" not in named and self.hf:
            if self.cache_default:
                _refuse_packed_with_cache(self.model_name, named)
            named["use_cache"] = False
        return named


def _refuse_packed_with_cache(model_name: str, named: dict[str, object]) -> None:
    """transformers masks each packed document apart (position_ids that restart inside a row) only
    without a cache; a model whose config says use_cache, called without use_cache=False, attends
    across the documents, while the program, which never holds a cache, would mask them apart."""
    pos = named.get("position_ids")
    if not isinstance(pos, torch.Tensor) or named.get("attention_mask") is not None or pos.dim() < 2 \
            or pos.shape[-1] < 2 or pos.is_meta:
        return
    restarts = (pos.diff(dim=-1) != 1).nonzero()
    if len(restarts):
        at = restarts[0].tolist()
        at[-1] += 1
        raise CaptureError(f"{model_name}: position_ids restart inside a row (at index {tuple(at)}: packed "
                           f"documents) with no attention_mask, and its config says use_cache=True: transformers then "
                           f"attends across the documents, which the program (no cache) would mask apart; pass "
                           f"use_cache=False to mask each document apart (packed training), or an attention_mask")


def normalize_inputs(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, object]:
    """Bind a call to `model.forward`'s parameter names; HF models get use_cache=False (training)."""
    return InputBinder.of(model)(args, kwargs)


def _is_hf(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def infer_example_inputs(model: nn.Module) -> tuple[tuple, dict]:
    """Example inputs when none are given: HF models from their config; fx-traceable modules whose
    first input feeds an embedding (token ids). Anything else must be given `example_inputs`."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    device = torch.device("cpu") if device.type == "meta" else device
    cfg = getattr(model, "config", None)
    if _is_hf(model) and getattr(cfg, "vocab_size", None):
        return (), {"input_ids": torch.randint(0, cfg.vocab_size, (2, 8), device=device)}
    try:
        traced = fx.symbolic_trace(model)
    except Exception as e:
        raise CaptureError(f"cannot infer example inputs for {type(model).__name__}: torch.fx could not "
                           f"trace it ({type(e).__name__}: {e}); pass example_inputs=(...)") from e
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    first = placeholders[0] if placeholders else None
    for user in (first.users if first else ()):
        if user.op == "call_module" and isinstance(traced.get_submodule(user.target), nn.Embedding):
            emb = traced.get_submodule(user.target)
            return (torch.randint(0, emb.num_embeddings, (2, 8), device=device),), {}
    raise CaptureError(f"cannot infer example inputs for {type(model).__name__}: its first input does not "
                       f"feed an nn.Embedding; pass example_inputs=(...)")


def _dynamic(named: dict[str, object]) -> dict[str, object]:
    def spec(x):
        return {i: Dim.AUTO for i in range(x.dim())} if isinstance(x, torch.Tensor) else None
    return {k: pytree.tree_map(spec, v) if not isinstance(v, torch.Tensor) else spec(v)
            for k, v in named.items()}


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast regions in force: (device type, dtype) for each enabled one.

    A graph is kept per state. Traced in fp32, `logits.float()` is the same tensor as `logits`, so
    export cannot tell which of the two the model returns; traced under autocast it can."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


@contextmanager
def _mode(model: nn.Module, training: bool | None):
    """`model.train(training)` for the block, every submodule's own mode restored after."""
    if training is None or all(m.training == training for m in model.modules()):
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, was in modes:
            m.training = was


@contextmanager
def _no_cache(model: nn.Module):
    """A Hugging Face model that takes `use_cache` only through **kwargs (GraniteMoe) reads it from
    its config and would return a DynamicCache, which export cannot hold: the config says no cache
    while the model is traced (a training graph has none), and is restored after."""
    config = getattr(model, "config", None)
    was = getattr(config, "use_cache", False)
    if not _is_hf(model) or not was:
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = was


def capture(model: nn.Module, named: dict[str, object], *, dynamic: bool = True,
            training: bool | None = None) -> Captured:
    """`dynamic=False` exports every size static (sequence parallelism cuts the sequence by index).
    `training`: capture in that mode (model.train(training) while tracing); None: as the model is.
    A model on the meta device is traced with its example inputs moved there too (only shapes
    matter); its graph then names the meta device, until materialization retargets it."""
    # Every example tensor its own contiguous copy (on meta for a meta model): export would read one
    # tensor passed as two inputs (idx and targets both `ids`) as one input, and reject overlapping
    # views of one batch.
    meta = any(p.is_meta for p in model.parameters())
    named = pytree.tree_map(lambda x: (x.to("meta") if meta else x.clone(memory_format=torch.contiguous_format))
                            if isinstance(x, torch.Tensor) else x, named)
    key = (trace_cache.trace_key(model, named, dynamic=dynamic, training=training, autocast=autocast_state())
           if trace_cache.enabled() else None)
    ep = trace_cache.lookup(key, model)
    if ep is None:
        ep = _export(model, named, dynamic, training)
        trace_cache.store(key, ep)
    gm = ep.module()
    # The guards leave the graph (every rank's program would carry them) and are checked where a
    # call picks its graph (Signature.matches): a call that fails one is compiled again.
    guards = getattr(gm, "_guards_fn", None)
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and n.target == "_guards_fn" and not n.users:
            gm.graph.erase_node(n)
        # export's record of a value's dtype before `.float()` / `.to(dtype)`: under autocast (or
        # outside it, for a graph captured inside) the dtype differs and the check would fail a
        # call the model runs; the cast itself stays
        elif n.op == "call_function" and n.target == torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(n)
    gm.graph._codegen = fx.graph.CodeGen()   # flat inputs: the program flattens calls itself
    for n in [n for n in gm.graph.nodes if n.op == "get_attr" and n.users]:
        first = min(n.users, key=_order(gm.graph))
        first.prepend(n)                      # read each weight where it is used: readable code
    gm.graph.eliminate_dead_code()
    gm.recompile()
    canonical = {}
    for name, p in model.named_parameters():
        canonical.setdefault(id(p), name)
    param_names = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj = fetch_attr(gm, n.target)
            if isinstance(obj, nn.Parameter) or (isinstance(obj, torch.Tensor) and id(obj) in canonical):
                param_names[n.target] = canonical.get(id(obj), n.target)
    flat, spec = pytree.tree_flatten(((), named))
    leaves = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for leaf, ph in zip(flat, placeholders):
        if isinstance(leaf, torch.Tensor):
            dims = tuple(int(s) if not isinstance(s, torch.SymInt) else str(s.node.expr)
                         for s in ph.meta["val"].shape)
            leaves.append(("tensor", leaf.dtype, dims))
        else:
            leaves.append(("const", leaf))
    return Captured(gm, param_names, Signature(spec, tuple(leaves), model.training if training is None else training,
                     autocast_state(), guards), ep.call_spec.out_spec)


def _export(model: nn.Module, named: dict[str, object], dynamic: bool, training: bool | None
            ) -> torch.export.ExportedProgram:
    errors = []
    for dyn in ((True, False) if dynamic else (False,)):
        try:
            with _mode(model, training), _no_cache(model), dense_experts(model):
                return torch.export.export(model, (), named, dynamic_shapes=_dynamic(named) if dyn else None,
                                           strict=False)
        except Exception as e:  # the tracer's own reason is what the user needs to see
            errors.append(e)
    e = errors[-1]
    raise CaptureError(export_refusal(model, e)) from e


def _order(graph: fx.Graph):
    pos = {n: i for i, n in enumerate(graph.nodes)}
    return pos.__getitem__
