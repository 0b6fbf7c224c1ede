import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*bos_token_id.*")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
