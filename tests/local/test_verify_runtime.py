"""`autoshard verify` runs the runtime itself on a local world (verify/runtime.py): bugs of the
runtime's own code, which the lockstep simulation never runs, fail the certificate without --gloo."""
import contextlib
from unittest import mock

import pytest

from autoshard.regions.experts_call import _CountedOnce
from autoshard.testing.current_models import build_current
from autoshard.testing.models import build_model
from autoshard.verify import verify_model
from tests.harness.verify_gloo_mutations import CONTROLS, GLOO_MUTATIONS


def test_the_gpt_oss_bias_counted_tp_times_fails_verify():
    """The gpt-oss bug round four fixed (down_proj_bias, added inside the experts module before g, kept
    on every tp rank of an expert-parallel rank), planted back, fails the runtime's rows (from step 1:
    verify moves the bias off 0 first). The same split without the plant is certified, the runtime
    included, by tests/simulation/test_verify.py's GptOss case (regression there: the runtime run
    raised, an all-to-all's byte count reading row 0 of a rank that sent no rows)."""
    split = dict(tp=2, dp=2, ep=2)
    with mock.patch.object(_CountedOnce, "forward", staticmethod(lambda ctx, x, first: x.clone())):
        planted = verify_model(build_current("GptOss"), split)
    runtime_failures = [i for i in planted.items if not i.holds and "runtime rank" in i.where]
    assert not planted.passed and runtime_failures and not planted.refusals
    assert any("local world" in run for run in planted.runs)


@pytest.mark.parametrize("name", [*GLOO_MUTATIONS, *CONTROLS])
def test_runtime_bugs_fail_verify_without_gloo_and_their_controls_pass(name):
    """tests/harness/verify_gloo_mutations.py's runtime bugs, each planted while verify runs (no flag):
    only the runtime's rows fail, the simulation's all hold; the same runs without a bug pass."""
    if name in CONTROLS:
        changes, split = CONTROLS[name]
        patch = contextlib.nullcontext()         # nothing planted
    else:
        _, changes, split, plant = GLOO_MUTATIONS[name]
        patch = plant()
    with patch:
        cert = verify_model(build_model(changes["model"], layers=2), split, distributed_optimizer=name.endswith("+do"))
    failing = [i for i in cert.items if not i.holds]
    if name in CONTROLS:
        assert cert.passed, failing
    else:
        assert failing and all("runtime rank" in i.where for i in failing), failing


def test_zero3_is_certified_and_a_stale_gather_fails_it():
    """A split at zero=3 steps the runtime with fully sharded parameters; planted: units kept gathered
    across the optimizer's step (the gathered copies hold the old weights), which only steps 2 and 3
    of the runtime's rows can see."""
    from autoshard.runtime.sharded_params import ShardedParams
    split = dict(dp=2, pp=2, microbatches=2, zero=3)
    cert = verify_model(build_model("llama", layers=2), split)
    assert cert.passed and cert.split["zero"] == 3, [i for i in cert.items if not i.holds]
    stale = mock.patch.multiple(ShardedParams, publish=lambda self: self._copy_mains(), release=lambda self, k: None)
    with stale:
        planted = verify_model(build_model("llama", layers=2), split)
    failing = [i for i in planted.items if not i.holds]
    assert failing and all("runtime rank" in i.where and "step 1" not in i.where for i in failing), failing


def test_a_failed_gloo_run_is_reported_by_its_exception_not_torchruns_banner():
    """Before, `verify --gloo` reported the last line of torchrun's stderr: the '=====' of its
    closing summary, which says nothing."""
    from types import SimpleNamespace

    from autoshard.verify.gloo import _failure
    stderr = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1, in <module>\n"
              "[rank0]: autoshard.errors.ShardingError: distributed() released the model's weights\n"
              "E1129 torch/distributed/elastic/multiprocessing/api.py failed (exitcode: 1)\n"
              "============================================================\n")
    assert _failure(SimpleNamespace(stderr=stderr, stdout="", returncode=1)) == \
        "[rank0]: autoshard.errors.ShardingError: distributed() released the model's weights"
    assert _failure(SimpleNamespace(stderr="", stdout="", returncode=3)) == "exit code 3"
