"""Planted bugs for `autoshard verify` to catch: each a small patch of one compiler or runtime part,
applied while the model is compiled and verified, and the model and split that exercise it.

`Mutation.reveals` names the certificate's input that a bug of its kind needs to show, where only
one does: "weights" (moved off their initial values), "ids" (every vocabulary shard's edge ids),
"masks" (an unpadded batch beside the padded one), "positions" (a packed batch), "dropout" (dropout
on, recomputation against none) and "steps" (several optimizer steps). Each such bug changes
nothing on the model's initial weights, a random padded batch and one step with dropout off.

    python -m tests.harness.mutations          # the table: bug -> first failing item, and whether
                                               # comparing losses alone would have caught it

tests/simulation/test_verify_mutations.py asserts that every one fails `verify` with a message naming
the parameter or output that differs. Each patch changes behaviour only while its `with` lasts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Callable
from unittest import mock

import torch

import autoshard.regions.recompute as recompute
import autoshard.compile.compiler as compiler
import autoshard.compile.trace_cache as trace_cache
import autoshard.parallel.lockstep as lockstep
import autoshard.parallel.expert_parallel as expert_parallel
import autoshard.parallel.ring_pieces as ring_pieces
import autoshard.parallel.rng as rng
import autoshard.parallel.sequence_parallel as sequence_parallel
import autoshard.parallel.tensor_parallel as tensor_parallel
import autoshard.parallel.vocab_parallel as vocab_parallel
import autoshard.runtime.loss_tokens as loss_tokens
from autoshard.compile import stage_layout, weights
from autoshard.passes.rewrite import edits
from autoshard.testing.models import build_model, build_moe
from autoshard.verify import Certificate, verify_model

__all__ = ["MUTATIONS", "Mutation", "run_mutation"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    model: str                  # testing.models' name, "mixtral", or "nanogpt-dropout"
    split: dict
    patch: Callable[[], contextlib.AbstractContextManager]
    reveals: str = ""           # the one certificate input this kind of bug needs to show (module doc)


def _run_with(cls, reducer_change: Callable):
    """Patch collective class `cls` so that its `run` sees a Reducer changed by `reducer_change`."""
    original = cls.run

    def run(red, mods, rank_args):
        return original(dataclasses.replace(red, **reducer_change(red)), mods, rank_args)
    return mock.patch.object(cls, "run", staticmethod(run))


def _f_without_reduce():
    return mock.patch.object(tensor_parallel._F, "backward", staticmethod(lambda ctx, *grads: (None, *grads)))


def _g_without_reduce():
    return mock.patch.object(tensor_parallel._G, "forward", staticmethod(lambda ctx, red, *xs: tuple(x.clone() for x in xs)))


@contextlib.contextmanager
def _f_g_swapped():
    f, g = tensor_parallel._F, tensor_parallel._G
    with mock.patch.object(tensor_parallel.CopyToTensorParallelRegion, "run",
                           staticmethod(lambda red, mods, args: list(g.apply(red, *(a[0] for a in args))))), \
         mock.patch.object(tensor_parallel.ReduceFromTensorParallelRegion, "run",
                           staticmethod(lambda red, mods, args: list(f.apply(red, *(a[0] for a in args))))):
        yield


def _g_backward_reduced():
    def backward(ctx, *grads):
        return (None, *[g * 2 for g in grads])          # summed over tp = 2 ranks holding equal gradients
    return mock.patch.object(tensor_parallel._G, "backward", staticmethod(backward))


def _shared_rows_not_summed():
    return mock.patch.object(tensor_parallel._SyncReplicas, "backward",
                             staticmethod(lambda ctx, *grads: (None, None, None, None, *grads)))


def _wrong_group():
    """Collectives of the f/g pair over a group of one rank (each rank alone) instead of its tp group."""
    return _run_with(tensor_parallel.ReduceFromTensorParallelRegion, lambda red: {"sum": lambda xs: [x.clone() for x in xs]})


def _gather_reversed():
    return _run_with(vocab_parallel.GatherFromTensorParallelRegion,
                     lambda red: {"all_gather": lambda xs, d: red.all_gather(xs[::-1], d)})


def _ce_reduced_twice():
    return _run_with(vocab_parallel.VocabParallelCrossEntropy, lambda red: {"sum": lambda xs: red.sum(red.sum(xs))})


def _ce_max_local():
    return _run_with(vocab_parallel.VocabParallelCrossEntropy, lambda red: {"max": lambda xs: [x.clone() for x in xs]})


def _ce_summed_not_averaged():
    original = vocab_parallel.CrossEntropySpec.build

    def build(self, handle):
        return original(dataclasses.replace(self, reduction=2), handle)
    return mock.patch.object(vocab_parallel.CrossEntropySpec, "build", build)


def _sp_wrong_chunk():
    def change(red):
        return {"reduce_scatter": lambda xs, d: red.reduce_scatter(xs, d)[::-1]}
    return _run_with(sequence_parallel.ReduceScatterToSequenceParallelRegion, change)


def _sp_gather_grads_not_reduced():
    def run(red, mods, rank_args):
        m = mods[0]
        return sequence_parallel.seq_all_gather(red, m.dim, m.outer, [a[0] for a in rank_args], not m.reduce_grads)
    return mock.patch.object(sequence_parallel.GatherFromSequenceParallelRegion, "run", staticmethod(run))


def _microbatch_mean():
    """Each microbatch's mean weighted 1 / m, not by its share of the counted tokens."""
    def factors(counter, flats, *rest):
        return [1.0 / len(flats)] * len(flats), True
    return mock.patch.object(loss_tokens, "loss_factors", factors)


def _tokens_counted_with_ignored():
    """The token count of a microbatch includes the labels of -100."""
    original = loss_tokens.loss_tokens

    def counted(gm):
        found = original(gm)
        if found is None:
            return None
        return loss_tokens.LossTokens(found.output, lambda *flat: torch.tensor(float(flat[0].numel())))
    return mock.patch.object(loss_tokens, "loss_tokens", counted)


def _stage_boundary_detached():
    """Values received from the previous pipeline stage are detached: no gradient crosses back."""
    original = stage_layout.StageLayout.stage_graphs

    def stage_graphs(self, gm, cache=True):
        stages = original(self, gm, cache=False)
        for sg in stages[1:]:
            received = [n for n in sg.graph.nodes if n.op == "placeholder"][-len(sg.receives):] if sg.receives else []
            for n in received:
                with sg.graph.inserting_after(n):
                    cut = sg.graph.call_function(torch.Tensor.detach, (n,))
                n.replace_all_uses_with(cut, delete_user_cb=lambda user, cut=cut: user is not cut)
            sg.graph.lint()
        return stages
    return mock.patch.object(stage_layout.StageLayout, "stage_graphs", stage_graphs)


def _weights_cut_shifted():
    """Each rank's weight shard cut from the next rank's rows."""
    def shifted(t, dim, ranges):
        n = t.shape[dim]
        moved = [((a + (b - a)) % n, (b + (b - a) - 1) % n + 1) for a, b in ranges]
        return _slice(t, dim, moved)
    return mock.patch.object(weights, "slice_layout", shifted)


def _kv_head_swapped():
    """kv < tp: the ranks sharing a kv head cut the other kv head's weights (a rank holding rows that
    more than 1/tp of the ranks hold gets the next such block)."""
    def cut(t, dim, ranges):
        n, held = t.shape[dim], sum(b - a for a, b in ranges)
        tp = 4                                  # the split this bug runs at
        if held * tp > n and held < n:         # rows shared by several ranks: a kv head at kv < tp
            ranges = [((a + held) % n, (a + held) % n + (b - a)) for a, b in ranges]
        return _slice(t, dim, ranges)
    return mock.patch.object(weights, "slice_layout", cut)


def _tp_stream_shared():
    """Every tensor-parallel rank seeded alike inside tensor-parallel regions."""
    original = rng.RNGTracker.manual_seed

    def manual_seed(self, seed):
        original(self, seed)
        self.seeds["tensor_parallel"] -= self.rank
    return mock.patch.object(rng.RNGTracker, "manual_seed", manual_seed)


def _replicated_stream_per_rank():
    """Each rank seeded apart outside tensor-parallel regions too."""
    original = rng.RNGTracker.manual_seed

    def manual_seed(self, seed):
        original(self, seed)
        self.seeds["replicated"] += 7 * self.rank
    return mock.patch.object(rng.RNGTracker, "manual_seed", manual_seed)


def _dropout_region_mislabeled():
    """Every random op run with the replicated stream (the rewrite's region label lost)."""
    original = rng.RandomOpSpec.build

    def build(self, tracker):
        return original(dataclasses.replace(self, region="replicated"), tracker)
    return mock.patch.object(rng.RandomOpSpec, "build", build)


def _slice(t, dim, ranges):
    from autoshard.compile.rank import slice_layout
    return slice_layout(t, dim, ranges)


def _experts_to_wrong_owner():
    """Each rank's tokens for expert owner 0 sent to owner 1 and back (counts swapped)."""
    original = expert_parallel._pairs_per_owner
    return mock.patch.object(expert_parallel, "_pairs_per_owner", lambda owner, size: original(owner, size)[::-1])


def _embedding_partial_sums_kept():
    """Vocabulary-parallel embedding's partial rows (zeros outside the shard) not summed: g skipped
    only there (the first g the lockstep simulation runs). Planted in the simulation's path: "the
    first call" means nothing to ranks that run on their own; skipping a g on one rank of the
    runtime is a collective the others wait on, which the local world names as a mismatch."""
    calls = {"n": 0}
    cls = tensor_parallel.ReduceFromTensorParallelRegion
    original = cls.simulate.__func__

    def simulate(klass, mods, rank_args):
        calls["n"] += 1
        if calls["n"] == 1:
            return [a[0].clone() for a in rank_args]
        return original(klass, mods, rank_args)
    return mock.patch.object(cls, "simulate", classmethod(simulate))


def _logits_gather_valid_ignored():
    """The gathered logits keep the vocabulary's padding rows in place of the last real ones."""
    def change(red):
        def gather(xs, d):
            out = red.all_gather(xs, d)
            return [o.roll(1, d) for o in out]
        return {"all_gather": gather}
    return _run_with(vocab_parallel.GatherFromTensorParallelRegion, change)


def _sp_split_reversed():
    """Sequence parallelism's scatter keeps the other rank's tokens."""
    return _run_with(sequence_parallel.GatherFromSequenceParallelRegion,
                     lambda red: {"all_gather": lambda xs, d: red.all_gather(xs[::-1], d)})


def _row_bias_before_reduce():
    """A row-parallel linear's bias added to each rank's partial sum before g: counted tp times (a
    bias at 0, as every Hugging Face bias starts, hides it)."""
    def reduce_row(rw, call, e, new):
        if call.bias is not None:
            new = rw.g.call_function(aten.add.Tensor, (new, call.bias))
            call.bias = None
        return original(rw, call, e, new)
    original = edits._reduce_row
    row = edits.EDITS[edits.RowParallel]
    return mock.patch.dict(edits.EDITS, {edits.RowParallel: dataclasses.replace(row, after=reduce_row)})


def _vocab_lower_bound_off_by_one():
    """The vocabulary-parallel embedding takes a shard's first id for another rank's (`lt` as `le`):
    that id's row is zeroed on every rank. Random ids of a large vocabulary rarely hold it."""
    def lookup(rw, call, e):
        original(rw, call, e)
        for n in rw.g.nodes:
            if n.op == "call_function" and n.target is aten.lt.Scalar and n.args[1] == 0:
                n.target = aten.le.Scalar
    original = edits._vocab_lookup
    row = edits.EDITS[edits.VocabLookup]
    return mock.patch.dict(edits.EDITS, {edits.VocabLookup: dataclasses.replace(row, apply=lookup)})


class _UnmaskedDiagonalBackward:
    """torch.ops.aten, with the flash attention backward run without its causal mask."""

    def __getattr__(self, name):
        op = getattr(torch.ops.aten, name)
        if name != "_scaled_dot_product_flash_attention_for_cpu_backward":
            return op
        return lambda *args, **kwargs: op(*args[:7], False, *args[8:], **kwargs)


def _ring_diagonal_unmasked():
    """The context-parallel ring's fused per-piece path (unpadded batches take it) runs its diagonal
    pieces' backward without the causal mask."""
    return mock.patch.object(ring_pieces, "aten", _UnmaskedDiagonalBackward())


def _stale_weight_copy():
    """Each rank's forward reads a copy of every weight taken at its first call (as a cast copy
    nobody refreshes), while gradients reach the weight: right until the first step moves it."""
    copies: dict[int, torch.Tensor] = {}
    original = lockstep.fetch_attr

    def fetch(gm, target):
        w = original(gm, target)
        if not isinstance(w, torch.nn.Parameter):
            return w
        held = copies.setdefault(id(w), w.detach().clone())
        return held + (w - w.detach())
    return mock.patch.object(lockstep, "fetch_attr", fetch)


def _packed_documents_joined():
    """The program captured as if the model held a cache: transformers then skips its packed-document
    masking, so each packed document attends to the one before it (as the model does with use_cache,
    which the program must refuse or match). The trace cache is bypassed: its key cannot see this."""
    import transformers.masking_utils as masking_utils
    original = compiler.capture

    def capture(*args, **kwargs):
        with mock.patch.dict(os.environ, {trace_cache.ENV: "0"}), \
                mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
            return original(*args, **kwargs)
    return mock.patch.object(compiler, "capture", capture)


def _recompute_draws_new_masks():
    """Recomputation does not restore the dropout streams: backward's masks are new draws."""
    return mock.patch.object(recompute, "_replaying",
                             lambda trackers: (contextlib.nullcontext(), contextlib.nullcontext()))


LLAMA = dict(tp=2, pp=2, microbatches=2)
MUTATIONS = [
    Mutation("f-missing", "f's backward does not all-reduce (column-parallel input gradients partial)", "llama", LLAMA,
             _f_without_reduce),
    Mutation("g-missing", "g's forward does not all-reduce (row-parallel outputs partial)", "llama", LLAMA,
             _g_without_reduce),
    Mutation("f-g-swapped", "f and g exchanged at every region boundary", "llama", LLAMA, _f_g_swapped),
    Mutation("g-backward-reduced", "g's backward all-reduces too (gradients counted tp times)", "gpt2", LLAMA,
             _g_backward_reduced),
    Mutation("wrong-group", "g's all-reduce over a group of one rank (not the tp group)", "gpt2", dict(tp=2),
             _wrong_group),
    Mutation("shared-rows-not-summed", "kv < tp: the gradient of a kv head two ranks share not summed", "llama",
             dict(tp=4), _shared_rows_not_summed),
    Mutation("kv-head-swapped", "kv < tp: ranks sharing a kv head hold the other kv head's weights", "llama",
             dict(tp=4), _kv_head_swapped),
    Mutation("logits-gathered-reversed", "vocab-parallel logits gathered in reverse rank order", "llama", dict(tp=2),
             _gather_reversed),
    Mutation("logits-gather-shifted", "gathered logits shifted by one vocabulary row", "gpt2", dict(tp=2),
             _logits_gather_valid_ignored),
    Mutation("ce-reduced-twice", "vocab-parallel cross-entropy's sums all-reduced twice", "llama", dict(tp=2),
             _ce_reduced_twice),
    Mutation("ce-max-local", "vocab-parallel cross-entropy's max not reduced (each rank its own)", "gpt2", dict(tp=2),
             _ce_max_local),
    Mutation("ce-summed", "vocab-parallel cross-entropy's mean built as a sum", "llama", dict(tp=2),
             _ce_summed_not_averaged),
    Mutation("embedding-partial", "vocab-parallel embedding's partial rows not summed", "gpt2", dict(tp=2),
             _embedding_partial_sums_kept),
    Mutation("sp-wrong-chunk", "sequence parallelism's reduce-scatter hands each rank the other's tokens", "gpt2",
             dict(tp=2, sequence_parallel=True), _sp_wrong_chunk),
    Mutation("sp-gather-grads", "sequence parallelism's all-gather backward reduce flag inverted", "llama",
             dict(tp=2, sequence_parallel=True), _sp_gather_grads_not_reduced),
    Mutation("sp-gather-reversed", "sequence parallelism's all-gather in reverse rank order", "llama",
             dict(tp=2, sequence_parallel=True), _sp_split_reversed),
    Mutation("microbatch-mean", "microbatches weighted 1/m, not by their counted tokens", "llama",
             dict(pp=2, microbatches=2), _microbatch_mean),
    Mutation("tokens-with-ignored", "a microbatch's token count includes labels of -100", "gpt2",
             dict(dp=2, microbatches=2), _tokens_counted_with_ignored),
    Mutation("stage-boundary-detached", "a pipeline stage's received values detached (no gradient goes back)",
             "llama", dict(pp=2, microbatches=2), _stage_boundary_detached),
    Mutation("weights-cut-shifted", "each rank's weight shard cut from the next rank's rows", "llama", dict(tp=2),
             _weights_cut_shifted),
    Mutation("dropout-tp-stream-shared", "a dropout region's stream reused across tensor-parallel ranks",
             "nanogpt-dropout", dict(tp=2), _tp_stream_shared),
    Mutation("dropout-replicated-per-rank", "replicated dropout drawn per rank (the replicas drift apart)",
             "nanogpt-dropout", dict(tp=2), _replicated_stream_per_rank),
    Mutation("dropout-region-mislabeled", "dropout inside a tensor-parallel region run on the replicated stream",
             "nanogpt-dropout", dict(tp=2), _dropout_region_mislabeled),
    Mutation("experts-wrong-owner", "expert parallelism sends each owner's tokens to the other owner", "mixtral",
             dict(dp=2, ep=2), _experts_to_wrong_owner),
    Mutation("row-bias-before-reduce", "a row-parallel bias added on every rank before the all-reduce", "gpt2",
             dict(tp=2), _row_bias_before_reduce, reveals="weights"),
    Mutation("vocab-lower-bound", "the vocabulary-parallel embedding drops each shard's first id", "llama-vocab512",
             dict(tp=2), _vocab_lower_bound_off_by_one, reveals="ids"),
    Mutation("ring-diagonal-unmasked", "the unpadded ring's diagonal pieces run backward unmasked", "llama",
             dict(cp=2, dp=2), _ring_diagonal_unmasked, reveals="masks"),
    Mutation("recompute-new-masks", "recomputation draws new dropout masks in backward", "gpt2-dropout",
             dict(tp=2, recompute="full"), _recompute_draws_new_masks, reveals="dropout"),
    Mutation("packed-documents-joined", "packed documents attend to each other (the mask a cache would give)",
             "llama", dict(tp=2), _packed_documents_joined, reveals="positions"),
    Mutation("stale-weight-copy", "forward reads a copy of each weight that the optimizer step does not reach",
             "llama", dict(tp=2), _stale_weight_copy, reveals="steps"),
]


def _model(name: str) -> torch.nn.Module:
    if name == "mixtral":
        return build_moe("mixtral")
    if name == "llama-vocab512":             # random ids of 512 rarely hold a shard's first id
        import transformers as hf
        torch.manual_seed(0)
        return hf.LlamaForCausalLM(hf.LlamaConfig(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                                  hidden_size=64, intermediate_size=128, vocab_size=512,
                                                  max_position_embeddings=64))
    if name == "gpt2-dropout":
        return build_model("gpt2", layers=2, heads=8, hidden=64, dropout=0.1)
    if name == "nanogpt-dropout":            # attention written out: its dropout's masks are visible
        return build_model("nanogpt-manual", layers=2, heads=8, hidden=64, dropout=0.1)
    return build_model(name, layers=2, heads=8, kv_heads=2, hidden=64)


def run_mutation(m: Mutation) -> Certificate:
    """The certificate of `m`'s split with `m` planted, from the simulation alone: these are bugs of
    the rank programs, which the simulation runs; the runtime run only adds items (and a planted
    compile bug fails the runtime too), so what fails here fails the default certificate. The
    runtime's own bugs are planted in tests/local/test_verify_runtime.py."""
    with m.patch():
        return verify_model(_model(m.model), m.split, runtime=False)


def table() -> str:
    from tabulate import tabulate
    rows = []
    for m in MUTATIONS:
        cert = run_mutation(m)
        first = cert.first_failure()
        loss = next((i for i in cert.items if i.group == "loss"), None)
        rows.append((m.name, m.what, m.model, " ".join(f"{k}={v}" for k, v in m.split.items()),
                     "caught" if not cert.passed else "MISSED",
                     f"{first.kind} {first.where} ({first.error:.2g})" if first else (cert.refusals or ["-"])[0][:60],
                     "yes" if loss is not None and not loss.holds else "no"))
    rows += _gloo_rows()
    return tabulate(rows, headers=("bug", "what", "model", "split", "verify", "first failing item", "loss alone"),
                    tablefmt="github")


def _gloo_rows() -> list[tuple]:
    """The runtime's bugs, caught by `verify --gloo` (tests/harness/verify_gloo_mutations.py)."""
    import tempfile

    from tests.harness.verify_gloo_mutations import GLOO_MUTATIONS, launch_all
    out = []
    with tempfile.TemporaryDirectory() as folder:
        for name, rows in launch_all(folder).items():
            if name not in GLOO_MUTATIONS:           # the controls: no bug planted
                continue
            what, changes, split, _ = GLOO_MUTATIONS[name]
            bad = [r for r in rows if r[2] > 1e-5]
            loss = next(r for r in rows if r[1] == "loss (gloo)")
            out.append((name, what, changes["model"], " ".join(f"{k}={v}" for k, v in split.items()) + " --gloo"
                        + (" --distributed-optimizer" if name.endswith("+do") else ""),
                        "caught" if bad else "MISSED", f"{bad[0][0]} {bad[0][3]} ({bad[0][2]:.2g})" if bad else "-",
                        "yes" if loss[2] > 1e-5 else "no"))
    return out


if __name__ == "__main__":
    print(table())
