"""`autoshard verify`: certificates that pass on correct programs, fail on planted bugs (naming what
differs), reduced twins of large configs, and the command line's exit status."""
import contextlib
import io
import re
import subprocess

import pytest
import torch

from autoshard import autoshard
from autoshard.testing.current_models import build_current
from autoshard.testing.models import build_model, build_moe
from autoshard.verify import verify_model
from autoshard.verify.command import main as verify_main
from autoshard.verify.twin import twin_config
from tests.harness.mutations import MUTATIONS, run_mutation


def _build(name):
    if name == "GptOss":
        return build_current(name)
    return build_moe(name) if name == "mixtral" else build_model(name, layers=2)


@pytest.mark.parametrize("name,split", [("gpt2", dict(tp=2, pp=2, microbatches=2)),
                                        ("llama", dict(tp=2, dp=2, sequence_parallel=True, recompute="full")),
                                        ("mixtral", dict(tp=2, dp=2, ep=2)),
                                        # regression: gpt-oss's down_proj_bias was added on every tp rank
                                        # of an expert-parallel rank before g (counted tp times once the
                                        # bias moved off 0: wrong from the second step of training)
                                        ("GptOss", dict(tp=2, dp=2, ep=2)),
                                        # regression: the ring's fused pieces (unpadded batches) kept their
                                        # log-sum-exps in float32, which the float64 backward refused
                                        ("llama", dict(cp=2, dp=2))])
def test_correct_programs_are_verified(name, split):
    model = _build(name)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cert = verify_model(model, split)
    assert cert.passed, cert.render()
    assert {i.kind for i in cert.items} == {"output", "gradient", "weight"}
    assert any("local world" in run for run in cert.runs)          # the runtime's rows too
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())     # the model is left alone
    assert "VERIFIED" in cert.render().splitlines()[-1]


@pytest.mark.parametrize("name", ["nanogpt-manual", "llama"])
def test_dropout_is_off_for_the_comparison_and_its_regions_checked(name):
    """Regression: GPT-2's default config (dropout 0.1) failed every comparison, and Llama's attention
    dropout (a float attribute passed to SDPA, no Dropout module) was left on."""
    cert = verify_model(build_model(name, layers=2, dropout=0.1), dict(tp=2))
    assert cert.passed, cert.render()
    assert [i.kind for i in cert.items].count("dropout") == 2 and any("dropout set to 0" in n for n in cert.notes)


def test_certificate_says_float64_where_the_ops_allow():
    gpt = verify_model(build_model("nanogpt", layers=2), dict(tp=2))
    assert gpt.passed and gpt.dtype == "float64" and gpt.tolerance == 1e-9, gpt.render()
    moe = verify_model(build_moe("mixtral"), dict(tp=2))          # grouped_mm takes no float64
    assert moe.passed and moe.dtype.startswith("float32"), moe.render()


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_planted_bug_fails_verify_naming_what_differs(mutation):
    cert = run_mutation(mutation)
    assert not cert.passed, f"{mutation.name} was not caught:\n{cert.render()}"
    first = cert.first_failure()
    assert first is not None, cert.refusals         # a comparison that differs, not a crash
    assert first.where in cert.verdict()


def test_mutation_suite_is_distinct_and_large_enough():
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS) >= 20


def test_every_input_of_the_certificate_has_a_bug_only_it_reveals():
    """Each kind is a planted bug the certificate before these inputs called VERIFIED (moved weights,
    shard-edge ids, unpadded and packed batches, recomputation against none, several steps); the
    parametrized test above asserts each is caught."""
    assert {m.reveals for m in MUTATIONS} >= {"weights", "ids", "masks", "positions", "dropout", "steps"}


def test_certificate_moves_weights_and_takes_steps_on_edge_ids_unpadded_and_packed():
    cert = verify_model(build_model("llama", layers=2), dict(tp=2))
    assert cert.passed, cert.render()
    assert "3 steps" in cert.batch and "unpadded" in cert.batch and "packed" in cert.batch, cert.batch
    assert "shard-edge ids 0, 63, 64, 127" in cert.batch, cert.batch
    assert any("moved off its initial value" in n for n in cert.notes)
    assert {i.where.split(" ")[1] for i in cert.items} >= {"1", "2"}      # worst steps named


def test_recomputation_is_checked_against_none_with_dropout_on():
    cert = verify_model(build_model("gpt2", layers=2, dropout=0.1), dict(tp=2, recompute="full"))
    assert cert.passed, cert.render()
    assert any(i.kind == "dropout" and "recompute=full" in i.group for i in cert.items), cert.render()


def test_prog_verify_leaves_the_program_alone():
    model = build_model("llama", layers=2)
    kw = {"input_ids": torch.randint(0, 128, (2, 16)), "labels": torch.randint(0, 128, (2, 16))}
    prog = autoshard(model, tp=2, example_kwargs=kw)
    before = {n: p.detach().clone() for n, p in prog.rank(1).named_parameters()}
    cert = prog.verify()
    assert cert.passed, cert.render()
    assert cert.split["tp"] == 2 and all(torch.equal(before[n], p) for n, p in prog.rank(1).named_parameters())


def test_twin_keeps_heads_and_layer_pattern():
    import transformers as hf
    cfg = hf.AutoConfig.for_model("smollm3")
    twin, said = twin_config(cfg, stages=2, tp=2)
    assert (twin.num_attention_heads, twin.num_key_value_heads) == (cfg.num_attention_heads, cfg.num_key_value_heads)
    assert twin.layer_types == cfg.layer_types[:twin.num_hidden_layers]
    assert twin.num_hidden_layers % 2 == 0 and twin.num_hidden_layers < cfg.num_hidden_layers
    assert twin.intermediate_size % 16 == 0 and any("layers" in s for s in said)


def _cli(*args):
    """`autoshard verify ARGS` in this process (its main(), as the console script calls it; the
    installed command itself is tests/unit/test_cli.py's): exit status and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = verify_main(list(args))
    return subprocess.CompletedProcess(["autoshard", "verify", *args], code, out.getvalue(), err.getvalue())


def test_cli_verifies_the_twin_of_a_7b_llama_config():
    run = _cli("--model", "llama", "--tp", "2", "--pp", "2")      # transformers' default LlamaConfig: 6.7B
    assert run.returncode == 0, run.stdout + run.stderr
    assert "reduced twin" in run.stdout and "6738.4M parameters" in run.stdout
    assert run.stdout.strip().splitlines()[-1].startswith("VERIFIED")


def test_cli_refuses_bad_input_in_one_line():
    run = _cli("--model", "not-a-model", "--tp", "2")
    assert run.returncode == 2 and "not a transformers model type" in run.stderr


def test_cli_verifies_a_v_schedule_on_the_twin_with_a_stage_per_layer():
    """Regression: --virtual defaulted to 1, which the V schedules refuse (they run 2 chunks per
    rank), and the twin then had one layer per rank, not per stage."""
    run = _cli("--model", "llama", "--pp", "2", "--schedule", "zbv")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "layers 32 -> 4 (>= one per stage of 4)" in run.stdout


def test_cli_verifies_schedule_auto_and_names_the_schedule_it_chose():
    """Regression: --schedule auto was not a choice, and the twin's layer count read the schedule's
    chunks from its name ("unknown schedule 'auto'")."""
    run = _cli("--model", "llama", "--pp", "2", "--schedule", "auto")
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"schedule=auto: (1f1b|interleaved|zb-h1|zbv|v-half) ", run.stdout), run.stdout


def test_cli_verifies_the_planners_split_and_refuses_plan_with_a_split():
    small = ["--model", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "128",
             "--max-positions", "64"]
    run = _cli(*small, "--plan", "--world-size", "2")
    assert run.returncode == 0 and "split: tp=" in run.stdout, run.stdout + run.stderr
    refused = _cli(*small, "--plan", "--world-size", "2", "--tp", "2")
    assert refused.returncode == 2 and "--plan verifies the split the planner chooses" in refused.stderr


def _verify_cli(capsys, *args):
    from autoshard.verify.command import main
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


SMALL_LLAMA = ["--model", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
               "--vocab", "128", "--max-positions", "64"]


def test_cli_a_split_the_model_cannot_take_exits_2_in_one_line(capsys):
    """Regression: tp=3 with 4 heads printed a whole certificate and exited 1."""
    code, out, err = _verify_cli(capsys, *SMALL_LLAMA, "--tp", "3")
    assert code == 2 and not out, out
    assert len(err.strip().splitlines()) == 1 and "the compile refused this split" in err and "3" in err, err


def test_cli_a_factory_model_without_a_config_is_verified_or_its_plan_refused_in_one_line(capsys):
    """Regression: --plan read model.config (AttributeError: 'Nano' object has no attribute 'config').
    The planner cannot read such a model's shape: it says so; a split given is verified, the
    vocabulary read off its embedding (96 ids: shard edges 0, 47, 48, 95)."""
    code, out, err = _verify_cli(capsys, "--model", "tests.factories:configless_lm", "--plan", "--world-size", "2")
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and "has no `config`" in err, err
    code, out, err = _verify_cli(capsys, "--model", "tests.factories:configless_lm", "--tp", "2")
    assert code == 0, out + err
    assert "shard-edge ids 0, 47, 48, 95" in out and out.strip().splitlines()[-1].startswith("VERIFIED"), out


def test_cli_a_required_input_verify_does_not_build_exits_2_in_one_line(capsys):
    """Regression: a forward requiring `segment_ids` raised a bare TypeError from inside the model."""
    code, out, err = _verify_cli(capsys, "--model", "tests.factories:needs_segments", "--tp", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "`segment_ids`" in err, err


def test_a_sequence_classifier_is_verified_with_one_label_per_sequence():
    """Regression: verify built one label per token for every model; a sequence classifier crashed
    inside torch's cross-entropy."""
    import transformers as hf
    torch.manual_seed(0)
    cfg = hf.BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128,
                        vocab_size=128, max_position_embeddings=64, num_labels=3)
    cert = verify_model(hf.BertForSequenceClassification(cfg), dict(tp=2, dp=2))
    assert cert.passed, cert.render()
    assert "one label per sequence (3 classes)" in cert.batch


def test_a_model_that_is_nan_in_float64_is_certified_in_float32():
    """Bloom in float64 gives NaN on a left-padded row (its masks are filled with float32's minimum
    and two of them add to -inf in its float32 softmax); before, every comparison then "differed"
    (NaN against NaN) and a correct split read NOT VERIFIED, at dp=2 as at tp=2."""
    import transformers as hf
    cfg = hf.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    cert = verify_model(hf.BloomForCausalLM(cfg), dict(tp=2))
    assert cert.passed, cert.verdict()
    assert cert.dtype.startswith("float32 (float64 gives a non-finite loss on this batch")


def test_a_model_whose_own_loss_is_nan_is_refused_saying_so():
    """A weight that is NaN makes the model's own loss NaN in every float type: before, each
    comparison was NaN against NaN and the certificate said "N of N comparisons differ", as if the
    split were wrong."""
    model = build_model("nanogpt", layers=2)
    with torch.no_grad():
        model.ln_f.weight[0] = float("nan")
    cert = verify_model(model, dict(tp=2))
    assert not cert.passed
    assert cert.verdict().startswith("NOT VERIFIED: the model's own loss on the certificate's batch is nan in float32")
