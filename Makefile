# One entry point for users, developers and CI. Everything installs into ./.venv from pinned files.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip --disable-pip-version-check -q

.PHONY: venv demo test bench clean

$(VENV)/.installed: requirements.txt requirements-torchrec.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP) install -r requirements.txt
	$(PIP) install --no-deps -r requirements-torchrec.txt
	$(PIP) install --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed

# The main job on its embedded synthetic default: 2 CPU processes (gloo) launched by torchx.
demo: venv
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/torchx run -s local_cwd torchrec_ftrl/components.py:train_ctr --nproc 2

test: venv
	$(VPY) -m pytest -q tests

bench: venv
	$(VPY) benchmarks/bench_tbe_cpu.py

clean:
	rm -rf $(VENV) build *.egg-info
