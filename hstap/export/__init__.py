"""Export: a trained drafter in the formats the serving engines load.

`stage.py` is `hstap export` (validate, then write one format atomically); `drafter_dir.py` the hstap drafter directory
that train writes and eval and export read (save, load, validate); `engines.py` the SGLang and vLLM/speculators configs
and tensor names, and `load_exported`, which reads any export back; `fit.py` whether a drafter fits a target (from
its JSON, before any weight loads: what eval and export check first).
"""
