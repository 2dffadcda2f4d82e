"""The wire protocol alone (no model, no Ray): every field honoured or refused, usage of n choices, the
logprobs shapes."""
import json

import pytest
from pydantic import ValidationError

from infer.openai_api import ChatRequest, CompletionRequest, logprobs_body, logprobs_k, refusal, response_body, \
    sse_chunk, summed_usage, validation_error_body

MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return ChatRequest(model="m", messages=MSGS, **kw)


@pytest.mark.parametrize("kw,param", [
    ({"n": 2, "temperature": 0}, "n"), ({"n": 2, "stream": True}, "n"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"top_logprobs": 0, "logprobs": False}, "top_logprobs"), ({"presence_penalty": 0.1}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
])
def test_known_fields_this_server_cannot_honour_are_refused(kw, param):
    assert refusal(chat(**kw))[0] == param


def test_fields_it_honours_pass():
    for kw in ({}, {"n": 4, "temperature": 0.7}, {"max_completion_tokens": 9}, {"user": "u"},
               {"stream": True, "stream_options": {"include_usage": False}}, {"temperature": 2},
               {"logprobs": True}, {"logprobs": True, "top_logprobs": 20}, {"logprobs": True, "stream": True}):
        assert refusal(chat(**kw)) is None, kw
    assert chat(max_completion_tokens=9).new_tokens() == 9 and chat(max_tokens=3).new_tokens() == 3
    assert refusal(CompletionRequest(model="m", prompt="p", logprobs=2)) is None
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
    body = response_body("id", 0, "m", True, [("a", "stop", None), ("b", "length", None)], u)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == \
        [(0, "a", "stop"), (1, "b", "length")]


def test_logprobs_k_is_the_decoders_alternatives_per_token():
    assert [logprobs_k(chat(**kw)) for kw in ({}, {"logprobs": True}, {"logprobs": True, "top_logprobs": 3})] == \
        [None, 0, 3]
    assert [logprobs_k(CompletionRequest(model="m", prompt="p", **kw)) for kw in ({}, {"logprobs": 0},
                                                                                   {"logprobs": 5})] == [None, 0, 5]
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt="p", logprobs=6)  # the completions API's 0..5
    with pytest.raises(ValidationError):
        chat(logprobs=True, top_logprobs=21)


# (token text, logprob, [(alternative text, logprob)]) per token, as serve.py names the decoder's entries
ENTRIES = [("Hi", -0.25, [("Hi", -0.25), ("Hello", -1.5)]), (" é", -1.0, [(" a", -0.5), (" é", -1.0)]),
           ("", float("-inf"), [("!", -0.1), (".", -2.0)])]


def test_chat_logprobs_shape():
    body = logprobs_body(True, ENTRIES, 2)
    first, second, last = body["content"]
    assert first == {"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": [
        {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]}, {"token": "Hello", "logprob": -1.5,
                                                                "bytes": list(b"Hello")}]}
    assert second["bytes"] == [32, 0xC3, 0xA9] and second["top_logprobs"][1]["bytes"] == [32, 0xC3, 0xA9]
    assert last["logprob"] == -9999.0  # -inf is not JSON: OpenAI's floor
    assert logprobs_body(True, ENTRIES, None) is None
    assert logprobs_body(True, [("Hi", -0.25, [])], 0) == \
        {"content": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": []}]}
    choice = response_body("id", 0, "m", True, [("Hi é", "stop", body)], {})["choices"][0]
    assert choice["logprobs"] == body and choice["message"]["content"] == "Hi é"
    assert response_body("id", 0, "m", True, [("a", "stop", None)], {})["choices"][0]["logprobs"] is None
    chunk = json.loads(sse_chunk("id", 0, "m", True, {"content": "Hi"}, None, None, logprobs_body(True, ENTRIES[:1], 2))
                       [len("data: "):])
    assert chunk["choices"][0]["logprobs"] == {"content": body["content"][:1]}


def test_completion_logprobs_shape():
    body = logprobs_body(False, ENTRIES, 2)
    assert body["tokens"] == ["Hi", " é", ""] and body["token_logprobs"] == [-0.25, -1.0, -9999.0]
    assert body["text_offset"] == [0, 2, 4]  # offsets into the choice's text
    # the k alternatives plus the token itself: up to k + 1 (OpenAI's "up to logprobs + 1")
    assert body["top_logprobs"] == [{"Hi": -0.25, "Hello": -1.5}, {" a": -0.5, " é": -1.0},
                                    {"!": -0.1, ".": -2.0, "": -9999.0}]
    assert logprobs_body(False, ENTRIES, 0)["top_logprobs"] is None
    later = logprobs_body(False, ENTRIES[1:], 2, offset=2)  # a stream chunk after "Hi" was sent
    assert later["text_offset"] == body["text_offset"][1:] and later["tokens"] == body["tokens"][1:]
    choice = response_body("id", 0, "m", False, [("Hi é", "length", body)], {})["choices"][0]
    assert choice["logprobs"] == body and choice["text"] == "Hi é"
    chunk = json.loads(sse_chunk("id", 0, "m", False, " é", None, None, later)[len("data: "):])
    assert chunk["choices"][0]["logprobs"] == later


def test_visible_text_leaves_stop_strings_out_and_holds_back_their_beginnings():
    from infer.openai_api import visible_text

    stops = ["\n\nQ:", "END"]
    assert visible_text("The answer is 4.\n\nQ: next", stops, final=True) == "The answer is 4."
    assert visible_text("a END b \n\nQ:", stops, final=False) == "a "  # the first stop in the text wins
    # a stream holds back a tail that may still become a stop: nothing it sends is taken back later
    assert visible_text("The answer is 4.\n", stops, final=False) == "The answer is 4."
    assert visible_text("The answer is 4.\n\n", stops, final=False) == "The answer is 4."
    assert visible_text("The answer is 4.\n\nA", stops, final=False) == "The answer is 4.\n\nA"
    assert visible_text("it is EN", stops, final=False) == "it is " and visible_text("it is EN", stops, True) == "it is EN"
    assert visible_text("no stops", [], final=False) == "no stops"


def test_stop_takes_at_most_four_strings():
    ok = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], stop=["a", "b", "c", "d"])
    assert ok.stop_list() == ["a", "b", "c", "d"]
    with pytest.raises(ValidationError, match="stop"):
        ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], stop=["a", "b", "c", "d", "e"])
