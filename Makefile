# Two commands on a fresh machine: `make train` and `make test`. Both create .venv on first use
# and reuse it afterwards; the stamp is rebuilt when the packaging or the C++ sources change.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lightning_rec-installed
CSRC := $(wildcard csrc/*.cpp csrc/*.h csrc/*.cu)
ARGS ?=
# pytest-xdist workers: most tests are one Python thread, or ranks that wait on each other, so two workers keep a
# 2-core machine busy (the suite: 7.5 min there with two workers, ~10 in one process). TEST_WORKERS=0: one process
TEST_WORKERS ?= 2

.PHONY: train test bench lint clean

$(STAMP): pyproject.toml setup.py $(CSRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# ninja: torch's extension builder compiles csrc/'s files in parallel with it (one at a time without)
	$(PY) -m pip install -q --upgrade pip "setuptools>=68" wheel ninja==1.13.2
	# torch first and pinned: anything that later asks for "torch" then finds it and pulls no CUDA wheels.
	$(PY) -m pip install -q torch==2.13.0
	# No build isolation: an isolated build would fetch an unpinned torch to compile csrc/.
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pip install -q --no-build-isolation -e '.[cpu,dev]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/lightning-rec fit --config recipes/configs/dlrm_synthetic.yaml $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/embedding.py

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_rec tests recipes benchmarks

clean:
	rm -rf $(VENV) build *.egg-info lightning_rec/_C*.so
