"""torch.compile(rank, fullgraph=True) of vocabulary-parallel rank programs on gloo processes
(tests/harness/compile_check.py): GPT-2 and Llama at tp=2 on two processes, loss and gradients equal
to the eager rank's, an out-of-range id still raising. Before: 'Could not guard on data-dependent
expression' at tp >= 2 (the id check was a Python `if` on tensor values). Two processes, not four:
every rank compiles with dynamo, the costliest part of the launch, and the bug showed at any tp >= 2."""
import pytest

from tests.launches import Job, needs

pytestmark = pytest.mark.slow
# real processes: dynamo traces torch.distributed's collectives, not a local world's Python
COMPILE = Job("torch-compile", "tests.harness.compile_check", ("--cases", "gpt2:2", "llama:2"), 2, local=False)


@needs(COMPILE)
def test_compiled_rank_programs_equal_eager_at_tp2(launched):
    lines = launched(COMPILE)
    assert [(r["model"], r["tp"]) for r in lines] == [("gpt2", 2), ("llama", 2)]
    for r in lines:
        assert r["all_ranks_ok"] and r["loss_rel"] <= 1e-6 and r["grad_rel"] <= 1e-5 and r["out_of_range_raised"], r
