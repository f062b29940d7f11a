"""Fixtures of the training tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def assets(request, tiny_tokenizer, tmp_path_factory) -> dict:
    """The requesting module's training assets: `helpers.train.build_assets` with the settings of its `ASSETS` dict, if
    any. The forkserver starts first, so that its imports overlap the building."""
    from helpers.train import build_assets, start_forkserver

    start_forkserver()
    module = request.module
    root = tmp_path_factory.mktemp(module.__name__.rpartition(".")[2])
    return build_assets(root, tiny_tokenizer[0], **getattr(module, "ASSETS", {}))
