"""The CPU fast path is picked in one place (infer/cpu/__init__.py) and named in one start-up line, and the
decode setting `cpu_path: generic` forces the generic path (the HF forward, the head's own modules) with
the same greedy tokens as the path `auto` picks."""
from __future__ import annotations

import logging

import pydantic
import pytest
import torch
import transformers as T

from infer.cpu.packed import packing_unsupported
from infer.generate import EagleGenerator, SpecSettings, TreeShape
from infer.tree import Candidates, finalize
from pipeline.target import default_aux_layers
from trainer.head import Eagle3Head, head_config_from_target

VOCAB = 320
BF16 = packing_unsupported(torch.zeros(1, dtype=torch.bfloat16)) is None
SHAPES = (dict(mode="tree", top_k=3, depth=4, total_tokens=10), dict(mode="chain", depth=3))


def tiny_llama(dtype: torch.dtype) -> T.PreTrainedModel:
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=256)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # peaked, tie-free next-token distributions
        for p in model.parameters():
            p.mul_(3.0) if p.dim() == 2 else None
    return model.to(dtype)


def generator(model, cpu_path: str, caplog) -> tuple[EagleGenerator, list[str]]:
    """The generator and the lines the project logged while building it."""
    torch.manual_seed(1)
    head = Eagle3Head(head_config_from_target(model.config, VOCAB))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        gen = EagleGenerator(model, None, head, default_aux_layers(4), cpu_path=cpu_path)
    gen.eos = set()
    ours = ("infer", "pipeline", "trainer")
    lines = [r.getMessage() for r in caplog.records if r.name.split(".")[0] in ours]
    return gen, lines


def decode(gen: EagleGenerator, cpu_path: str) -> list[list[int]]:
    out = []
    for seed in range(2):
        ids = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(10 + seed)).tolist()
        for shape in SHAPES:
            out.append(gen.generate(ids, SpecSettings(**shape, max_new_tokens=20, cpu_path=cpu_path)).tokens)
    return out


def hf_greedy(model) -> list[list[int]]:
    out = []
    for seed in range(2):
        ids = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(10 + seed))
        with torch.no_grad():
            want = model.generate(ids[None], attention_mask=torch.ones(1, 24, dtype=torch.long),
                                  max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
        out += [want[0, 24:].tolist()] * len(SHAPES)
    return out


def test_auto_and_generic_give_the_same_tokens_and_one_line_names_each(caplog):
    """fp32: `auto` takes the lean target on a Llama (the head stays generic: only bf16 is packed), and
    `generic` the HF forward; both decode HF generate's greedy tokens."""
    model = tiny_llama(torch.float32)
    fast, fast_lines = generator(model, "auto", caplog)
    assert fast.target.lean is not None and fast.target.path.name == "lean"
    assert "bf16" in fast.target.path.reason  # why not lean+packed
    assert fast_lines == [fast.path_line] and fast.path_line.startswith("cpu path: target lean (")
    plain, plain_lines = generator(model, "generic", caplog)
    assert plain.target.lean is None and plain.target.tap is not None and plain.draft.head is not None
    assert plain_lines == ["cpu path: target generic (cpu_path: generic); draft generic (cpu_path: generic)"]
    want = hf_greedy(model)
    assert decode(fast, "auto") == want
    assert decode(plain, "generic") == want


def oracle_draft(gen: EagleGenerator, ref: list[int]) -> None:
    """The draft proposes a wrong token, then the reference continuation beside it as a chain, so rounds
    accept whole paths that are not the tree's first branch (the verify's rows and the compaction count)."""
    def build_tree(root, hidden, logits, last_pos, top_k, depth, total_tokens, plan=None):
        nxt = ref[last_pos + 2:last_pos + 2 + min(depth, total_tokens - 2)]  # ref[last_pos + 1] is the root
        n = len(nxt)
        cands = Candidates([(nxt[0] + 1) % VOCAB, *nxt], [-1, -1, *range(1, n)],
                           [-0.1 * (i + 1) for i in range(n + 1)], [1, *range(1, n + 1)])
        gen.draft.levels = n
        return finalize(root, cands, list(range(n + 1)))

    gen.draft.build_tree = build_tree


def test_accepted_paths_are_the_same_on_both_paths(caplog):
    model = tiny_llama(torch.float32)
    ids = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model.generate(ids[None], attention_mask=torch.ones(1, 24, dtype=torch.long), max_new_tokens=40,
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    runs = {}
    for cpu_path in ("auto", "generic"):
        gen, _ = generator(model, cpu_path, caplog)
        oracle_draft(gen, ref)
        s = SpecSettings(mode="tree", depth=4, total_tokens=8, max_new_tokens=30, sizing="fixed")
        out = gen.generate(ids.tolist(), s)
        runs[cpu_path] = out.tokens, out.stats.accepted
    assert runs["auto"][0] == runs["generic"][0] == ref[24:54]
    assert runs["auto"][1] == runs["generic"][1] and sum(runs["auto"][1]) >= 20  # whole paths accepted


@pytest.mark.skipif(not BF16, reason="no oneDNN bf16 on this CPU: the packed rungs are not reached")
def test_bf16_auto_climbs_past_packing_and_decodes_hf_greedy(caplog):
    """bf16 where oneDNN packs: the target goes at least to lean+packed, the head at least to packed, one
    line says so, and the tokens are HF generate's (the generic path's masked bf16 verify is not exact,
    so its tokens are only checked to come out)."""
    model = tiny_llama(torch.bfloat16)
    fast, lines = generator(model, "auto", caplog)
    assert fast.target.path.name in ("lean+packed", "lean+scripted", "lean+fused")
    assert fast.draft.path.name in ("packed", "scripted", "fused")
    assert "exact verify" in fast.target.path.reason
    assert lines == [fast.path_line]
    assert f"target {fast.target.path.name} (" in fast.path_line
    assert f"draft {fast.draft.path.name} (" in fast.path_line
    assert decode(fast, "auto") == hf_greedy(model)
    plain, _ = generator(model, "generic", caplog)
    assert plain.target.path.name == "generic" and plain.draft.path.name == "generic"
    assert all(len(t) == 20 for t in decode(plain, "generic"))


def test_other_families_name_why_they_take_the_generic_path(caplog):
    cfg = T.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)
    torch.manual_seed(0)
    gen, lines = generator(T.AutoModelForCausalLM.from_config(cfg).eval(), "auto", caplog)
    assert gen.target.path.name == "generic" and "gemma2" in gen.target.path.reason
    assert lines == [gen.path_line] and lines[0].startswith("cpu path: target generic (model_type 'gemma2'")


def test_cpu_path_is_a_decode_setting_fixed_when_the_model_loads(caplog):
    assert TreeShape().cpu_path == SpecSettings().cpu_path == "auto"
    with pytest.raises(pydantic.ValidationError):
        TreeShape(cpu_path="fast")
    gen, _ = generator(tiny_llama(torch.float32), "auto", caplog)
    with pytest.raises(ValueError, match="cpu_path: generic needs a generator built with it"):
        gen.generate([5, 6, 7], SpecSettings(cpu_path="generic", max_new_tokens=2))
