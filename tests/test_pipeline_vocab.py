"""Draft vocabulary (ARCHITECTURE.md §3)."""
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from pipeline.vocab import build_draft_vocab


def test_build_draft_vocab_by_hand():
    counts = np.array([0, 5, 0, 9, 1, 5, 0, 2])
    d2t, t2d = build_draft_vocab(counts, 4)
    used = [1, 3, 5, 7]  # top 4 by count (ties -> lower id), ascending
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [u - i for i, u in enumerate(used)]
    assert t2d.tolist() == [i in used for i in range(8)]
    assert (torch.arange(4) + d2t).tolist() == used


def test_pads_with_lowest_unused_and_identity():
    d2t, t2d = build_draft_vocab(np.array([0, 0, 3, 0, 1]), 4)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 2, 4]
    d2t, t2d = build_draft_vocab(np.array([1, 0, 2]), 3)
    assert d2t.tolist() == [0, 0, 0] and t2d.all()
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(np.zeros(3), 4)


def test_vocab_stage_counts_only_masked_tokens(pipeline_run):
    t = load_file(str(pipeline_run / "capture/draft_vocab.safetensors"))
    tokens = pq.read_table(pipeline_run / "tokenize/tokens.parquet").to_pylist()
    counts = np.zeros(len(t["t2d"]), dtype=np.int64)
    for r in tokens:
        ids = np.array(r["input_ids"])
        counts += np.bincount(ids[np.array(r["loss_mask"], bool)], minlength=len(counts))
    d2t, t2d = build_draft_vocab(counts, 256)
    assert torch.equal(t["d2t"], d2t) and torch.equal(t["t2d"], t2d)
    assert t["d2t"].shape == (256,) and int(t["t2d"].sum()) == 256
