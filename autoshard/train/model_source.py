"""The model `--model` names: a transformers model type built from its config (random weights,
the size options applied), a local Hugging Face folder (its config; weights read per rank after
sharding), or a `module:factory` callable."""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch
from torch import nn

from autoshard.factory import load_factory
from autoshard.train.options import TrainError, TrainOptions

__all__ = ["ModelSource", "apply_sizes", "build", "BYTE_VOCAB"]

BYTE_VOCAB = 384        # the byte tokenizer's 257 ids, rounded up to a multiple of 128 (as Megatron pads)
# size option -> the config attribute it sets (transformers' attribute_map resolves GPT-2's n_layer etc.)
_OVERRIDES = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
              "kv_heads": "num_key_value_heads", "vocab": "vocab_size", "max_positions": "max_position_embeddings"}


@dataclass
class ModelSource:
    model: nn.Module
    kind: str                       # "config", "folder" or "factory"
    input_name: str                 # the forward argument the token ids go to
    label_name: str                 # ... and the labels: "labels" (the model shifts them, as Hugging Face's
                                    # do) or "targets" (the next tokens already, as nanoGPT's)
    max_positions: int | None
    vocab: int | None
    weights: str | None = None      # a folder whose safetensors each rank reads its slices from

    @property
    def shifted(self) -> bool:
        """Whether the labels are the next tokens (cut one token further than the inputs)."""
        return self.label_name == "targets"

    @property
    def config(self):
        return getattr(self.model, "config", None)


# the feed-forward widths a config may hold: the dense MLP's, each expert's, the shared experts'
_FFN_WIDTHS = ("intermediate_size", "ffn_hidden_size", "ffn_dim", "n_inner", "moe_intermediate_size",
               "shared_expert_intermediate_size")
# where --ffn goes: the dense MLP's width, by the name the config gives it (Falcon: ffn_hidden_size,
# OPT: ffn_dim, GPT-2: n_inner)
_DENSE_FFN = ("intermediate_size", "ffn_hidden_size", "ffn_dim", "n_inner")


def _ffn_widths(cfg, opts: TrainOptions) -> dict[str, int]:
    """With --hidden and no --ffn, each feed-forward width of the config keeps its ratio to the hidden
    size, rounded up to a multiple of 8 (before: Llama at --hidden 64 kept 11,008, an MLP 30 times
    the rest of the model). Widths the config leaves unset (GPT-2's n_inner: 4 x hidden) stay unset."""
    if opts.hidden is None or opts.ffn is not None:
        return {}
    old = cfg.hidden_size
    out = {}
    for attr in _FFN_WIDTHS:
        width = getattr(cfg, attr, None)
        if isinstance(width, int) and width > 0:
            scaled = -(-width * opts.hidden // old)          # ceil(width * hidden / old)
            out[attr] = -(-scaled // 8) * 8
    return out


def apply_sizes(cfg, opts: TrainOptions, byte_tokenizer: bool) -> None:
    widths = _ffn_widths(cfg, opts)
    for attr, width in widths.items():
        setattr(cfg, attr, width)
    for opt, attr in _OVERRIDES.items():
        value = getattr(opts, opt)
        if opt == "vocab" and value is None and byte_tokenizer:
            value = BYTE_VOCAB
        if value is not None:
            setattr(cfg, attr, value)
    if opts.ffn is not None:
        attr = next((a for a in _DENSE_FFN if hasattr(cfg, a)), None)
        if attr is None:          # before: set as n_inner, which such a config never reads
            raise TrainError(f"--ffn {opts.ffn}: {type(cfg).__name__} has no feed-forward width to set (none of "
                             f"{', '.join(_DENSE_FFN)}; its MLP's width follows the hidden size)")
        setattr(cfg, attr, opts.ffn)
    if opts.kv_heads is None and hasattr(cfg, "num_key_value_heads") and opts.heads is not None:
        cfg.num_key_value_heads = opts.heads
    derived = getattr(type(cfg), "head_dim", None)       # Falcon's: a property of hidden and heads, no setter
    if getattr(cfg, "head_dim", None) is not None and (opts.hidden or opts.heads) \
            and not (isinstance(derived, property) and derived.fset is None):
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):   # the config's ids for a vocabulary it no longer has
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value >= cfg.vocab_size:
            setattr(cfg, attr, None)
        elif isinstance(value, list):
            setattr(cfg, attr, [v for v in value if v < cfg.vocab_size] or None)


def _signature_names(model: nn.Module) -> tuple[str, str]:
    params = list(inspect.signature(model.forward).parameters)
    if not params:
        raise TrainError(f"{type(model).__name__}.forward takes no arguments; it needs the token ids and labels")
    label = next((n for n in ("labels", "targets") if n in params), None)
    if label is None:
        raise TrainError(f"{type(model).__name__}.forward({', '.join(params)}) takes no `labels` or `targets`: "
                         f"autoshard train needs the model to compute its loss")
    return ("input_ids" if "input_ids" in params else params[0]), label


def build(opts: TrainOptions, byte_tokenizer: bool) -> ModelSource:
    """The model on every rank alike (seeded by --seed; a folder's model on the meta device)."""
    torch.manual_seed(opts.seed)
    if os.path.isdir(opts.model):
        from transformers import AutoConfig, AutoModelForCausalLM
        sizes = [o for o in (*_OVERRIDES, "ffn") if getattr(opts, o) is not None]
        if sizes:
            raise TrainError(f"--model {opts.model} is a folder: its config fixes the sizes (drop "
                             f"{', '.join('--' + s.replace('_', '-') for s in sizes)})")
        cfg = AutoConfig.from_pretrained(opts.model)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        has_weights = any(f.endswith(".safetensors") or f == "model.safetensors.index.json"
                          for f in os.listdir(opts.model))
        if not has_weights:
            raise TrainError(f"--model {opts.model}: no safetensors weights in the folder")
        return ModelSource(model, "folder", "input_ids", "labels", getattr(cfg, "max_position_embeddings", None),
                           getattr(cfg, "vocab_size", None), weights=opts.model)
    if ":" in opts.model:
        try:
            factory = load_factory(opts.model, "--model")
        except SystemExit as e:                 # the shared loader's one-line refusal
            raise TrainError(str(e)) from None
        model = factory()
        if not isinstance(model, nn.Module):
            raise TrainError(f"--model {opts.model} returned a {type(model).__name__}, not an nn.Module")
        inputs, labels = _signature_names(model)
        cfg = getattr(model, "config", None)
        limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "block_size", None)
        return ModelSource(model, "factory", inputs, labels, limit, getattr(cfg, "vocab_size", None))
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if opts.model not in CONFIG_MAPPING:
        known = ", ".join(k for k in ("llama", "gpt2", "mistral", "qwen2", "qwen3", "gemma", "olmo2", "phi3")
                          if k in CONFIG_MAPPING)
        raise TrainError(f"--model {opts.model}: not a transformers model type, a folder or module:factory "
                         f"(model types include {known})")
    cfg = AutoConfig.for_model(opts.model)
    apply_sizes(cfg, opts, byte_tokenizer)
    try:
        model = AutoModelForCausalLM.from_config(cfg)
    except Exception as e:
        raise TrainError(f"--model {opts.model} with these sizes does not build: {e}") from None
    return ModelSource(model, "config", "input_ids", "labels", getattr(cfg, "max_position_embeddings", None),
                       getattr(cfg, "vocab_size", None))
