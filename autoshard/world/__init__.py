"""The one seam between a rank and the other ranks (the `World`).

Everything in autoshard that talks to another rank (the compiler's collectives, the runtime's
gradient buckets, pipeline transfers, loss-token counts, the distributed optimizer's gathers,
expert all-to-alls, ring attention, checkpoint gathers, the checkers' verdicts) calls the world of
the rank it runs as:

    from autoshard.world import current
    world = current()
    world.all_reduce(t, group=groups.dp)          # in place, as torch.distributed's

Three implementations (world/protocol.py names the methods):

- `TorchWorld` (world/torch_world.py): torch.distributed, gloo or NCCL; what a torchrun job runs,
  and the only module that calls torch.distributed for communication.
- `LocalWorld` (world/local.py): N ranks in one process, one thread each, driven in turn; a rank
  runs until it waits on a receive or a collective, and a wait no rank can end is reported as a
  deadlock naming every rank and what it waits on.
- `ShapeWorld` (world/shapes.py): collectives that keep shapes and touch no data, for a rank run
  alone on meta tensors (the planner's walk of one pipeline rank).

`current()` is the world of the calling thread: the one `use(world)` set, else torch.distributed's
default group once it is initialized, else a world of one rank (a program of one rank needs no
process group).
"""
from autoshard.world.protocol import P2P, Group, Work, World
from autoshard.world.select import current, use
from autoshard.world.local import DeadlockError, LocalWorld, run_ranks

__all__ = ["World", "Work", "Group", "P2P", "current", "use", "LocalWorld", "DeadlockError", "run_ranks"]
