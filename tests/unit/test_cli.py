"""The `autoshard` command line: inspect and schedule (in process, and once as the installed command)."""
import os
import shutil
import subprocess

import pytest

from autoshard.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_inspect_prints_table_and_stage_code(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    main(["inspect", "tests.factories:small_gpt2", "--tp", "2", "--pp", "2", "--microbatches", "2", "--code",
          "--rank", "1"])
    out, err = capsys.readouterr()
    assert "autoshard program: tp=2 x pp=2 x dp=1, world size 4" in out
    assert "transformer.h.0.attn.c_attn.weight" in out and "split dim 1" in out
    assert "# ---- tensor-parallel rank 1, stage 1 (pipeline rank 1) ----" in out
    assert "self.g(" in out and "compiling GPT2LMHeadModel at tp=2, pp=2" in err and "done in" in err


def test_inspect_refuses_a_bad_factory(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit, match="expected module:callable"):
        main(["inspect", "tests.factories"])
    with pytest.raises(SystemExit, match="cannot load 'tests.factories:nothing'"):
        main(["inspect", "tests.factories:nothing"])


def test_schedule_prints_timeline_and_writes_picture(capsys, tmp_path):
    main(["schedule", "--pp", "4", "--virtual", "2", "--microbatches", "8", "--out", str(tmp_path / "s")])
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("rank 0 | F0 F1 F2 F3 f0 f1 f2 f3 F4")
    assert "bubble: 0.1875 of ideal time" in out
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "s.json").exists()
    with pytest.raises(SystemExit, match="autoshard schedule: ShardingError: .*microbatches divisible by pp: "
                                         "6 microbatches, pp=4"):
        main(["schedule", "--pp", "4", "--virtual", "2", "--microbatches", "6"])


@pytest.mark.skipif(shutil.which("autoshard") is None and not os.path.exists(os.path.join(ROOT, ".venv/bin/autoshard")),
                    reason="the package is not installed with its console script")
def test_installed_command(tmp_path):
    exe = shutil.which("autoshard") or os.path.join(ROOT, ".venv/bin/autoshard")
    proc = subprocess.run([exe, "schedule", "--pp", "2", "--virtual", "1", "--schedule", "1f1b",
                           "--microbatches", "4"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "bubble: 0.2500" in proc.stdout


def test_plan_from_a_shape_prints_ranked_table(capsys):
    main(["plan", "--hidden", "10240", "--layers", "60", "--heads", "80", "--vocab", "51200", "--seq", "2048",
          "--gpus", "1024", "--global-batch", "1792", "--top", "3"])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split()[:6] == ["#", "tp", "pp", "dp", "microbatch", "v"]
    assert lines[2].split()[:4] == ["1", "8", "4", "32"]
    assert "configurations fit; the first three:" in out and "estimating every split of 1024 GPUs" in err


def test_plan_from_a_factory_and_its_errors(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    main(["plan", "tests.factories:small_gpt2", "--gpus", "4", "--global-batch", "8", "--hardware", "h200"])
    out, err = capsys.readouterr()
    assert "1. tp=" in out and "no --seq: planning for" in err and "the config's maximum" in err
    with pytest.raises(SystemExit, match="give module:factory or all of --hidden"):
        main(["plan", "--gpus", "4", "--global-batch", "8"])
    with pytest.raises(SystemExit, match="no split of 2 GPUs fits"):
        main(["plan", "--hidden", "12288", "--layers", "96", "--heads", "96", "--vocab", "51200", "--seq", "2048",
              "--gpus", "2", "--global-batch", "8"])


def test_plan_table_tells_every_row_apart(capsys, monkeypatch):
    """The planner searches recompute, sequence parallelism and (MoE) ep; before, the table showed
    none of them and its first five rows for a small Mixtral on 8 GPUs read alike."""
    monkeypatch.chdir(ROOT)
    main(["plan", "tests.factories:small_mixtral", "--gpus", "8", "--global-batch", "16", "--top", "12"])
    lines = capsys.readouterr().out.splitlines()
    head = lines[0].split()
    assert head[:9] == ["#", "tp", "pp", "dp", "ep", "microbatch", "v", "sp", "recompute"], head
    rows = [tuple(line.split()[1:9]) for line in lines[2:14]]
    assert len(rows) == 12 and len(set(rows)) == 12, rows
    assert {r[3] for r in rows} > {"1"}, rows                        # ep searched
    main(["plan", "tests.factories:small_gpt2", "--gpus", "4", "--global-batch", "8"])
    assert "ep" not in capsys.readouterr().out.splitlines()[0].split()  # no MoE: no ep column
    # the distributed optimizer searched: where dp > 1 it divides the state and the optimizer's time
    main(["plan", "tests.factories:small_gpt2", "--gpus", "4", "--global-batch", "8", "--distributed-optimizer", "search"])
    lines = capsys.readouterr().out.splitlines()
    col = lines[0].split().index("dist-opt")
    assert lines[2].split()[col] == ("yes" if lines[2].split()[3] != "1" else "no"), lines[:3]
    assert "distributed-optimizer" in "\n".join(lines[len(lines) - 8:]) or lines[2].split()[3] == "1"


def test_errors_are_one_line_unless_debug(monkeypatch):
    # before: a 20-35 line traceback for a bad tp
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        main(["inspect", "tests.factories:small_gpt2", "--tp", "3"])
    assert str(e.value).startswith("autoshard inspect: ShardingError: tp=3") and "\n" not in str(e.value)
    assert "--debug shows the traceback" in str(e.value)
    from autoshard import ShardingError
    with pytest.raises(ShardingError, match="tp=3"):
        main(["inspect", "tests.factories:small_gpt2", "--tp", "3", "--debug"])


def test_inspect_asks_for_seq_where_the_model_needs_example_inputs(monkeypatch):
    # before: "pass example_inputs=(...)", which the command line cannot
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit, match="give it token ids with --seq S") as e:
        main(["inspect", "tests.factories:plain_mlp", "--tp", "2"])
    assert "example_inputs=(" not in str(e.value)


def test_checkpoint_converter_refuses_a_bad_factory_in_one_line(tmp_path, monkeypatch):
    # before: a raw ModuleNotFoundError / AttributeError traceback
    from autoshard.checkpoint.convert import main as convert
    monkeypatch.chdir(ROOT)
    for spec, match in [("nowhere.at.all:make", "cannot load 'nowhere.at.all:make'"),
                        ("tests.factories:nothing", "cannot load 'tests.factories:nothing'"),
                        ("tests.factories", "expected module:callable"),
                        ("tests.factories:not_a_model", "returned a int, not an nn.Module")]:
        with pytest.raises(SystemExit, match=match):
            convert([str(tmp_path), str(tmp_path / "out"), "--factory", spec])
