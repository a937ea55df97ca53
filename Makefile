# Everything runs from ./.venv, which `make install` builds from nothing (torch CPU first, then
# Pillow-SIMD from source with AVX2, then the rest), so a fresh machine needs only python3 and a C compiler.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
PILLOW_SIMD_VERSION ?= 12.1.1.post0
AZURITE_VERSION ?= 3.35.0
STAMP := $(VENV)/.installed

# make shards INPUT=... OUTPUT=... CONFIG=...; with no INPUT it generates the sample dataset first.
# Each word of INPUT reaches `preprocess run` single-quoted, so the shell expands no glob or brace range
# and preprocess's own glob rule applies: INPUT='data/*' over an img2dataset folder takes the tars and
# ignores 00000_stats.json, as `preprocess run 'data/*'` does (an expanded glob named it explicitly: a
# failed input). Several patterns: INPUT='a/*.tar b/*.tar'.
INPUT ?=
OUTPUT ?= out/sample-shards
CONFIG ?= configs/default.yaml
SAMPLE_DIR ?= data/sample
# Written by `python -m bench.run` (cached): 6 tars of 200 LAION-like JPEGs.
BENCH_CORPUS := bench/out/corpus/laion-like-6x200-s0

.PHONY: install pillow-simd pillow-simd-rebuild shards sample test azurite bench gpu-check lint doctor clean docs docs-gen

# `install` checks Pillow-SIMD every time, not only when the stamp is stale: anything that requires
# `pillow` (pip install torchvision, matplotlib) writes stock Pillow over it without touching the stamp.
install: $(STAMP)
	@$(MAKE) --no-print-directory pillow-simd

$(STAMP): pyproject.toml setup.py preprocess/image/_jpeg_region.c shardio/read/_jpeg_batch.c shardio/read/_gather.c Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: a bare `torch` requirement would pull the multi-GB CUDA build.
	$(PIP) install -q torch==$(TORCH_VERSION)
	# WebP decoding needs libwebp headers at Pillow-SIMD build time (libjpeg and zlib are assumed there).
	@if [ ! -f /usr/include/webp/decode.h ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get install -y -q libwebp-dev || (apt-get update -q && apt-get install -y -q libwebp-dev)) \
			>/dev/null 2>&1 || echo "warning: no libwebp-dev: WebP samples will be counted as failures" >&2; fi
	# Pillow-SIMD before the package, so pip finds `pillow-simd` satisfied and never pulls stock Pillow.
	@$(MAKE) --no-print-directory pillow-simd
	$(PIP) install -q -e '.[preprocess,dev,s3]'
	# The `models` extra for examples/cache_latents.py and its test: diffusers without its dependencies (it
	# requires stock Pillow, which would replace Pillow-SIMD; transformers brings the others it needs).
	$(PIP) install -q 'transformers>=4.40' importlib_metadata
	$(PIP) install -q --no-deps 'diffusers>=0.30'
	@$(MAKE) --no-print-directory pillow-simd
	$(PY) -m preprocess.cli doctor
	touch $(STAMP)

# Pillow-SIMD active and built with AVX2 (preprocess/image/pillow_check.py compares the PIL files on disk
# with Pillow-SIMD's install record), or rebuilt from source now.
pillow-simd:
	@$(PY) -m preprocess.image.pillow_check || $(MAKE) --no-print-directory pillow-simd-rebuild

# Stock Pillow and Pillow-SIMD share the PIL directory: uninstalling one deletes the other's files, so
# remove both and whatever is left of PIL, then build Pillow-SIMD afresh. --no-cache-dir: a cached wheel
# may come from a build without AVX2 or without WebP.
pillow-simd-rebuild:
	@echo "rebuilding Pillow-SIMD $(PILLOW_SIMD_VERSION) from source (CC=\"cc -mavx2\")" >&2
	-$(PIP) uninstall -q -y pillow pillow-simd
	rm -rf "$$($(PY) -m preprocess.image.pillow_check --pil-dir)" $(VENV)/.pillow-simd-avx2
	CC="cc -mavx2" $(PIP) install -q --no-cache-dir --force-reinstall --no-deps --no-binary pillow-simd \
		pillow-simd==$(PILLOW_SIMD_VERSION)
	echo 'CC="cc -mavx2"' > $(VENV)/.pillow-simd-avx2
	# Fails loudly (exit 1, the reasons on stderr) if the rebuild did not give a working Pillow-SIMD.
	$(PY) -m preprocess.image.pillow_check

sample: $(STAMP)
	$(PY) -m preprocess.sample_data $(SAMPLE_DIR)

shards: $(STAMP)
ifeq ($(strip $(INPUT)),)
	$(PY) -m preprocess.sample_data $(SAMPLE_DIR)
	$(PY) -m preprocess.cli run '$(SAMPLE_DIR)/*.tar' --output $(OUTPUT) --config $(CONFIG)
else
	$(PY) -m preprocess.cli run $(foreach pattern,$(INPUT),'$(pattern)') --output '$(OUTPUT)' --config '$(CONFIG)'
endif

test: $(STAMP)
	# The JPEG layout tests encode with libjpeg-turbo's cjpeg (Debian: libjpeg-turbo-progs); they fail,
	# naming the package, where it is missing.
	@if ! command -v cjpeg >/dev/null && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get install -y -q libjpeg-turbo-progs || (apt-get update -q && apt-get install -y -q libjpeg-turbo-progs)) \
			>/dev/null 2>&1 || echo "warning: no libjpeg-turbo-progs: the tests that need cjpeg will fail" >&2; fi
	@$(MAKE) --no-print-directory azurite
	$(PY) -m pytest -q

# The Azure Blob emulator the tests start on loopback, from npm into the project's own .node/ (gitignored);
# without it the Azure tests fail, naming it.
azurite:
	@test -x .node/node_modules/.bin/azurite-blob || npm install --prefix .node --no-audit --no-fund --silent \
		azurite@$(AZURITE_VERSION) || echo "warning: npm could not install azurite: the Azure tests will fail" >&2

bench: $(STAMP)
	# OpenCV for the img2dataset-style baseline (it needs no Pillow; the bench skips it if this fails).
	-$(PIP) install -q opencv-python-headless
	@$(MAKE) --no-print-directory pillow-simd
	$(PY) -m bench.run
	# The default shuffled read (windows of 256 shards, blocks of 1) against np.copyto, beside sequential and
	# order version 1's default (windows of 8, blocks of 16) in one run, each round back to back (goal >= 0.5),
	# and its batches assembled other ways: numpy (no extension), one torch.cat over the slices, no read-ahead,
	# fresh maps. Alone: python -m bench.reader --shuffled-gather [--rounds 7] [--threads 1,2,4].
	$(PY) -m bench.reader --shuffled-gather
	# Augmentation on the device (here the CPU): samples/s against copying the batch, and resampling error.
	$(PY) -m bench.augment
	# JPEG datasets: single-core libjpeg-turbo decode, the CPU reader on every core against cores x it
	# (goal >= 0.85) and against the raw reader on the same images; --device cuda: the GPU decode, on a GPU host.
	$(PY) -m bench.jpeg_reader
	# yuv420 datasets: PSNR against raw on photo-like images (goal median >= 38 dB), the conversion alone
	# against np.copyto, and the CPU reader against the raw reader on the same images (goal >= 0.8).
	$(PY) -m bench.yuv_reader
	# The job at LAION size: a no-op rerun and a run with work (10 new tars) over 300 / 3k / 30k
	# committed local inputs (wall, RSS), the same with 3k inputs of 1 / 10 / 100 shards and on LAION-2B-en's
	# 230k tars x 10 shards (synthetic index), the job's share of one finished input, the plan alone.
	$(PY) -m bench.scale_job --shard-curve 3000:1,10,100 --synthetic 230000:10
	# The index at scale: append bytes / wall, metadata on disk, open cost at 300 / 30k / 300k shards.
	$(PY) -m bench.scale --sizes 300,3000,30000,300000
	# Lightning's SimpleProfiler: share of the epoch in train_dataloader_next, on shards of the bench corpus
	# (1,200 LAION-like images: 18 batches an epoch; the 191-image sample set has 3, and each epoch's first
	# batch is assembled cold, so it measured the epoch boundary: 1.2-1.5% there, 0.3% here).
	$(PY) -m preprocess.cli run '$(BENCH_CORPUS)/*.tar' --output bench/out/lightning-shards -q
	$(PY) -m bench.lightning --shards bench/out/lightning-shards --tars '$(BENCH_CORPUS)/*.tar'
	# The lazy epoch plan at 300 / 30k / 300k / 2.3M shards of 1,000 (synthetic counts, rank 0 of 64), and
	# ShardDataset opened + first shuffled batch at 100k vs 1M samples (~1 minute).
	$(PY) -m bench.scale_plan
	# Sources beyond tars: a worker's images/s over the same images as a tar, a Parquet file and a folder;
	# a 2 GB Parquet file read in 32 MB row groups (peak RSS over the process, against the file); a no-op
	# rerun over 1,000 committed Parquet files against 1,000 committed tars (seconds, ratio).
	$(PY) -m bench.sources
	$(PY) -m bench.parquet_memory --gb 2
	$(PY) -m bench.sources_rerun --inputs 1000
	# Object storage, on a SeaweedFS server on loopback: raw GET, s3fs vs obstore (s3fs is no dependency
	# of shardio: in its own venv, bench/out/clients-venv), the S3 reader and job against local, LitData and
	# Mosaic Streaming in theirs (bench/out/peer-venv); both made on first use. Adds object_store to
	# bench/results.json / .md.
	$(PY) -m bench.object_store
	# Every epoch cold from S3, GCS and Azure (their emulators): the reader with a cache of a third of the dataset
	# against raw parallel GETs and the local-disk reader, raw and JPEG shards, and 4 ranks sharing a cache_dir.
	# Adds cold_epoch to bench/results.json / .md (~10 minutes on 2 cores).
	$(PY) -m bench.cold_epoch
	# models: in the job on the CPU: one worker's images/s with a cheap model and a small convolution against
	# none (goal: cheap >= 0.8). Adds models_job to bench/results.json / .md (~2 minutes).
	$(PY) -m bench.models_job

# The GPU path on a GPU machine, in one call (bench/gpu_check.py: CUDA tests, stream safety, decode rates, H2D,
# a ResNet-50 step's wait for data, the object-store reader); installs what it needs itself (bench/gpu_env.sh)
# into .gpu-check/, never into .venv. Writes gpu_check.json and gpu_check.md into $OUT or bench/out/gpu-check.
# GPU_CHECK_ARGS=--dry-run: the plan and the parts a CPU runs, on this machine.
gpu-check:
	bash bench/gpu_env.sh $(GPU_CHECK_ARGS)

lint: $(STAMP)
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check shardio preprocess tests bench examples docsgen

# The documentation site (mkdocs.yml; docs/about.md): the generated pages first (config, CLI, API, format,
# figures, the README's figures table: docsgen, run by the project's Python, which imports the code), then a
# strict build into site/ (a broken link, anchor or API reference fails it) with the site's tools from their
# own venv, .docs-venv/ (pinned in docs/requirements.txt), so nothing they pull replaces Pillow-SIMD in .venv.
DOCS_VENV := .docs-venv
DOCS_STAMP := $(DOCS_VENV)/.installed

$(DOCS_STAMP): docs/requirements.txt
	test -x $(DOCS_VENV)/bin/python || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q -r docs/requirements.txt
	touch $(DOCS_STAMP)

docs-gen: $(STAMP)
	$(PY) -m docsgen.generate

docs: docs-gen $(DOCS_STAMP)
	rm -rf site
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --quiet
	@echo "site/: $$(find site -name index.html | wc -l) pages"

doctor: $(STAMP)
	$(PY) -m preprocess.cli doctor

clean:
	rm -rf $(VENV) $(DOCS_VENV) site out data bench/out
