"""The GPU layer's tests. Those marked ``gpu`` need a GPU: skipped, with the reason shown,
only where no NVIDIA driver exists. The others run everywhere against the scripted driver
(``testkit/fake_driver.py``).

On a machine with a driver they run; anything missing there is a failure, not a skip. Set
``JGS_GPU_RESULTS=FILE`` to write every GPU test's outcome and the figures the tests record
(device, driver, date, times, image sizes) to a JSON file (testkit/gpu_results.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from testkit.gpu_check import no_gpu_reason

# The start of a kernel's cell whose PyTorch computes the same bits on every run: cuBLAS's
# workspace fixed, the generators seeded, the non-deterministic kernels refused.
DETERMINISTIC_TORCH = """
import os
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch, torch.nn as nn
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
"""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = no_gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        # The mark, not the keyword: every test of this folder has "gpu" among its keywords,
        # and the GPU layer's scenarios with the scripted driver run everywhere.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _drop_images(request: pytest.FixtureRequest) -> Iterator[None]:
    """GPU images are gigabytes: remove a GPU test's store when it ends (the disk is small).
    Its path is taken before the test: at this fixture's teardown the store's own fixture
    is gone already."""
    root = None
    if request.node.get_closest_marker("gpu") is not None and "store" in request.fixturenames:
        root = request.getfixturevalue("store").root
    yield
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
