"""Mosaic Streaming on the bench's images: ``MDSWriter`` to the S3 server, then ``StreamingDataset`` epochs.

Fastest setting for fixed 256x256 uint8 images: the ``ndarray:uint8:256,256,3`` column (static dtype
and shape: the raw bytes, no header, ``np.frombuffer`` on read; no JPEG/PNG, no compression) and an
``int`` label, 64 MB shards uploaded as they close, shuffled (py1e, the default), a torch ``DataLoader``
with each of ``--workers`` process counts (one per process; the bench tries several: the best warm rate is the
row), no ``cache_limit`` (the warm epochs read local shards). Mosaic reads the S3 endpoint from
``S3_ENDPOINT_URL``. Run inside bench/out/peer-venv; prints one ``PEER_RESULT {json}`` line.
"""

from __future__ import annotations

import os
import time

from _common import Samples, arguments, emit, read_epochs


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    os.environ["S3_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"]
    import streaming
    from streaming import MDSWriter, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()
    samples = Samples(args.shards)
    count = len(samples)
    os.makedirs(args.scratch, exist_ok=True)
    columns = {"image": "ndarray:uint8:256,256,3", "cls": "int"}
    write_s = None
    if not args.skip_write:
        start = time.perf_counter()
        with MDSWriter(out=(os.path.join(args.scratch, "staging"), args.remote), columns=columns,
                       compression=None, size_limit=64 << 20, max_workers=4) as writer:
            for index in range(count):
                image, label = samples[index]
                writer.write({"image": image, "cls": label})
        write_s = round(time.perf_counter() - start, 2)

    def loader(workers: int, cache: str) -> DataLoader:
        clean_stale_shared_memory()
        dataset = StreamingDataset(remote=args.remote, local=cache, batch_size=args.batch, shuffle=True)
        return DataLoader(dataset, batch_size=args.batch, num_workers=workers)

    emit({
        "name": "Mosaic Streaming",
        "version": streaming.__version__,
        "setting": "MDSWriter: ndarray:uint8:256,256,3 + int, 64MB shards, no compression; StreamingDataset "
                   f"shuffle=True (py1e), DataLoader, batch {args.batch}, no cache_limit",
        "samples": count,
        "write_s": write_s,
        **read_epochs(args, count, loader),
    })


if __name__ == "__main__":
    main()
