"""Render-mode loss masks on real chat-template shapes (inline Jinja, written for these tests after the
families' published templates; no downloads): every answer and its end-of-turn token is in the mask,
nothing else, on multi-turn conversations, including templates that are not prefix-preserving."""
import copy

import pytest

from pipeline.tokenize import mask_by_render

LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
          " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QWEN25 = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba "
          "Cloud. You are a helpful assistant.<|im_end|>\\n' }}{% endif %}" + CHATML)
# Qwen3: the last assistant turn carries an (empty) think block, earlier ones do not; thinking can be
# switched off in the generation prompt.
QWEN3 = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% set c = m['content'].split('</think>')[-1]"
         ".lstrip('\\n') %}{% if loop.last %}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + c + "
         "'<|im_end|>\\n' }}{% else %}{{ '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' }}{% endif %}"
         "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is "
         "defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")
# DeepSeek-R1 distill: history answers lose their reasoning, the generation prompt opens a think block.
DEEPSEEK_R1 = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
               "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}{% else %}"
               "{{ '<｜Assistant｜>' + m['content'].split('</think>')[-1] + '<｜end▁of▁sentence｜>' }}{% endif %}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
           "' [/INST]' }}{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}{% endif %}"
           "{% endfor %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")

TEMPLATES = {  # name: (template, special tokens, bos, eos, the answer's end-of-turn marker)
    "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>",
               "<|eot_id|>", "<|eot_id|>"),
    "qwen2.5": (QWEN25, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|im_end|>"),
    "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>", "<|im_end|>"),
    "deepseek_r1": (DEEPSEEK_R1, ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"], "<｜begin▁of▁sentence｜>",
                    "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "mistral": (MISTRAL, ["[INST]", "[/INST]"], "<s>", "</s>", "</s>"),
    "gemma": (GEMMA, ["<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<end_of_turn>"),
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|im_end|>"),
}

CONV = [{"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is the capital of Kaloria?"},
        {"role": "assistant", "content": "The capital of Kaloria is Vemar."},
        {"role": "user", "content": "小明有5个苹果，又买了3个。他现在有几个？"},
        {"role": "assistant", "content": "小明现在有8个苹果。"},
        {"role": "user", "content": "Repeat your first answer."},
        {"role": "assistant", "content": "The capital of Kaloria is Vemar."}]


@pytest.fixture(scope="module")
def base_tok(tiny_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


def make_tok(base, name):
    template, specials, bos, eos, _ = TEMPLATES[name]
    tok = copy.deepcopy(base)
    extra = {"additional_special_tokens": specials}
    if bos:
        extra["bos_token"] = bos
    extra["eos_token"] = eos
    tok.add_special_tokens(extra)
    tok.chat_template = template
    return tok


def masked_spans(tok, ids, mask) -> list[str]:
    spans, cur = [], []
    for t, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    return spans


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_mask_is_each_answer_and_its_end_token(base_tok, name):
    tok = make_tok(base_tok, name)
    conv = [m for m in CONV if name not in ("mistral", "deepseek_r1") or m["role"] != "system"]
    ids, mask = mask_by_render(tok, conv)
    end = TEMPLATES[name][4]
    want = [m["content"] + end for m in conv if m["role"] == "assistant"]
    got = masked_spans(tok, ids, mask)  # a first token may carry the separator's space (" The")
    assert [g.lstrip(" ") for g in got] == want, got


def test_reasoning_in_history_is_not_learned(base_tok):
    """DeepSeek-R1 drops a history answer's reasoning from the render: the mask covers what is rendered,
    the visible answer + end token, and nothing of the user turns around it."""
    tok = make_tok(base_tok, "deepseek_r1")
    conv = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
            {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "It is 6."}]
    ids, mask = mask_by_render(tok, conv)
    assert masked_spans(tok, ids, mask) == ["It is 4.<｜end▁of▁sentence｜>", "It is 6.<｜end▁of▁sentence｜>"]


def test_qwen3_multi_turn_with_thinking_off(base_tok):
    """Qwen3 with enable_thinking=False: its empty think block sits only on the last turn, so prefix
    renders disagree; every multi-turn record used to be rejected. Now each answer is found."""
    tok = make_tok(base_tok, "qwen3")
    ids, mask = mask_by_render(tok, CONV, enable_thinking=False)
    assert masked_spans(tok, ids, mask) == [m["content"] + "<|im_end|>" for m in CONV if m["role"] == "assistant"]
    assert "<think>" not in "".join(masked_spans(tok, ids, mask))


def test_answer_missing_from_render_is_an_error(base_tok):
    tok = make_tok(base_tok, "chatml")
    tok.chat_template = CHATML.replace("m['content']", "m['content'][:3]")
    with pytest.raises(ValueError, match="assistant turn 2 not found"):
        mask_by_render(tok, CONV)
