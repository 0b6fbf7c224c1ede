"""The current models' new rules (issue 35) in the runtime, not only in the simulator: OLMo 2,
gpt-oss and JetMoE at tp=2 (2 ranks on a local world) train three steps equal to one device.
A job of the suite's launches (tests/launches.py)."""
import pytest

from tests.launches import Job, needs

CURRENT = Job("current-models", "tests.harness.current_models_check", ("--steps", "3"), 2)


@pytest.mark.slow
@needs(CURRENT)
def test_current_models_train_equal_to_one_device(launched):
    lines = launched(CURRENT)
    assert {r["model"] for r in lines} == {"Olmo2", "GptOss", "JetMoe"}
    for r in lines:
        assert r["all_ranks_ok"] and r["world"] == 2, r
        assert r["loss_rel"] <= 1e-5 and r["param_rel"] <= 1e-5, r
        assert r["sharded"] > 10, r
