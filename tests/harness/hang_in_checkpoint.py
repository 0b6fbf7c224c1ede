"""`autoshard train` whose ranks hang inside writing one checkpoint: each writes its shards, then
waits forever before the index is gathered, as the ranks of a node that is about to be lost do.

    python -m tests.harness.hang_in_checkpoint STEP <autoshard train arguments>

A node started so (torchrun ... -m tests.harness.hang_in_checkpoint 10 ...) leaves step STEP's
checkpoint half written for as long as it lives; killing it then is losing a node mid-checkpoint,
without timing a kill against the write."""
from __future__ import annotations

import sys
import time

from autoshard.checkpoint import sharded
from autoshard.train import main


def hang_after_writing(step: int) -> None:
    """Make this process's rank hang once it has written its part of step `step`'s checkpoint."""
    write = sharded._write_rank

    def writing(folder: str, *args, **kwargs) -> dict:
        manifest = write(folder, *args, **kwargs)
        if folder.endswith(f"step-{step:08d}"):
            while True:
                time.sleep(60)
        return manifest
    sharded._write_rank = writing


if __name__ == "__main__":
    hang_after_writing(int(sys.argv[1]))
    main(sys.argv[2:])
