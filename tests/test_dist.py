"""hstap.dist in one process: torchrun's environment and its errors, the device rule, the single-process no-op
collectives, agree, grad_sync's contexts, full_state_dict and the RNG state round trip. (Two real gloo ranks run in
tests/capture/test_hf_procs.py and tests/train/test_train.py.)"""

from __future__ import annotations

import contextlib
import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from hstap import dist as D
from hstap.common import HstapError


@pytest.fixture
def no_torchrun(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_torchrun_env_and_its_errors(no_torchrun):
    env = no_torchrun
    assert D.torchrun_env() == (0, 1, 0)  # a plain process
    env.setenv("RANK", "3")
    env.setenv("WORLD_SIZE", "4")
    assert D.torchrun_env() == (3, 4, 3)  # LOCAL_RANK defaults to RANK (one node)
    env.setenv("LOCAL_RANK", "1")
    assert D.torchrun_env() == (3, 4, 1)
    env.setenv("RANK", "4")
    with pytest.raises(HstapError, match="RANK=4 is out of range for WORLD_SIZE=4"):
        D.torchrun_env()
    env.setenv("RANK", "-1")
    with pytest.raises(HstapError, match="out of range"):
        D.torchrun_env()
    for bad in (("RANK", "one"), ("WORLD_SIZE", ""), ("LOCAL_RANK", "0.5")):
        env.setenv("RANK", "0")
        env.setenv("WORLD_SIZE", "2")
        env.setenv("LOCAL_RANK", "0")
        env.setenv(*bad)
        with pytest.raises(HstapError, match="RANK / WORLD_SIZE / LOCAL_RANK must be integers"):
            D.torchrun_env()


def test_local_device():
    cpu = torch.device("cpu")
    assert D.local_device("cpu", 1, 0) == cpu and D.local_device("cpu", 8, 5) == cpu  # --device cpu under torchrun
    if torch.cuda.is_available():
        assert D.local_device("cuda", 1, 0).type == "cuda"
        assert D.local_device("auto", 2, 0) == torch.device("cuda", 0)  # torchrun: GPU LOCAL_RANK
        assert torch.cuda.current_device() == 0
    else:
        assert D.local_device("auto", 1, 0) == cpu and D.local_device("auto", 4, 2) == cpu
        for device, world in (("cuda", 1), ("cuda", 2), ("cuda:1", 1)):
            with pytest.raises(HstapError, match="CUDA is not available"):
                D.local_device(device, world, 1)


def test_a_single_process_joins_no_group(no_torchrun):
    assert D.init_dist("cpu") == (0, 1, 0, torch.device("cpu"))
    assert not D.is_dist()
    assert D.init_barrier(1) is None and not D.is_dist()


def test_single_process_collectives_are_no_ops(capsys):
    assert not D.is_dist() and D.get_rank() == 0 and D.get_world() == 1
    D.barrier()
    D.destroy()
    t = torch.tensor([1.0, 2.0])
    assert D.all_reduce_sum(t) is t and t.tolist() == [1.0, 2.0]
    D.print0("rank", 0, sep="-")
    assert capsys.readouterr().out == "rank-0\n"
    assert D.agree(True) is True and D.agree(False) is False
    x = torch.randn(3)
    assert D.full_tensor(x) is x  # plain tensors pass through
    assert torch.equal(D.like(x, torch.zeros(3)), x)


class _FSDPLike(nn.Linear):
    """What grad_sync sees of an FSDP2 module: set_requires_gradient_sync."""

    def __init__(self):
        super().__init__(2, 2)
        self.calls: list[bool] = []

    def set_requires_gradient_sync(self, flag: bool) -> None:
        self.calls.append(flag)


class _DDPLike(nn.Linear):
    """What grad_sync sees of a DDP module: no_sync()."""

    def __init__(self):
        super().__init__(2, 2)
        self.entered = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.entered += 1
        yield


def test_grad_sync_contexts(monkeypatch):
    plain, ddp, fsdp = nn.Linear(2, 2), _DDPLike(), _FSDPLike()
    for m in (plain, ddp, fsdp):  # one process: there is no all-reduce to skip
        assert isinstance(D.grad_sync(m, False), contextlib.nullcontext)
    assert ddp.entered == 0 and fsdp.calls == []
    monkeypatch.setattr(D, "is_dist", lambda: True)
    for m in (plain, ddp, fsdp):  # the last micro-batch of a step: gradients are reduced
        assert isinstance(D.grad_sync(m, True), contextlib.nullcontext)
    with D.grad_sync(ddp, False):
        assert ddp.entered == 1
    with D.grad_sync(fsdp, False):
        assert fsdp.calls == [False]
    assert fsdp.calls == [False, True]  # restored on leaving
    with pytest.raises(RuntimeError, match="backward failed"):
        with D.grad_sync(fsdp, False):
            raise RuntimeError("backward failed")
    assert fsdp.calls == [False, True, False, True]  # restored after an error too
    assert isinstance(D.grad_sync(plain, False), contextlib.nullcontext)  # neither kind: nothing to skip


def test_full_state_dict_is_plain_cpu_copies():
    m = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    m.register_buffer("steps", torch.arange(3))
    ref = m.state_dict()
    sd = D.full_state_dict(m)
    assert list(sd) == list(ref) == ["steps", "0.weight", "0.bias", "1.weight", "1.bias"]
    for k, v in sd.items():
        assert v.device.type == "cpu" and not v.requires_grad and torch.equal(v, ref[k])


def test_rng_state_round_trip_through_json():
    def draws():
        return torch.rand(4), random.random(), np.random.rand(3)

    tensors, js = D.rng_state()
    js = json.loads(json.dumps(js))  # checkpoints keep the python/numpy states as JSON
    want = draws()
    draws()  # move every generator on
    D.set_rng_state(tensors, js)
    got = draws()
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and np.array_equal(got[2], want[2])
