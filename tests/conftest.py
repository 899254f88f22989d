import os
import zlib

import pytest
import torch


@pytest.fixture
def generator(request) -> torch.Generator:
    """Random data of its own for every test case, reproducible from the test id and W4A16_TEST_SEED."""
    seed = (zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("W4A16_TEST_SEED", "0"))) % (2**31)
    request.node.user_properties.append(("seed", seed))
    return torch.Generator().manual_seed(seed)
