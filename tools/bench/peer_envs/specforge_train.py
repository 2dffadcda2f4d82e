"""Runs inside SpecForge's own environment (.peers/specforge, `make peers`), never in ours.

    .peers/specforge/bin/python tools/bench/peer_envs/specforge_train.py PREP_DIR OUT_DIR TARGET [key=value ...]

PREP_DIR is the folder tools/bench/peer_envs/speculators_prep.py wrote from our shards (one neutral copy for every
peer): hidden_states/hs_{i}.safetensors ([T, 4, H]: the three aux states in our capture order, then the
last state divided by the target's final-norm weight), rows.jsonl (input_ids, loss_mask), d2t.npy /
t2d.npy and meta.json. This writes SpecForge's offline input under PREP_DIR/specforge (built here, in the
peer's environment, because its format is pickled `torch.save` records): one `.ckpt` per training row
(`input_ids`, `loss_mask`, `aux_hidden_state` [1, T, 3H], `hidden_state` [1, T, H] *after* the final norm:
the stored state times the norm weight again) and `vocab_mapping.pt` (our draft vocabulary), then a run
config (`run.yaml`: its defaults, CPU settings, then the key=value overrides) and runs `specforge train`
in this process, then `specforge export --to sglang` into OUT_DIR/head. Its export names no aux layers, so
vLLM would take its own default layers: the head's config gets `eagle_aux_hidden_state_layer_ids`, our
capture's layers in vLLM's numbering (ours + 1). OUT_DIR/timing.json: the seconds of the training call.

CPU settings and patches (SpecForge 0.2.0, one process), each for a line that assumes a GPU:
- `training.attention_backend: sdpa` (its default, flex attention, compiles Triton kernels), `fsdp_sharding:
  NO_SHARD`, `TORCHDYNAMO_DISABLE=1` (its reference loss is wrapped in torch.compile);
- `specforge.core.loss` imports Triton at module level for its fused loss: a throwaway `triton` module
  while it imports (a permanent one breaks torch's inductor import), and the fused loss replaced by the
  math of its own reference `_compute_loss` (the same value, without Triton);
- its target lm_head (the teacher's distribution) is cast to bf16 for a GPU: kept in fp32 here, as our
  trainer computes it;
- a one-file target is given to it as a folder of links with a `model.safetensors.index.json` (its
  embedding / lm_head loader resolves tensors through the index).
"""
from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path


def write_features(prep: Path, target: Path) -> Path:
    """PREP/specforge/features/row_{i:06d}.ckpt for our training rows (not the held-out ones) -> that folder."""
    import numpy as np
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = prep / "specforge"
    feats = out / "features"
    meta = json.loads((prep / "meta.json").read_text())
    done = out / "features.done"
    if done.is_file() and done.read_text() == json.dumps(meta, sort_keys=True):
        return out
    feats.mkdir(parents=True, exist_ok=True)
    w = None
    for f in sorted(target.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if "model.norm.weight" in st.keys():
                w = st.get_tensor("model.norm.weight").float()
    rows = [json.loads(line) for line in (prep / "rows.jsonl").open()][: meta["train_rows"]]
    for i, row in enumerate(rows):
        hs = load_file(str(prep / "hidden_states" / f"hs_{i}.safetensors"))["hidden_states"].float()
        t, _, h = hs.shape
        torch.save({"input_ids": torch.tensor(row["input_ids"], dtype=torch.long),
                    "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.long),
                    "aux_hidden_state": hs[:, :3].reshape(1, t, 3 * h).contiguous(),
                    "hidden_state": (hs[:, 3] * w).reshape(1, t, h).contiguous()}, feats / f"row_{i:06d}.ckpt")
    d2t = torch.from_numpy(np.load(prep / "d2t.npy")).long()
    t2d = torch.from_numpy(np.load(prep / "t2d.npy")).bool()
    torch.save({"d2t": d2t, "t2d": t2d}, out / "vocab_mapping.pt")
    done.write_text(json.dumps(meta, sort_keys=True))
    return out


def indexed_target(target: Path, out: Path) -> Path:
    """The target as SpecForge loads it: a folder of links to the target's files, plus the
    `model.safetensors.index.json` its embedding / lm_head loader resolves tensors through when the
    checkpoint is one file without one (the target folder itself is left as it is)."""
    if (target / "model.safetensors.index.json").is_file() or not (target / "model.safetensors").is_file():
        return target
    from safetensors import safe_open

    shadow = out / "target"
    shadow.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        if not (shadow / f.name).exists():
            (shadow / f.name).symlink_to(f.resolve())
    with safe_open(str(target / "model.safetensors"), "pt") as st:
        names = list(st.keys())
    (shadow / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: "model.safetensors" for k in names}}))
    return shadow


def patch_for_cpu() -> None:
    import torch

    if torch.cuda.is_available():
        return
    import torch._dynamo  # noqa: F401 - before the stub: torch's compile machinery probes for a real Triton
    stub = types.ModuleType("triton")
    stub.jit = lambda fn=None, **k: fn if fn is not None else (lambda f: f)
    stub.language = types.ModuleType("triton.language")
    stub.language.constexpr = int
    stub.next_power_of_2 = lambda n: 1 << max(0, (int(n) - 1).bit_length())
    sys.modules["triton"], sys.modules["triton.language"] = stub, stub.language
    try:
        import specforge.core.loss as loss
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]

    def reference_loss(logits, target_p, position_mask):  # SpecForge's _compute_loss, uncompiled
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -torch.sum(position_mask * target_p * logp, -1).mean()

    class LogSoftmaxLoss(torch.autograd.Function):
        @staticmethod
        def apply(logits, target_p, position_mask):
            return reference_loss(logits, target_p, position_mask)

    loss.LogSoftmaxLoss = LogSoftmaxLoss
    from specforge.modeling.target import target_head

    load = target_head.TargetHead.from_pretrained.__func__

    def fp32_head(cls, *args, **kwargs):  # it casts the target's lm_head to bf16; our features are fp32
        return load(cls, *args, **kwargs).float()

    target_head.TargetHead.from_pretrained = classmethod(fp32_head)
    for name in list(sys.modules):
        mod = sys.modules[name]
        if name.startswith("specforge") and mod is not None and getattr(mod, "LogSoftmaxLoss", None) is not None:
            mod.LogSoftmaxLoss = LogSoftmaxLoss


ARCH_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "max_position_embeddings", "rms_norm_eps", "hidden_act", "initializer_range", "attention_bias",
               "head_dim", "rope_theta", "rope_scaling", "bos_token_id", "eos_token_id", "pad_token_id")


def draft_config(target: Path, out: Path, draft_vocab: int) -> Path:
    """SpecForge's one-layer EAGLE-3 draft over the target's shapes with our draft vocabulary (the config
    it generates itself assumes 32,000 draft tokens)."""
    tcfg = json.loads((target / "config.json").read_text())
    cfg = {k: tcfg[k] for k in ARCH_FIELDS if tcfg.get(k) is not None}
    cfg |= {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "tie_word_embeddings": False, "use_cache": True, "draft_vocab_size": draft_vocab}
    cfg.setdefault("pad_token_id", 0)
    path = out / "draft_config.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path


def run_config(prep: Path, out: Path, target: Path, overrides: list[str]) -> Path:
    import yaml

    meta = json.loads((prep / "meta.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model": {"target_model_path": str(target), "vocab_mapping_path": str(prep / "specforge/vocab_mapping.pt"),
                  "draft_model_config": str(draft_config(target, out, meta["draft_vocab_size"])),
                  "aux_hidden_state_layer_ids": meta["aux_layer_ids"], "torch_dtype": "float32",
                  "load_target_embedding": True},
        "data": {"hidden_states_path": str(prep / "specforge/features"), "max_length": 4096,
                 "dataloader_num_workers": 0, "cache_dir": str(out / "cache")},
        "training": {"strategy": "eagle3", "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                     "log_interval": 10},
        "output_dir": str(out), "run_id": "eagleray-bench",
    }
    for kv in overrides:
        key, _, value = kv.partition("=")
        node = cfg
        *path, leaf = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    (out / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out / "run.yaml"


def main() -> None:
    prep, out, target = (Path(a).resolve() for a in sys.argv[1:4])
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("SPECFORGE_DEVICE", "cpu")
    write_features(prep, target)
    config = run_config(prep, out, indexed_target(target, out), sys.argv[4:])
    patch_for_cpu()
    from specforge.cli import main as cli_main

    t0 = time.time()
    rc = cli_main(["train", "--config", str(config)])
    (out / "timing.json").write_text(json.dumps({"train_call_s": round(time.time() - t0, 1)}))
    if rc:
        sys.exit(rc)
    latest = max(out.glob("*-step*"), key=lambda p: int(p.name.rsplit("step", 1)[1]))
    rc = cli_main(["export", "--to", "sglang", "--checkpoint", str(latest), "--draft-config",
                   str(out / "draft_config.json"), "--output-dir", str(out / "head"),
                   "--vocab-mapping", str(prep / "specforge/vocab_mapping.pt")])
    meta = json.loads((prep / "meta.json").read_text())
    head_cfg = json.loads((out / "head/config.json").read_text())
    head_cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in meta["aux_layer_ids"]]
    (out / "head/config.json").write_text(json.dumps(head_cfg, indent=2))
    sys.exit(rc)


if __name__ == "__main__":
    main()
