# One entry point for users, developers and CI. Everything installs into ./.venv from pinned files;
# .venv-torchrec19 is the same set with torchrec 1.9.2, for the integration suites. Installing the
# package into .venv compiles its CPU kernel into the checkout (setup.py); .venv-torchrec19 has the same
# torch and loads those libraries, so its install skips the build (TORCHREC_FTRL_BUILD_CPU=0).
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip --disable-pip-version-check -q
VENV19 := .venv-torchrec19
PIP19 := $(VENV19)/bin/python -m pip --disable-pip-version-check -q
# The suites that exercise TorchRec's internals (registration, patches, planner, DMP, sharded reliability).
INTEGRATION_TESTS := tests/test_integration.py tests/test_planner.py tests/test_distributed.py \
	tests/test_checkpoint.py tests/test_reliability_sharded.py tests/test_package_scope.py \
	tests/test_state_paths.py tests/test_inference_export.py

.PHONY: venv venv19 demo test bench clean

$(VENV)/.installed: requirements.txt requirements-torchrec.txt requirements-tensorflow.txt pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(PIP) install -r requirements.txt
	$(PIP) install -r requirements-tensorflow.txt -c requirements.txt
	$(PIP) install --no-deps -r requirements-torchrec.txt
	$(PIP) install --no-deps --no-build-isolation -e ".[job]"
	touch $@

venv: $(VENV)/.installed

$(VENV19)/.installed: requirements.txt requirements-torchrec19.txt pyproject.toml
	$(PY) -m venv $(VENV19)
	$(PIP19) install -r requirements.txt
	$(PIP19) install --no-deps -r requirements-torchrec19.txt
	TORCHREC_FTRL_BUILD_CPU=0 $(PIP19) install --no-deps --no-build-isolation -e ".[job]"
	touch $@

venv19: $(VENV19)/.installed

# The main job on its embedded synthetic default: 2 CPU processes (gloo) launched by torchx.
demo: venv
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/torchx run -s local_cwd torchrec_ftrl/components.py:train_ctr --nproc 2

# The whole suite on the pinned set, then the integration suites on torchrec 1.9.2.
test: venv venv19
	$(VPY) -m pytest -q tests
	$(VENV19)/bin/python -m pytest -q $(INTEGRATION_TESTS)

bench: venv
	$(VPY) benchmarks/bench_tbe_cpu.py

clean:
	rm -rf $(VENV) $(VENV19) build *.egg-info torchrec_ftrl/kernels/cpu/_ftrl_tbe_cpu_*
