"""Export: a trained drafter in the formats the serving engines load.

`stage.py` is `hstap export` (validate, then write one format atomically; the hstap drafter directory it reads is
`hstap.artifacts.drafter_dir`, below both train and export), `config.py` its config (read and checked before torch
loads); `engines.py` the SGLang and vLLM/speculators configs and tensor names, and `load_exported`, which reads any
export back; `fit.py` whether a drafter fits a target (from its JSON, before any weight loads: what eval and export
check first).
"""
