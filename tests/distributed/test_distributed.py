"""Tier (c): real processes on gloo, launched by torchrun, each running only its own rank. Each
mesh is a job of the suite's launch per world size (tests/launches.py)."""
import functools
import json
import pathlib

import pytest

from autoshard.testing.pipeline_check import write_references
from tests.launches import Job, job_params, needs

MODES = {"gathered-logits": [], "vocab-parallel-loss": ["--in-graph-loss"],
         "sequence-parallel": ["--in-graph-loss", "--sequence-parallel"],
         # fused ops (their torch implementations here): the fused graphs' layouts on real collectives
         "fused-sequence-parallel": ["--in-graph-loss", "--sequence-parallel", "--fuse"]}


# every mode at tp=2; at tp=4 the vocabulary-parallel loss (the other modes at tp=4 run in simulation:
# tests/simulation). All on a local world: gloo runs this checker in `./run demo`, and the suite's
# gloo smoke launches per world size are test_train.py's gloo-vs-in-process runs (4 ranks) and
# the parity test below (2 and 8)
WORLD_MODES = [(2, mode) for mode in sorted(MODES)] + [(4, "vocab-parallel-loss")]
TRAINING = {f"{w}-{m}": Job(f"training/{w}-{m}", "autoshard.testing.dist_check", ("--steps", "3", *MODES[m]), w)
            for w, m in WORLD_MODES}


@pytest.mark.slow
@pytest.mark.parametrize("key", job_params(TRAINING))
def test_training_matches_single_device(launched, key):
    job = TRAINING[key]
    lines, world = launched(job), job.world
    assert {r["model"] for r in lines} == {"nanogpt", "gpt2", "llama", "bert"}
    for r in lines:
        assert r["world"] == world and r["all_ranks_ok"], r
        assert r["loss_rel"] <= 1e-5 and r["param_rel"] <= 1e-5, r
        assert r["sharded"] > 0, r


# tests/local's two programs (interleaved tp2 x pp2 x dp2 with the distributed optimizer; cp2 x ep2
# Mixtral) on gloo and in a local world: the same losses and the same parameters, to the bit (every
# reduction is over two ranks, which both worlds add in the same order)
PARITY = {f"{config}-{where}": Job(f"parity/{config}-{where}", "tests.harness.local_parity_check",
                                   ("--config", config), world, local=where == "local")
          for config, world in (("interleaved", 8), ("moe", 2)) for where in ("gloo", "local")}


@pytest.mark.slow
@pytest.mark.parametrize("config", [pytest.param(c, marks=needs(PARITY[f"{c}-gloo"], PARITY[f"{c}-local"]))
                                    for c in ("interleaved", "moe")])
def test_the_runtime_steps_on_gloo_and_on_a_local_world_agree_to_the_bit(launched, config):
    real, local = launched(PARITY[f"{config}-gloo"]), launched(PARITY[f"{config}-local"])
    assert real[0]["all_ranks_ok"] and len(real[0]["params"]) == real[0]["world"]
    assert real == local, (real, local)


DROPOUT = Job("dropout", "tests.harness.dropout_check", (), 2)


@pytest.mark.slow
@needs(DROPOUT)
def test_training_with_dropout_keeps_replicas_equal_fused_or_not(launched):
    """GPT-2 with dropout 0.3 at tp=2, plain and fused, with and without sequence parallelism: every
    rank computes the same losses and the replicated parameters stay bitwise equal (a fused dropout
    draws its mask in its region, as the plain one does)."""
    lines = launched(DROPOUT)
    assert {(r["fuse"], r["sequence_parallel"]) for r in lines} == {(f, sp) for f in (0, 1) for sp in (0, 1)}
    for r in lines:
        assert r["all_ranks_ok"] and r["same_loss"] and r["differ"] == [], r
        assert (r["fused_dropouts"] == 4) == r["fuse"], r


PIPELINES = ["tp1-pp2-dp1-v1", "tp1-pp4-dp1-v2", "tp2-pp2-dp1-v2", "tp2-pp2-dp2-v1"]   # (tp, pp, dp, v)
FUSED_TOO = "tp2-pp2-dp1-v2"             # trains fused as well (interleaved stages holding fused ops)
STEPS = 5           # AdamW steps per model: several, so that a wrong moment or clipping scale shows after step 1


def _layers(config: str) -> int:
    """Two layers a model chunk, 4 to 8 in all: every stage still holds several layers, and the export
    each rank makes of each model (most of a launch's time) stays small."""
    _, pp, _, v = _dims(config)
    return min(8, max(4, 2 * pp * v))


def _dims(config: str) -> tuple[int, int, int, int]:
    return tuple(int(part[2:] if part[0] != "v" else part[1:]) for part in config.split("-"))


def _references(args: list[str], folder: pathlib.Path) -> None:
    write_references(str(folder / "reference.pt"), [a.replace("{dir}", str(folder)) for a in args])


def _pipeline_job(config: str) -> Job:
    """A pipeline config's checker run; its Chrome traces go to the job's folder ("{dir}"), and its
    single-device references are computed once, before the launch (Job.before), not on every rank."""
    tp, pp, dp, v = _dims(config)
    args = ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--virtual-pipeline", str(v),
            "--microbatches", str(2 * pp), "--steps", str(STEPS), "--trace", "{dir}", "--layers", str(_layers(config)),
            "--reference", "{dir}/reference.pt"]
    if dp > 1:      # SGD too (GPT-2, whose tied embedding spans the stages): linear in the gradients,
        args += ["--optim", "adamw", "sgd", "--sgd-models", "gpt2"]   # so parameters match element by element
    if config == FUSED_TOO:
        args += ["--fuse", "both"]
    return Job(f"pipelines/{config}", "autoshard.testing.pipeline_check", tuple(args), tp * pp * dp, seconds=600,
               before=functools.partial(_references, args))    # world 8 on gloo: the parity test above


PIPELINE_JOBS = {config: _pipeline_job(config) for config in PIPELINES}


@pytest.mark.slow
@pytest.mark.parametrize("config", job_params(PIPELINE_JOBS))
def test_pipeline_training_matches_single_device(launched, config):
    """GPT-2 and Llama, 4 or 8 layers (_layers), STEPS AdamW steps with gradient clipping on one global batch per step."""
    tp, pp, dp, v = _dims(config)
    lines, tmp_path = launched(PIPELINE_JOBS[config]), launched.folder(PIPELINE_JOBS[config])
    assert {(r["model"], r["optim"], r["fuse"]) for r in lines} >= {
        (m, "adamw", f) for m in ("gpt2", "llama") for f in ((False, True) if config == FUSED_TOO else (False,))}
    assert dp == 1 or ("gpt2", "sgd", False) in {(r["model"], r["optim"], r["fuse"]) for r in lines}
    for r in lines:
        assert r["all_ranks_ok"] and (r["tp"], r["pp"], r["dp"], r["virtual"]) == (tp, pp, dp, v), r
        assert r["loss_rel"] <= 1e-5 and r["grad_norm_rel"] <= 1e-5 and r["param_norm_rel"] <= 1e-5, r
        assert r["params_here"] < r["params_total"], r       # a pipeline rank holds only its stages
        assert r["optim"] == "adamw" or r["param_rel"] <= 1e-5, r
        # rank 0 runs stage 0 (and, interleaved, stage pp): each forward sends the hidden states
        # on, each backward of a later chunk its input gradient back; one header per step and stage
        m, senders = 2 * pp, v
        assert r["messages_sent"] == STEPS * (senders * m + (v - 1) * m + senders), r
        # on gloo each receive is posted once the one before is done (runtime/p2p.py): with one chunk,
        # rank 0 receives only its backward's gradients, each posted once its forward went out
        assert r["received_ahead"] == STEPS * m if v == 1 else r["received_ahead"] > 0, r
        trace = json.load(open(tmp_path / f"{r['model']}_tp{tp}_pp{pp}_dp{dp}_v{v}.json"))
        events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert sum(e["cat"] in ("forward", "backward") for e in events) == 2 * tp * pp * dp * v * 2 * pp
        assert sum(e["cat"] == "grad-reduce" for e in events) >= tp * pp * dp      # every rank's buckets
        assert (tmp_path / f"{r['model']}_tp{tp}_pp{pp}_dp{dp}_v{v}.png").read_bytes()[:4] == b"\x89PNG"


CHECKPOINTED = ("gpt2", "llama")       # tied embedding across stages; rotary buffers
# pp=2 on two processes, a stage a rank (checkpoints saved at tp=2 resume at other tp in
# tests/simulation/test_checkpoint.py and test_train.py)
CHECKPOINT_ARGS = ("--tp", "1", "--pp", "2", "--meta", "--models", *CHECKPOINTED)
# a job of the suite's launch. A rank killed mid-run and torchrun restarting the group is
# test_train.py's lost node (autoshard train, GPT-2 tied across pp=2, resumed to the bit)
UNINTERRUPTED = Job("checkpoint", "tests.harness.checkpoint_check", (*CHECKPOINT_ARGS, "--root", "{dir}"), 2)


@pytest.mark.slow
@needs(UNINTERRUPTED)
@pytest.mark.parametrize("name", CHECKPOINTED)
def test_checkpoints_reshard_and_load_into_the_models_own_class(launched, tmp_path, name):
    """Built on the meta device, pp=2, 6 AdamW steps saving every 2: each model's final checkpoint
    loads at (tp=4, pp=1) and (tp=1, pp=1) and into the model's own class, with the same logits."""
    from autoshard import autoshard
    from autoshard import checkpoint as ck
    from autoshard.checkpoint.convert import consolidate
    from tests.harness.checkpoint_check import batch
    from autoshard.testing.models import build_model

    launched(UNINTERRUPTED)
    whole = launched.folder(UNINTERRUPTED) / name
    outs = []
    for tp in (4, 1):
        prog = autoshard(build_model(name, layers=4, seed=11), tp=tp, example_kwargs=batch(name, 0, 2))
        for rank in prog.ranks():
            ck.load(str(whole / "final"), prog, rank)
        outs.append(prog.simulate(**batch(name, 9, 2)).logits)
    consolidate(str(whole / "final"), build_model(name, layers=4), str(tmp_path / "hf"))
    model = type(build_model(name, layers=1)).from_pretrained(str(tmp_path / "hf"))
    want = model(**batch(name, 9, 2)).logits
    for out in outs:
        assert ((out - want).abs().max() / want.abs().max()).item() < 1e-5


RECOMPUTE_MESHES = {"tp2": ["--tp", "2"], "tp2-pp2": ["--tp", "2", "--pp", "2"],
                    "pp2-v2": ["--pp", "2", "--virtual-pipeline", "2"], "tp2-sp": ["--tp", "2", "--sp"]}


RECOMPUTE_JOBS = {mesh: Job(f"recompute/{mesh}", "tests.harness.recompute_check", tuple(args),
                      4 if mesh == "tp2-pp2" else 2) for mesh, args in sorted(RECOMPUTE_MESHES.items())}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", job_params(RECOMPUTE_JOBS))
def test_recompute_matches_no_recompute(launched, mesh):
    """GPT-2 and Llama, dropout 0.1, full and selective recompute against none on real processes (1F1B,
    interleaved, sequence parallelism): per-step losses and this rank's gradients equal."""
    lines = launched(RECOMPUTE_JOBS[mesh])
    assert {(r["model"], r["mode"]) for r in lines} == {(m, x) for m in ("gpt2", "llama") for x in ("full", "selective")}
    for r in lines:
        assert r["all_ranks_ok"] and r["regions"] > 0 and r["loss_rel"] <= 1e-6 and r["grad_rel"] <= 1e-6, r
