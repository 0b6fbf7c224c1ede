import socket
import warnings

import pytest
import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*bos_token_id.*")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_process_group():
    """A real gloo process group of one rank (the executor's tests in one process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# Each test's tier is the folder it lives in (unit/, simulation/, distributed/, gpu/), unless it
# names another with a marker; a test of a CUDA device elsewhere (a `needs a CUDA GPU` skip, or a
# "cuda" parameter) is also marked gpu. `pytest -m unit` runs one tier; tests/README.md tells what
# each holds.
TIERS = ("unit", "simulation", "distributed", "gpu")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            folder = item.path.parent.name
            if folder in TIERS:
                item.add_marker(getattr(pytest.mark, folder))
        needs_cuda = any(m.name == "skipif" and "CUDA" in str(m.kwargs.get("reason", ""))
                         for m in item.iter_markers())
        if needs_cuda or "cuda" in getattr(getattr(item, "callspec", None), "params", {}).values():
            item.add_marker(pytest.mark.gpu)
