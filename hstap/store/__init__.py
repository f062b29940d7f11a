"""The hidden-state store: a directory of safetensors shards of captured target states plus a manifest.
`hstap.store.format` is the versioned on-disk format (its docstring is the spec) and what reader and writer share
(constants, fp8 quantization, header checks and the store's identity, manifest and part files, `merge_manifest`, the
file checksum); `hstap.store.reader` reads a store memory-mapped (`open_store`, `Store`) and checks its shards against
their entries (`Store.check`: sizes, checksums; before train reads or capture resumes a store); `hstap.store.writer`
writes one with the commit protocol (`StoreWriter`), each shard file laid out, written and hashed by
`hstap.store.shard_file`; `hstap.store.consumer` records the shards a following trainer consumed (consumer.json) and
the window its writers wait for."""
