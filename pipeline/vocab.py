"""Stage 5, draft vocabulary (ARCHITECTURE.md §3): d2t / t2d from loss-masked token frequencies."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import ray
import torch
from safetensors.torch import load_file, save_file

from pipeline import storage
from pipeline.config import Vocab
from pipeline.target import TargetSpec

VOCAB_FILE = "draft_vocab.safetensors"


def build_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure: counts over the full target vocab -> (d2t int64 [draft], t2d bool [vocab]).

    `used` = the draft_vocab_size most frequent ids (ties: lower id first), sorted ascending, padded with
    the lowest unseen ids when fewer appear. target_id = draft_id + d2t[draft_id].
    """
    vocab = len(counts)
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"vocab.draft_vocab_size={draft_vocab_size} must be in 1..{vocab} (target vocab)")
    order = np.lexsort((np.arange(vocab), -counts.astype(np.int64)))  # by count desc, then id asc
    seen = order[counts[order] > 0][:draft_vocab_size]
    if len(seen) < draft_vocab_size:
        unseen = np.setdiff1d(np.arange(vocab), seen)[: draft_vocab_size - len(seen)]
        seen = np.concatenate([seen, unseen])
    used = np.sort(seen)
    d2t = torch.from_numpy(used - np.arange(draft_vocab_size)).to(torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.from_numpy(used)] = True
    return d2t, t2d


def _count_batch(batch: dict, vocab: int) -> dict:
    counts = np.zeros(vocab, dtype=np.int64)
    for ids, mask in zip(batch["input_ids"], batch["loss_mask"]):
        ids = np.asarray(ids)
        counts += np.bincount(ids[np.asarray(mask, dtype=bool)], minlength=vocab)[:vocab]
    return {"counts": [counts]}


def masked_token_counts(tokens_path, vocab: int) -> np.ndarray:
    """`tokens_path` a path or URI: Ray Data's read tasks, on any node, read it there."""
    fs, path = storage.filesystem(tokens_path)
    ds = ray.data.read_parquet(path, filesystem=fs).select_columns(["input_ids", "loss_mask"])
    parts = ds.map_batches(_count_batch, batch_format="numpy", fn_kwargs={"vocab": vocab}).take_all()
    return np.sum([np.asarray(p["counts"]) for p in parts], axis=0) if parts else np.zeros(vocab, np.int64)


def run_vocab(cfg: Vocab, target: Path, tokens_path, out_dir: Path) -> dict:
    """The draft vocabulary: the `cfg.draft_vocab_size` most frequent loss-masked tokens."""
    vocab_size = TargetSpec.read(target).vocab_size
    counts = masked_token_counts(tokens_path, vocab_size)
    for i, extra in enumerate(cfg.include):  # a flywheel round: the old corpus's tokens keep their place
        storage.check(f"vocab.include.{i}", extra, must_exist=True)
        counts = counts + masked_token_counts(extra, vocab_size)
    size = min(cfg.draft_vocab_size, vocab_size)
    d2t, t2d = build_draft_vocab(counts, size)
    covered = int(counts[t2d.numpy()].sum())
    stats = {"draft_vocab_size": size, "target_vocab_size": vocab_size, "masked_tokens": int(counts.sum()),
             "distinct_masked_tokens": int((counts > 0).sum()),
             "coverage": round(covered / max(1, int(counts.sum())), 6)}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({"d2t": d2t, "t2d": t2d}, str(out_dir / VOCAB_FILE),
              metadata={k: str(v) for k, v in stats.items()})
    (out_dir / "vocab_stats.json").write_text(json.dumps(stats, indent=2))
    return stats


def load_draft_vocab(shard_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    t = load_file(str(Path(shard_dir) / VOCAB_FILE))
    return t["d2t"], t["t2d"]
