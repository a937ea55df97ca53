"""The job's config (``preprocess.config``) in ``mode: bucket``: the keys, their checks, the resolved list stored and
read back."""

from __future__ import annotations

import pytest

from preprocess.image.buckets import derive_buckets
from preprocess.config import JobConfig, load_config
from shardio.errors import ConfigError


def test_derived_list_is_resolved_and_stored() -> None:
    cfg = JobConfig(mode="bucket")
    assert cfg.buckets == derive_buckets(256, 256)
    stored = cfg.output_dict()
    assert stored["buckets"] == [list(b) for b in derive_buckets(256, 256)]
    assert stored["bucket_step"] == 16 and stored["bucket_max_ratio"] == 3.0


def test_other_modes_store_no_bucket_keys() -> None:
    for mode in ("center_crop", "pad", "stretch"):
        assert not {"buckets", "bucket_step", "bucket_max_ratio"} & JobConfig(mode=mode).to_dict().keys()


def test_explicit_list_from_yaml(tmp_path) -> None:
    path = tmp_path / "b.yaml"
    path.write_text("mode: bucket\nheight: 256\nwidth: 256\nbuckets: [[256, 256], [192, 320], [320, 192]]\n")
    cfg = load_config(str(path))
    assert cfg.buckets == [(256, 256), (192, 320), (320, 192)]
    assert cfg.output_dict()["buckets"] == [[256, 256], [192, 320], [320, 192]]


def test_step_and_ratio_from_yaml_and_flags(tmp_path) -> None:
    path = tmp_path / "b.yaml"
    path.write_text("mode: bucket\nbucket_step: 32\n")
    cfg = load_config(str(path), {"bucket_max_ratio": 2})
    assert cfg.bucket_max_ratio == 2.0 and isinstance(cfg.bucket_max_ratio, float)
    assert cfg.buckets == derive_buckets(256, 256, 32, 2.0)


def test_a_rerun_reads_the_stored_list_back() -> None:
    stored = JobConfig(mode="bucket", buckets=[[256, 256], [128, 512]]).to_dict()
    again = load_config(base=stored)
    assert again.buckets == [(256, 256), (128, 512)]
    assert again.to_dict() == stored  # the same config bytes, so the same config hash


def test_a_stored_list_is_kept_even_if_the_default_derivation_differs() -> None:
    # A list that derive_buckets would not give (an older default, or one listed by hand) is read as stored.
    stored = JobConfig(mode="bucket").to_dict()
    stored["buckets"] = [[256, 256], [224, 288], [288, 224]]
    assert load_config(base=stored).buckets == [(256, 256), (224, 288), (288, 224)]


def test_another_mode_over_a_bucketed_dataset_differs_by_mode_not_by_an_error() -> None:
    stored = JobConfig(mode="bucket").to_dict()
    cfg = load_config(overrides={"mode": "center_crop"}, base=stored)
    assert cfg.mode == "center_crop" and cfg.buckets is None  # the job refuses it for its mode


@pytest.mark.parametrize("values, words", [
    ({"mode": "center_crop", "buckets": [[256, 256]]}, "buckets is for mode: bucket only"),
    ({"mode": "bucket", "buckets": [[256, 256], [256, 256]]}, r"buckets\[1\] \[256, 256\] is listed twice"),
    ({"mode": "bucket", "bucket_step": 0}, "bucket_step must be an integer >= 1"),
    ({"mode": "bucket", "bucket_max_ratio": 0.9}, "bucket_max_ratio must be a number >= 1"),
    ({"mode": "bucket", "bucket_step": 512}, "bucket_step 512 is larger than the budget's side"),
])
def test_bad_bucket_keys_are_refused_with_the_key(values, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        JobConfig(**values)


def test_unknown_mode_lists_bucket() -> None:
    with pytest.raises(ConfigError, match="center_crop, pad, stretch, bucket"):
        JobConfig(mode="buckets")


def test_per_bucket_configs_are_centre_crops_of_each_shape() -> None:
    cfg = JobConfig(mode="bucket", buckets=[[256, 256], [192, 320]], resample="lanczos", draft=False)
    one = cfg.bucket_config(1)
    assert (one.mode, one.height, one.width, one.resample, one.draft) == ("center_crop", 192, 320, "lanczos", False)
    assert cfg.bucket_config(1) is one  # made once
    assert cfg.bucket_of(1600, 1000) == 1 and cfg.bucket_of(1000, 1000) == 0
    assert cfg.max_side == 320


def test_configs_buckets_yaml_over_its_own_dataset_is_the_same_config() -> None:
    # The nightly rerun names the file again: its `buckets: null` derives the list the dataset stores.
    first = load_config("configs/buckets.yaml")
    assert first.buckets == derive_buckets(256, 256) and len(first.buckets) == 15
    again = load_config("configs/buckets.yaml", base=first.to_dict())
    assert again.output_dict() == first.output_dict()


def test_a_config_listing_more_buckets_than_a_dataset_holds_is_refused_at_load(tmp_path) -> None:
    """Bucket ids are stored as uint16 (``shard_bucket``): 65,537 buckets can never be committed, so the run
    is refused before it reads an input or writes a file, naming the config file and the limit."""
    from typer.testing import CliRunner

    from preprocess.cli import app
    from shardio.format import MAX_BUCKETS

    too_many = [(h, w) for h in range(1, 10) for w in range(1, 8193)][:MAX_BUCKETS + 1]
    config = tmp_path / "many.yaml"
    config.write_text("mode: bucket\nbuckets: [" + ", ".join(f"[{h}, {w}]" for h, w in too_many) + "]\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(tmp_path / "nothing-*.tar"), "--output", str(out),
                                      "--config", str(config), "-q"])
    said = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert str(config) in said and "65,537 buckets" in said and "65,536" in said and "uint16" in said, said
    assert not out.exists()
    with pytest.raises(ConfigError, match="65,537 buckets"):
        JobConfig(mode="bucket", buckets=too_many)
    assert len(JobConfig(mode="bucket", buckets=too_many[:MAX_BUCKETS]).buckets) == MAX_BUCKETS
