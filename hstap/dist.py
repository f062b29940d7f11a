"""Process-group plumbing: torchrun's environment, this process's device, rank-0 printing, reductions, DDP / FSDP2
wrapping.

The one place that reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK: `torchrun_env`) and picks a process's
device (`local_device`). Training joins an NCCL (CUDA) or gloo (CPU) group with `init_dist`; capture (capture/hf/driver.py)
joins a gloo group used only for barriers and the final counts with `init_barrier`.

Model code (`models/drafter.py`) never sees ranks; `train/stage.py` calls these from outside, torchtitan-style. Everything degrades
to a no-op in a plain single process (no RANK/WORLD_SIZE in the environment), so the same code path trains on a laptop.

    torchrun --nproc-per-node 8 -m hstap.cli train --store S --target T --out RUN            # DDP
    torchrun --nproc-per-node 8 -m hstap.cli train --store S --target T --out RUN --fsdp     # FSDP2 (fully_shard)

Backends: NCCL on CUDA, gloo on CPU (tests run 2 CPU processes). FSDP2 shards each drafter decoder layer and the root
(fc, norm, lm_head and the frozen embedding); `reshard_after_forward=False` keeps the gathered weights through the K
TTT passes (ZeRO-2-like: one all-gather per step, not one per TTT step).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hstap.common import HstapError
from hstap.device import resolve_device


def torchrun_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) without it."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise HstapError("RANK / WORLD_SIZE / LOCAL_RANK must be integers") from None
    if not 0 <= rank < world:
        raise HstapError(f"RANK={rank} is out of range for WORLD_SIZE={world}")
    return rank, world, local


def local_device(device: str, world_size: int, local_rank: int) -> torch.device:
    """`hstap.device.resolve_device(device)`, except that under torchrun (world_size > 1) "auto" and "cuda" mean GPU
    `local_rank`; a CUDA device becomes the current one (streams, events and pinned copies then default to it)."""
    if world_size > 1 and str(device) in ("auto", "cuda") and torch.cuda.is_available():
        device = f"cuda:{local_rank}"
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def init_dist(device: str = "auto") -> tuple[int, int, int, torch.device]:
    """Read torchrun's env (RANK, WORLD_SIZE, LOCAL_RANK), join the process group -> (rank, world, local_rank, device).

    device: "auto" (cuda if available), "cpu" or "cuda". With CUDA each process takes GPU `local_rank`."""
    rank, world, local = torchrun_env()
    dev = local_device(device, world, local)
    if world > 1 and not is_dist():
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=30), **kw)
    return rank, world, local, dev


def init_barrier(world_size: int):
    """A gloo process group for barriers and counts (no tensors of the model go through it) -> torch.distributed, or
    None for one process."""
    if world_size <= 1:
        return None
    if not dist.is_initialized():
        # hours, not the default 30 min: a rank that finished waits at the final barrier for the slowest one
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=48))
    return dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world() -> int:
    return dist.get_world_size() if is_dist() else 1


def print0(*args, **kw) -> None:
    if get_rank() == 0:
        print(*args, **kw, flush=True)


def barrier() -> None:
    if is_dist():
        dist.barrier()


def destroy() -> None:
    if is_dist():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (returns t). A no-op in one process."""
    if is_dist():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def agree(ok: bool) -> bool:
    """True when `ok` holds on every rank (a collective): lets one rank's failure stop all of them, not hang them."""
    if not is_dist():
        return ok
    t = torch.tensor([1 if ok else 0], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def wrap_ddp(model: nn.Module, device: torch.device | None = None) -> nn.Module:
    """DistributedDataParallel over the whole TTT module (one forward per backward). Buffers (d2t, t2d, RoPE) are equal
    on every rank by construction, so they are not re-broadcast each forward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = device or next(model.parameters()).device
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)


def apply_fsdp(model: nn.Module, bf16: bool = False) -> nn.Module:
    """FSDP2 `fully_shard` on each decoder layer of `model.drafter` (the midlayer, and layers 1.. of a deeper drafter)
    and on the root `model` (in place; returns it).

    bf16: gather parameters in bf16 and reduce gradients in fp32 (fp32 master weights stay sharded)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
    for layer in model.drafter.decoder_layers():
        fully_shard(layer, reshard_after_forward=False, **kw)
    fully_shard(model, reshard_after_forward=False, **kw)
    return model


def grad_sync(model: nn.Module, sync: bool):
    """Context for one micro-batch backward: gradient all-reduce only when `sync` (the last micro-batch of a step)."""
    if sync or not is_dist():
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        return _restore_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _restore_sync(model):
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to a plain tensor (a collective: every rank must call it); plain tensors pass through."""
    return t.full_tensor() if _is_dtensor(t) else t


def like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`full` laid out like `ref`: a DTensor sharded as ref when ref is one (every rank holds `full`), else `full`."""
    if not _is_dtensor(ref):
        return full.to(device=ref.device)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(ref.device_mesh.device_type), ref.device_mesh, ref.placements)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a plain CPU tensor (gathered from FSDP2 shards; a collective under FSDP)."""
    return {k: full_tensor(v.detach()).to("cpu") for k, v in module.state_dict().items()}


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """This process's RNG states: torch CPU (and CUDA) as uint8 tensors; python `random` and numpy as JSON lists."""
    t = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        t["cuda"] = torch.cuda.get_rng_state()
    py, npst = random.getstate(), np.random.get_state()
    return t, {"python": [py[0], list(py[1]), py[2]],
               "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])]}


def set_rng_state(t: dict[str, torch.Tensor], js: dict) -> None:
    torch.set_rng_state(t["cpu"])
    if "cuda" in t and torch.cuda.is_available():
        torch.cuda.set_rng_state(t["cuda"])
    py, n = js["python"], js["numpy"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
