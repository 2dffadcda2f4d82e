"""Demo target: trains a byte-level BPE tokenizer and a small Llama (GQA) on chat corpora, from scratch.

No model hub is reachable here, so the project builds its own target. The result is an ordinary
Hugging Face folder (config.json, model.safetensors, tokenizer files with a chat template whose
`{% generation %}` markers give `return_assistant_tokens_mask`), loadable with the Auto classes.

    python -m infer.demo.target --out runs/demo/target --preset demo --corpus runs/demo/corpus/train.jsonl
    python -m infer.demo.target --out /tmp/t --preset tiny steps=50 lr=2e-3      # dotted overrides

Shows a progress bar, then one line (size, steps, time, loss); writes report.json (parameter count,
train/validation loss, distinct-2 of greedy continuations on held-out prompts) and samples.json.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline.yaml_config import ExistingPath, StrictModel, load_or_exit
from pipeline.formats import load_conversations
from pipeline.target import cpu_has_native_bf16

SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
# The assistant turn's content and its end-of-turn token sit inside {% generation %}, so the mask that
# `return_assistant_tokens_mask` returns is exactly what the draft must learn to predict.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

PRESETS = {
    # ~13M parameters, 16 layers: one draft layer costs about 1/16 of a target step, as for an 8B target.
    "demo": dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=16,
                 num_attention_heads=8, num_key_value_heads=2, seq_len=256, batch_size=16, steps=220,
                 lr=3e-3, max_records=0),
    # The demo's target (`make demo`): the demo preset's 16 layers at a quarter of the width, ~0.95M
    # parameters, so every later stage runs in minutes on a 2-core laptop and its bf16 weights (1.9 MB) ship
    # in data/demo_target/ (`--shipped`): training it takes 2.6 min on an AVX-512 EPYC, ~3x that on AVX2.
    # head_dim 32: vLLM's CPU attention supports no smaller head.
    "demo1m": dict(vocab_size=2048, hidden_size=64, intermediate_size=160, num_hidden_layers=16,
                   num_attention_heads=2, num_key_value_heads=1, seq_len=256, batch_size=16, steps=400,
                   lr=6e-3, max_records=0),
    # A 2-layer model of about a draft head's cost, for HF assisted generation in bench_decode.
    "assistant": dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, seq_len=256, batch_size=16, steps=220,
                      lr=3e-3, max_records=0),
    # Seconds to train; for tests. 8 layers so the aux-layer rule (1, N//2-1, N-4) has distinct layers;
    # head_dim 32 because vLLM's CPU attention supports no smaller head (the interop test runs it there).
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=8,
                 num_attention_heads=2, num_key_value_heads=1, seq_len=128, batch_size=16, steps=120,
                 lr=4e-3, max_records=1500),
}


class TargetRecipe(StrictModel):
    out: Path = Path("runs/demo/target")
    preset: str = "demo"
    corpus: list[ExistingPath] = [Path("runs/demo/corpus/train.jsonl")]
    val_corpus: ExistingPath | None = None
    tokenizer: ExistingPath | None = None  # reuse this folder's tokenizer (an assistant must share the target's)
    seed: int = 0
    vocab_size: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    seq_len: int | None = None
    batch_size: int | None = None
    steps: int | None = None
    lr: float | None = None
    max_records: int | None = None  # 0 = all
    max_minutes: float = 6.0        # hard cap on the training loop; the report says if it was hit
    threads: int = 2
    heldout_prompts: int = 20
    sample_tokens: int = 48

    def resolved(self) -> dict:
        if self.preset not in PRESETS:
            raise SystemExit(f"config error: preset: unknown preset {self.preset!r} (known: {', '.join(PRESETS)})")
        merged = dict(PRESETS[self.preset])
        merged.update({k: v for k, v in self.model_dump().items() if k in merged and v is not None})
        return merged


def recipe_key(rc: TargetRecipe) -> dict:
    """What decides the trained result: the resolved recipe and the corpus files' sizes."""
    return {"resolved": rc.resolved(), "seed": rc.seed, "out": str(rc.out), "tokenizer": str(rc.tokenizer),
            "corpus": {str(p): Path(p).stat().st_size for p in rc.corpus}}


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   chat_template=CHAT_TEMPLATE, model_max_length=2048)


def pack(tokenizer, convs: list[list[dict]], seq_len: int) -> torch.Tensor:
    """Render every conversation with the chat template, concatenate, cut into [n, seq_len] rows."""
    ids: list[int] = []
    for conv in convs:
        ids += tokenizer.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return 0.1 * peak + 0.9 * peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def mixed_precision():
    """bf16 autocast where the CPU computes bf16 natively, else plain fp32 (emulated bf16 is ~100x slower)."""
    import contextlib

    if cpu_has_native_bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def eval_loss(model, rows: torch.Tensor, batch: int) -> float:
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(rows), batch):
        x = rows[i:i + batch]
        with mixed_precision():
            out = model(input_ids=x, labels=x)
        total += out.loss.float().item() * len(x)
        n += len(x)
    model.train()
    return total / max(1, n)


def distinct_2(seqs: list[list[int]]) -> float:
    grams = [tuple(s[i:i + 2]) for s in seqs for i in range(len(s) - 1)]
    return len(set(grams)) / max(1, len(grams))


@torch.no_grad()
def greedy_samples(model, tokenizer, prompts: list[list[dict]], max_new: int) -> list[dict]:
    model.eval()
    out = []
    for conv in prompts:
        ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
        new = gen[0, ids.shape[1]:].tolist()
        out.append({"prompt": conv[-1]["content"], "completion": tokenizer.decode(new, skip_special_tokens=True),
                    "tokens": new})
    return out


def train_target(rc: TargetRecipe) -> dict:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    p = rc.resolved()
    torch.set_num_threads(rc.threads)
    torch.manual_seed(rc.seed)
    rng = random.Random(rc.seed)
    convs: list[list[dict]] = []
    rejects: dict[str, int] = {}
    for path in rc.corpus:
        c, r = load_conversations(path)
        convs += c
        for k, v in r.items():
            rejects[k] = rejects.get(k, 0) + v
    if not convs:
        raise SystemExit(f"no usable conversations in {', '.join(map(str, rc.corpus))} (rejects: {rejects})")
    rng.shuffle(convs)
    if p["max_records"]:
        convs = convs[: p["max_records"]]
    if rc.val_corpus is not None:
        val_convs = load_conversations(rc.val_corpus)[0]
    else:
        n_val = max(rc.heldout_prompts, len(convs) // 50)
        val_convs, convs = convs[:n_val], convs[n_val:]

    t0 = time.time()
    texts = [m["content"] for c in convs for m in c] + ["user", "assistant", "system"]
    if rc.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(rc.tokenizer)
    else:
        tokenizer = build_tokenizer(texts, p["vocab_size"])
    t_tok = time.time() - t0
    train_rows, val_rows = pack(tokenizer, convs, p["seq_len"]), pack(tokenizer, val_convs, p["seq_len"])
    hd = p["hidden_size"] // p["num_attention_heads"]
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_hidden_layers"], num_attention_heads=p["num_attention_heads"],
        num_key_value_heads=p["num_key_value_heads"], head_dim=hd, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(cfg)
    n_params = sum(q.numel() for q in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    steps, bs = p["steps"], p["batch_size"]
    bar = tqdm(total=steps, unit="step", dynamic_ncols=True, mininterval=2,
               desc=f"target {n_params / 1e6:.1f}M params, {cfg.num_hidden_layers} layers")
    first_loss, loss_hist, t_train, hit_cap = None, [], time.time(), False
    order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(rc.seed))
    for step in range(steps):
        idx = order[(torch.arange(bs) + step * bs) % len(order)]
        x = train_rows[idx]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, p["lr"])
        with mixed_precision():
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_hist.append(loss.item())
        first_loss = first_loss if first_loss is not None else loss_hist[0]
        bar.set_postfix(loss=f"{loss_hist[-1]:.3f}", refresh=False)
        bar.update(1)
        if time.time() - t_train > rc.max_minutes * 60:
            hit_cap = True
            break
    bar.close()
    train_s = time.time() - t_train
    val_loss = eval_loss(model, val_rows, bs)

    rc.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    model.save_pretrained(rc.out)
    tokenizer.save_pretrained(rc.out)
    prompts = [c[: next(i for i, m in enumerate(c) if m["role"] == "user") + 1] for c in val_convs]
    samples = greedy_samples(model, tokenizer, prompts[: rc.heldout_prompts], rc.sample_tokens)
    report = {
        "preset": rc.preset, "params": n_params, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
        "vocab": cfg.vocab_size, "train_rows": len(train_rows), "seq_len": p["seq_len"],
        "steps_run": len(loss_hist), "hit_time_cap": hit_cap, "first_loss": round(first_loss, 4),
        "bf16_autocast": cpu_has_native_bf16(),
        "final_train_loss": round(sum(loss_hist[-10:]) / len(loss_hist[-10:]), 4),
        "val_loss": round(val_loss, 4), "distinct2_heldout": round(distinct_2([s["tokens"] for s in samples]), 4),
        "heldout_prompts": len(samples), "tokenizer_s": round(t_tok, 1), "train_s": round(train_s, 1),
        "tokens_per_s": round(len(loss_hist) * bs * p["seq_len"] / train_s), "rejects": rejects,
        "recipe": recipe_key(rc),
    }
    (rc.out / "samples.json").write_text(json.dumps(
        [{k: v for k, v in s.items() if k != "tokens"} for s in samples], ensure_ascii=False, indent=2))
    (rc.out / "report.json").write_text(json.dumps(report, indent=2))
    return report | {"samples": samples[:3]}


SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "report.json", "samples.json")


def copy_beside_weights(src: Path, dest: Path) -> None:
    """The shipped files save_pretrained does not write (tokenizer, template, report, samples), as they are."""
    for name in SHIPPED_FILES:
        if name not in ("config.json", "generation_config.json", "model.safetensors") and (src / name).is_file():
            (dest / name).write_bytes((src / name).read_bytes())


def ship(out: Path, dest: Path) -> None:
    """Write the trained target in `out` to `dest` for the repo: bf16 weights (half the bytes), the rest as is."""
    from transformers import AutoModelForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(torch.bfloat16).save_pretrained(dest)
    copy_beside_weights(out, dest)


def checked_sums(folder: Path) -> None:
    """Refuse a shipped file whose sha256 differs from its line in `folder`/../SHA256SUMS (data/'s one list)."""
    import hashlib

    sums = {}
    for line in (folder.parent / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name.removeprefix("./")] = digest
    for f in sorted(folder.iterdir()):
        key = f"{folder.name}/{f.name}"
        if sums.get(key) != hashlib.sha256(f.read_bytes()).hexdigest():
            raise SystemExit(f"shipped target: {f} does not match its sha256 in {folder.parent / 'SHA256SUMS'}; "
                             "restore it with git, or retrain: make demo-target")


def use_shipped(rc: TargetRecipe, shipped: Path) -> dict | None:
    """The target shipped in `shipped`, written to rc.out in fp32, when it was trained from this recipe and
    corpus; None (train instead) when it was not. -> its report, marked as shipped."""
    report = json.loads((shipped / "report.json").read_text())
    key, want = report["recipe"], recipe_key(rc)
    if (key["resolved"], key["seed"], sorted(key["corpus"].values())) != \
            (want["resolved"], want["seed"], sorted(want["corpus"].values())):
        print(f"target: {shipped} was trained from another recipe or corpus; training one here", flush=True)
        return None
    checked_sums(shipped)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the step's console is its one line

    rc.out.mkdir(parents=True, exist_ok=True)
    AutoModelForCausalLM.from_pretrained(shipped, dtype=torch.float32).save_pretrained(rc.out)  # vLLM's CPU build wants fp32 here
    copy_beside_weights(shipped, rc.out)
    report = report | {"shipped_from": str(shipped), "recipe": want}
    (rc.out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="YAML with TargetRecipe keys (flags and key=value override it)")
    ap.add_argument("--out")
    ap.add_argument("--preset", choices=sorted(PRESETS))
    ap.add_argument("--corpus", nargs="+", help="ShareGPT / UltraChat / question-answer .json or .jsonl files")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--reuse", action="store_true",
                    help="skip training when --out already holds a target built from the same recipe")
    ap.add_argument("--shipped", type=Path,
                    help="a trained target shipped with the repo (data/demo_target): used when it was trained from "
                         "this recipe and corpus and its checksums hold, else the target is trained")
    ap.add_argument("--ship", type=Path, help="after training, also write a bf16 copy to this folder (for data/)")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. steps=100")
    args = ap.parse_args(argv)
    overrides = list(args.overrides)
    for key in ("out", "preset", "seed"):
        if getattr(args, key) is not None:
            overrides.append(f"{key}={getattr(args, key)}")
    if args.corpus:
        overrides.append("corpus=" + json.dumps(args.corpus))
    recipe = load_or_exit(TargetRecipe, args.config, overrides)
    previous = recipe.out / "report.json"
    old = json.loads(previous.read_text()) if previous.is_file() else {}
    if args.reuse and old.get("hit_time_cap"):  # a target cut short (a busy machine) is not the recipe's target
        print(f"retraining {recipe.out}: its previous training stopped at max_minutes after "
              f"{old.get('steps_run')} steps", flush=True)
    report = None
    if args.reuse and old.get("recipe") == recipe_key(recipe) and not old.get("hit_time_cap"):
        report = json.loads(previous.read_text())
        print(f"target: reusing the target in {recipe.out} (same recipe; delete the folder to retrain)")
    elif args.shipped is not None and (args.shipped / "report.json").is_file():
        report = use_shipped(recipe, args.shipped)
    if report is None:
        report = train_target(recipe)
    if args.ship is not None:
        ship(recipe.out, args.ship)
    # Loss, size and time; the sample answers stay in samples.json: a model this small trained this briefly
    # writes fluent text with wrong arithmetic, which on a console reads like a bug.
    how = f"trained by this recipe in {report['train_s']:.0f} s"
    if report.get("shipped_from"):
        how = f"shipped in {report['shipped_from']}/, trained by this recipe in {report['train_s']:.0f} s elsewhere"
    print(f"target: {report['params'] / 1e6:.1f}M params, {report['steps_run']} steps ({how}), "
          f"loss {report['first_loss']:.2f} -> {report['final_train_loss']:.2f} (held-out {report['val_loss']:.2f}); "
          f"{recipe.out}/ (samples.json)", flush=True)
    if report.get("hit_time_cap"):
        print(f"WARNING: training stopped at max_minutes={recipe.max_minutes} after {report['steps_run']} of "
              f"{report.get('recipe', {}).get('resolved', {}).get('steps')} steps (a busy machine?): this target is undertrained; rerun to retrain it, or "
              f"raise max_minutes", flush=True)
    return report


if __name__ == "__main__":
    main()
