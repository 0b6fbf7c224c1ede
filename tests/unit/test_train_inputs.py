"""`autoshard train`'s inputs: each bad one is refused with a message naming it, before any
training; the data is tokenized, packed and cut per data-parallel rank as documented; the
learning-rate schedule and the loss picture."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from autoshard.train.data import Batches, ByteTokenizer, prepare_tokens
from autoshard.train.loop import _check_fit, split_of
from autoshard.train.lr import learning_rate
from autoshard.train.model_source import BYTE_VOCAB, build
from autoshard.train.options import TrainError, parse
from autoshard.train.plot import loss_curve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox " + " ".join(str(i) for i in range(400)))     # no two sequences alike
    return str(path)


def _opts(text, out, *extra):
    return parse(["--model", "llama", "--data", text, "--out", str(out), *extra])


def test_missing_files_and_bad_numbers_are_named(tmp_path, text):
    with pytest.raises(TrainError, match=r"--data .*nope.txt: no such file or folder"):
        parse(["--model", "llama", "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path)])
    with pytest.raises(TrainError, match=r"--model ./no/such/folder: no such folder"):
        parse(["--model", "./no/such/folder", "--data", text, "--out", str(tmp_path)])
    (tmp_path / "empty_model").mkdir()
    with pytest.raises(TrainError, match="the folder has no config.json"):
        parse(["--model", str(tmp_path / "empty_model"), "--data", text, "--out", str(tmp_path)])
    with pytest.raises(TrainError, match="--tp must be a positive integer, got 0"):
        _opts(text, tmp_path, "--tp", "0")
    with pytest.raises(TrainError, match="--plan chooses tp, pp, dp, virtual and microbatches itself"):
        _opts(text, tmp_path, "--plan", "--tp", "2")
    for bad in (["--in-process"], ["--in-process", "--nproc-per-node", "2", "--device", "cuda"]):
        with pytest.raises(TrainError, match="--in-process runs the --nproc-per-node ranks on this CPU"):
            _opts(text, tmp_path, *bad)


def test_unknown_model_types_and_folders_without_weights_are_named(tmp_path, text):
    with pytest.raises(TrainError, match="--model lama: not a transformers model type, a folder or module:factory "
                                         r"\(model types include llama, gpt2"):
        build(parse(["--model", "lama", "--data", text, "--out", str(tmp_path)]), True)
    folder = tmp_path / "cfg_only"
    folder.mkdir()
    from transformers import LlamaConfig
    LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                vocab_size=300).save_pretrained(folder)
    with pytest.raises(TrainError, match="no safetensors weights in the folder"):
        build(parse(["--model", str(folder), "--data", text, "--out", str(tmp_path)]), True)
    with pytest.raises(TrainError, match="is a folder: its config fixes the sizes \\(drop --layers\\)"):
        build(parse(["--model", str(folder), "--data", text, "--out", str(tmp_path), "--layers", "2"]), True)


def test_empty_data_and_data_shorter_than_a_sequence_are_named(tmp_path, text):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(TrainError, match=r"empty.txt: no text in 1 file\(s\)"):
        prepare_tokens(str(empty), ByteTokenizer(), "text", str(tmp_path / "cache"))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(TrainError, match="the folder holds no .txt, .md, .text, .jsonl files"):
        prepare_tokens(str(tmp_path / "nothing"), ByteTokenizer(), "text", str(tmp_path / "cache"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(TrainError, match=r"bad.jsonl line 2 has no string field 'text' \(--text-field\)"):
        prepare_tokens(str(bad), ByteTokenizer(), "text", str(tmp_path / "cache"))
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    tokens = prepare_tokens(str(short), ByteTokenizer(), "text", str(tmp_path / "cache"))
    with pytest.raises(TrainError, match="the data holds 5 tokens, fewer than one sequence of --seq-len 64"):
        Batches.open(tokens, seq_len=64, global_batch=2, dp=1, dp_rank=0, seed=0)


def test_special_token_ids_beyond_a_smaller_vocabulary_are_dropped(tmp_path, text):
    """Phi-3's config keeps pad_token_id 32000: with the byte tokenizer's 384 rows it did not build."""
    source = build(parse(["--model", "phi3", "--layers", "1", "--hidden", "32", "--heads", "2", "--data", text,
                          "--out", str(tmp_path)]), byte_tokenizer=True)
    cfg = source.model.config
    assert cfg.vocab_size == BYTE_VOCAB and cfg.pad_token_id is None and cfg.bos_token_id == 1


def test_falcons_and_opts_sizes_reach_their_own_config_names(tmp_path, text):
    """Before: Falcon's head_dim (a property of hidden and heads) crashed `--hidden`, `--ffn` went to an
    `n_inner` neither Falcon nor OPT reads, and with `--hidden` alone their MLPs kept the full model's
    width (Falcon's 18176 beside a hidden size of 32). A config with no MLP width (Bloom) refuses --ffn."""
    def cfg(*args):
        return build(parse(["--layers", "1", "--hidden", "32", "--heads", "2", "--data", text, "--out", str(tmp_path),
                            *args]), byte_tokenizer=True).model.config
    falcon = cfg("--model", "falcon")
    assert falcon.ffn_hidden_size == 128 and falcon.head_dim == 16     # 4 x hidden, as the full model has
    assert cfg("--model", "falcon", "--ffn", "64").ffn_hidden_size == 64
    assert cfg("--model", "opt", "--ffn", "64").ffn_dim == 64
    with pytest.raises(TrainError, match="--ffn 64: BloomConfig has no feed-forward width to set"):
        cfg("--model", "bloom", "--ffn", "64")


def test_sequence_length_beyond_the_model_and_a_small_vocabulary_are_named(tmp_path, text):
    opts = _opts(text, tmp_path, "--layers", "1", "--hidden", "32", "--heads", "2", "--max-positions", "64",
                 "--seq-len", "128")
    source = build(opts, byte_tokenizer=True)
    assert source.vocab == BYTE_VOCAB and source.model.config.num_hidden_layers == 1
    with pytest.raises(TrainError, match="--seq-len 128 is beyond the model's 64 positions"):
        _check_fit(opts, source, ByteTokenizer())
    small = build(_opts(text, tmp_path, "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "200"), True)
    with pytest.raises(TrainError, match="the bytes tokenizer has 257 ids but the model's vocabulary has 200"):
        _check_fit(opts.__class__(**{**vars(opts), "seq_len": 32}), small, ByteTokenizer())


def test_world_size_that_does_not_match_the_split_is_named(tmp_path, text):
    with pytest.raises(TrainError, match=r"the world has 4 processes but tp=2 x pp=1 x dp=3 = 6"):
        split_of(_opts(text, tmp_path, "--tp", "2", "--dp", "3"), 4)
    with pytest.raises(TrainError, match=r"the world has 3 processes, not a multiple of tp=2 x pp=1 = 2"):
        split_of(_opts(text, tmp_path, "--tp", "2"), 3)
    assert split_of(_opts(text, tmp_path, "--cp", "2"), 4)["dp"] == 2
    with pytest.raises(TrainError, match=r"the world has 6 processes, not a multiple of tp=1 x pp=1 x cp=4 = 4"):
        split_of(_opts(text, tmp_path, "--cp", "4"), 6)
    with pytest.raises(TrainError, match=r"--cp 3 cuts each sequence in 2 x cp = 6 equal pieces: --seq-len 64"):
        _opts(text, tmp_path, "--cp", "3", "--seq-len", "64")
    with pytest.raises(TrainError, match=r"--batch 6 cannot be split into dp=1 x microbatches=4 equal parts"):
        split_of(_opts(text, tmp_path, "--pp", "2", "--batch", "6"), 2)
    assert split_of(_opts(text, tmp_path, "--tp", "2", "--pp", "2"), 8) == dict(tp=2, pp=2, dp=2, ep=1, cp=1,
                                                                                 virtual=1, microbatches=4)
    with pytest.raises(TrainError, match=r"--ep: ep=2 must divide dp=3"):
        split_of(_opts(text, tmp_path, "--dp", "3", "--ep", "2", "--batch", "6"), 3)


def test_the_command_line_says_the_error_in_one_line_and_exits_2(tmp_path, text):
    """Through the console entry, also the world-size check made before torchrun is launched."""
    for args, message in ((["--data", str(tmp_path / "missing.txt")], "--data .*missing.txt: no such file or folder"),
                          (["--data", text, "--tp", "2", "--nproc-per-node", "3"],
                           "the world has 3 processes, not a multiple of tp=2 x pp=1 = 2")):
        proc = subprocess.run([sys.executable, "-m", "autoshard.cli", "train", "--model", "llama", "--out",
                               str(tmp_path / "run"), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert proc.returncode == 2, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.startswith("autoshard train:")]
        assert len(lines) == 1 and __import__("re").search(message, lines[0]), proc.stderr


def _launch(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoshard.train", "--model", "llama", "--layers", "1", "--hidden", "32",
                           "--heads", "2", "--out", str(tmp_path / "run"), "--nproc-per-node", "2", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_an_empty_data_file_is_refused_before_any_rank_starts(tmp_path):
    """Before: found only after every rank had built and compiled the model (1.7 minutes here),
    then torchrun's 40-line report. Now the launcher tokenizes once, and refuses: one line, exit 2,
    no rank started (nothing a rank prints, no torchrun report)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = _launch(tmp_path, "--data", str(empty))
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines() == [f"autoshard train: --data {empty}: no text in 1 file(s)"], proc.stderr


def test_an_error_on_the_ranks_ends_in_one_line_not_torchruns_report(tmp_path, text):
    proc = _launch(tmp_path, "--data", text, "--vocab", "100", "--seq-len", "16")       # found by the ranks
    assert proc.returncode == 2, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        "autoshard train: the bytes tokenizer has 257 ids but the model's vocabulary has 100 (--vocab)"], proc.stderr
    assert "ChildFailedError" not in proc.stderr + proc.stdout


def test_the_byte_tokenizer_saved_for_an_export_encodes_as_training_did(tmp_path):
    """Before: an export of a byte-tokenizer run had no tokenizer; AutoTokenizer.from_pretrained
    returned the model type's own."""
    from transformers import AutoTokenizer
    ByteTokenizer().save_pretrained(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    for sentence in ("The quick brown fox jumps over the lazy dog.", "naïve café, 東京 — ok?\n\ttabs  and  spaces",
                     " leading space", "\x00\x7f bytes"):
        assert tok(sentence, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(sentence), sentence
        assert tok.decode(ByteTokenizer().encode(sentence)) == sentence
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == ByteTokenizer.eos and len(tok) == 257


def test_batches_are_each_ranks_own_part_of_a_seeded_order(tmp_path, text):
    """dp ranks' parts of a step, side by side, are the global batch a dp=1 run reads; epochs are
    permutations of every sequence; a step's batch depends on nothing but the step."""
    tokens = prepare_tokens(text, ByteTokenizer(), "text", str(tmp_path / "cache"))
    assert prepare_tokens(text, ByteTokenizer(), "text", str(tmp_path / "cache")) == tokens     # cached
    arr = np.load(tokens)
    assert arr[-1] == ByteTokenizer.eos and bytes(arr[:9].tolist()).decode() == "the quick"
    whole = Batches.open(tokens, seq_len=16, global_batch=8, dp=1, dp_rank=0, seed=3)
    parts = [Batches.open(tokens, seq_len=16, global_batch=8, dp=2, dp_rank=r, seed=3) for r in range(2)]
    for step in (0, 5, 13):
        assert torch.equal(torch.cat([p.batch(step) for p in parts]), whole.batch(step))
    n = whole.sequences
    seen = torch.cat([whole.batch(s) for s in range(n // 8)])
    assert len({tuple(r.tolist()) for r in seen}) == len(seen)          # no sequence twice within an epoch
    assert not torch.equal(whole.batch(0), Batches.open(tokens, seq_len=16, global_batch=8, dp=1, dp_rank=0,
                                                        seed=4).batch(0))


def test_learning_rate_warms_up_then_decays_to_the_floor():
    lr = [learning_rate(s, peak=1.0, warmup=4, total=20, min_ratio=0.1) for s in range(20)]
    assert lr[:4] == [0.25, 0.5, 0.75, 1.0] and lr[4] == 1.0
    assert all(a >= b for a, b in zip(lr[4:], lr[5:])) and abs(lr[-1] - (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 15 / 16)))) < 1e-12


def test_loss_curve_is_a_png_of_the_requested_size(tmp_path):
    path = tmp_path / "loss.png"
    loss_curve(list(range(1, 51)), [5 - 0.05 * i for i in range(50)], str(path), width=300, height=200)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(data[16:20], "big") == 300
    assert int.from_bytes(data[20:24], "big") == 200


def test_factory_models_name_their_inputs_and_targets_are_the_next_tokens(tmp_path, text, monkeypatch):
    """nanoGPT's forward(idx, targets) takes the next tokens as targets: the batches read one token
    more per row and the loop cuts inputs and targets from it; a model without labels is refused."""
    monkeypatch.chdir(ROOT)
    source = build(parse(["--model", "tests.factories:tiny_nanogpt", "--data", text, "--out", str(tmp_path)]),
                   True)
    assert (source.input_name, source.label_name, source.shifted, source.max_positions) == ("idx", "targets", True, 64)
    with pytest.raises(TrainError, match=r"Echo.forward\(x\) takes no `labels` or `targets`"):
        build(parse(["--model", "tests.factories:no_loss", "--data", text, "--out", str(tmp_path)]), True)
    with pytest.raises(TrainError, match="cannot load 'tests.factories:nothing'"):
        build(parse(["--model", "tests.factories:nothing", "--data", text, "--out", str(tmp_path)]), True)
    tokens = prepare_tokens(text, ByteTokenizer(), "text", str(tmp_path / "cache"))
    rows = Batches.open(tokens, seq_len=16, global_batch=2, dp=1, dp_rank=0, seed=0, extra=1).batch(0)
    arr = np.load(tokens)
    assert rows.shape == (2, 17)
    for row in rows.tolist():
        start = next(i for i in range(len(arr)) if arr[i:i + 17].tolist() == row)
        assert start % 16 == 0          # a sequence's 16 tokens and the one after them


def test_a_model_folders_own_tokenizer_is_used_and_its_end_of_text_separates_documents(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from autoshard.train.data import HFTokenizer, tokenizer_for
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1, "the": 2, "fox": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", eos_token="</s>").save_pretrained(tmp_path / "m")
    tok = tokenizer_for(str(tmp_path / "m"))
    assert isinstance(tok, HFTokenizer) and (tok.vocab, tok.eos) == (4, 1)
    assert isinstance(tokenizer_for("llama"), ByteTokenizer)
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "the fox"}) + "\n\n" + json.dumps({"text": "fox jumps"}) + "\n")
    tokens = np.load(prepare_tokens(str(docs), tok, "text", str(tmp_path / "cache")))
    assert tokens.tolist() == [2, 3, 1, 3, 0, 1]


def test_the_launcher_passes_virtual_on_under_a_name_torchrun_does_not_claim(tmp_path, text):
    from autoshard.train import worker_argv
    argv = ["--model", "gpt2", "--virtual", "2", "--nproc-per-node", "2", "--pp", "2", "--nproc-per-node=2",
            "--virtual=3"]
    assert worker_argv(argv) == ["--model", "gpt2", "--virtual-pipeline", "2", "--pp", "2", "--virtual-pipeline=3"]
    assert _opts(text, tmp_path, "--virtual-pipeline", "2").virtual == _opts(text, tmp_path, "--virtual", "2").virtual == 2


def test_the_reason_of_whichever_rank_stopped_first_is_said_once(tmp_path, monkeypatch):
    """Before: only rank 0 printed a TrainError, so when rank 1 stopped first and the agent ended
    rank 0 before it printed, the run ended with exit 2 and nothing said (seen once under load in
    test_an_error_on_the_ranks_ends_in_one_line_not_torchruns_report). Ranks launched by the
    launcher write their reason into its folder; the launcher says the lowest rank's once."""
    from autoshard.train import ERRORS, TrainError, _say, failure_line
    monkeypatch.setenv(ERRORS, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    _say(TrainError("the bytes tokenizer has 257 ids but the model's vocabulary has 100 (--vocab)"))
    assert failure_line({0: -15, 1: 2}, str(tmp_path)) == (
        "autoshard train: the bytes tokenizer has 257 ids but the model's vocabulary has 100 (--vocab)")
    (tmp_path / "rank-1.txt").unlink()
    assert failure_line({1: 1, 0: -15}, str(tmp_path)) == (
        "autoshard train: rank 0 failed (exit code -15); its output is above")


@pytest.mark.parametrize("model,hidden,widths", [
    ("llama", 64, {"intermediate_size": 176}),                 # 11008 / 4096 of 64 = 172, up to a multiple of 8
    ("mixtral", 64, {"intermediate_size": 224}),
    ("qwen3_moe", 128, {"intermediate_size": 384, "moe_intermediate_size": 48}),
    ("gpt2", 64, {"n_inner": None}),                           # unset: GPT-2 makes it 4 x hidden itself
])
def test_hidden_scales_the_feed_forward_widths_with_it(tmp_path, text, model, hidden, widths):
    """Before, --hidden 64 left Llama's MLP at the config's 11,008 (30 times the rest of the model,
    and 14x the step time of the intended model); --ffn still sets the dense width itself."""
    opts = parse(["--model", model, "--data", text, "--out", str(tmp_path), "--layers", "1", "--hidden", str(hidden),
                  "--heads", "4"])
    cfg = build(opts, True).model.config
    assert {attr: getattr(cfg, attr) for attr in widths} == widths
    if model == "llama":
        opts = parse(["--model", model, "--data", text, "--out", str(tmp_path), "--layers", "1", "--hidden", "64",
                      "--heads", "4", "--ffn", "100"])
        assert build(opts, True).model.config.intermediate_size == 100
