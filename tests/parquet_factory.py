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


def with_non_utf8_column_name(path, table: pa.Table, column: str) -> str:
    """``table`` written to ``path`` with ``column``'s name made invalid UTF-8 in the footer itself: the
    name is a thrift string there (in the schema and in each column chunk's path), its last two bytes
    replaced by 0xFF 0xFE, the length unchanged. (No arrow schema is stored beside it, which would say the
    name again, base64-encoded.)"""
    placeholder = column + "~~"
    renamed = table.rename_columns([placeholder if name == column else name for name in table.column_names])
    pq.write_table(renamed, str(path), row_group_size=4, store_schema=False)
    data = open(path, "rb").read()
    footer_start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    footer = data[footer_start:]
    assert placeholder.encode() in footer and placeholder.encode() not in data[:footer_start]
    with open(path, "wb") as f:
        f.write(data[:footer_start] + footer.replace(placeholder.encode(), column.encode() + b"\xff\xfe"))
    return str(path)
