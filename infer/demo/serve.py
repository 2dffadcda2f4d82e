"""Demo: start the OpenAI-compatible endpoint on the demo head, ask one question with the `openai`
client, print one line (tokens, tau) and write the answer to --out, shut down.

    python -m infer.demo.serve [configs/serve/demo.yaml] [key=value ...] [--out runs/demo/serve.json]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from infer.serve import ServeConfig, start, stop
from pipeline.yaml_config import load_or_exit

QUESTION = "Write a Python function that returns the sum of a list of numbers."


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    out_path = Path("runs/demo/serve.json")
    if "--out" in argv:
        i = argv.index("--out")
        out_path = Path(argv[i + 1])
        del argv[i:i + 2]
    path = argv.pop(0) if argv and not argv[0].count("=") else "configs/serve/demo.yaml"
    cfg = load_or_exit(ServeConfig, path, argv)
    import openai

    url = start(cfg)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        r = client.chat.completions.create(model=cfg.model_name, max_tokens=128, temperature=0,
                                           messages=[{"role": "user", "content": QUESTION}])
        out = {"endpoint": f"{url}/v1", "model": cfg.model_name, "question": QUESTION,
               "answer": r.choices[0].message.content, "completion_tokens": r.usage.completion_tokens,
               "tau": r.usage.model_extra.get("tau")}
    finally:
        stop()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, ensure_ascii=False, indent=2))
    print(f"[serve] {out['endpoint']} ({cfg.model_name}) answered with the openai client: "
          f"{out['completion_tokens']} tokens, tau {out['tau']}; answer in {out_path}", flush=True)
    return out


if __name__ == "__main__":
    main()
