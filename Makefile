# Set-up and checks. Every target creates/uses the virtual environment in $(VENV).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a bare `torch` requirement would pull several GB of CUDA wheels.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: venv test demo proto bench lint clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	# DeepSpeed's setup imports torch, so it builds against the torch installed above.
	$(PY) -m pip install -q --no-build-isolation "deepspeed>=0.16"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

demo: venv
	$(PY) -m elasticrl.demo

proto: venv
	$(PY) tools/gen_proto.py

bench: venv
	$(PY) bench/coordinator.py
	$(PY) bench/rendezvous.py
	$(PY) bench/scheduler.py
	$(PY) -m torch.distributed.run --standalone --nproc-per-node=2 bench/collectives.py --op all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
