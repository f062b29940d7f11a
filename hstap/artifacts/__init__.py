"""The directories and files hstap reads and writes beside its store: what they hold and who wrote them.

`model_dir.py` reads a HF target model directory (config, tokenizer and chat template with their hashes, the target
model, its embedding and lm_head, the weights fingerprint a store header records; a multimodal wrapper's language
model); `tiktoken_dir.py` reads a tiktoken-format tokenizer (Kimi-K2's) as a fast tokenizer without running its remote
code; `drafter_dir.py` is the hstap drafter directory train writes and eval, export and serve-loop read; `vocab_map.py`
is the draft vocabulary map (prepare builds it, capture copies it into a store, train resolves it, a drafter carries it,
export checks it); `quantization.py` reads what a checkpoint's `quantization_config` says (INT4 pack-quantized, block
FP8) and refuses any other; `outputs.py` says which stage wrote an output directory, so that `--overwrite` replaces only
what that stage wrote.
"""
