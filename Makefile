# Set-up and checks. Every target creates/uses the virtual environment in $(VENV).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch, pinned and installed first: a bare `torch` requirement would pull several GB of CUDA
# wheels. On the project's machines the pin resolves to a CPU wheel already on disk; elsewhere, on
# Linux, PyPI's torch is the CUDA build: add TORCH_INDEX=https://download.pytorch.org/whl/cpu.
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=

.PHONY: venv test demo proto bench lint clean

# Two stages: what the demo needs (torch, the package, matplotlib), then what the tests add
# (pytest, transformers, DeepSpeed, the deploy/ checkers), so a first `make demo` installs less.
$(VENV)/.installed-demo: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[demo]"
	touch $@

$(VENV)/.installed: $(VENV)/.installed-demo
	$(PY) -m pip install -q -e ".[dev]"
	# DeepSpeed's setup imports torch, so it builds against the torch installed above.
	$(PY) -m pip install -q --no-build-isolation "deepspeed>=0.16"
	# The op DeepSpeed JIT-builds at first use on CPU (shared-memory comm, ~40-60 s), built here
	# once instead of inside whichever test or run starts DeepSpeed first (CPU even on a GPU host).
	DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $@

venv: $(VENV)/.installed

# Three runs: the unit tests on UNIT_WORKERS processes (pytest-xdist; their own clocks, loopback at
# most); the integration tests marked `waits` on WAITS_WORKERS processes (they mostly wait on
# leases, deadlines and restarts: ~335 s one at a time, ~110 s on 3 on two cores); then the other
# integration tests one at a time (real coordinators, torchrun agents and training whose leases and
# kills are timed on this machine's cores). Every run runs even when one before failed (not after
# a Ctrl-C: pytest's status 2), and make fails if any did. PYTEST_ARGS goes to each; a run it
# leaves without a test to run (status 5, e.g. -m "not integration") is no failure. One file or
# test: .venv/bin/python -m pytest PATH.
UNIT_WORKERS ?= 2
WAITS_WORKERS ?= 3

test: venv
	@rc=0; \
	for run in "tests/unit -n $(UNIT_WORKERS)" "tests/integration --part=waits -n $(WAITS_WORKERS)" "tests/integration --part=busy"; do \
		$(PY) -m pytest $$run $(PYTEST_ARGS) || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
		[ $$rc -eq 2 ] && exit 2; \
	done; \
	exit $$rc

demo: $(VENV)/.installed-demo
	$(PY) -m elasticrl.demo

proto: venv
	$(PY) tools/gen_proto.py

bench: venv
	$(PY) bench/coordinator.py
	$(PY) bench/rendezvous.py
	$(PY) bench/scheduler.py
	$(PY) bench/episodes.py
	$(PY) bench/async.py
	$(PY) bench/soak.py
	$(PY) bench/recovery.py
	$(PY) -m torch.distributed.run --standalone --nproc-per-node=2 bench/collectives.py --op all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
