"""The zero-bubble schedules train exactly as 1F1B does (tests/harness/schedule_check.py, each rank
running what a torchrun process runs, on a local world): 5 AdamW steps with clipping, GPT-2 and
Llama, each schedule's losses and parameters against 1F1B's run in the same job (tests/launches.py)."""
import pytest

from tests.launches import Job, job_params, needs

SCHEDULES = {"zb-h1", "zbv", "v-half"}
STEPS = "5"         # AdamW steps per run: several, so that a wrong moment or clipping scale shows
JOBS = {
    "pp2": Job("zero-bubble/pp2", "tests.harness.schedule_check",
               ("--pp", "2", "--layers", "4", "--steps", STEPS), 2),
    "pp4": Job("zero-bubble/pp4", "tests.harness.schedule_check",
               ("--pp", "4", "--layers", "8", "--steps", STEPS), 4),
    # ZBV in its phases (m >= 2p - 1; at m = 4 the jobs above run its list-scheduled form)
    "pp4-m8-zbv": Job("zero-bubble/pp4-m8-zbv", "tests.harness.schedule_check",
                      ("--pp", "4", "--layers", "8", "--steps", STEPS, "--microbatches", "8", "--schedules", "zbv"), 4),
    # the distributed optimizer's buffer filled by W, its state over dp = 2
    "pp2-dp2-distributed-optimizer": Job("zero-bubble/pp2-dp2-do", "tests.harness.schedule_check",
                                         ("--pp", "2", "--dp", "2", "--distributed-optimizer", "--layers", "4",
                                          "--steps", STEPS, "--schedules", "zb-h1", "zbv"), 4),
    # f / g and sequence parallelism's gathers in B; recomputation once, in B
    "tp2-pp2-sp-selective": Job("zero-bubble/tp2-pp2-sp", "tests.harness.schedule_check",
                                ("--pp", "2", "--tp", "2", "--sequence-parallel", "--recompute", "selective",
                                 "--models", "llama", "--layers", "4", "--steps", STEPS, "--schedules", "zb-h1", "zbv"), 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("key", job_params(JOBS))
def test_zero_bubble_schedules_train_as_1f1b(launched, key):
    lines = launched(JOBS[key])
    args = JOBS[key].argv
    models = {"llama"} if "--models" in args else {"gpt2", "llama"}
    want = SCHEDULES
    if "--schedules" in args:
        want = {a for a in args[args.index("--schedules") + 1:] if a in SCHEDULES}
    assert {(r["model"], r["schedule"]) for r in lines} == {(m, s) for m in models for s in want}
    for r in lines:
        assert r["all_ranks_ok"] and r["loss_rel"] <= 1e-6 and r["param_rel"] <= 1e-6, r
        assert r["w_actions"] == r["actions"] // 3, r          # every backward split in two
        # ZB-H1 runs 1F1B's stages and order: the same arithmetic, bit for bit; Llama bitwise everywhere
        if r["schedule"] == "zb-h1" or r["model"] == "llama":
            assert r["bitwise"], r


CALLS = Job("zero-bubble/user-calls", "tests.harness.zero_bubble_calls", (), 2)


@pytest.mark.slow
@needs(CALLS)
def test_zero_bubble_as_users_call_it(launched):
    """Qwen2 (no other test builds it) frozen two ways, -100 prompts, padding, two train_step calls per
    optimizer step and a new length: ZB-H1 and ZBV equal 1F1B bit for bit; frozen weights stay."""
    lines = launched(CALLS)
    assert {(r["freeze"], r["schedule"]) for r in lines} == {(f, s) for f in ("embedding", "lora") for s in ("zb-h1", "zbv")}
    for r in lines:
        assert r["all_ranks_ok"] and r["bitwise"] and r["frozen_unchanged"] and r["frozen"] > 0, r
        assert r["received_ahead"] > 0, r         # gloo: receives posted ahead, the new length included
