"""SpecForge's runs in tools/bench/peers.py (run in our environment; the training itself runs in
.peers/specforge through tools/bench/peer_envs/specforge_train.py, on the folder tools/bench/peer_envs/speculators_prep.py wrote).

Budgets: SpecForge trains one row a step (`batch_size` 1 without packing), so `accumulation_steps` is our
run's rows per optimizer step, and both take about as many optimizer steps over the same rows and epochs.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PYTHON = ROOT / ".peers" / "specforge" / "bin" / "python"


def runs(ours_cfg, rows_per_step: int, epochs: int, seed: int | None) -> dict[str, list[str]]:
    """SpecForge's defaults (TTT 7, lr 1e-4, no decay across TTT steps) and the same trainer aligned to ours
    where it takes the setting (TTT length, the per-step decay, the learning rate)."""
    common = [f"training.num_epochs={epochs}", "training.batch_size=1", f"training.accumulation_steps={rows_per_step}"]
    if seed is not None:
        common.append(f"training.seed={seed}")
    aligned = [f"training.ttt_length={ours_cfg.model.ttt_length}", f"training.kl_decay={ours_cfg.model.decay}",
               f"training.learning_rate={ours_cfg.optim.lr}"]
    return {"specforge": common, "specforge_aligned": common + aligned}


def rows_per_step(ours: dict, prep: Path, epochs: int) -> int:
    """Our run's rows per optimizer step (its steps over the same rows and epochs)."""
    rows = json.loads((prep / "meta.json").read_text())["train_rows"]
    return max(1, round(rows * epochs / ours["steps"])) if ours.get("steps") else 1


def train(name: str, overrides: list[str], prep: Path, target: Path, out: Path, run) -> dict:
    """One SpecForge run through `run(cmd, log) -> (rc, seconds, peak_rss_mb)` -> a bench entry."""
    save = out / name
    ttt = next((int(o.split("=")[1]) for o in overrides if o.startswith("training.ttt_length=")), 7)
    rows = next((int(o.split("=")[1]) for o in overrides if o.startswith("training.accumulation_steps=")), 1)
    entry = {"kind": "specforge", "overrides": overrides, "head": None, "ttt_steps": ttt, "rows_per_step": rows}
    if not PYTHON.is_file():
        return entry | {"status": "failed: no .peers/specforge (run `make peers`)"}
    cmd = [str(PYTHON), str(ROOT / "tools/bench/peer_envs/specforge_train.py"), str(prep), str(save), str(target), *overrides]
    rc, secs, rss = run(cmd, out / f"{name}.log")
    entry |= {"train_s": round(secs, 1), "peak_rss_mb": round(rss)}
    if (save / "timing.json").is_file():  # the training call: model set-up and the epochs
        entry["loop_s"] = json.loads((save / "timing.json").read_text())["train_call_s"]
    if rc != 0 or not (save / "head" / "config.json").is_file():
        lines = [ln for ln in (out / f"{name}.log").read_text(errors="replace").splitlines() if ln.strip()]
        return entry | {"status": f"failed: {' | '.join(lines[-3:])[-600:]}"}
    return entry | {"status": "ok", "head": str(save / "head")}
