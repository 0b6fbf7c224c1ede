"""Checkpoints and deferred initialization, in one process: resharding, resuming, consolidation,
slice-only loading, meta-device materialization, and refusing bad checkpoints."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from autoshard import autoshard
from autoshard import checkpoint as ck
from autoshard.checkpoint.convert import consolidate, load_from_file, load_full_state_dict
from autoshard.checkpoint.index import CheckpointError, read_index
from autoshard.checkpoint.materialize import materialize, materialize_full
from autoshard.errors import ShardingError
from autoshard.passes.rewrite.retarget import retarget_device
from autoshard.testing.metrics import max_rel
from autoshard.testing.models import VOCAB, build_model, build_moe


def _kw(step, size=4):
    gen = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(0, 128, (size, 16), generator=gen),
            "labels": torch.randint(0, 128, (size, 16), generator=gen)}


def _trained(name, tp, steps, folder=None):
    """A tp program trained `steps` AdamW steps in simulation (and saved to `folder`)."""
    prog = autoshard(build_model(name, layers=2), tp=tp, example_kwargs=_kw(0))
    opts = [torch.optim.AdamW(r.parameters(), lr=1e-2) for r in prog.ranks()]
    for step in range(steps):
        prog.simulate(**_kw(step)).loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
    if folder:
        ck.save_ranks(folder, prog, prog.ranks(), opts, step=steps)
    return prog, opts


def _continue(prog, opts, start, steps):
    losses = []
    for step in range(start, start + steps):
        loss = prog.simulate(**_kw(step)).loss
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("new_tp", [1, 2, 4])
def test_resume_at_any_tp_continues_the_same_training(name, new_tp, tmp_path):
    """Save at tp=2 after 2 AdamW steps, load parameters and optimizer state at tp 1, 2 or 4 into a
    differently seeded model: the next 2 losses equal those of the uninterrupted run."""
    prog, opts = _trained(name, 2, 2, str(tmp_path))
    prog2 = autoshard(build_model(name, layers=2, seed=7), tp=new_tp, example_kwargs=_kw(0))
    opts2 = [torch.optim.AdamW(r.parameters(), lr=0.5) for r in prog2.ranks()]     # lr comes from the file
    infos = [ck.load(str(tmp_path), prog2, r, o) for r, o in zip(prog2.ranks(), opts2)]
    assert infos[0]["step"] == 2 and opts2[0].param_groups[0]["lr"] == 1e-2
    full, full2 = prog.full_state_dict(), prog2.full_state_dict()
    assert all(torch.equal(full[k], full2[k]) for k in full)
    want, got = _continue(prog, opts, 2, 2), _continue(prog2, opts2, 2, 2)
    assert max(abs(a - b) / abs(a) for a, b in zip(want, got)) < 1e-5, (want, got)


def test_checkpoint_writes_each_row_once_and_atomically(tmp_path):
    prog, opts = _trained("llama", 4, 1, str(tmp_path / "step-1"))     # 2 kv heads over 4 ranks: shared kv rows
    index = read_index(str(tmp_path / "step-1"))
    for key, e in index["tensors"].items():
        covered = sum(p["stop"] - p["start"] for p in e["pieces"]) if e["dim"] is not None else None
        assert covered in (None, e["shape"][e["dim"]] if e["dim"] is not None else None), key
    kv = index["tensors"]["model.layers.0.self_attn.k_proj.weight"]
    assert len(kv["pieces"]) == 2           # 4 ranks hold 2 distinct kv heads: written twice, not 4 times
    assert not [f for f in os.listdir(tmp_path / "step-1") if ".tmp" in f]
    ck.save_ranks(str(tmp_path / "step-3"), prog, prog.ranks(), opts, step=3)
    ck.save_ranks(str(tmp_path / "step-5"), prog, prog.ranks(), opts, step=5)
    os.remove(tmp_path / "step-5" / "index.json")       # a save cut short: not a checkpoint
    assert ck.latest(str(tmp_path)) == str(tmp_path / "step-3")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_consolidated_checkpoint_loads_into_the_original_class(name, tmp_path):
    prog, _ = _trained(name, 2, 1, str(tmp_path / "ck"))
    consolidate(str(tmp_path / "ck"), build_model(name, layers=2, seed=3), str(tmp_path / "hf"))
    model = type(prog.model).from_pretrained(str(tmp_path / "hf"))
    assert max_rel(model(**_kw(5)).logits, prog.simulate(**_kw(5)).logits) < 1e-5


def test_rank_reads_only_its_slices_of_a_full_file(tmp_path):
    model = build_model("gpt2", layers=2)
    model.save_pretrained(str(tmp_path))
    prog = autoshard(build_model("gpt2", layers=2, seed=9), tp=4, example_kwargs=_kw(0))
    total = sum(p.numel() for p in model.parameters())
    for r in prog.ranks():
        read = load_from_file(str(tmp_path), prog, r)
        assert read == sum(p.numel() for p in r.parameters()) < total / 2
    full = prog.full_state_dict()
    assert all(torch.equal(full[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_checkpoint_with_experts_one_module_each_loads_into_stacked_experts(name, tmp_path):
    """save_pretrained (and published checkpoints) store experts one Linear each, Mixtral's under
    block_sparse_moe with w1/w3/w2; the model trains them stacked [experts, ...]. Loaded at tp=2 from
    such a folder, the program gives the model's logits (before: 'has no tensor for parameter
    model.layers.0.mlp.gate.weight'). A folder with other expert counts is refused by name."""
    model = build_moe(name)
    model.save_pretrained(str(tmp_path))
    assert not any("gate_up_proj" in k for k in load_file(str(tmp_path / "model.safetensors")))
    kw = {"input_ids": _kw(0)["input_ids"] % VOCAB}
    prog = autoshard(build_moe(name, device="meta"), tp=2, example_kwargs=kw)
    for r in prog.ranks():
        materialize(prog, r, seed=1)
        load_from_file(str(tmp_path), prog, r)
    with torch.no_grad():
        assert max_rel(prog.simulate(**kw).logits, model(**kw).logits) < 1e-5
    fewer = autoshard(build_moe(name, experts=2, device="meta"), tp=2, example_kwargs=kw)
    materialize(fewer, fewer.rank(0), seed=1)
    with pytest.raises(CheckpointError, match="the checkpoint has 4 experts under .*, the model 2|"
                                              "gate.weight has shape \\(4, 32\\) in .* is \\(2, 32\\)"):
        load_from_file(str(tmp_path), fewer, fewer.rank(0))


def test_bad_checkpoints_are_refused_and_nothing_is_loaded(tmp_path):
    folder = str(tmp_path / "ck")
    prog, _ = _trained("gpt2", 2, 1, folder)
    target = autoshard(build_model("gpt2", layers=2, seed=4), tp=2, example_kwargs=_kw(0))
    rank = target.rank(1)
    before = {n: p.detach().clone() for n, p in rank.named_parameters()}

    def refused(match, folder=folder, prog=target, module=rank):
        with pytest.raises(CheckpointError, match=match):
            ck.load(folder, prog, module)
        assert all(torch.equal(before[n], p) for n, p in rank.named_parameters())

    shard = os.path.join(folder, "rank-pp0-tp1.safetensors")
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[:-100])
    refused("has .* bytes, the index says .* \\(truncated")
    open(shard, "wb").write(data[:-1] + bytes([data[-1] ^ 0xFF]))
    refused("is corrupted: sha256")
    os.remove(shard)
    refused("rank-pp0-tp1.safetensors is missing")
    open(shard, "wb").write(data)
    llama = autoshard(build_model("llama", layers=2), tp=2, example_kwargs=_kw(0))
    with pytest.raises(CheckpointError, match="checkpoint of GPT2LMHeadModel does not fit LlamaForCausalLM"):
        ck.load(folder, llama, llama.rank(0))
    wide = autoshard(build_model("gpt2", layers=2, hidden=32, heads=4), tp=2, example_kwargs=_kw(0))
    with pytest.raises(CheckpointError, match="transformer.wte.weight has shape \\(128, 64\\) in the checkpoint, "
                                              "\\(128, 32\\) in the model"):
        ck.load(folder, wide, wide.rank(0))
    os.remove(os.path.join(folder, "index.json"))
    refused("not a complete checkpoint: it has no index.json")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="has no tensor for parameter transformer.wte.weight"):
        load_from_file(str(tmp_path / "other.safetensors"), target, rank)
    with pytest.raises(CheckpointError, match="nowhere is not a complete checkpoint"):
        load_full_state_dict(str(tmp_path / "nowhere"))
    whole = build_model("gpt2", layers=2)             # before: a truncated file's error named no file
    whole.save_pretrained(str(tmp_path / "hf"))
    path = tmp_path / "hf" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="hf/model.safetensors: cannot read it as safetensors"):
        load_from_file(str(tmp_path / "hf"), target, rank)


@pytest.mark.parametrize("name", ["gpt2", "llama", "nanogpt"])
def test_meta_model_ranks_materialize_slices_of_one_initialization(name):
    """Built on the meta device, each rank materializes only its shards; they are slices of the
    same seeded full initialization, and the program runs (rotary tables included)."""
    with torch.device("meta"):
        model, ref = build_model(name, layers=2), build_model(name, layers=2)
    ids = torch.randint(0, 128, (2, 16))
    kw = {"idx": ids, "targets": ids} if name == "nanogpt" else {"input_ids": ids, "labels": ids}
    prog = autoshard(model, tp=2, example_kwargs=kw)
    assert all(p.is_meta for p in prog.rank(0).parameters())
    assert all(materialize(prog, r, seed=3) > 0 for r in prog.ranks())
    materialize_full(ref, seed=3)
    full = prog.full_state_dict()
    assert all(torch.equal(full[n], p) for n, p in ref.named_parameters())
    out, want = prog.simulate(**kw), ref(**kw)
    loss = (lambda o: o[1] if isinstance(o, tuple) else o.loss)
    assert max_rel(loss(out), loss(want)) < 1e-5
    if name == "gpt2":     # GPT-2's own scheme: residual projections drawn with std 0.02 / sqrt(2 n_layer)
        std = ref.transformer.h[0].attn.c_proj.weight.std().item()
        assert 0.009 < std < 0.011 and 0.018 < ref.transformer.h[0].attn.c_attn.weight.std().item() < 0.022


def test_materialize_refuses_a_tensor_nothing_initializes():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.empty(4))
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * self.scale

    with torch.device("meta"):
        model = Scaled()
    prog = autoshard(model, example_inputs=(torch.randn(2, 4),))
    with pytest.raises(ShardingError, match="scale \\(Scaled at <root>\\) is not fully set"):
        materialize(prog, prog.rank(0))
    n = materialize(prog, prog.rank(0), init=lambda m: torch.nn.init.ones_(m.scale) if hasattr(m, "scale")
                    else m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    assert n == 3 and torch.equal(prog.rank(0).scale, torch.ones(4))


def test_retarget_replaces_meta_devices_in_nested_graphs():
    with torch.device("meta"):
        model = build_model("llama", layers=1)
    prog = autoshard(model, example_kwargs=_kw(0))
    gm = prog._compiler.compiled[0].captured.gm
    codes = lambda: [sub.code for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)]   # noqa: E731
    assert any("device(type='meta')" in code for code in codes())
    assert retarget_device(gm, "cpu") > 0
    assert not any("device(type='meta')" in code for code in codes())


def test_consolidate_command(tmp_path):
    import subprocess
    import sys
    _trained("llama", 2, 1, str(tmp_path / "ck"))
    proc = subprocess.run([sys.executable, "-m", "autoshard.checkpoint.convert", str(tmp_path / "ck"),
                           str(tmp_path / "out"), "--factory", "tests.factories:small_llama"],
                          capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = type(build_model("llama", layers=1)).from_pretrained(str(tmp_path / "out"))
    full = load_full_state_dict(str(tmp_path / "ck"))
    assert all(torch.equal(full[n], p) for n, p in model.named_parameters())


def test_every_edit_of_the_index_is_refused_or_loads_what_was_saved(tmp_path):
    """300 random single-byte edits of index.json (seeded): each load raises CheckpointError naming
    the index, and changes nothing, or loads exactly the clean checkpoint's weights and optimizer
    state. Before: one edited digit loaded another Adam beta, swapped pieces the wrong rows, and 63
    of 300 edits ended in a raw KeyError or IndexError."""
    import random
    folder = str(tmp_path / "ck")
    _trained("gpt2", 2, 1, folder)
    target = autoshard(build_model("gpt2", layers=2, seed=4), tp=2, example_kwargs=_kw(0))
    rank = target.rank(1)

    def load_into_fresh():
        opt = torch.optim.AdamW(rank.parameters(), lr=1e-3, betas=(0.8, 0.9))
        with torch.no_grad():
            for p in rank.parameters():
                p.fill_(7.0)
        return ck.load(folder, target, rank, opt), opt

    info, opt = load_into_fresh()
    clean_params = {n: p.detach().clone() for n, p in rank.named_parameters()}
    clean_state = {n: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
                   for n, p in rank.named_parameters()}
    clean_groups = [dict(g, params=None) for g in opt.param_groups]
    path = os.path.join(folder, "index.json")
    data = open(path, "rb").read()
    rng = random.Random(0)
    outcomes = {"refused": 0, "same": 0}
    for _ in range(300):
        edited = bytearray(data)
        i = rng.randrange(len(edited))
        edited[i] = rng.choice([b for b in b'0123456789",:{}[]abcdefxyz -.' if b != edited[i]])
        open(path, "wb").write(bytes(edited))
        try:
            got, opt = load_into_fresh()
        except CheckpointError as e:
            assert "index.json" in str(e), str(e)
            assert all(bool((p == 7.0).all()) for p in rank.parameters())      # nothing loaded
            outcomes["refused"] += 1
            continue
        assert got["step"] == info["step"]
        assert all(torch.equal(clean_params[n], p) for n, p in rank.named_parameters())
        for n, p in rank.named_parameters():
            assert all(torch.equal(v, clean_state[n][k]) if torch.is_tensor(v) else v == clean_state[n][k]
                       for k, v in opt.state[p].items())
        assert [dict(g, params=None) for g in opt.param_groups] == clean_groups
        outcomes["same"] += 1
    open(path, "wb").write(data)
    assert outcomes["refused"] > 250, outcomes


def test_consolidated_tied_model_loads_strictly(tmp_path):
    # before: no lm_head.weight was written, so load_state_dict(load_file(...)) failed strict loading
    from safetensors.torch import load_file
    model = build_model("nanogpt", layers=2)
    prog = autoshard(model, tp=2, example_inputs=(torch.randint(0, 128, (2, 16)),))
    ck.save_ranks(str(tmp_path / "ck"), prog, prog.ranks())
    consolidate(str(tmp_path / "ck"), build_model("nanogpt", layers=2, seed=5), str(tmp_path / "out"))
    fresh = build_model("nanogpt", layers=2, seed=6)
    fresh.load_state_dict(load_file(str(tmp_path / "out" / "model.safetensors")))
    assert fresh.lm_head.weight is fresh.wte.weight
    ids = torch.randint(0, 128, (2, 16))
    assert max_rel(fresh(ids)[0], model(ids)[0]) <= 1e-6
