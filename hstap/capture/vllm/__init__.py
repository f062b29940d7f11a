"""The vLLM engine: `importer.py` converts files written by vLLM's `extract_hidden_states` (stock vLLM or
speculators) into a store."""
