"""Runs inside speculators' own environment (.peers/speculators, `make peers`), never in ours.

    .peers/speculators/bin/python tools/bench/peer_envs/speculators_train.py PREP_DIR [speculators train flags ...]

PREP_DIR is what tools/bench/peers.py wrote from our shards: rows.jsonl (input_ids, loss_mask per row) and
hidden_states/hs_{i}.safetensors in speculators' offline layout. This builds the `save_to_disk` dataset
speculators' trainer reads (torch format, as its own prepare step leaves it), applies the CPU patches its
trainer needs on a machine without an accelerator, and runs `speculators.train` with the given flags.

The CPU patches (speculators 0.9.0, one process, no torchrun), each for a line that assumes a GPU:
- `torch.accelerator.synchronize()` in its timers raises without an accelerator: a no-op here;
- `.to(local_rank)` moves the model and batches to device index 0, i.e. CUDA: the rank is "cpu" here;
- its trainer's device type falls back on "cuda" when no accelerator is found, which turns
  `torch.autocast` off without a word: set to "cpu".
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def build_dataset(prep: Path) -> Path:
    import torch
    from datasets import Dataset

    out = prep / "dataset"
    if (out / "state.json").is_file():
        return out
    rows = [json.loads(line) for line in (prep / "rows.jsonl").open()]
    ds = Dataset.from_dict({"input_ids": [torch.tensor(r["input_ids"]) for r in rows],
                            "loss_mask": [torch.tensor(r["loss_mask"]) for r in rows],
                            "seq_len": [len(r["input_ids"]) for r in rows]})
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))
    (out / "hidden_states").symlink_to(prep / "hidden_states", target_is_directory=True)
    return out


def patch_for_cpu() -> None:
    import torch

    if torch.accelerator.is_available():
        return
    import speculators.train.trainer as trainer

    torch.accelerator.synchronize = lambda *a, **k: None
    trainer.get_local_rank = lambda: "cpu"
    init = trainer.Trainer.__init__

    def cpu_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = cpu_init


def main() -> None:
    prep = Path(sys.argv[1]).resolve()
    data = build_dataset(prep)
    patch_for_cpu()
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    train_main(TrainConfig.resolve(["--data-path", str(data), *sys.argv[2:]]))


if __name__ == "__main__":
    main()
