"""`hstap capture`: run the target over a prepared set and store the hidden states an EAGLE-3 drafter trains on.

    hstap capture --target MODEL_DIR --data PREPARED --out STORE             # one GPU (bf16), or the CPU (fp32)
    torchrun --nproc-per-node 8 -m hstap.cli capture --target MODEL_DIR --data PREPARED --out STORE
    hstap capture --target ../shared/reference/target-tiny --data runs/prepared --out runs/store \
        --dtype fp32 --device cpu

What is stored per sample (format: `hstap/store/format.py`): input_ids, loss_mask, `aux` = outputs of the decoder layers
`--layers` (canonical ids, default [1, N//2-1, N-4]) and `final` = the final-norm output, in `--dtype`.

Resumable: a sample is written once its shard commits; killing the run (even with SIGKILL) loses at most the open
shards, and re-running the same command skips every committed sample, once every committed shard is checked against
its recorded size and checksum (a damaged one is refused by name: its samples are not "already captured"). A store made with another target, tokenizer,
layer set or dtype is refused unless `--new` (which wipes it). Data prepared with another tokenizer than the target's
is refused, and so is data rendered with another chat template than the target's (unless --allow-template-mismatch).
The prepared set's draft vocabulary map is copied into the store (STORE/vocab_map.safetensors, its sha256 in the
header), so that `hstap train --store STORE` uses the vocabulary chosen at prepare (--draft-vocab).

Multi-GPU: under torchrun each rank takes samples rank::world_size, runs its own copy of the model on cuda:LOCAL_RANK
and writes its own shards; rank 0 merges the manifest after a barrier (a gloo process group is used only for barriers
and the final counts; torchrun's environment is read by hstap/dist.py). Engines, each owning its capture loop:
`hf` (embedded, capture/hf/), `sglang` (a server with the hstap plugin and hook, capture/sglang/hook.py, driven by
capture/sglang/driver.py), `vllm` (vLLM's own engine with hstap's connector, capture/vllm/connector.py, driven by
capture/vllm/driver.py) and `vllm-import` (convert stock vLLM extract_hidden_states output,
capture/vllm/importer.py). This module is the stage's entry: it reaches each engine by import. The config is
`hstap.capture.config`; what the engines share lives below them and this module, in `hstap.capture.inputs`: the plan
of a run (`resolve`: the data's tokenizer and template against the target's, `hstap.data.fits`; the layers), the store
to resume (`check_out`: made with this run's target, layers and dtype, its committed shards at their recorded sizes and
checksums), the store header and the summary pieces. Everything is checked before the store is created or extended: a
run refused on its inputs leaves --out as it was.
"""

from __future__ import annotations

from hstap.capture.config import CaptureConfig


def capture(cfg: CaptureConfig) -> dict:
    """Capture hidden states into cfg.out; prints and returns a summary (rank 0's has the totals of all ranks). Each
    engine is imported when it runs: the config is checked before torch or any engine is imported."""
    if cfg.engine == "hf":
        from hstap.capture.hf.driver import capture_hf
        return capture_hf(cfg)
    if cfg.engine == "sglang":
        from hstap.capture.sglang.driver import run_sglang_capture
        return run_sglang_capture(cfg)
    if cfg.engine == "vllm":
        from hstap.capture.vllm.driver import run_vllm_capture
        return run_vllm_capture(cfg)
    from hstap.capture.vllm.importer import import_vllm
    return import_vllm(cfg)
