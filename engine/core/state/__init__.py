"""Durable sequences (`--state-dir`): persistent sequences and their KV cells on disk.

- `records`: what a sequence's truth is on disk (one JSON document per sequence) and how it is checked.
- `sequence_files`: those documents, one file each, replaced atomically (write, fsync, rename).
- `cell_files`: KV cells as content-addressed safetensors chunks, shared by every sequence whose tokens
  share the prefix (a fork family's common cells are stored once), with the model's identity in each header.
- `identity`: that identity (a fingerprint of the weights and config, the dtype, the KV layout).
- `store`: `DurableStore`, what `SequenceTable` (engine/core/persistent.py) calls: write, forget, save,
  restore, and the byte budget.
- `archive`: one sequence or a whole family as one portable safetensors file (export, import).
"""
