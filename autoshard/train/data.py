"""Training data: text files, JSONL or a folder of them, tokenized once into a cached array of
token ids (documents separated by the tokenizer's end-of-text id), cut into sequences, and read
per data-parallel rank: step s's batch is sequences s*B ... s*B + B - 1 of a seeded permutation
per epoch, and rank d reads only its B / dp of them from the memory-mapped array."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from autoshard.train.options import TrainError

__all__ = ["ByteTokenizer", "HFTokenizer", "tokenizer_for", "documents", "data_files", "prepare_tokens", "Batches"]

_SUFFIXES = (".txt", ".md", ".text", ".jsonl")


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, 256 ends a document."""
    name = "bytes"
    eos = 256
    vocab = 257
    EOS_TEXT = "<|endoftext|>"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def save_pretrained(self, folder: str) -> None:
        """Write a Hugging Face tokenizer that encodes as this one does (AutoTokenizer.from_pretrained
        reads it): byte-level, no merges, byte b is id b, and EOS_TEXT (id 256) ends a document, as
        bos, eos and pad. Text that spells EOS_TEXT itself encodes to 256 there, to its bytes here."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        vocab = {char: b for b, char in _byte_chars().items()}
        vocab[self.EOS_TEXT] = self.eos
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        special = dict(bos_token=self.EOS_TEXT, eos_token=self.EOS_TEXT, pad_token=self.EOS_TEXT)
        PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(folder)


def _byte_chars() -> dict[int, str]:
    """Byte -> the character byte-level pre-tokenizers write it as (GPT-2's table): printable
    Latin-1 bytes stand for themselves, the other 68 for code points 256, 257, ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    out, shifted = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


class HFTokenizer:
    """A Hugging Face tokenizer from a local model folder."""

    def __init__(self, folder: str):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.name = f"hf:{os.path.abspath(folder)}"
        self.eos = self.tok.eos_token_id
        self.vocab = len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]


def tokenizer_for(model: str) -> ByteTokenizer | HFTokenizer:
    """The model folder's tokenizer when it has one, else bytes."""
    if os.path.isdir(model) and any(os.path.isfile(os.path.join(model, f))
                                    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return HFTokenizer(model)
    return ByteTokenizer()


def data_files(path: str) -> list[str]:
    """The files --data names: itself, or a folder's text and JSONL files (sorted, recursively)."""
    if os.path.isfile(path):
        return [path]
    found = sorted(os.path.join(root, f) for root, _, files in os.walk(path) for f in files
                   if f.endswith(_SUFFIXES))
    if not found:
        raise TrainError(f"--data {path}: the folder holds no {', '.join(_SUFFIXES)} files")
    return found


def documents(path: str, text_field: str) -> Iterator[str]:
    """Each document of one file: a JSONL file's records' `text_field`, any other file whole."""
    if not path.endswith(".jsonl"):
        with open(path, encoding="utf-8", errors="replace") as fh:
            yield fh.read()
        return
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TrainError(f"{path} line {n} is not JSON: {e}") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise TrainError(f"{path} line {n} has no string field {text_field!r} (--text-field)")
            yield record[text_field]


def _cache_key(files: list[str], tokenizer, text_field: str) -> str:
    h = hashlib.sha256(f"{tokenizer.name}\0{text_field}".encode())
    for f in files:
        st = os.stat(f)
        h.update(f"\0{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def prepare_tokens(data: str, tokenizer, text_field: str, cache_dir: str) -> str:
    """Tokenize --data into `cache_dir/tokens-<hash>.npy` (once: an existing file is reused) and
    return its path. Call it on one process; the others wait, then open the file."""
    files = data_files(data)
    path = os.path.join(cache_dir, f"tokens-{_cache_key(files, tokenizer, text_field)}.npy")
    if os.path.isfile(path):
        return path
    ids: list[int] = []
    for f in files:
        for doc in documents(f, text_field):
            if doc:
                ids.extend(tokenizer.encode(doc))
                if tokenizer.eos is not None:
                    ids.append(tokenizer.eos)
    if not ids:
        raise TrainError(f"--data {data}: no text in {len(files)} file(s)")
    os.makedirs(cache_dir, exist_ok=True)
    staged = f"{path}.{os.getpid()}.tmp.npy"
    np.save(staged, np.asarray(ids, dtype=np.int32 if max(ids) < 2**31 else np.int64))
    os.replace(staged, path)
    return path


@dataclass
class Batches:
    """Sequences of `seq_len` tokens cut from the token file; `batch(step)` is this data-parallel
    rank's part of step `step`'s global batch of `global_batch` sequences ([rows, seq_len + extra])."""
    tokens: np.ndarray              # memory-mapped
    seq_len: int
    global_batch: int
    dp: int
    dp_rank: int
    seed: int
    extra: int = 0                  # tokens each row reads past seq_len (1: next-token targets cut from it)
    _orders: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str, **kw) -> "Batches":
        b = cls(np.load(path, mmap_mode="r"), **kw)
        if b.sequences == 0:
            raise TrainError(f"the data holds {len(b.tokens)} tokens, fewer than one sequence of --seq-len "
                             f"{b.seq_len}")
        return b

    @property
    def sequences(self) -> int:
        return (len(self.tokens) - self.extra) // self.seq_len

    def _order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s permutation of the sequences, drawn once (steps ask for it again and again)."""
        if epoch not in self._orders:
            if len(self._orders) > 1:              # a batch spans at most two epochs
                self._orders.pop(min(self._orders))
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.sequences)
        return self._orders[epoch]

    def batch(self, step: int) -> torch.Tensor:
        per_rank = self.global_batch // self.dp
        first = step * self.global_batch + self.dp_rank * per_rank
        rows = []
        for g in range(first, first + per_rank):
            epoch, i = divmod(g, self.sequences)
            s = int(self._order(epoch)[i]) * self.seq_len
            rows.append(np.asarray(self.tokens[s:s + self.seq_len + self.extra], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))
