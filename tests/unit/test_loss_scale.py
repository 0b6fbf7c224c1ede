"""The fp16 loss scaler's rule (torch.amp.GradScaler's): back off on inf/NaN, grow after clean steps."""
import pytest
import torch

from autoshard import ShardingError
from autoshard.runtime.loss_scale import LossScaler


def test_backs_off_on_overflow_and_grows_after_the_interval():
    s = LossScaler(scale=1024.0, growth_interval=3)
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 1024.0 and s.clean_steps == 2
    s.update(found_inf=True)                       # an overflow resets the count
    assert s.scale == 512.0 and s.clean_steps == 0 and s.skipped == 1
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 1024.0 and s.clean_steps == 0
    restored = LossScaler()
    restored.load(s.state())
    assert (restored.scale, restored.clean_steps, restored.skipped) == (1024.0, 0, 1)


def test_finds_inf_and_nan_in_one_process():
    s = LossScaler()
    assert not s.found_inf([torch.ones(3), torch.zeros(2)])
    assert s.found_inf([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert s.found_inf([torch.tensor([float("-inf")])])


@pytest.mark.parametrize("bad", [dict(scale=0.0), dict(growth=1.0), dict(backoff=1.0), dict(growth_interval=0)])
def test_bad_settings_are_refused_naming_them(bad):
    with pytest.raises(ShardingError, match="LossScaler needs scale > 0, growth > 1"):
        LossScaler(**bad)
