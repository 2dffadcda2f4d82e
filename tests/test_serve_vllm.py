"""serve.backend=vllm: the tiny target with our exported head as vLLM's EAGLE-3 speculator, deployed through
Ray Serve LLM on the session's local Ray, driven by the real `openai` client."""
import time

import openai
import pytest

from conftest import _free_port
from test_serve import MSGS, greedy_text

pytestmark = pytest.mark.slow
MODEL = "tiny-vllm"


@pytest.fixture(scope="module")
def vllm_server(ray_cluster, tiny_target, tiny_head):
    from ray import serve

    from infer.serve import ServeConfig, start

    cfg = ServeConfig(backend="vllm", target=tiny_target, head=tiny_head.parent / "head_speculators",
                      model_name=MODEL, app_name="vllm-test", port=_free_port(), num_cpus_per_replica=1,
                      speculative={"mode": "chain", "depth": 3},
                      vllm={"max_model_len": 512, "dtype": "float32", "max_num_seqs": 16})
    url = start(cfg)
    yield url
    serve.shutdown()


def test_vllm_backend_serves_greedy_text_with_speculation(vllm_server, tiny_target):
    from infer.serve_vllm import engine_spec_counters

    c = openai.OpenAI(base_url=vllm_server + "/v1", api_key="none", max_retries=0, timeout=300)
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40, temperature=0)
    assert r.choices[0].message.content == greedy_text(tiny_target, MSGS, 40)  # speculation is lossless
    chunks = list(c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40, temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
    counters = {}
    for _ in range(30):  # Ray exports the engine's counters every few seconds
        counters = engine_spec_counters(MODEL)
        if counters["drafts"] > 0:
            break
        time.sleep(2)
    assert counters["drafts"] > 0 and counters["accepted"] > 0 and counters["tau"] > 1.2, counters


def test_vllm_backend_validation(vllm_server):
    """vLLM's own OpenAI validation: unknown model 404, max_tokens past the context 400."""
    c = openai.OpenAI(base_url=vllm_server + "/v1", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=MSGS, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=100000)


def test_llm_config_carries_the_cpu_engine_environment(tiny_target):
    """vllm.* CPU options reach the engine's environment through Ray Serve LLM's runtime_env."""
    from infer.serve import ServeConfig
    from infer.serve_vllm import llm_config

    cfg = ServeConfig(backend="vllm", target=tiny_target, model_name=MODEL, num_cpus_per_replica=1,
                      vllm={"kv_cache_gb": 2, "cpu_threads_bind": "0-1", "cpu_reserved": 0})
    env = llm_config(cfg).runtime_env["env_vars"]
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                   "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    default = llm_config(ServeConfig(backend="vllm", target=tiny_target, model_name=MODEL)).runtime_env["env_vars"]
    assert default == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
