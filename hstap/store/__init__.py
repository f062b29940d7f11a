"""The hidden-state store: a directory of safetensors shards of captured target states plus a manifest.
`hstap.store.format` is the versioned on-disk format (its docstring is the spec: layout, tensors, dtypes, manifest,
commit protocol, resume, the end of writing, consumed shards); what reader and writer share lives beside it, a module
per concept: `hstap.store.header` (the header's checks, what a resume compares), `hstap.store.manifest` (manifest and
part files, their union, `merge_manifest`, the end of writing, the directory a store may be created in),
`hstap.store.fp8` (fp8 quantization), `hstap.store.checksum` (the file checksum, the I/O pool). `hstap.store.reader`
reads a store memory-mapped (`open_store`, `Store`) and checks its shards against their entries (`Store.check`: sizes,
checksums; before train reads or capture resumes a store); `hstap.store.writer` writes one with the commit protocol
(`StoreWriter`), each shard file laid out, written and hashed by `hstap.store.shard_file`; `hstap.store.consumer`
records the shards a following trainer consumed (consumer.json) and the window its writers wait for."""
