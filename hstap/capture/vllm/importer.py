"""The `vllm-import` engine: import the hidden states vLLM's `extract_hidden_states` method writes into an hstap store.

    hstap capture --engine vllm-import --src HS_DIR --vllm-layers 2,4,5,8 --data PREPARED --target MODEL --out STORE

What vLLM writes (vLLM >= 0.18, `--speculative-config '{"method": "extract_hidden_states", ...}'` with the
`ExampleHiddenStatesConnector`; speculators' `file` backend is the same connector): one safetensors file per
request, `hidden_states` [T, L, H] (the server's dtype) and `token_ids` [T]. Slot l holds vLLM id `ids[l]` = the
residual stream entering layer `ids[l]`; id N (= num_hidden_layers) is the last layer's output *before* the final
norm. The ids are not in the file: `--vllm-layers` repeats the server's `eagle_aux_hidden_state_layer_ids`
(parsed by `hstap.layers.parse_vllm_layers`: the last id must be N).

How they become a store sample:
 - aux = the slots before the last, canonical ids `hstap.layers.from_vllm(ids[:-1])` (id j -> output of layer j-1);
 - final = the target's final RMSNorm applied to the last slot (which must be id N), as HF's LlamaRMSNorm computes
   it in the files' dtype (`hstap.capture.vllm.norm`);
 - the store header's `engine.compute_dtype` is the files' dtype (vLLM's KV cache holds the states in the model's
   dtype), so that `hstap verify` holds a bf16 server's states to bf16 limits;
 - the sample is found by name, `hs_{i}.safetensors` = row i of the prepared set (speculators' naming), else by its
   token ids (any other name, e.g. vLLM's request id). Its token ids must equal the prepared sample's, else the import
   stops with an error naming the file: input_ids and loss_mask are taken from the prepared set.

Pickle-based stores (SpecForge / EAGLE `.ckpt`, ModelOpt `.pt`, speculators' legacy `data_{i}.pt`, any `.pt/.pth/.bin/
.pkl`) are refused before anything is read: unpickling runs arbitrary code. Nothing here ever unpickles.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from hstap.capture.config import CaptureConfig
from hstap.capture.inputs import copy_vocab_map, resolve, short_id
from hstap.capture.vllm.norm import load_final_norm, rms_norm
from hstap.common import HstapError, write_run_config
from hstap.layers import to_vllm
from hstap.store.writer import StoreWriter

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")
_HS_NAME = re.compile(r"^hs_(\d+)\.safetensors$")
def refuse_pickles(src: Path) -> None:
    bad = sorted(p for p in src.rglob("*") if p.is_file() and p.name.lower().endswith(PICKLE_SUFFIXES))
    if bad:
        raise HstapError(f"{bad[0]}: pickle-based hidden-state files ({len(bad)} in {src}, e.g. SpecForge/EAGLE "
                         ".ckpt or torch.save .pt) are not read: unpickling can run arbitrary code. Re-capture with "
                         "vLLM's extract_hidden_states (safetensors) or hstap capture, or convert them with a trusted "
                         "script")


def _token_key(ids) -> tuple:
    return tuple(int(x) for x in ids)


def import_vllm(cfg: CaptureConfig) -> dict:
    """Import cfg.src into cfg.out (cfg: CaptureConfig with target, data, out, src, vllm_layers, layers, dtype, new,
    max_samples, shard_tokens). Returns the summary it prints."""
    from safetensors import safe_open

    t0 = time.perf_counter()
    src, files = _source_files(cfg.src)
    inputs = resolve(cfg)  # its layers: the canonical ids of --vllm-layers
    ds, n, N, H = inputs.ds, inputs.n, inputs.target["num_layers"], inputs.target["hidden_size"]
    layers = list(inputs.layers)
    vids = to_vllm(layers) + [N]  # + N: the last layer's pre-norm output, from which `final` is computed
    weight, eps, norm_key = load_final_norm(cfg.target)
    if tuple(weight.shape) != (H,):
        raise HstapError(f"{cfg.target}: {norm_key} has shape {tuple(weight.shape)}, expected ({H},)")

    rows = _Rows(ds, n, cfg.data)
    engine = {"name": "vllm-import", "version": "vllm extract_hidden_states", "device": "import",
              "compute_dtype": _files_dtype(files),
              "vllm_layers": vids, "final": f"rms_norm({norm_key}, eps={eps}) of vLLM id {N}",
              "src": str(src.resolve())}
    header = inputs.header(engine, cfg)
    samples = tokens = skipped = 0
    with StoreWriter(cfg.out, header, new=cfg.new, shard_tokens=cfg.shard_tokens) as w:
        copy_vocab_map(cfg.data, cfg.out)
        committed = w.committed_ids()
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                keys = set(h.keys())
                if not {"hidden_states", "token_ids"} <= keys:
                    raise HstapError(f"{f}: expected tensors hidden_states and token_ids (vLLM extract_hidden_states), "
                                     f"found {sorted(keys)}")
                tok = h.get_tensor("token_ids").reshape(-1)  # (T,)
                row = rows.row_of(f, tok)
                if row is None:
                    continue  # beyond --max-samples
                sid = rows.ids[row]
                if sid in committed:
                    skipped += 1
                    continue
                hs = h.get_tensor("hidden_states")  # (T, L, H)
            aux, final = _sample_states(f, hs, int(tok.numel()), vids, H, weight, eps)  # (T, K, H), (T, H)
            w.add(sid, tok.long(), torch.as_tensor(ds[row]["loss_mask"], dtype=torch.uint8), aux, final)
            samples += 1
            tokens += int(tok.numel())
    write_run_config(cfg.out, "capture", cfg)
    missing = n - len(rows.used)
    summary = {"samples": samples, "tokens": tokens, "skipped_committed": skipped, "files": len(files),
               "prepared_without_file": missing, "layers": layers, "vllm_layers": vids, "dtype": cfg.dtype,
               "seconds": round(time.perf_counter() - t0, 3), "out": cfg.out}
    print(f"capture: imported {samples} samples ({tokens} tokens) from {len(files)} vLLM files in {src}; {skipped} "
          f"already in the store; {missing} prepared samples have no file; layers {layers} (vLLM ids {vids}), "
          f"final = final norm of vLLM id {N}")
    return summary


def _files_dtype(files: list[Path]) -> str | None:
    """The dtype vLLM computed in: that of the first file's hidden_states (its KV cache holds the model's dtype)."""
    from safetensors import safe_open

    try:
        with safe_open(str(files[0]), framework="pt") as h:
            st = h.get_slice("hidden_states").get_dtype()
    except Exception:  # noqa: BLE001 - an unreadable file is reported by the import loop, naming it
        return None
    return {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(st, st.lower())


def _source_files(src: str | None) -> tuple[Path, list[Path]]:
    """--src and the safetensors files in it (sorted, hidden ones skipped), after refusing pickle-based files."""
    if not src:
        raise HstapError("--src: required with --engine vllm-import (the directory vLLM wrote its hidden states to)")
    src = Path(src)
    if not src.is_dir():
        raise HstapError(f"--src {src}: not a directory")
    refuse_pickles(src)
    files = sorted(p for p in src.rglob("*.safetensors") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise HstapError(f"--src {src}: no .safetensors files")
    return src, files


class _Rows:
    """Which prepared row a vLLM file holds: `hs_{i}.safetensors` is row i (speculators' naming), any other name is
    found by its token ids. Each row comes from one file at most (`used`: row -> file)."""

    def __init__(self, ds, n: int, data: str):
        self.ds, self.n, self.data = ds, n, data
        self.ids = [str(x) for x in ds.select_columns(["id"])[:n]["id"]]
        self.by_tokens: dict[tuple, list[int]] = {}  # built on the first file not named hs_{row} (needs every row's tokens)
        self.used: dict[int, Path] = {}

    def row_of(self, f: Path, tok: torch.Tensor) -> int | None:
        """The row of file `f`, whose token_ids are `tok` (T,); None when its name is a row beyond --max-samples."""
        m = _HS_NAME.match(f.name)
        if m:
            row = int(m.group(1))
            if row >= len(self.ds):
                raise HstapError(f"{f}: names row {row}, the prepared set has {len(self.ds)} rows")
            if row >= self.n:
                return None
            want = self.ds[row]["input_ids"]
            if _token_key(tok) != _token_key(want):
                raise HstapError(f"{f}: token_ids ({tok.numel()} tokens) differ from prepared row {row} "
                                 f"(id {short_id(self.ids[row])}, {len(want)} tokens): another prepared set, or "
                                 "include_output_tokens?")
        else:
            if not self.by_tokens:
                for i, t in enumerate(self.ds.select_columns(["input_ids"])[:self.n]["input_ids"]):
                    self.by_tokens.setdefault(_token_key(t), []).append(i)
            cands = [r for r in self.by_tokens.get(_token_key(tok), []) if r not in self.used]
            if not cands:
                raise HstapError(f"{f}: its token_ids ({tok.numel()} tokens) match no sample of {self.data} "
                                 "(another prepared set, or include_output_tokens?)")
            row = cands[0]
        if row in self.used:
            raise HstapError(f"{f}: row {row} was already imported from {self.used[row]}")
        self.used[row] = f
        return row


def _sample_states(f: Path, hs: torch.Tensor, T: int, vids: list[int], H: int, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden_states (T, L, H) of file `f` (T tokens) -> (aux (T, K, H) as stored, final (T, H) = the final norm of the
    last slot)."""
    if hs.dim() != 3 or tuple(hs.shape) != (T, len(vids), H):
        raise HstapError(f"{f}: hidden_states has shape {tuple(hs.shape)}, expected ({T}, {len(vids)}, {H}) "
                         f"for --vllm-layers {','.join(map(str, vids))} and hidden size {H}")
    if not torch.isfinite(hs).all():
        raise HstapError(f"{f}: hidden_states contain NaN/Inf")
    final = rms_norm(hs[:, -1], weight, eps)  # (T, H), in hs's dtype
    return hs[:, :-1], final  # (T, K, H), (T, H)
