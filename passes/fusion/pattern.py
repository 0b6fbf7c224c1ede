"""Op-tree patterns over FX graphs: `P` matches a call_function node and its arguments, `V` binds
any value to a name (optionally tested), a list matches a list argument item by item. A name bound
twice must bind the same node or an equal constant. A node with more arguments than its pattern
names does not match (x[::2] is not x[:]). A call_module node that runs an op (Facts.module_op:
a dropout under its region's generator) matches as that op. Used by the fusion pass (passes/fusion/fuse.py).

    env, inner = {}, []
    if match(P((aten.relu.default,), (V("x"),)), node, env, inner, lookup):
        env["x"]          # relu's input; `inner`: the matched nodes below the root
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

__all__ = ["P", "V", "Test", "Facts", "match", "ASSERTS", "users"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Facts:
    """What a test may know beyond the graph: `facts(target)`, a get_attr target's tensor; and
    `facts.captured(node)`, the node's value in the captured single-device program as export
    recorded it (a fake tensor with int / SymInt sizes, or a SymInt), or None where unknown. Its
    sizes are the single-device ones: a dim tensor parallelism splits has its full size there."""
    attr: Callable[[str], object]
    captured: Callable[[fx.Node], object] = lambda node: None
    # the op a call_module node runs for the graph (a random op under its region's generator), or None
    module_op: Callable[[str], object] = lambda target: None

    def __call__(self, target: str) -> object:
        return self.attr(target)


# a test on a bound value: (value, Facts (or a plain get_attr lookup), the bindings made so far) -> ok
Test = Callable[[object, Callable[[str], object], dict], bool]


@dataclass(frozen=True)
class V:
    name: str
    test: Test | None = None
    default: object = ...                      # bound when the node has fewer arguments


@dataclass(frozen=True)
class P:
    targets: tuple
    args: tuple = ()
    bind: str | None = None
    kwargs_ok: Callable[[dict], bool] = lambda kw: not kw


# export's dtype assertions before a `.to`: not real users; they go with the node they check
ASSERTS = (aten._assert_tensor_metadata.default,)


def users(n: fx.Node) -> list[fx.Node]:
    return [u for u in n.users if u.target not in ASSERTS]


def _same(a: object, b: object) -> bool:
    """Two bindings of one name: the same node, or equal constants."""
    return a is b if isinstance(a, fx.Node) or isinstance(b, fx.Node) else type(a) is type(b) and a == b


def _runs(n: fx.Node, facts) -> object:
    """The op a node runs: a call_function's target, or the op of a call_module that runs one (a
    dropout under its region's generator matches a dropout pattern; the builder sees `n.op`)."""
    if n.op == "call_function":
        return n.target
    return getattr(facts, "module_op", lambda target: None)(n.target) if n.op == "call_module" else None


def match(pat: object, value: object, env: dict, inner: list[fx.Node], lookup, root: bool = True) -> bool:
    """Match `pat` at `value`, binding names in `env` and listing the inner nodes (single-user,
    so they can go) in `inner`, parents before children."""
    if isinstance(pat, list):                        # a list argument (cat's tensors), matched item by item
        return (isinstance(value, (list, tuple)) and len(value) == len(pat)
                and all(match(p, v, env, inner, lookup, False) for p, v in zip(pat, value)))
    if isinstance(pat, V):
        if pat.name in env and not _same(env[pat.name], value):
            return False
        if pat.test is not None and not pat.test(value, lookup, env):
            return False
        env[pat.name] = value
        return True
    n = value
    if not (isinstance(n, fx.Node) and _runs(n, lookup) in pat.targets
            and pat.kwargs_ok(dict(n.kwargs)) and len(n.args) <= len(pat.args)):
        return False                                 # an argument the pattern does not name (a slice's step)
    if not root:
        if len(users(n)) != 1:
            return False
        inner.append(n)
    if pat.bind:
        env[pat.bind] = n
    for i, sub in enumerate(pat.args):
        if i < len(n.args):
            if not match(sub, n.args[i], env, inner, lookup, False):
                return False
        elif isinstance(sub, V) and sub.default is not ...:
            env.setdefault(sub.name, sub.default)
        else:
            return False
    return True
