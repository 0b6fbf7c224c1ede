"""Measured `cpu` profiles kept on disk, one per machine and shape, so a profile is measured once
(autoshard/cpu_profile/__init__.py's measure_cpu takes 30-60 s on 2 cores).

A profile is keyed by what it depends on: the host name, the processor's model, the core count,
torch's version and the shapes and options it was measured for. It is a JSON file in
`$AUTOSHARD_CACHE_DIR` (default `~/.cache/autoshard`), `cpu-profile-<digest>.json`, holding the key,
the Hardware's fields, what made it unreliable if anything, when it was measured and how long that
took. Delete the file to measure again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import time
from pathlib import Path

import torch

from autoshard.cpu_profile.collectives import PAIRS
from autoshard.cpu_profile.rounds import ROUNDS
from autoshard.planning.hardware import Hardware

__all__ = ["profile_key", "profile_path", "load_profile", "save_profile"]


def _processor() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# the profile's fields changed (2: op_overhead_s, op_bytes_gb_s; 3: startup_us; 4: attention_tflops): measured again
_FIELDS = 4


def profile_key(*, rounds: int = ROUNDS, pairs: int = PAIRS, **shape) -> dict:
    """What a profile measured with `shape` (measure_cpu's arguments, its `rounds` and `pairs`
    defaulting to measure_cpu's) depends on."""
    return {"host": socket.gethostname(), "processor": _processor(), "cores": os.cpu_count() or 1,
            "torch": torch.__version__, "fields": _FIELDS, "rounds": rounds, "pairs": pairs, **shape}


def profile_path(key: dict) -> Path:
    folder = Path(os.environ.get("AUTOSHARD_CACHE_DIR") or Path.home() / ".cache" / "autoshard")
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return folder / f"cpu-profile-{digest}.json"


def load_profile(key: dict) -> tuple[Hardware, float, list[str]] | None:
    """The profile stored for `key`, the seconds its measurement took and what made it unreliable
    (measure_cpu's warnings), or None (none stored, or a file that does not read as one: it is
    measured again)."""
    path = profile_path(key)
    try:
        stored = json.loads(path.read_text())
        if stored["key"] != key:
            return None
        fields = dict(stored["hardware"])
        fields["tile"] = tuple(fields["tile"])
        fields["startup_us"] = tuple((kind, float(us)) for kind, us in fields.get("startup_us", ()))
        return Hardware(**fields), float(stored["seconds"]), list(stored.get("notes", []))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_profile(key: dict, hw: Hardware, seconds: float, notes: list[str] = ()) -> Path:
    """Store `hw` for `key` with what made it unreliable, if anything (said again at each read);
    written whole, then renamed: a reader never sees half a file."""
    path = profile_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"key": key, "hardware": dataclasses.asdict(hw), "seconds": seconds, "notes": list(notes),
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    part = path.with_suffix(f".{os.getpid()}.part")
    part.write_text(json.dumps(body, indent=1))
    os.replace(part, path)
    return path
