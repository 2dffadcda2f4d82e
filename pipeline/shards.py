"""Hidden-state shard format (ARCHITECTURE.md §3): schema, deterministic names, signature, manifest, readers.

Shared by the capture stage (writer) and the trainer (reader), so both agree on every field. A shard
folder is a path or a URI (pipeline/storage.py).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage

SHARD_SCHEMA = pa.schema([
    ("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
    ("aux_hidden", pa.binary()), ("last_hidden", pa.binary())])
META_KEY = b"eagleray"
MANIFEST = "manifest.json"
# Fields that must agree between shards of one run, and with the target a trainer uses.
SIGNATURE_FIELDS = ("target_config_sha256", "target_weights_id", "hidden_size", "num_layers", "aux_layer_ids",
                    "dtype", "max_length", "chat_template_sha256", "vocab_size")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


def shard_ranges(n_rows: int, rows_per_shard: int) -> list[tuple[int, int, int]]:
    """Deterministic split of the token table into (index, start, end) row ranges."""
    return [(i, s, min(s + rows_per_shard, n_rows)) for i, s in enumerate(range(0, n_rows, rows_per_shard))]


def rows_digest(ids: list[str], lengths: list[int]) -> str:
    h = hashlib.sha256()
    for rid, n in zip(ids, lengths):
        h.update(f"{rid}\t{n}\n".encode())
    return h.hexdigest()[:32]


def data_signature(spec, aux_layer_ids: list[int], dtype: str, max_length: int) -> dict:
    """What every shard of a run and the trainer's target must agree on: the target's identity
    (`TargetSpec.identity`) plus how its states were captured."""
    return spec.identity() | {"aux_layer_ids": list(aux_layer_ids), "dtype": dtype, "max_length": max_length}


def first_mismatch(found: dict, expected: dict) -> str | None:
    """The first signature field `expected` names whose value `found` does not share, or None."""
    return next((k for k in SIGNATURE_FIELDS if k in expected and found.get(k) != expected[k]), None)


def signature_mismatch(found: dict, expected: dict) -> str | None:
    """The first signature field that differs, worded for the user, or None."""
    k = first_mismatch(found, expected)
    return None if k is None else f"{k}: shards have {found.get(k)!r}, expected {expected[k]!r}"


def shard_meta(loc) -> dict:
    md = storage.parquet_file(loc).schema_arrow.metadata or {}
    return json.loads(md.get(META_KEY, b"{}"))


def write_shard(table: pa.Table, final, meta: dict, compression_level: int = 3) -> int:
    """A shard file that exists is complete: written locally under a temp name, fsynced and renamed; to
    an object store in one upload (an object appears whole or not at all). `final`: a path or URI. -> bytes."""
    table = table.cast(SHARD_SCHEMA).replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
    opts = dict(compression="zstd", compression_level=compression_level, use_dictionary=False,
                write_statistics=False, row_group_size=16)
    if storage.is_uri(final):  # a multipart upload: the object exists once the writer closes
        fs, path = storage.filesystem(final)
        pq.write_table(table, path, filesystem=fs, **opts)
        return storage.size(final)
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp")
    pq.write_table(table, tmp, **opts)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(final)
    return final.stat().st_size


def read_manifest(shard_dir) -> dict:
    """The manifest of a capture folder (a path or URI)."""
    loc = storage.join(shard_dir, MANIFEST)
    if not storage.is_file(loc):
        raise FileNotFoundError(f"{storage.redact(shard_dir)}: no {MANIFEST}; is this a capture output folder?")
    return json.loads(storage.read_text(loc))


def drop_ids(batch: pa.Table, ids: list[str]) -> pa.Table:
    """Ray Data UDF: the rows of `batch` whose id is not in `ids` (the trainer's held-out rows). It lives
    here, where imports are light: each Ray task process that runs it imports its module, and the trainer's
    data module imports torch (~6 s a process on 2 cores, paid before the first training batch)."""
    import pyarrow.compute as pc

    return batch.filter(pc.invert(pc.is_in(batch["id"], value_set=pa.array(ids, pa.string()))))


def join_captures(first, second, out) -> dict:
    """One capture folder `out` holding the shards of `first`, then `second`'s (renamed in that order), with
    `second`'s draft vocabulary, which must cover both (an on-policy round's capture: its vocab stage
    counts the offline tokens too) -> its manifest. Refuses, naming the field, captures whose signatures
    differ. A trainer reading `out` sees the rows of both, its held-out rows the last of `second`'s."""
    from pipeline.vocab import VOCAB_FILE

    a, b = read_manifest(first), read_manifest(second)
    why = signature_mismatch(a, {k: b[k] for k in SIGNATURE_FIELDS if k in b})
    if why:
        raise ValueError(f"join_captures: {storage.redact(first)}: {why} ({storage.redact(second)}'s)")
    shards = []
    for src, entries in ((first, a["shards"]), (second, b["shards"])):
        for s in entries:
            name = shard_name(len(shards))
            storage.write_bytes(storage.join(out, name), storage.read_bytes(storage.join(src, s["file"])))
            shards.append(dict(s, file=name))
    for f in (VOCAB_FILE, "vocab_stats.json"):
        if storage.is_file(storage.join(second, f)):
            storage.write_bytes(storage.join(out, f), storage.read_bytes(storage.join(second, f)))
    manifest = dict(b, shards=shards, **{k: a[k] + b[k] for k in ("rows", "tokens", "bytes", "raw_hidden_bytes")
                                         if k in a and k in b}, joined=[str(first), str(second)])
    storage.write_text(storage.join(out, MANIFEST), json.dumps(manifest, indent=2))
    return manifest
