"""hstap's methods inside vLLM's workers: `--worker-extension-cls hstap.serve_loop.worker.HstapWorker` mixes them into the
worker class (vLLM's documented extension point, as RLHF weight syncs use it); a client calls them between engine steps
through `collective_rpc`: `LLM.collective_rpc("hstap_load_drafter", args=(DIR,))` in-process, or, against `vllm
serve` started with VLLM_SERVER_DEV_MODE=1, `POST /collective_rpc {"method": "hstap_load_drafter", "args": [DIR]}`.

- `hstap_load_drafter(DIR)`: the EAGLE-3 drafter the engine drafts with takes the weights of the drafter directory DIR
  (`hstap export --to vllm`, or any checkpoint vLLM loads as this drafter), in place, by vLLM's own reload
  (`vllm.model_executor.model_loader.reload.inplace.reload_weights` on `model_runner.get_draft_model()`: the layers
  are put back to checkpoint format, loaded through the drafter's own `load_weights`, then processed again; on the
  CPU backend that re-packs the oneDNN/SGL GEMM weights, on a GPU it copies into the same storage, so CUDA graphs keep
  their pointers). The RPC runs in the engine core's loop between two steps: no step sees half a drafter, requests in
  flight go on (their drafts are verified by the target as always, so outputs do not change), and the next step
  drafts with the new weights. DIR must hold the same tensors (names, shapes) as the drafter the server started with
  (checked first, so a refused DIR leaves the drafter untouched). A module vLLM shares between the drafter and the
  target (the lm_head of a drafter whose lm_head equalled the target's at start-up) is copied for the drafter first
  (`unshare`): the target's weights never change. Returns what was loaded and a check that the engine's fused fc
  and lm_head compute with DIR's weights.
  It uses what both of vLLM's model runners have (`get_draft_model`, `get_model`, `vllm_config`) and says which runner
  it ran on (`hstap.engines.vllm_runner`).
- `hstap_tap_start()`: starts the tap beside EAGLE-3 (hstap/capture/vllm/eagle_tap.py) in this worker; refused under
  Model Runner V2, before anything is wrapped (the tap reads V1's runner).

vLLM's other ways to new weights, and why not these: `reload_weights` RPC of the worker (the target only), the
weight-transfer API (`/start_draft_weight_update`, `/update_weights`: it does retarget the draft model, but its
engines are NCCL / CUDA IPC / RDMA, none on the CPU backend), sleep / wake_up (not supported on CPU; discards the
weights), a restart (drops the server's requests and costs its start-up). docs/engines.md has the details.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from hstap.common import HstapError


def _shapes(d: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every safetensors file in a drafter directory (headers only)."""
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as g:
            for k in g.keys():
                out[k] = tuple(g.get_slice(k).get_shape())
    return out


def check_same_drafter(served: Path, new: Path) -> None:
    """HstapError unless `new` holds the same tensors as `served` and taps the same layers."""
    a, b = _shapes(served), _shapes(new)
    if not b:
        raise HstapError(f"{new}: no *.safetensors: not a drafter directory")
    if a and a != b:
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))[:5]
        raise HstapError(f"{new}: its tensors differ from the served drafter's ({served}): {diff}: a drafter of "
                         "another shape needs a new server")
    ids = []
    for d in (served, new):
        try:
            ids.append(json.loads((d / "config.json").read_text()).get("eagle_aux_hidden_state_layer_ids"))
        except (OSError, ValueError):
            ids.append(None)
    if ids[0] != ids[1]:
        raise HstapError(f"{new}: config.json: eagle_aux_hidden_state_layer_ids {ids[1]} != the served drafter's "
                         f"{ids[0]}: the target's taps are fixed when the server starts")


def weights_error(model, weights_dir: Path) -> dict[str, float]:
    """max |m(x) - x W^T| over 4 random rows for the drafter's fc and lm_head: what the engine computes with (whatever
    it packed the weights into) against DIR's `fc.weight` / `lm_head.weight` (a module or tensor absent: left out)."""
    import torch
    from safetensors import safe_open

    mods = {"fc": getattr(getattr(model, "model", None), "fc", None), "lm_head": getattr(model, "lm_head", None)}
    out: dict[str, float] = {}
    for f in sorted(weights_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as g:
            for name, mod in mods.items():
                if f"{name}.weight" not in g.keys() or not hasattr(mod, "quant_method"):
                    continue
                w = g.get_tensor(f"{name}.weight").float()  # (N, K)
                dev = next(p.device for p in model.parameters())
                with torch.no_grad():
                    x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(0))  # (4, K)
                    got = mod.quant_method.apply(mod, x.to(dev, mod_dtype(mod))).float().cpu()  # (4, N')
                out[name] = float((got[:, : w.shape[0]] - x @ w.t()).abs().max())
    return out


def mod_dtype(mod):
    """The dtype a module computes in: its first floating-point parameter's (a packed weight leaves an empty one)."""
    import torch

    return next((p.dtype for p in mod.parameters() if p.is_floating_point()), torch.float32)


def unshare(model, target, checkpoint_names: set[str]) -> list[str]:
    """Give the drafter its own copy of every module it shares with the target and that the checkpoint has weights
    for; returns their names. vLLM shares the target's embedding and lm_head with an EAGLE drafter whose checkpoint
    lacks them or holds identical ones (`SpecDecodeBaseProposer._maybe_share_lm_head`: a drafter initialised from the
    target's head, say), and a reload writes into whatever module the drafter holds: without this, new drafter weights
    would change the target's lm_head, and the target's outputs with it. The copy takes over the module's
    checkpoint-format metadata, which vLLM's layerwise reload restores from."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    owned = {id(m) for m in target.modules()}
    done: list[str] = []
    for name, mod in list(model.named_modules()):
        if not name or id(mod) not in owned or any(name.startswith(d + ".") for d in done):
            continue
        keys = (name, name.removeprefix("model."))  # the Eagle-3 checkpoint names lack the "model." of the module
        if not any(k.startswith(c + ".") for k in checkpoint_names for c in keys):
            continue
        new = copy.deepcopy(mod)
        for a, b in zip(mod.modules(), new.modules()):
            src, dst = get_layerwise_info(a), get_layerwise_info(b)
            dst.restore_metadata, dst.restore_device = src.restore_metadata, src.restore_device
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        done.append(name)
    return done


class HstapWorker:
    """Mixed into vLLM's worker class (module docstring); `self` is the worker (`self.model_runner`)."""

    def hstap_load_drafter(self, path: str) -> dict:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
        from vllm.model_executor.model_loader.utils import get_draft_load_config

        mr = self.model_runner
        vc = mr.vllm_config
        spec = vc.speculative_config
        model = mr.get_draft_model() if hasattr(mr, "get_draft_model") else None
        if spec is None or model is None or spec.draft_model_config is None:
            raise HstapError("hstap_load_drafter: this server drafts with no draft model (start it with "
                             "--speculative-config '{\"method\": \"eagle3\", \"model\": DIR, ...}')")
        new = Path(path)
        served = Path(getattr(self, "_hstap_served", None) or spec.draft_model_config.model)
        check_same_drafter(served, new)
        t0 = time.perf_counter()
        mc = copy.copy(spec.draft_model_config)  # the draft's model config, pointed at DIR for the loader only
        mc.model = str(new)
        unshared = unshare(model, mr.get_model(), set(_shapes(new)))
        weights = get_model_loader(get_draft_load_config(vc)).get_all_weights(mc, model)
        dvc = copy.copy(vc)  # reload_weights reads model_config for processing; the target's stays untouched
        dvc.model_config = mc
        with set_current_vllm_config(vc):
            reload_weights(dvc, model, weights_iterator=weights, weights_path=None, is_checkpoint_format=True)
        self._hstap_served = str(new)
        from hstap.engines.vllm_runner import runner_of

        return {"path": str(new), "seconds": time.perf_counter() - t0, "tensors": len(_shapes(new)),
                "model_runner": runner_of(mr),
                "unshared": unshared, "max_abs_err": weights_error(model, new)}

    def hstap_tap_start(self) -> dict:
        from hstap.capture.vllm.eagle_tap import install

        return install(self.model_runner)
