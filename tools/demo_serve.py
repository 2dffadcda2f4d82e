"""Demo: start the OpenAI-compatible endpoint on the demo head, ask one question with the `openai`
client, print the answer and its tau, shut down.

    python tools/demo_serve.py [configs/serve/demo.yaml] [key=value ...]
"""
from __future__ import annotations

import sys

from infer.serve import ServeConfig, start
from pipeline.yaml_config import load_or_exit


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    path = argv.pop(0) if argv and not argv[0].count("=") else "configs/serve/demo.yaml"
    cfg = load_or_exit(ServeConfig, path, argv)
    import openai
    from ray import serve

    url = start(cfg)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        question = "Write a Python function that returns the sum of a list of numbers."
        r = client.chat.completions.create(model=cfg.model_name, max_tokens=128, temperature=0,
                                           messages=[{"role": "user", "content": question}])
        print(f"\nendpoint {url}/v1 ({cfg.model_name})\nQ: {question}\nA: {r.choices[0].message.content}")
        print(f"usage: {r.usage.completion_tokens} tokens, tau {r.usage.model_extra.get('tau')}")
    finally:
        serve.shutdown()


if __name__ == "__main__":
    main()
