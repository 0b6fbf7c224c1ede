"""Which dims of a value are the sequence's tokens, and how each op carries them: the table.

The context-parallel pass (passes/context/split.py) tags every token dim of every value computed
from parameters: LOCAL (this rank's tokens: 1/cp of them) or GLOBAL (every token, in position
order: keys and values after their all-gather, the keys' side of attention scores). A token dim
is a dim whose size is the sequence length S, or a multiple of it (B * S when batch and sequence
are flattened). Values computed from the inputs alone (ids, masks, labels, positions, rotary and
mask tables) are "tables": computed at the whole sequence, and cut to this rank's tokens where they
meet a LOCAL dim.

Each op kind is a row of `TOKEN_RULES` (op -> rule name); passes/context/split.py holds one method
per rule. An op that touches a token dim and has no row is refused, naming it: an op that mixes
tokens (a cumulative sum, a pooling) must never run on a rank's slice as if it were the sequence.
"""
from __future__ import annotations

import torch

from autoshard.kernels.norm_ops import per_head_layer_norm

__all__ = ["LOCAL", "GLOBAL", "TOKEN_RULES", "ELEMENTWISE", "mixed_dims", "SIZE_ARG", "module_rule"]

aten = torch.ops.aten

LOCAL, GLOBAL = "local", "global"

# Shape-preserving ops that act on each element alone (besides aten's pointwise-tagged ops)
ELEMENTWISE = {aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
               aten.contiguous.default, aten.alias.default, aten.detach.default, aten.type_as.default,
               aten.dropout.default, aten.native_dropout.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
               aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.lift_fresh_copy.default,
               aten.copy.default, aten.fill.Scalar, aten.zeros_like.default, aten.ones_like.default,
               aten.empty_like.default, aten.full_like.default, aten.gelu.default, aten.silu.default,
               aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten.softplus.default,
               aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default,
               aten.__or__.Tensor, aten.__and__.Tensor, aten.__xor__.Tensor}

# Views that keep the token dims in order (each token dim of the output is one of the input's)
ORDERED_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
                 aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
                 aten.unflatten.int, aten.slice.Tensor, aten.select.int, aten.view_as_complex.default,
                 aten.view_as_real.default, aten.expand.default, aten.repeat_interleave.self_int,
                 aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
                 aten.narrow.default}

# ops whose token dims follow from an explicit permutation
PERMUTES = {aten.transpose.int, aten.permute.default, aten.t.default}

# ops reading values along dims: a LOCAL dim among them would be read as if it were the sequence
_MIX_DIM_ARG = {aten._softmax.default: 1, aten.softmax.int: 1, aten._log_softmax.default: 1,
                aten.log_softmax.int: 1, aten.sum.dim_IntList: 1, aten.mean.dim: 1, aten.amax.default: 1,
                aten.amin.default: 1, aten.max.dim: 1, aten.min.dim: 1, aten.argmax.default: 1,
                aten.argmin.default: 1, aten.var.correction: 1, aten.std.correction: 1, aten.logsumexp.default: 1,
                aten.cumsum.default: 1, aten.cumprod.default: 1, aten.sort.default: 1, aten.topk.default: 2,
                aten.norm.ScalarOpt_dim: 2, aten.linalg_vector_norm.default: 2, aten.flip.default: 1,
                aten.roll.default: 2, aten.all.dim: 1, aten.any.dim: 1}
_MIX_LAST = {aten.layer_norm.default: 1, aten.native_layer_norm.default: 1, aten.rms_norm.default: 1}
_MIX_ALL = {aten.sum.default, aten.mean.default, aten.max.default, aten.min.default, aten.all.default,
            aten.any.default}
_DEFAULT_LAST = {aten.topk.default, aten.sort.default}

TOKEN_RULES: dict[object, str] = {
    **{op: "ordered" for op in ORDERED_VIEWS},
    **{op: "permute" for op in PERMUTES},
    **{op: "mixing" for op in (*_MIX_DIM_ARG, *_MIX_LAST, *_MIX_ALL)},
    aten.linear.default: "linear",
    aten.matmul.default: "matmul", aten.bmm.default: "matmul", aten.mm.default: "matmul",
    aten.baddbmm.default: "matmul", aten.addmm.default: "matmul",
    aten.scaled_dot_product_attention.default: "attention",
    aten.embedding.default: "embedding",
    aten.cross_entropy_loss.default: "loss",
    aten.new_zeros.default: "sized", aten.new_ones.default: "sized", aten.new_empty.default: "sized",
    aten.new_full.default: "sized",
    aten.cat.default: "cat", aten.stack.default: "stack",
    per_head_layer_norm: "per_head_norm",
    aten.conv1d.default: "convolution", aten.conv1d.padding: "convolution",
}

def module_rule(target: object) -> str:
    """The rule of a rank graph's module call, by the name the tensor-parallel rewrite gives it: f, g,
    dropout's modules and sequence parallelism's reduce-scatter (over the tp ranks, within this rank's
    tokens) keep their input's token dims ("elementwise"), a gather of vocabulary shards or of sequence
    parallelism's token chunks keeps token dims in order ("gather_module"), the vocabulary-parallel cross-entropy is the loss ("loss");
    anything else is not built with context parallelism ("refused_module")."""
    name = str(target)
    if name in ("f", "g") or "_rng_" in name or name.startswith("reduce_scatter_to_sequence"):
        return "elementwise"
    if name.startswith("gather_"):
        return "gather_module"
    if name.startswith("vocab_cross_entropy"):
        return "loss"
    return "refused_module"


# ops with a size list, and where it is: its entries are the output's dims
SIZE_ARG = {aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1, aten.expand.default: 1,
            aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_empty.default: 1, aten.new_full.default: 1}


def mixed_dims(op: object, args: tuple, ndim: int) -> list[int]:
    """The dims a "mixing" op reads along (normalized to 0..ndim-1)."""
    if op in _MIX_ALL:
        return list(range(ndim))
    if op in _MIX_LAST:
        shape = args[1]
        return list(range(ndim - len(shape), ndim))
    i = _MIX_DIM_ARG[op]
    dims = args[i] if len(args) > i else None
    if dims is None:
        dims = -1 if op in _DEFAULT_LAST else list(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted({d % ndim for d in dims}) if ndim else []
