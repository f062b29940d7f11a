"""Verify: whether stored states are the numbers an engine computes.

`stage.py` is `hstap verify` (store integrity, recompute against the target, layer-offset detection, store against
store) and the quick check train runs before its first step, `config.py` its config (read and checked before torch
loads); `parity.py` the per-layer error metrics of two captures of the same states and the dtype-aware tolerances they
are held to; `twin.py` the target again in the other precision (the bf16 noise floor a bf16 capture is held to);
`routing.py` which tokens of a MoE target a bf16 computation may route to other experts (routing flips, counted
rather than failed); `partial.py` a target too large to load, checked on the layers that fit.
"""
