"""Model code, single-device PyTorch with no I/O, no ranks and no logging.

`target.py` is the target LLM with forward hooks on the tapped decoder layers; `drafter.py` the EAGLE-3 drafter (SGLang's
`LlamaForCausalLMEagle3` layout, deeper for vLLM) and its KV cache. `lean_target.py` and `lean_drafter.py` are their
decode-time kernels: fused GEMMs, table rotary, few-row products as reductions (same math); the drafter has one forward
whose kernels are a strategy (`ModuleKernels`, lean_drafter's `FusedKernels`); lean_target's is the one
Llama-family layer forward over a pluggable KV cache (`cache.update(k, v, layer)`), which the fast decoder runs over a
static cache and `slots.py` over per-row KV slots (rows of their own lengths advanced together: generate's continuous
batching). `rotary.py` is RoPE for all of them: the rotation, the drafter's rotary module, cos/sin tables. `widen.py`
widens a target and its drafter function-preservingly (the small target's behaviour at a big one's cost).
`compiled.py` is the torch.compile machinery of training (the drafter's flex_attention, TTT's compiled regions): a
recompile budget per region, compile failures told apart.
"""
