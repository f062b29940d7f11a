"""hstap — hidden-state tap: capture a serving engine's hidden states and train EAGLE-3 drafters on them.

The stages are packages, in pipeline order: `data` (conversations in, the target's own answers out: `hstap data`,
`prepare`, `generate`, `serve`), `capture` (the target's states from inside an engine, into a store), `store` (the
crash-safe shard store), `train` (EAGLE-3 with training-time test), `export` (the formats SGLang and vLLM load),
`speculative` (lossless speculative decoding and `hstap eval`), `verify` (whether stored states are the engine's
numbers), `serve_loop` (train as you serve), `demo` (the whole pipeline on a toy target). Below them: `models`
(single-device model code), `artifacts` (the directories hstap reads and writes: model, tokenizer, drafter, run
records), `engines` (vLLM and SGLang as hstap starts them). At the root: `cli` (the `hstap` command), `config` (what
every stage config shares), `common` (one-line errors, atomic writes, hashing, run metadata), `layers` (layer-id
conventions), `batching`, `dist` (torchrun, DDP/FSDP2), `console`, `plots`, `convert` (`hstap convert`: GGUF -> HF).
Each package's docstring says which module holds what."""

__version__ = "0.1.0"
