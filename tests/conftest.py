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
