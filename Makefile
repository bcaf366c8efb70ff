# Two commands for a fresh machine: `make train` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/default.yaml
RUN    ?= runs/default
ARGS   ?=

.PHONY: train test test-slow test-gpu test-hf bench setup clean

$(PY):
	@base=$$(scripts/find_python.sh) && echo "creating $(VENV) with $$base" && "$$base" -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml scripts/jax_overlap_no_gpu.pth
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# Without a GPU, keeps the CUDA plugin's failed version check off stderr (jax_overlap/__init__.py)
	cp scripts/jax_overlap_no_gpu.pth "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	@touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/jax-overlap train --config $(CONFIG) --run-dir $(RUN) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 -m slow $(ARGS)

# Against transformers: installs the [hf] extra (torch, transformers) first.
test-hf: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,hf]'
	$(PY) -m pytest -q -m hf tests/test_hf_transformers.py $(ARGS)

test-gpu: $(STAMP)
	JAX_PLATFORMS=cuda,cpu $(PY) -m pytest -q -m gpu tests/gpu $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
