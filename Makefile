# distlion: `make demo` and `make test` set themselves up on a fresh machine.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: help setup demo test bench lint experiment tune estimate report clean-runs

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install distlion with its dev tools

demo: setup  ## the main job on the embedded digits data: a method x workers x 3 seeds sweep, then results/demo/
	$(VENV)/bin/distlion-experiment experiments/demo.yaml --jobs 2 --no-records
	@echo "open results/demo/index.html in a browser (every experiment: results/index.html)"

test: setup  ## the test suite (about 15-20 minutes on 2 cores once installed)
	$(VENV)/bin/pytest -q

bench: setup  ## speed ratios measured side by side; writes results/bench.md
	$(PY) scripts/bench.py

lint: setup  ## ruff
	$(VENV)/bin/ruff check distlion tests scripts benchmarks

experiment: setup  ## run one spec of experiments/: make experiment NAME=demo [JOBS=2]
	$(VENV)/bin/distlion-experiment experiments/$(NAME).yaml --jobs $(or $(JOBS),1)

tune: setup  ## tune a spec with a tuning section, write conf/tuned/, then its final runs: make tune NAME=demo [JOBS=2]
	$(VENV)/bin/distlion-experiment experiments/$(NAME).yaml --tune --jobs $(or $(JOBS),1)

estimate: setup  ## device-hours of a spec on the device at hand, without training: make estimate NAME=cifar10_workers
	$(VENV)/bin/distlion-experiment experiments/$(NAME).yaml --estimate

report: setup  ## rebuild a spec's tables and plots from finished runs: make report NAME=demo
	$(VENV)/bin/distlion-experiment experiments/$(NAME).yaml --report-only

.PHONY: submitit-demo
submitit-demo: setup  ## the SLURM path on this machine (submitit_local): a 2-rank torchdist job per method, a 4-point sweep
	$(VENV)/bin/distlion-train -m hydra/launcher=submitit_local experiment=submitit_demo logger=none \
		cluster=torchdist cluster.tasks_per_node=2 method=dlion,adamw
	$(VENV)/bin/distlion-train -m hydra/launcher=submitit_local experiment=submitit_demo logger=none \
		method=dlion,adamw seed=0,1
	$(VENV)/bin/distlion-report runs/submitit_demo --out results/submitit_demo

.PHONY: torchrun-demo
torchrun-demo: setup  ## D-Lion MaVo on digits with 4 torchrun ranks over gloo (CPU, loopback): runs/torchrun_demo/
	GLOO_SOCKET_IFNAME=$${GLOO_SOCKET_IFNAME:-lo} $(VENV)/bin/torchrun --standalone --nproc-per-node 4 \
		-m distlion.train cluster=torchdist method=dlion task=digits experiment=torchrun_demo logger=none
