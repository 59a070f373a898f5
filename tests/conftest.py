import os

import torch

# Without a GPU, Triton kernels run under the interpreter; it must be on before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
