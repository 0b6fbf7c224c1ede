"""Context parallelism: a rank graph -> context-parallel rank c's graph, which holds 1/cp of each
sequence's tokens from the embedding to the loss.

    cut = split_context(graph, cp=2, rank=c, value=example_value, param_names=..., suffix="")

Every rank is called with the whole batch (ids, masks and labels are small); the graph cuts them
to its tokens (`context_positions`: load-balanced pieces) where they first meet a value computed
from parameters, so every activation holds only the rank's tokens. Where tokens meet each other,
in attention (attention.py): an SDPA call becomes ring attention (`cp_ring_<node>` modules:
parallel/ring_attention.py) with the rank's queries, keys, values, positions and mask rows; with
`attention="all_gather"`, and for attention written out as ops, the keys and values are gathered in
position order (`cp_gather_<node>`: parallel/context_parallel.py) as close to their projection as
the graph allows (before GQA's head repetition), the queries stay local, so scores are [.., local
queries, all keys] and the mask table is cut to the rank's query rows; SDPA with `is_causal=True`
then becomes kernels/attention.py's `causal_attention_at`, whose mask is built from the positions.

Sizes: the graph's shapes are written with the sequence length S; a view of a local value is
given S / cp where the graph wrote S (sizes.py). The loss is each rank's mean over its own
tokens; the runtime and the simulator weight it by the rank's share of counted tokens
(runtime/loss_tokens.py reads the count from the graph, which now counts the rank's labels).

What cannot be read this way is refused naming the node, its module and why (tokens.py's table
says which ops carry token dims how). The pass changes the graph in place and returns `ContextCut`.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import sympy
import torch
import torch.fx as fx

from autoshard.errors import ShardingError
from autoshard.parallel.context_parallel import context_positions
from autoshard.passes.context import rules
from autoshard.passes.context.attention import attention_tags, matmul_tags
from autoshard.passes.context.shapes import exprs as _exprs
from autoshard.passes.context.shapes import infer_shape
from autoshard.passes.context.sizes import expr_of, fix_sizes
from autoshard.passes.context.tokens import ELEMENTWISE, LOCAL, SIZE_ARG, TOKEN_RULES, module_rule
from autoshard.passes.graph_reading import module_path, op_name

__all__ = ["ContextCut", "split_context"]

aten = torch.ops.aten


@dataclass
class ContextCut:
    """What the pass did to one rank graph."""

    specs: list = field(default_factory=list)        # the specs of the gathers and rings it calls
    local_outputs: dict[int, int] = field(default_factory=dict)      # flat output index -> its LOCAL token dim
    loss_output: int | None = None                                   # flat output index of the local mean loss


# rule name (tokens.py's TOKEN_RULES, and the kinds `_Split._rule` finds) -> the rule
RULES = {"ordered": rules.ordered, "permute": rules.permute, "mixing": rules.mixing, "linear": rules.linear,
         "matmul": matmul_tags, "attention": attention_tags, "embedding": rules.embedding, "loss": rules.loss,
         "sized": rules.sized, "cat": rules.cat, "elementwise": rules.elementwise, "other": rules.other,
         "item": rules.item, "token_wise": rules.token_wise, "rank_part": rules.rank_part, "gather_module": rules.gather_module,
         "refused_module": rules.refused_module, "convolution": rules.convolution,
         "stack": rules.stack, "per_head_norm": rules.per_head_norm}


def split_context(graph: fx.Graph, *, cp: int, rank: int, value: Callable[[fx.Node], object],
                  param_names: dict[str, str], suffix: str = "", token_wise: set[str] = frozenset(),
                  attention: str = "ring", choose: Callable[[dict], str] | None = None,
                  symbolic: Callable[[fx.Node], object] | None = None) -> ContextCut:
    """Cut `graph` (a rank graph, changed in place) to context-parallel rank `rank` of `cp`. `value`:
    a node's example value; `token_wise`: paths of modules whose output for a token depends on that
    token alone (experts modules, as expert parallelism assumes), inside which a rank's tokens are
    sorted and grouped as the model wrote it. `attention`: how SDPA calls meet the other ranks'
    keys, "ring", "all_gather" or "auto" (`choose`, given a call's example sizes). `symbolic`: for a
    graph exported with static sizes (sequence parallelism), a node's sizes in the sequence length
    (compile/static_shapes.py), or None where it has no captured value; its static sizes of token
    dims are then divided by cp where the value holds this rank's tokens."""
    return _Split(graph, cp, rank, value, param_names, suffix, token_wise, attention, choose, symbolic).run()


class _Split:
    def __init__(self, graph: fx.Graph, cp: int, rank: int, value, param_names, suffix: str, token_wise: set[str],
                 attention: str, choose: Callable[[dict], str] | None, symbolic: Callable[[fx.Node], object] | None):
        self.graph, self.cp, self.rank, self.value, self.attention = graph, cp, rank, value, attention
        self.choose, self.symbolic = choose, symbolic
        self.token_wise = set(token_wise)
        self.params, self.suffix = set(param_names) | set(param_names.values()), suffix   # captured targets, rank names
        self.cut = ContextCut()
        self.shapes: dict[fx.Node, object] = {}          # global shapes (sympy exprs in S), or lists for tuples
        self.tags: dict[fx.Node, object] = {}            # token tags of computed values (tuples, or lists for tuples)
        self.computed: set[fx.Node] = set()              # values that depend on a parameter
        self.local: dict[tuple, fx.Node] = {}            # (table node, dims) -> its cut to this rank's tokens
        self.sizes: dict[fx.Node, fx.Node] = {}          # size node -> its local size
        self.seqs, self.seq_node = self._sequence()
        self.positions: fx.Node | None = None

    # ---- reading the graph -------------------------------------------------------------------
    def _sequence(self) -> tuple[set, fx.Node]:
        """The sequence length's symbols (dim 1 of every integer input with two or more dims: ids,
        masks and labels are exported with symbols of their own) and a node computing the ids' one."""
        inputs = [n for n in self.graph.nodes if n.op == "placeholder" and isinstance(v := self.value(n), torch.Tensor)
                  and v.dim() >= 2 and not v.is_floating_point()]
        if not inputs:
            raise ShardingError(f"cp={self.cp}: the model has no token-id input ([batch, sequence] integers) to "
                                "cut the sequence by")
        if self.symbolic is not None:        # a static graph: the sizes read against its twin
            seqs = {e for n in inputs if (e := self.shape(n)[1]).free_symbols}
            self.seq_value = int(self.value(inputs[0]).shape[1])
            with self.graph.inserting_after([p for p in self.graph.nodes if p.op == "placeholder"][-1]):
                return seqs, self.graph.call_function(aten.sym_size.int, (inputs[0], 1))
        seqs = set()
        for n in inputs:
            size = self.value(n).shape[1]
            if not isinstance(size, torch.SymInt):
                raise ShardingError(f"cp={self.cp}: input {n.name}'s sequence dim was exported static ({size}); "
                                    "context parallelism needs it dynamic")
            seqs.add(sympy.sympify(size.node.expr))
        first = sympy.sympify(self.value(inputs[0]).shape[1].node.expr)
        for m in self.graph.nodes:
            if m.target == aten.sym_size.int and expr_of(self.value(m)) == first:
                return seqs, m
        last = [p for p in self.graph.nodes if p.op == "placeholder"][-1]
        with self.graph.inserting_after(last):
            return seqs, self.graph.call_function(aten.sym_size.int, (inputs[0], 1))

    def shape(self, n: object) -> list | None:
        """`n`'s global shape as sympy expressions (a list of them for a tuple), from its example
        value, or inferred for the nodes the tensor-parallel rewrite made (they have none)."""
        if not isinstance(n, fx.Node):
            return None
        if n not in self.shapes:
            v = self.value(n)
            if self.symbolic is not None and (s := self.symbolic(n)) is not None:
                self.shapes[n] = s
            elif isinstance(v, (tuple, list)):
                self.shapes[n] = [_exprs(x) for x in v]
            elif isinstance(v, torch.Tensor):
                self.shapes[n] = _exprs(v)
            else:
                self.shapes[n] = infer_shape(n, self.shape)
        return self.shapes[n]

    def is_token(self, e) -> bool:
        return bool(self.seqs & getattr(e, "free_symbols", set()))

    def is_seq(self, e) -> bool:
        """`e` is the sequence length itself (a dim of its own, not flattened with others)."""
        return e in self.seqs

    def token_dims(self, shape: list | None) -> list[int]:
        return [i for i, e in enumerate(shape or []) if self.is_token(e)]

    def refuse(self, n: fx.Node, why: str):
        raise ShardingError(f"cp={self.cp}: node {n.name} ({_op(n)}) in {module_path(n)}: {why}")

    # ---- the pass ----------------------------------------------------------------------------
    def run(self) -> ContextCut:
        for n in list(self.graph.nodes):
            if n.op == "placeholder":
                continue
            if n.op == "get_attr":
                if n.target in self.params:
                    self.computed.add(n)
                    self.tags[n] = tuple(None for _ in self.shape(n) or [])
                continue
            if n.op == "output":
                self._outputs(n)
                continue
            if not any(a in self.computed for a in n.all_input_nodes):
                continue                                  # a table: computed at the whole sequence
            self.computed.add(n)
            rule = self._rule(n)
            if rule in ("mixing", "other") and self._in_token_wise(n):
                rule = "token_wise"
            RULES[rule](self, n)
        fix_sizes(self)
        self.graph.lint()
        return self.cut

    def _rule(self, n: fx.Node) -> str:
        if n.op == "call_module":
            return module_rule(n.target)
        if n.target is operator.getitem:
            return "item"
        if n.meta.get("rank_part"):
            return "rank_part"
        if n.target in TOKEN_RULES:
            return TOKEN_RULES[n.target]
        if n.target in ELEMENTWISE or torch.Tag.pointwise in getattr(n.target, "tags", ()):
            return "elementwise"
        return "other"

    def _in_token_wise(self, n: fx.Node) -> bool:
        stack = n.meta.get("nn_module_stack") or {}
        return any(path in self.token_wise for path, _ in stack.values())

    # ---- cutting tables, gathering keys ------------------------------------------------------
    def positions_node(self) -> fx.Node:
        if self.positions is None:
            device = next((v.device for n in self.graph.nodes if n.op == "placeholder"
                           and isinstance(v := self.value(n), torch.Tensor)), None)
            with self.graph.inserting_after(self.seq_node):
                self.positions = self.graph.call_function(context_positions, (self.seq_node, self.cp, self.rank),
                                                          {"device": device})
        return self.positions

    def cut_table(self, a: fx.Node, dims: list[int], before: fx.Node) -> fx.Node:
        """Table `a` cut to this rank's tokens along `dims` (its token dims), inserted before `before`."""
        key = (a, tuple(dims))
        if key in self.local:
            return self.local[key]
        shape = self.shape(a)
        if all(self.is_seq(shape[d]) for d in dims):
            node = a
            with self.graph.inserting_before(before):
                pos = self.positions_node()
                for d in dims:
                    node = self.graph.call_function(aten.index_select.default, (node, d, pos))
        elif a.op == "call_function" and (a.target in SIZE_ARG or a.target in ELEMENTWISE) and \
                isinstance(a.args[0], fx.Node):
            src = a.args[0]
            src_dims = self.token_dims(self.shape(src))
            ours = self.token_dims(shape)
            if len(src_dims) != len(ours):
                raise ShardingError(f"cp={self.cp}: table {a.name} in {module_path(a)} cannot be cut to this "
                                    "rank's tokens (its token dims do not follow its input's)")
            inner = self.cut_table(src, [src_dims[ours.index(d)] for d in dims], before)
            with self.graph.inserting_before(before):
                node = self.graph.create_node("call_function", a.target, (inner, *a.args[1:]), dict(a.kwargs))
            self.tags[node] = tuple(LOCAL if d in dims else None for d in range(len(shape)))
            self.computed.add(node)     # its sizes are fixed as a computed value's
        else:
            raise ShardingError(f"cp={self.cp}: table {a.name} ({_op(a)}) in {module_path(a)} meets this rank's "
                                f"tokens along a flattened dim the pass cannot cut")
        self.shapes[node] = shape
        self.local[key] = node
        return node

    # ---- outputs ---------------------------------------------------------------------------
    def _outputs(self, n: fx.Node) -> None:
        flat = list(n.args[0]) if isinstance(n.args[0], (list, tuple)) else [n.args[0]]
        for i, o in enumerate(flat):
            if o not in self.computed:
                continue
            if o.target == aten.cross_entropy_loss.default or (o.op == "call_module" and module_rule(o.target) == "loss"):
                self.cut.loss_output = i
                continue
            tags = self.tags.get(o)
            if not isinstance(tags, tuple):
                continue
            local = [d for d, t in enumerate(tags) if t == LOCAL]
            if len(local) > 1 or (local and not self.is_seq(self.shape(o)[local[0]])):
                self.refuse(o, "the model returns it with this rank's tokens along a flattened dim")
            if not self.token_dims(self.shape(o)) and self.shape(o) == []:
                if self.cut.loss_output is None and o.target not in (aten.cross_entropy_loss.default,):
                    self.refuse(o, "the model returns a value reduced over its tokens other than a mean "
                                   "cross-entropy; a rank holds only its part of it")
            if local:
                self.cut.local_outputs[i] = local[0]


def _op(n: fx.Node) -> str:
    return op_name(n.target) if n.op == "call_function" else f"{n.op} {n.target}"
