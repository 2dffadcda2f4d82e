"""serve.backend=vllm: the tiny target with our exported head as vLLM's EAGLE-3 speculator, deployed through
Ray Serve LLM on the session's local Ray, driven by the real `openai` client."""
import time

import openai
import pytest

from infer.cluster.local import free_port as _free_port
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
                      vllm={"max_model_len": 512, "dtype": "fp32", "max_num_seqs": 16, "draft_up_to_batch": 2})
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


def test_vllm_drafts_nothing_past_draft_up_to_batch_and_stays_lossless(vllm_server, tiny_target):
    """vllm.draft_up_to_batch 2: with 8 requests at once vLLM's batch-size schedule drafts no tokens for
    most steps (drafted tokens per generated token far under a single request's), and every answer is still
    the target's own greedy text."""
    from concurrent.futures import ThreadPoolExecutor

    from infer.serve_vllm import engine_spec_counters

    c = openai.OpenAI(base_url=vllm_server + "/v1", api_key="none", max_retries=0, timeout=300)
    prompts = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(8)]

    def settled(before: dict) -> dict:
        """The counters once moved and then still for 16 s: Ray exports them every 10 s
        (`RAY_metrics_report_interval_ms`), so a 2-s still window could read an export made mid-run."""
        last, still = before, 0
        for _ in range(45):
            time.sleep(2)
            now = engine_spec_counters(MODEL)
            still = still + 1 if now == last else 0
            last = now
            if now != before and still >= 8:
                return now
        return last

    def drafted_per_token(run) -> float:
        before = engine_spec_counters(MODEL)
        tokens = run()
        after = settled(before)
        return (after["draft_tokens"] - before["draft_tokens"]) / tokens

    def one():
        r = c.chat.completions.create(model=MODEL, messages=prompts[0], max_tokens=40, temperature=0)
        return r.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        def many():
            rs = list(pool.map(lambda m: c.chat.completions.create(model=MODEL, messages=m, max_tokens=40,
                                                                   temperature=0), prompts))
            assert [r.choices[0].message.content for r in rs] == [greedy_text(tiny_target, m, 40) for m in prompts]
            return sum(r.usage.completion_tokens for r in rs)
        alone, crowd, again = drafted_per_token(one), drafted_per_token(many), drafted_per_token(one)
    print("drafted tokens per generated token: alone, 8 at once, alone", alone, crowd, again)
    assert alone > 0.5 and again > 0.5 and crowd < 0.5 * min(alone, again), (alone, crowd, again)


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


def test_draft_up_to_batch_becomes_vllms_batch_size_schedule(tiny_target, tiny_head):
    from infer.serve import ServeConfig
    from infer.serve_vllm import llm_config

    head = tiny_head.parent / "head_speculators"
    spec = lambda **v: llm_config(ServeConfig(backend="vllm", target=tiny_target, head=head, model_name=MODEL,  # noqa: E731
                                              speculative={"depth": 3}, vllm=v)).engine_kwargs["speculative_config"]
    assert spec(draft_up_to_batch=4, max_num_seqs=32)["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 32, 0]]
    assert "num_speculative_tokens_per_batch_size" not in spec()
    assert "num_speculative_tokens_per_batch_size" not in spec(draft_up_to_batch=64, max_num_seqs=64)
