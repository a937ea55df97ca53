# Everything runs from ./.venv, which `make install` builds from nothing (torch CPU first, then
# Pillow-SIMD from source with AVX2, then the rest), so a fresh machine needs only python3 and a C compiler.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
PILLOW_SIMD_VERSION ?= 12.1.1.post0
STAMP := $(VENV)/.installed

# make shards INPUT=... OUTPUT=... CONFIG=...; with no INPUT it generates the sample dataset first.
INPUT ?=
OUTPUT ?= out/sample-shards
CONFIG ?= configs/default.yaml
SAMPLE_DIR ?= data/sample

.PHONY: install shards sample test bench lint doctor clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: a bare `torch` requirement would pull the multi-GB CUDA build.
	$(PIP) install -q torch==$(TORCH_VERSION)
	# WebP decoding needs libwebp headers at Pillow-SIMD build time (libjpeg and zlib are assumed there).
	@if [ ! -f /usr/include/webp/decode.h ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get install -y -q libwebp-dev || (apt-get update -q && apt-get install -y -q libwebp-dev)) \
			>/dev/null 2>&1 || echo "warning: no libwebp-dev: WebP samples will be counted as failures" >&2; fi
	# Pillow-SIMD replaces stock Pillow (same `PIL` package): remove Pillow, build SIMD with AVX2.
	# --no-cache-dir: a cached wheel may come from a build without AVX2 or without WebP.
	-$(PIP) uninstall -q -y pillow
	@if ! $(PIP) show pillow-simd >/dev/null 2>&1 || [ ! -f $(VENV)/.pillow-simd-avx2 ]; then \
		CC="cc -mavx2" $(PIP) install -q --no-cache-dir --force-reinstall --no-deps --no-binary pillow-simd \
			pillow-simd==$(PILLOW_SIMD_VERSION) && echo 'CC="cc -mavx2"' > $(VENV)/.pillow-simd-avx2; fi
	$(PIP) install -q -e '.[preprocess,dev]'
	# Anything that required `pillow` would have put stock Pillow back: fail loudly if so.
	@if $(PIP) show pillow >/dev/null 2>&1; then echo "stock Pillow was reinstalled over Pillow-SIMD" >&2; exit 1; fi
	$(PY) -m preprocess.cli doctor
	touch $(STAMP)

sample: $(STAMP)
	$(PY) -m preprocess.sample_data $(SAMPLE_DIR)

shards: $(STAMP)
ifeq ($(strip $(INPUT)),)
	$(PY) -m preprocess.sample_data $(SAMPLE_DIR)
	$(PY) -m preprocess.cli run '$(SAMPLE_DIR)/*.tar' --output $(OUTPUT) --config $(CONFIG)
else
	$(PY) -m preprocess.cli run $(INPUT) --output $(OUTPUT) --config $(CONFIG)
endif

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	# OpenCV for the img2dataset-style baseline (it needs no Pillow; the bench skips it if this fails).
	-$(PIP) install -q opencv-python-headless
	@if $(PIP) show pillow >/dev/null 2>&1; then echo "stock Pillow was installed over Pillow-SIMD" >&2; exit 1; fi
	$(PY) -m bench.run

lint: $(STAMP)
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check shardio preprocess tests bench examples

doctor: $(STAMP)
	$(PY) -m preprocess.cli doctor

clean:
	rm -rf $(VENV) out data bench/out
