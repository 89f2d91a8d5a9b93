# distlion: `make demo` and `make test` set themselves up on a fresh machine.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: help setup demo test bench lint experiment tune report clean-runs

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install distlion with its dev tools

demo: setup  ## the main job on the embedded digits data: a method x workers x 3 seeds sweep, then results/demo/
	$(VENV)/bin/distlion-experiment experiments/demo.yaml --jobs 2

test: setup  ## the test suite (about 12-15 minutes on 2 cores once installed)
	$(VENV)/bin/pytest -q

bench: setup  ## speed ratios measured side by side; writes results/bench.md
	$(PY) scripts/bench.py

lint: setup  ## ruff
	$(VENV)/bin/ruff check distlion tests scripts benchmarks

experiment: setup  ## run one spec of experiments/: make experiment NAME=demo [JOBS=2]
	$(VENV)/bin/distlion-experiment experiments/$(NAME).yaml --jobs $(or $(JOBS),1)

tune: setup  ## tune a spec with a tuning section, write conf/tuned/, then its final runs: make tune NAME=demo [JOBS=2]
	$(VENV)/bin/distlion-experiment experiments/$(NAME).yaml --tune --jobs $(or $(JOBS),1)

report: setup  ## rebuild a spec's tables and plots from finished runs: make report NAME=demo
	$(VENV)/bin/distlion-experiment experiments/$(NAME).yaml --report-only

.PHONY: torchrun-demo
torchrun-demo: setup  ## D-Lion MaVo on digits with 4 torchrun ranks over gloo (CPU, loopback): runs/torchrun_demo/
	GLOO_SOCKET_IFNAME=$${GLOO_SOCKET_IFNAME:-lo} $(VENV)/bin/torchrun --standalone --nproc-per-node 4 \
		-m distlion.train cluster=torchdist method=dlion task=digits experiment=torchrun_demo logger=none
