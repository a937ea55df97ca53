"""The ``models:`` mapping: the two forms, the defaults, and each mistake refused naming the output and the key."""

from __future__ import annotations

import pytest
import yaml

from bucket_fixtures import make_bucketed_dataset
from dataset_fixtures import make_dataset, write_inputs
from preprocess.models.model_config import DEFAULT_BATCH_SIZE, RESERVED_NAMES, ModelSpec, parse_models
from shardio.errors import ConfigError
from shardio.read.batches import FIELDS
from shardio.read.bucket_order import Buckets
from shardio.read.dataset import ShardDataset
from shardio.read.mixing import MixedDataset


def models(text: str) -> tuple[ModelSpec, ...]:
    return parse_models(yaml.safe_load(text)["models"])


def test_a_string_and_a_mapping_give_specs_in_the_order_given():
    specs = models("""
models:
  text_embedding: my_models:make_text_encoder
  latent:
    fn: my_models.vae:Factory.make
    input: image
    batch_size: 4
    dtype: bfloat16
    device: cuda:1
""")
    assert specs == (
        ModelSpec(name="text_embedding", fn="my_models:make_text_encoder"),
        ModelSpec(name="latent", fn="my_models.vae:Factory.make", input="image", batch_size=4, dtype="bfloat16",
                  device="cuda:1"),
    )
    text = specs[0]
    assert (text.input, text.batch_size, text.dtype, text.device) == ("image", DEFAULT_BATCH_SIZE, None, "auto")
    assert (specs[1].module, specs[1].function) == ("my_models.vae", "Factory.make")
    assert specs[1].output_dict() == {"fn": "my_models.vae:Factory.make", "input": "image", "dtype": "bfloat16"}
    assert specs[1].to_dict()["batch_size"] == 4


def test_no_models_is_an_empty_tuple():
    assert parse_models(None) == ()
    assert parse_models({}) == ()


def test_a_spec_is_frozen():
    spec = ModelSpec(name="latent", fn="m:f")
    with pytest.raises(AttributeError):
        spec.batch_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(("entry", "words"), [
    ({"fn": "m:f", "batchsize": 4}, "models: latent: unknown key 'batchsize' (known: fn, input, batch_size"),
    ({"input": "image"}, "models: latent: fn is missing"),
    ({"fn": "m:f", "input": "video"}, "models: latent: input must be one of image, text, got 'video'"),
    ({"fn": "m:f", "batch_size": 0}, "models: latent: batch_size must be an integer >= 1, got 0"),
    ({"fn": "m:f", "batch_size": True}, "batch_size must be an integer >= 1, got True"),
    ({"fn": "m:f", "batch_size": "8"}, "batch_size must be an integer >= 1, got '8'"),
    ({"fn": "m:f", "dtype": "half"}, "models: latent: dtype must be one of float16, bfloat16"),
    ({"fn": "m:f", "device": "gpu"}, "models: latent: device must be one of auto, cpu, cuda, cuda:N, got 'gpu'"),
    ({"fn": "m:f", "device": "cuda:x"}, "device must be one of"),
    ({"fn": "make_vae"}, "models: latent: fn must be 'MODULE:FUNCTION' (e.g. my_models:make_vae), got 'make_vae'"),
    ({"fn": "my-models:make"}, "fn must be 'MODULE:FUNCTION'"),
    ({"fn": "m:f:g"}, "fn must be 'MODULE:FUNCTION'"),
    ({"fn": 3}, "fn must be 'MODULE:FUNCTION'"),
    ("m", "models: latent: fn must be 'MODULE:FUNCTION'"),
    (["m:f"], "models: latent: must be 'MODULE:FUNCTION' or a mapping with fn and options"),
])
def test_a_bad_entry_is_refused_naming_the_output_and_the_key(entry, words):
    with pytest.raises(ConfigError) as caught:
        parse_models({"latent": entry})
    assert words in str(caught.value)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_every_device_form_is_taken(device):
    assert parse_models({"latent": {"fn": "m:f", "device": device}})[0].device == device


@pytest.mark.parametrize("name", ["1latent", "my latent", "latent-vae", "latént", "", 3])
def test_an_output_name_must_be_an_ascii_identifier(name):
    with pytest.raises(ConfigError, match="must be an identifier"):
        parse_models({name: "m:f"})


@pytest.mark.parametrize("name", ["image", "bucket", "index", "__key__", "cls", "txt", "content_box", "__other__"])
def test_an_output_name_a_batch_already_carries_is_refused_saying_so(name):
    with pytest.raises(ConfigError) as caught:
        parse_models({name: "m:f"})
    assert f"output name {name!r} is a key every batch or sample already carries" in str(caught.value)


@pytest.mark.parametrize("name", ["jpg", "yuv", "JPG"])
def test_an_output_name_an_encodings_file_suffix_takes_is_refused(name):
    with pytest.raises(ConfigError, match=f"output name '{name}' would name its files as a shard's pixels are named "
                                          r"\(reserved: jpg, yuv\)"):
        parse_models({name: "m:f"})


def test_models_must_be_a_mapping():
    with pytest.raises(ConfigError, match="models must be a mapping of output names"):
        parse_models(["latent"])


def _keys(datasets) -> set[str]:
    keys: set[str] = set()
    for ds in datasets:
        keys |= set(next(iter(ds)))
        keys |= set(ds.sample(0))
    return keys


def test_the_reserved_names_cover_every_key_of_real_batches_and_samples(tmp_path):
    single = str(tmp_path / "single")
    make_dataset(single, (5, 3), json_field=True)
    bucketed = make_bucketed_dataset(str(tmp_path / "buckets"))
    pad = str(tmp_path / "pad")
    write_inputs(pad, (4,), lambda i, n, name: {"key": f"s{i:06d}", "tar": name, "member": f"{i}.jpg",
                                               "width": 8, "height": 8, "cls": i, "txt": "t", "json": None},
                 height=8, width=8, config={"height": 8, "width": 8, "mode": "pad"})
    datasets = [ShardDataset(path, 2, prefetch=0) for path in (single, bucketed, pad)]
    mixed = MixedDataset([ShardDataset(single, 2, prefetch=0), ShardDataset(pad, 2, prefetch=0)], [0.5, 0.5],
                         seed=1, batches_per_epoch=2)
    keys = _keys(datasets) | set(next(iter(mixed)))
    assert {"content_box", "bucket", "__source__", "index"} <= keys  # each kind of batch was seen
    assert keys | set(FIELDS) | set(Buckets.batch_defaults) <= set(RESERVED_NAMES)
