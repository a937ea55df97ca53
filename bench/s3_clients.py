"""The object store itself, through two clients: the raw parallel GET ceiling, and s3fs against obstore.

``raw_get`` is the denominator of the reader's cold-epoch figure: the same shard objects fetched with
plain obstore GETs from a thread pool, bytes into memory and dropped, nothing written to disk. Two
shapes, the larger rate counts: whole objects one per thread (what a cache that downloads whole shards
can do at best) and 8 MB ranges of every object spread over the threads (which also saturates the
server when there are fewer objects than threads).

``compare_clients`` is the measurement the issue asks for before choosing a client: GET of one large
object, GET of many 200 KB objects (one at a time: latency; and concurrently, each client's own way:
``s3fs.cat`` of the list, obstore GETs from a thread pool), PUT of a large object. Same server, same
bytes, alternated client by client, median of the rounds.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["SAMPLE_BYTES", "compare_clients", "obstore_store", "raw_get", "s3fs_filesystem"]

SAMPLE_BYTES = 256 * 256 * 3  # one 256x256 RGB uint8 image: raw bytes/s -> samples/s equivalent
RANGE_BYTES = 8 << 20
THREADS = 8


def obstore_store(bucket: str, env: dict[str, str]) -> Any:
    """An obstore ``S3Store`` on ``bucket`` from the AWS variables of ``env`` (the bench's server)."""
    from obstore.store import S3Store

    return S3Store(
        bucket,
        endpoint=env["AWS_ENDPOINT_URL"],
        access_key_id=env["AWS_ACCESS_KEY_ID"],
        secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region=env["AWS_REGION"],
        client_options={"allow_http": True},
    )


def s3fs_filesystem(env: dict[str, str]) -> Any:
    import s3fs

    return s3fs.S3FileSystem(
        key=env["AWS_ACCESS_KEY_ID"],
        secret=env["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=env["AWS_ENDPOINT_URL"],
        client_kwargs={"region_name": env["AWS_REGION"]},
        use_listings_cache=False,
    )


def _timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    nbytes = fn()
    return time.perf_counter() - start, nbytes


def raw_get(store: Any, objects: dict[str, int], rounds: int = 3, threads: int = THREADS) -> dict[str, Any]:
    """Bytes/s of parallel GETs of ``objects`` (key -> size), both shapes, median of ``rounds`` each."""
    import obstore

    def whole() -> int:
        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(lambda key: len(obstore.get(store, key).bytes()), objects))

    ranges = [(key, start, min(RANGE_BYTES, size - start))
              for key, size in objects.items() for start in range(0, size, RANGE_BYTES)]

    def ranged() -> int:
        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(lambda r: len(obstore.get_range(store, r[0], start=r[1], length=r[2])), ranges))

    total = sum(objects.values())
    result: dict[str, Any] = {"objects": len(objects), "bytes": total, "threads": threads}
    for name, fn in (("whole_objects", whole), (f"ranges_{RANGE_BYTES >> 20}MB", ranged)):
        rates = []
        for _ in range(rounds):
            seconds, nbytes = _timed(fn)
            if nbytes != total:
                raise RuntimeError(f"raw GET read {nbytes} bytes of {total}")
            rates.append(total / seconds)
        result[name] = {"MB/s": round(statistics.median(rates) / 1e6, 1),
                        "samples/s": round(statistics.median(rates) / SAMPLE_BYTES, 1),
                        "rounds_MB/s": [round(r / 1e6, 1) for r in rates]}
    best = max(result[k]["MB/s"] for k in result if isinstance(result[k], dict))
    result["best_MB/s"] = best
    result["best_samples/s"] = round(best * 1e6 / SAMPLE_BYTES, 1)
    return result


def compare_clients(bucket: str, env: dict[str, str], rounds: int = 3, large_mb: int = 128,
                    small_count: int = 256, small_bytes: int = 200_000) -> dict[str, Any]:
    """GET / PUT rates of s3fs and obstore on the same objects of ``bucket`` (written here, under
    ``clients/``), medians of ``rounds`` alternated rounds."""
    import obstore

    store, fs = obstore_store(bucket, env), s3fs_filesystem(env)
    large = os.urandom(large_mb << 20)
    small = [os.urandom(small_bytes) for _ in range(small_count)]
    small_keys = [f"clients/small/{i:05d}" for i in range(small_count)]
    obstore.put(store, "clients/large", large)
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda kv: obstore.put(store, kv[0], kv[1]), zip(small_keys, small)))

    def fs_paths(keys: list[str]) -> list[str]:
        return [f"{bucket}/{k}" for k in keys]

    def ob_many(keys: list[str]) -> int:
        with ThreadPoolExecutor(THREADS) as pool:
            return sum(pool.map(lambda k: len(obstore.get(store, k).bytes()), keys))

    cases: dict[str, dict[str, Callable[[], int]]] = {
        f"GET one {large_mb} MB object": {
            "s3fs": lambda: len(fs.cat_file(f"{bucket}/clients/large")),
            "obstore": lambda: len(obstore.get(store, "clients/large").bytes()),
        },
        f"GET {small_count} x {small_bytes // 1000} KB, one at a time": {
            "s3fs": lambda: sum(len(fs.cat_file(p)) for p in fs_paths(small_keys)),
            "obstore": lambda: sum(len(obstore.get(store, k).bytes()) for k in small_keys),
        },
        f"GET {small_count} x {small_bytes // 1000} KB, concurrent": {
            "s3fs": lambda: sum(len(v) for v in fs.cat(fs_paths(small_keys)).values()),
            "obstore": lambda: ob_many(small_keys),
        },
        f"PUT one {large_mb} MB object": {
            "s3fs": lambda: (fs.pipe_file(f"{bucket}/clients/put-s3fs", large), len(large))[1],
            "obstore": lambda: (obstore.put(store, "clients/put-obstore", large), len(large))[1],
        },
    }
    out: dict[str, Any] = {}
    for case, clients in cases.items():
        rates: dict[str, list[float]] = {name: [] for name in clients}
        for _ in range(rounds):
            for name, fn in clients.items():
                seconds, nbytes = _timed(fn)
                rates[name].append(nbytes / seconds / 1e6)
        out[case] = {name: {"MB/s": round(statistics.median(r), 1), "rounds": [round(x, 1) for x in r]}
                     for name, r in rates.items()}
        out[case]["obstore / s3fs"] = round(out[case]["obstore"]["MB/s"] / out[case]["s3fs"]["MB/s"], 2)
    out["versions"] = _versions()
    for key in ["clients/large", "clients/put-s3fs", "clients/put-obstore", *small_keys]:
        obstore.delete(store, key)
    return out


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("obstore", "s3fs", "aiobotocore")}
