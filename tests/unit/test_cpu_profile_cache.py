"""The measured cpu profile kept per machine and shape (autoshard/cpu_profile_cache.py), and what
measure_cpu says of a doubtful measurement: tested with the measurement's processes replaced by
fixed results (the real measurement takes one to two minutes; tests/distributed runs it once)."""
import warnings

import pytest

import autoshard.cpu_profile as cpu_profile
from autoshard.cpu_profile import CPU_DEFAULTS
from autoshard.cpu_profile_cache import load_profile, profile_key, profile_path, save_profile
from autoshard.planning.hardware import Hardware

SHAPE = dict(hidden=64, heads=4, seq=32, microbatch=2, memory_gib=None, name="cpu")
HW = Hardware("cpu", peak_tflops=0.05, hbm_gb_s=3.0, memory_gib=24, gpus_per_node=2, nvlink_gb_s=1.5,
              network_gb_s=1.5, latency_us=80.0, **CPU_DEFAULTS)


def test_a_profile_is_read_back_for_its_own_key_only(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path))
    key = profile_key(**SHAPE)
    assert load_profile(key) is None
    path = save_profile(key, HW, 71.0, ["a note"])
    assert path.parent == tmp_path and load_profile(key) == (HW, 71.0, ["a note"])
    assert load_profile(profile_key(**{**SHAPE, "seq": 64})) is None           # another shape
    path.write_text("{ half a file")
    assert load_profile(key) is None                                           # measured again


class _Fake:
    """measure_cpu's two spawned measurements, counted: the local one, then gloo's."""

    def __init__(self, gloo=(2e-4, 1.2e-3, 4 * 2 * 32 * 64, 4 * 2 ** 20)):
        self.calls, self.gloo = 0, gloo

    def __call__(self, target, args, n):
        self.calls += 1
        if target is cpu_profile._local_worker:
            return 5e10, 3e9, None, 1e-4, 2e-3, 1e-9, 1e-6, 3e-6, 8e9, None
        return self.gloo


def _measure(**kw):
    return cpu_profile.measure_cpu(hidden=64, heads=4, seq=32, microbatch=2, **kw)


def test_measured_once_then_read_back(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_profile.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    fake = _Fake()
    monkeypatch.setattr(cpu_profile, "_spawned", fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # a clean measurement says nothing but its time
        first = _measure()
        assert fake.calls == 2 and "measured the cpu profile in" in capsys.readouterr().err
        assert _measure() == first and fake.calls == 2                     # read back, not measured
    assert profile_path(profile_key(**SHAPE)).exists()
    _measure(cache=False)
    assert fake.calls == 4


def test_a_value_under_its_floor_or_a_busy_machine_is_said_each_time(tmp_path, monkeypatch):
    """Regression: a remainder clamped at 1e-6 s gave an element-wise rate of 11,207 GB/s and gloo's
    latency sat at its 1 us floor, with nothing said."""
    monkeypatch.setenv("AUTOSHARD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_profile.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(cpu_profile, "_spawned", _Fake(gloo=(-3e-5, 1.2e-3, 4 * 2 * 32 * 64, 4 * 2 ** 20)))
    with pytest.warns(UserWarning, match="may be off: a small all-reduce measured -30 us, under its floor"):
        hw = _measure()
    assert hw.latency_us >= 1.0
    with pytest.warns(UserWarning, match="the stored cpu profile may be off: a small all-reduce"):
        assert _measure() == hw
    monkeypatch.setattr(cpu_profile.os, "getloadavg", lambda: (7.5, 0.0, 0.0))
    monkeypatch.setattr(cpu_profile, "_spawned", _Fake())
    with pytest.warns(UserWarning, match=r"busy as the measurement started \(load average 7.5 on"):
        _measure(cache=False)


def test_the_element_wise_remainder_has_a_floor_and_says_so(monkeypatch):
    """The element-wise rate is the layer's time less its GEMMs and dispatch: a remainder under 5% of
    the layer is noise, floored there, and noted."""
    from autoshard.planning.gemm_timing import LayerShape
    x = LayerShape(2, 32, 64, 4, 1)
    monkeypatch.setattr(cpu_profile, "_per_layer", lambda x: (1e-3, 0.0))
    rate, note, _ = cpu_profile._elementwise_rate(x, gemm_rate=1e30, dispatch=0.5e-3)
    assert note is None
    rate_floored, note, _ = cpu_profile._elementwise_rate(x, gemm_rate=1e30, dispatch=0.999e-3)
    assert "under the floor of 5% of the layer" in note and rate_floored == pytest.approx(rate * 0.5 / 0.05)
    # a busy machine measured 4 layers no slower than 2: the layer at 0 (before: division by zero)
    monkeypatch.setattr(cpu_profile, "_per_layer", lambda x: (0.0, 1e-3))
    rate_zero, note, _ = cpu_profile._elementwise_rate(x, gemm_rate=1e30, dispatch=1e-4)
    assert "layer's 0 ms" in note and 0 < rate_zero < float("inf")


def test_the_gloo_pair_keeps_its_own_store_inside_a_torchrun_job(monkeypatch):
    """Regression: measured from a rank of `autoshard train --hardware cpu`, the pair's processes
    inherited torchrun's TORCHELASTIC_USE_AGENT_STORE, waited for the job's agent store and hung."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    seen = {}

    class Stop(Exception):
        pass

    def init(*args, **kwargs):
        seen["agent_store"] = cpu_profile.os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
        seen["init_method"] = kwargs.get("init_method")
        raise Stop
    monkeypatch.setattr(cpu_profile.dist, "init_process_group", init)
    monkeypatch.setattr(cpu_profile.torch, "set_flush_denormal", lambda on: True)    # this process's mode stays
    with pytest.raises(Stop):
        cpu_profile._gloo_worker(0, 12345, 64, None)
    assert seen == {"agent_store": None, "init_method": "tcp://127.0.0.1:12345"}


def test_the_op_rates_are_read_on_the_ops_counted(monkeypatch):
    """For step times read off a program's ops: seconds per aten op from the tiny layer's time over
    its op count, the other ops' bytes rate from what is left of the layer; a remainder under 5% of
    the layer is floored and noted."""
    from autoshard.planning.gemm_timing import LayerShape
    from autoshard.planning.op_cost import OpWork
    tiny, x = LayerShape(1, 8, 16, 2, 1), LayerShape(2, 32, 64, 4, 1)
    works = {tiny: OpWork(0.0, 0.0, 0.0, 100), x: OpWork(1e9, 0.0, 4e6, 100)}
    monkeypatch.setattr(cpu_profile, "_layer_work", works.__getitem__)
    per_op, rate, note = cpu_profile._op_rates(x, tiny, layer=3e-3, tiny_layer=1e-4, gemm_rate=1e12)
    assert per_op == pytest.approx(1e-6) and note is None
    assert rate == pytest.approx(4e6 / (3e-3 - 1e-3 - 1e-4))
    _, floored, note = cpu_profile._op_rates(x, tiny, layer=1.1e-3, tiny_layer=1e-4, gemm_rate=1e12)
    assert "op-bytes rate" in note and floored == pytest.approx(4e6 / (0.05 * 1.1e-3))
