"""The resize-mode table has one row per mode the config accepts, and agrees with the format on crops."""

from __future__ import annotations

from preprocess.config import BUCKET, RESIZE_MODES
from preprocess.image.resize_modes import RESIZE_MODE_TABLE, resize_mode
from shardio.format import UNCROPPED_MODES


def test_one_row_per_config_mode() -> None:
    assert tuple(mode.name for mode in RESIZE_MODE_TABLE) == RESIZE_MODES


def test_only_bucket_picks_a_bucket_and_uncropped_modes_write_no_crop() -> None:
    assert [mode.name for mode in RESIZE_MODE_TABLE if mode.picks_bucket] == [BUCKET]
    assert {mode.name for mode in RESIZE_MODE_TABLE if not mode.writes_crop} == set(UNCROPPED_MODES)


def test_bucket_crops_as_center_crop() -> None:
    target, content = (96, 64), (129.0, 64.0)
    assert resize_mode(BUCKET).kept_box(target, content) == resize_mode("center_crop").kept_box(target, content)
