"""Run under torchrun (2 processes): the zero-bubble schedules as users call them, against 1F1B.

    torchrun --standalone --nproc-per-node 2 -m tests.harness.zero_bubble_calls

A Hugging Face Qwen2 (no other test builds it) at pp=2, frozen as users freeze (its embedding, or
all but LoRA adapters on q and v: tests/harness/frozen.py), trained 5 AdamW steps on batches with
ignored prompt labels (-100) and right padding, two train_step calls per optimizer step (the second
clips), and a new sequence length from the fourth step. Each zero-bubble schedule's losses and
parameters (every rank's, gathered) must equal 1F1B's bit for bit (the same arithmetic: the split
changes when weight gradients are computed, not how), and frozen parameters must not move. The
receives are posted ahead (runtime/p2p.py) across the change of length too.
Rank 0 prints one JSON line per freeze and schedule.
"""
from __future__ import annotations

import torch

from autoshard import autoshard
from autoshard.testing.launch import agree, run_checker
from autoshard.world import current
from tests.harness.frozen import freeze


def _model(how: str):
    import transformers as hf
    torch.manual_seed(0)
    cfg = hf.Qwen2Config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                         intermediate_size=128, vocab_size=128, max_position_embeddings=64)
    return freeze(hf.Qwen2ForCausalLM(cfg), how)


def _batches() -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for seq in (16, 16, 16, 24, 24):
        ids = torch.randint(0, 128, (8, seq), generator=gen)
        labels = ids.clone()
        labels[:, :5] = -100                       # the prompt is not scored
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0                           # one row padded on the right
        out.append(dict(input_ids=ids, labels=labels, attention_mask=mask))
    return out


def _train(how: str, schedule: str, batches: list[dict]) -> tuple[list[float], dict, dict, int]:
    model = _model(how)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    example = {k: v[:2] for k, v in batches[0].items()}
    rt = autoshard(model, pp=2, microbatches=4, schedule=schedule, example_kwargs=example).distributed()
    opt = torch.optim.AdamW([p for p in rt.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for b in batches:
        first = rt.train_step(**{k: v[:4] for k, v in b.items()})
        second = rt.train_step(**{k: v[4:] for k, v in b.items()}, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(first + second))
    mine = {n: p.detach().clone() for n, p in rt.named_parameters()}
    everyone: list = current().gather_objects(mine)
    params = {k: v for part in everyone for k, v in part.items()}
    return losses, params, {n: t for n, t in frozen.items() if n in params}, rt.transfer.received_ahead


def main() -> None:
    def checks() -> bool:
        ok, batches = True, _batches()
        for how in ("embedding", "lora"):
            base, base_params, _, _ = _train(how, "1f1b", batches)
            for schedule in ("zb-h1", "zbv"):
                losses, params, frozen, ahead = _train(how, schedule, batches)
                same = losses == base and params.keys() == base_params.keys() and all(
                    torch.equal(params[k], base_params[k]) for k in base_params)
                still = all(torch.equal(params[k], t) for k, t in frozen.items())
                ok &= agree({"freeze": how, "schedule": schedule, "bitwise": same, "frozen_unchanged": still,
                             "frozen": len(frozen), "losses": losses, "received_ahead": ahead},
                            same and still and len(frozen) > 0)
        return ok
    run_checker(checks)


if __name__ == "__main__":
    main()
