"""Our capture folder -> speculators' offline training input (run in our environment by tools/bench/peers.py).

Writes PREP/: hidden_states/hs_{i}.safetensors ({"hidden_states": [T, 4, H], "token_ids": [T]}: the three aux
states in our capture order, then the last layer's state), rows.jsonl (input_ids, loss_mask per row; the
dataset itself is built inside speculators' environment by tools/bench/peer_envs/speculators_train.py), d2t.npy and
t2d.npy (our draft vocabulary, EAGLE's offsets convention, which speculators shares) and meta.json.

The last state: speculators expects it *before* the target's final norm and applies that norm itself
(`verifier_norm`, loaded from the target); our shards hold it after the norm, y = w * x / rms(x). We write
x' = y / w, whose RMS is 1, so the target's own norm maps it back to y (to within its eps): no second
capture, and the peer computes exactly our target distribution. A final norm weight with a zero has no
such inverse and is refused.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.codec import from_bytes
from pipeline.shards import read_manifest
from pipeline.vocab import load_draft_vocab
from trainer.data import shard_files, val_rows

FORMAT = "speculators-offline-1"


def final_norm_weight(target: Path) -> torch.Tensor:
    for f in sorted(Path(target).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if "model.norm.weight" in st.keys():
                return st.get_tensor("model.norm.weight").float()
    raise ValueError(f"{target}: no model.norm.weight (the final norm speculators applies to the last state)")


def training_rows(capture: Path, n_val: int, held_out: bool = False):
    """Our trainer's training rows of a capture, in shard order: every row but the held-out last n_val
    (held_out: those n_val rows instead)."""
    files = shard_files(capture)
    held = set(val_rows(files, n_val)["id"].to_pylist()) if n_val else set()
    for f in files:
        for row in pq.read_table(f).to_pylist():
            if (row["id"] in held) == held_out:
                yield row


def training_tokens(capture: Path, n_val: int) -> int:
    return sum(len(r["input_ids"]) for r in training_rows(capture, n_val))


def write(capture: Path, target: Path, out: Path, n_val: int) -> Path:
    """-> out, written once per (capture, held-out count); a finished folder is reused. Our training rows
    come first, then our held-out rows: speculators splits by a ratio (train_ratio below) and needs a
    validation split, so its validation rows are ours."""
    if n_val < 1:
        raise ValueError("speculators needs a validation split: hold out at least one row (data.val_rows)")
    man = read_manifest(capture)
    sig = man.get("signature", man)
    key = {"format": FORMAT, "capture": str(Path(capture).resolve()), "rows": man["rows"], "n_val": n_val}
    meta_path = out / "meta.json"
    if meta_path.is_file() and {k: v for k, v in json.loads(meta_path.read_text()).items() if k in key} == key:
        return out
    h, dtype = sig["hidden_size"], sig["dtype"]
    w = final_norm_weight(target)
    if bool((w == 0).any()):
        raise ValueError(f"{target}: model.norm.weight has zeros: the post-norm state cannot be inverted")
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    n = 0
    rows = [*training_rows(capture, n_val), *training_rows(capture, n_val, held_out=True)]
    with (out / "rows.jsonl").open("w") as rows_out:
        for i, row in enumerate(rows):
            aux = from_bytes(row["aux_hidden"], dtype, 3 * h, groups=3).float().view(-1, 3, h)
            last = from_bytes(row["last_hidden"], dtype, h).float() / w
            ids = torch.tensor(row["input_ids"], dtype=torch.long)
            save_file({"hidden_states": torch.cat([aux, last[:, None]], dim=1).contiguous(),
                       "token_ids": ids}, str(out / "hidden_states" / f"hs_{i}.safetensors"))
            rows_out.write(json.dumps({"input_ids": row["input_ids"], "loss_mask": row["loss_mask"]}) + "\n")
            n += 1
    d2t, t2d = load_draft_vocab(capture)
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    meta_path.write_text(json.dumps(key | {"written_rows": n, "train_rows": n - n_val, "draft_vocab_size": len(d2t),
                                           "aux_layer_ids": sig["aux_layer_ids"]}, indent=2))
    return out


def train_ratio(prep: Path) -> float:
    """speculators' --train-data-ratio that puts exactly our training rows in its training split."""
    meta = json.loads((prep / "meta.json").read_text())
    return (meta["train_rows"] + 0.5) / meta["written_rows"]


def draft_vocab_size(prep: Path) -> int:
    return json.loads((prep / "meta.json").read_text())["draft_vocab_size"]


def vllm_layer_ids(prep: Path) -> list[int]:
    """Our aux ids (outputs of layers) in speculators' and vLLM's numbering (inputs of layers): + 1."""
    return [j + 1 for j in json.loads((prep / "meta.json").read_text())["aux_layer_ids"]]
