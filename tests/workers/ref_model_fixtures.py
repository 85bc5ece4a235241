"""The tiny `ref` model both constraint test files decode with (512 positions, 256 KV blocks, seed 5),
module-scoped: built once per test file."""

from __future__ import annotations

import pytest

from workers.backends.ref import RefBackend
from workers.model_maker import make_model
from workers.package_loader import load_package


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return load_package(make_model(str(tmp_path_factory.mktemp("pkg") / "m"), max_seq=512, kv_num_blocks=256,
                                   seed=5))


@pytest.fixture(scope="module")
def backend(package):
    b = RefBackend()
    b.load(package)
    yield b
    b.unload()
