"""LitData on the bench's images: ``litdata.optimize`` to the S3 server, then ``StreamingDataset`` epochs.

Fastest setting for fixed 256x256 uint8 images: each sample a dict of the raw ``np.ndarray`` (LitData's
numpy serializer: a small shape header and the bytes, ``np.frombuffer`` on read; no JPEG/PNG, no
compression) and the label, chunks of 160 samples (``CHUNK_SAMPLES``: why below), shuffled, items decoded one
at a time (``batch_decode=0``: the default decodes windows of items together, 5-6x slower on these arrays), a
``StreamingDataLoader`` with ``--workers`` processes and a cache with room for everything
(``max_cache_size``), so the warm epochs read local chunks. Run inside bench/out/peer-venv; prints one
``PEER_RESULT {json}`` line.
"""

from __future__ import annotations

import os
import time

from _common import Samples, arguments, emit, read_epochs

# 160 samples a chunk (31 MB), as shardio's bench shards: 16 chunks split evenly over 2 or 4 DataLoader
# workers. LitData memory-maps only chunks no other worker reads; for a chunk two workers share it reads
# the whole chunk file once per item (item_loader._load_batched_item), so 64 MB chunks (8, some shared)
# read at ~200 samples/s here.
CHUNK_SAMPLES = 160
SAMPLES: Samples | None = None
SHARDS = ""


def sample(index: int) -> dict:
    global SAMPLES
    if SAMPLES is None:  # once per optimize worker process
        SAMPLES = Samples(SHARDS)
    image, label = SAMPLES[index]
    return {"image": image, "cls": label}


def main() -> None:
    global SHARDS
    import litdata

    args = arguments(__doc__.splitlines()[0])
    # LitData moves chunks with obstore, built with client options of its own that never allow plain
    # http, so against the bench's loopback server (http://127.0.0.1) every upload fails with "builder
    # error: BadScheme". Real S3 is https; here the one missing option is added (in place: forked
    # workers inherit it). Nothing else of LitData's configuration is touched.
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
    SHARDS = os.environ["PEER_SHARDS"] = args.shards
    storage = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
    count = len(Samples(args.shards))
    os.makedirs(args.scratch, exist_ok=True)
    write_s = None
    if not args.skip_write:
        start = time.perf_counter()
        litdata.optimize(fn=sample, inputs=list(range(count)), output_dir=args.remote, chunk_size=CHUNK_SAMPLES,
                         num_workers=2, mode="overwrite", storage_options=storage, verbose=False,
                         start_method="fork")
        write_s = round(time.perf_counter() - start, 2)

    def loader(workers: int, cache: str) -> litdata.StreamingDataLoader:
        # batch_decode=0 (one item at a time): its "auto" decodes windows of items together and then
        # shuffles within them, 5-6x slower on these 196 KB arrays (local disk, 2 workers, shuffled:
        # auto 600-770, 0 2,700-4,400, 32 1,600-1,800, 160 540-670 samples/s).
        dataset = litdata.StreamingDataset(args.remote, cache_dir=cache, shuffle=True, max_cache_size="100GB",
                                           storage_options=storage, batch_decode=0)
        return litdata.StreamingDataLoader(dataset, batch_size=args.batch, num_workers=workers)

    emit({
        "name": "LitData",
        "version": litdata.__version__,
        "setting": "optimize: raw uint8 ndarray + int label, chunks of 160 samples, no compression; StreamingDataset "
                   f"shuffle=True, batch_decode=0, StreamingDataLoader, batch {args.batch}, max_cache_size 100GB",
        "samples": count,
        "write_s": write_s,
        **read_epochs(args, count, loader),
    })


if __name__ == "__main__":
    main()
