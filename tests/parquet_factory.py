"""Parquet files for tests, in the two layouts users hold, with the self-identifying images of tar_factory."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from tests.tar_factory import index_image, jpeg_bytes

__all__ = ["hf_table", "img2dataset_table", "write_parquet"]


def hf_table(indices, image=lambda i: jpeg_bytes(index_image(i))) -> pa.Table:
    """Hugging Face's layout: the image as a {bytes, path} struct, text, label, one more scalar; the same
    txt / cls / json as ``TarFactory.samples`` gives the tar of the same images."""
    indices = list(indices)
    return pa.table({
        "image": [{"bytes": image(i), "path": f"{i:06d}.jpg"} for i in indices],
        "text": [f"caption {i}" for i in indices],
        "label": pa.array(indices, pa.int64()),
        "index": indices,
    })


def img2dataset_table(indices, failed=()) -> pa.Table:
    """img2dataset's layout: key, jpg bytes (null for a failed download), caption, status, error_message."""
    indices = list(indices)
    return pa.table({
        "key": [f"{i:06d}" for i in indices],
        "jpg": pa.array([None if i in failed else jpeg_bytes(index_image(i)) for i in indices], pa.binary()),
        "caption": [f"caption {i}" for i in indices],
        "status": ["failed_to_download" if i in failed else "success" for i in indices],
        "error_message": pa.array(["HTTP Error 404: Not Found" if i in failed else None for i in indices],
                                  pa.string()),
        "width": [320] * len(indices),
    })


def write_parquet(path, table: pa.Table, row_group_size: int = 4) -> str:
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)
