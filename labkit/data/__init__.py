"""The data path: binaries and text to verified token shards, and MLM batches from them.

- ``labkit.data.corpus``: functions disassembled from ELF files, one document each;
  ``labkit.data.sources``: text, JSONL and Parquet sources; ``labkit.data.documents``: their
  common table;
- ``labkit.data.clean``, ``labkit.data.dedup``, ``labkit.data.partitioned``: filters, exact and
  near (MinHash LSH) deduplication, over engines;
- ``labkit.data.tokenize`` and ``labkit.data.instructions``: the tokenizers;
- ``labkit.data.balance``, ``labkit.data.pack``, ``labkit.data.heldout``, ``labkit.data.shards``:
  per-source balance, packing, the held-out split and the shard format (``index.json``);
- ``labkit.data.stage``: shards copied to node-local disk and verified;
- ``labkit.data.mlm``: dataset, rank sampler, masking collator and DataLoader;
- ``labkit.data.prepared``: what a prepared work directory holds.
"""
