"""Engines that produce hidden states: `hf` (embedded), `sglang` (forward hook in a server), `vllm` (import)."""
