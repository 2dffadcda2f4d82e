"""The wire protocol alone (no model, no Ray): every field honoured or refused, usage of n choices."""
import pytest
from pydantic import ValidationError

from infer.openai_api import ChatRequest, CompletionRequest, refusal, response_body, summed_usage, \
    validation_error_body

MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return ChatRequest(model="m", messages=MSGS, **kw)


@pytest.mark.parametrize("kw,param", [
    ({"n": 2, "temperature": 0}, "n"), ({"n": 2, "stream": True}, "n"), ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "logprobs"), ({"presence_penalty": 0.1}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
])
def test_known_fields_this_server_cannot_honour_are_refused(kw, param):
    assert refusal(chat(**kw))[0] == param


def test_fields_it_honours_pass():
    for kw in ({}, {"n": 4, "temperature": 0.7}, {"max_completion_tokens": 9}, {"user": "u"},
               {"stream": True, "stream_options": {"include_usage": False}}, {"temperature": 2}):
        assert refusal(chat(**kw)) is None, kw
    assert chat(max_completion_tokens=9).new_tokens() == 9 and chat(max_tokens=3).new_tokens() == 3
    assert refusal(CompletionRequest(model="m", prompt="p", logprobs=2))[0] == "logprobs"
    assert refusal(CompletionRequest(model="m", prompt="p", echo=True))[0] == "echo"


@pytest.mark.parametrize("kw,param,words", [
    ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ({"temperature": 1e9}, "temperature", "temperature: "), ({"n": 0}, "n", "n: "), ({"n": 17}, "n", "n: "),
])
def test_invalid_fields_are_named(kw, param, words):
    with pytest.raises(ValidationError) as e:
        chat(**kw)
    err = validation_error_body(e.value.errors())["error"]
    assert err["param"] == param and err["message"].startswith(words), err


def test_n_choices_count_the_prompt_once_and_pool_tau():
    u = summed_usage([{"prompt_tokens": 5, "completion_tokens": 10, "verify_rounds": 4, "tau": 2.5},
                      {"prompt_tokens": 5, "completion_tokens": 6, "verify_rounds": 2, "tau": 3.0}])
    assert u == {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21, "tau": 2.6667,
                 "verify_rounds": 6}
    body = response_body("id", 0, "m", True, [("a", "stop"), ("b", "length")], u)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == \
        [(0, "a", "stop"), (1, "b", "length")]
