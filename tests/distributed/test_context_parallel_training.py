"""Context parallelism in the runtime, not only in the simulator: GPT-2 and Llama at cp=2 x dp=2 and
cp=2 x tp=2 (4 ranks on a local world, the runtime a torchrun job runs) train 10 AdamW steps equal
to one device with ring attention (point-to-point sends), a rank with no counted token included; Llama again with the
key/value all-gather and the distributed optimizer, its checkpoint read back whole; Mixtral at
cp=2 x dp=2 x ep=4 (experts over all four data ranks, tokens exchanged across cp and dp ranks);
GPT-2 at cp=2 x tp=2 with sequence parallelism. A job of the suite's launches (tests/launches.py)."""
import pytest

from tests.launches import Job, needs

CONTEXT = Job("context-parallel", "tests.harness.context_check",
              ("--steps", "10", "--gather-models", "llama", "--expert-models", "mixtral", "--sp-models", "gpt2", "--root", "{dir}"), 4,
              folder="context-parallel")


@pytest.mark.slow
@needs(CONTEXT)
def test_context_parallel_trains_equal_to_one_device(launched):
    lines = launched(CONTEXT)
    runs = {(r["model"], r["mesh"], r["attention"], r["distributed_optimizer"]) for r in lines}
    assert runs == {(m, mesh, "ring", False) for m in ("gpt2", "llama") for mesh in ("cp2xdp2", "cp2xtp2")} | \
        {("llama", "cp2xdp2", "all_gather", True), ("mixtral", "cp2xdp2xep4", "ring", False),
         ("gpt2", "cp2xtp2sp", "ring", False)}
    for r in lines:
        assert r["all_ranks_ok"] and r["steps"] == 10, r
        assert r["loss_rel"] <= 1e-5 and r["param_rel"] <= 1e-5, r
        assert not r["distributed_optimizer"] or r["checkpoint_rel"] <= 1e-5, r
        assert r["ring_steps_ok"] and (r["ring_steps"] > 0) == (r["attention"] == "ring"), r      # the trace's
