# zaec — every entry point a newcomer needs. `make test` and `make demo` work on a fresh machine:
# they create the virtual environment (and fetch Debian's Fashion-MNIST for the demo) themselves.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zaec-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export MPLBACKEND := Agg

FMNIST_DIR ?= data/fashion-mnist
DEMO_SHARDS := data/demo/shards
SHARDS ?= $(DEMO_SHARDS)
RESULTS ?= results
# Temperature scaling's labelled source set and the dataset of the per-sample figures: the demo's clean set and a
# shifted set for the demo's shards, the paper's choices (imagenet, imagenet_a) for any other shards.
TS_SOURCE ?= $(if $(filter $(DEMO_SHARDS),$(SHARDS)),fmnist,imagenet)
REFERENCE ?= $(if $(filter $(DEMO_SHARDS),$(SHARDS)),fmnist_blur,imagenet_a)

.PHONY: help venv test slurm-packages demo bench bench-extract bench-gpu gpu-wheels gpu-check tables fmnist clean

help:
	@echo "make demo           run the whole pipeline on the embedded default (small CLIP trained on Fashion-MNIST)"
	@echo "make test           run the test suite (creates $(VENV) first; as root also installs SLURM for its tests)"
	@echo "make tables         tables and figures from SHARDS=$(SHARDS) into RESULTS=$(RESULTS) (TS_SOURCE=$(TS_SOURCE); ALLOW_PARTIAL=1 uses partial runs)"
	@echo "make bench          CPU-stage benchmarks (ratios from one run)"
	@echo "make bench-extract  extraction-stage benchmarks on the CPU with a small model (view generation per core, every method's adapt cost, ECALP's and the transductive methods' growth; BENCH_EXTRACT_ARGS=...)"
	@echo "make bench-gpu      extraction vs the image encoder's ceiling on a CUDA GPU (random ViT-B-16, RN50); JSON=FILE"
	@echo "make gpu-wheels     save the wheels a bare CUDA machine lacks in .whl/ (needs the package index)"
	@echo "make gpu-check      on a CUDA machine without network: install .whl/, run the extraction tests (CUDA ones too), the shortcut check and bench-gpu"

# torch is pinned first: on these machines torch==2.14.1/torchvision==0.29.1 install from local disk;
# any other resolution downloads several GB or breaks torchvision's import.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e '.[extract,sweep,test,diffusion,cosmic]'
	touch $@

venv: $(STAMP)

fmnist:
	bash data/fetch_fmnist.sh $(FMNIST_DIR)

test: $(STAMP) fmnist slurm-packages
	FMNIST_DIR=$(FMNIST_DIR) $(PY) -m pytest -q tests

# The SLURM tests (tests/extract/sweep/test_slurm_real.py, marker `slurm`) run a one-machine cluster
# (tools/slurm_local.sh). As root with apt, this installs Debian's slurm-wlm, munge, slurmdbd and MariaDB when missing
# (about a minute on a fresh machine); elsewhere it says in one line why not and the tests skip with that reason.
slurm-packages:
	@bash tools/slurm_local.sh install --accounting || echo "make: the SLURM tests will skip (see the line above)"

demo: $(STAMP) fmnist
	$(VENV)/bin/python -m tools.demo --fmnist-dir $(FMNIST_DIR)

# ALLOW_PARTIAL=1: use runs with fewer samples than their test set (interrupted, or --limit subsets), marked as such
ALLOW_PARTIAL ?=
tables: $(STAMP)
	ZAEC_ALLOW_PARTIAL_AS='ALLOW_PARTIAL=1 (make tables ALLOW_PARTIAL=1)' $(VENV)/bin/zaec-calibrate tables $(SHARDS) \
		--out $(RESULTS) --ts-source $(TS_SOURCE) --reference-dataset $(REFERENCE) $(if $(ALLOW_PARTIAL),--allow-partial)

bench: $(STAMP)
	$(PY) -m tools.bench_calibrate

# more options of bench-extract, e.g. BENCH_EXTRACT_ARGS="--only-transductive --transductive-n 1000,5000,20000"
BENCH_EXTRACT_ARGS ?=
bench-extract: $(STAMP)
	$(PY) -m tools.bench_extract $(BENCH_EXTRACT_ARGS)

# writes $(JSON) too (default bench-gpu.json), for `zaec-sweep --dry-run --rates $(JSON)`
JSON ?= bench-gpu.json
# more options of bench-gpu (its default: every registered method at K = 47, 200, 1000 on ViT-B-16 and RN50)
BENCH_GPU_ARGS ?=
bench-gpu: $(STAMP)
	$(PY) -m tools.bench_gpu --json $(JSON) $(BENCH_GPU_ARGS)

# A GPU check in one command on a CUDA machine that cannot reach the package index and has its own Python with
# torch, torchvision, pyarrow, typer, rich, timm, safetensors and pytest but not open_clip (the `device` machines
# here: Python 3.12). Here: `make gpu-wheels` saves the missing wheels, at this venv's versions, in .whl/
# (git-ignored, 3 MB). There, with .whl carried (and data/models/fmnist-ViT plus data/datasets/fashion-mnist/blur
# from `make demo`, for the shortcut check on a trained model): `make gpu-check JSON=...` installs the wheels into
# $(GPU_SITE), runs the extraction tests (the CUDA ones included), the shortcut check and bench-gpu, and exits
# non-zero if a step failed. docs/benchmarks.md says what to look at.
GPU_PYTHON ?= python3
# gpu-check's bench-gpu keeps to TPT and TPS (its 9 minutes); every method's rates: GPU_CHECK_BENCH_ARGS= (up to about 25
# more minutes per backbone for the 42 methods, an estimate: docs/benchmarks.md)
GPU_CHECK_BENCH_ARGS ?= --methods tpt,tps
GPU_PY_VERSION ?= 3.12
GPU_SITE ?= /tmp/zaec-site
GPU_WHEELS := open_clip_torch ftfy wcwidth
GPU_TESTS := tests/extract/methods/test_tpt.py tests/extract/methods/test_tps.py tests/extract/test_text_encoder.py \
             tests/extract/test_views.py tests/extract/test_runner.py tests/extract/test_augmix_device.py \
             tests/extract/test_models.py tests/tools/test_check_shortcuts.py tests/tools/test_bench_gpu.py \
             tests/extract/methods/test_promptalign.py
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY_VERSION) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
	  $$($(PY) -c "import importlib.metadata as m; print(' '.join(n + '==' + m.version(n) for n in '$(GPU_WHEELS)'.split()))")
	@ls .whl

gpu-check:
	@test -n "$$(ls .whl/*.whl 2>/dev/null)" || { echo "error: no wheels in .whl/: run 'make gpu-wheels' where the package index is reachable, and carry .whl" >&2; exit 2; }
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl
	@export PYTHONPATH=$(GPU_SITE):$(CURDIR) PYTHONUNBUFFERED=1; status=0; \
	$(GPU_PYTHON) -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"; \
	$(GPU_PYTHON) -m pytest -q -rs -p no:cacheprovider $(GPU_TESTS) || status=1; \
	if [ -d data/models/fmnist-ViT ] && [ -d data/datasets/fashion-mnist/blur ]; then \
	  $(GPU_PYTHON) -m tools.check_shortcuts --pretrained local-dir:data/models/fmnist-ViT --dataset fmnist_blur \
	    --data-root data/datasets --methods tpt,atpt --limit 1000 --json $(dir $(JSON))shortcuts.json || status=1; \
	else echo "shortcut check skipped: data/models/fmnist-ViT or data/datasets/fashion-mnist/blur not here"; fi; \
	$(GPU_PYTHON) -m tools.bench_gpu --json $(JSON) $(GPU_CHECK_BENCH_ARGS) || status=1; \
	exit $$status

clean:
	rm -rf $(RESULTS) bench-out .pytest_cache
