"""Model code, single-device PyTorch with no I/O, no ranks and no logging.

`target.py` is the target LLM with forward hooks on the tapped decoder layers; `drafter.py` the EAGLE-3 drafter (SGLang's
`LlamaForCausalLMEagle3` layout, deeper for vLLM) and its KV cache. `lean_target.py` and `lean_drafter.py` are their
decode-time forms for the fast decoder: fused GEMMs, table rotary, few-row products as reductions (same math).
`slots.py` runs the target over per-row KV slots (rows of their own lengths advanced together: generate's continuous
batching). `widen.py` widens a target and its drafter function-preservingly (the small target's behaviour at a big one's cost).
`compiled.py` is the torch.compile machinery of training (the drafter's flex_attention, TTT's compiled regions): a
recompile budget per region, compile failures told apart.
"""
