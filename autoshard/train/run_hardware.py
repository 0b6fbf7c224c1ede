"""The cost model's hardware for an `autoshard train` run (its progress line's estimate, --plan).

`--hardware` names a GPU preset or `cpu`; without it, the preset of the GPU the run is on
(device.running_hardware), and none on the CPU. `cpu` is this machine's measured profile
(autoshard/cpu_profile/__init__.py) for the model's shapes: rank 0 measures it, or reads it back when it was
measured before here (one to two minutes the first time, then nothing), and hands it to the others.
"""
from __future__ import annotations


from autoshard.planning.hardware import Hardware
from autoshard.train.device import Placement, running_hardware
from autoshard.train.options import TrainOptions
from autoshard.world import current

__all__ = ["run_hardware", "hardware_name"]


def run_hardware(opts: TrainOptions, place: Placement, config, microbatch: int) -> str | Hardware | None:
    """The preset's name, the measured `cpu` Hardware, or None (no estimate to make). Every rank
    calls it (the measured profile is broadcast from rank 0)."""
    name = opts.hardware or running_hardware(place)
    if name != "cpu":
        return name
    box: list[Hardware | None] = [None]
    if current().rank() == 0:
        from autoshard.cpu_profile import measure_cpu
        box[0] = measure_cpu(hidden=config.hidden_size, heads=config.num_attention_heads, seq=opts.seq_len,
                             microbatch=microbatch)
    box = current().broadcast_object(box, src=0)
    return box[0]


def hardware_name(hardware: str | Hardware | None) -> str | None:
    return hardware.name if isinstance(hardware, Hardware) else hardware
