"""Running a model over samples: outputs equal the model applied to each sample's pixels, per bucket; batches full
across inputs; each input's order kept; a failing batch fails its inputs only; a broken contract stops the run."""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np
import pytest
import torch

from preprocess.models.model_config import ModelSpec
from preprocess.models.runner import ModelOutputs, ModelRunner, resolve_device
from shardio.errors import ConfigError, InputError
from toy_models import LatentNet, caption_hash, latent_of

BUCKETS = {0: (16, 24), 1: (24, 16), 2: (16, 16)}
INPUTS = {"a.tar": 7, "b.tar": 11, "c.tar": 5}  # 23 samples, batches of 4: no bucket is a multiple of 4
LATENT = ModelSpec(name="latent", fn="toy_models:make_latent", batch_size=4, device="cpu")
TEXT = ModelSpec(name="text", fn="toy_models:make_text", input="text", batch_size=3, device="cpu")


def samples() -> list[tuple[str, int, int, np.ndarray]]:
    """(input, index, bucket, pixels) of every sample, each sample's pixels drawn from its own number."""
    out = []
    number = 0
    for name, count in INPUTS.items():
        for index in range(count):
            bucket = (number * 7) % 3
            height, width = BUCKETS[bucket]
            pixels = np.random.default_rng(number).integers(0, 256, (height, width, 3), dtype=np.uint8)
            out.append((name, index, bucket, pixels))
            number += 1
    return out


@pytest.fixture
def latent_run() -> tuple[LatentNet, dict[str, ModelOutputs]]:
    model = LatentNet()
    runner = ModelRunner(LATENT, model)
    for name, index, bucket, pixels in samples():
        runner.add(name, index, pixels, bucket)
    return model, runner.finish()


def test_outputs_equal_the_model_applied_to_each_samples_pixels_per_bucket(latent_run):
    _, outputs = latent_run
    expected: dict[str, list] = {name: [] for name in INPUTS}
    for name, index, bucket, pixels in samples():
        expected[name].append((index, bucket, latent_of(pixels)))
    assert set(outputs) == set(INPUTS)
    for name, out in outputs.items():
        assert out.failure is None
        assert out.indices == [index for index, _, _ in expected[name]]  # in the order added
        assert out.buckets == [bucket for _, bucket, _ in expected[name]]
        for value, (_, bucket, want) in zip(out.values, expected[name]):
            height, width = BUCKETS[bucket]
            assert value.dtype == np.float16 and value.shape == (4, height // 8, width // 8)
            np.testing.assert_array_equal(value, want)


def test_batches_are_full_across_inputs_and_one_short_batch_a_bucket_at_the_end(latent_run):
    model, _ = latent_run
    per_bucket = Counter(bucket for _, _, bucket, _ in samples())
    assert sorted(model.batch_sizes, reverse=True) == sorted(
        [4] * sum(n // 4 for n in per_bucket.values()) + [n % 4 for n in per_bucket.values() if n % 4], reverse=True)
    assert model.batch_sizes[:sum(n // 4 for n in per_bucket.values())] == [4] * sum(
        n // 4 for n in per_bucket.values())  # every full batch ran while samples came, the short ones at the end


def test_a_batch_holds_samples_of_several_inputs():
    seen: list[list[str]] = []

    def model(captions: list[str]) -> torch.Tensor:
        seen.append(list(captions))
        return caption_hash(captions)

    runner = ModelRunner(TEXT, model)
    for name, count in (("a.tar", 2), ("b.tar", 2), ("c.tar", 2)):
        for index in range(count):
            runner.add(name, index, f"{name} {index}")
    outputs = runner.finish()
    assert seen == [["a.tar 0", "a.tar 1", "b.tar 0"], ["b.tar 1", "c.tar 0", "c.tar 1"]]
    for name, out in outputs.items():
        np.testing.assert_array_equal(np.stack(out.values), caption_hash([f"{name} 0", f"{name} 1"]).numpy())
        assert out.values[0].dtype == np.float32 and out.values[0].shape == (8,)


def test_an_input_is_handed_back_once_ended_and_through():
    runner = ModelRunner(TEXT, caption_hash)
    for index in range(4):
        runner.add("a.tar", index, f"a {index}")
    runner.end_input("a.tar")
    assert runner.take_done() == {}  # its fourth caption waits for a full batch
    runner.add("b.tar", 0, "b 0")
    runner.add("b.tar", 1, "b 1")
    done = runner.take_done()
    assert list(done) == ["a.tar"] and done["a.tar"].indices == [0, 1, 2, 3]
    assert runner.take_done() == {}
    assert list(runner.finish()) == ["b.tar"]


def test_samples_added_out_of_order_come_back_in_the_order_added():
    runner = ModelRunner(TEXT, caption_hash)
    for index in (5, 2, 9, 0):
        runner.add("a.tar", index, f"a {index}", bucket=index % 2)
    out = runner.finish()["a.tar"]
    assert out.indices == [5, 2, 9, 0] and out.buckets == [1, 0, 1, 0]
    np.testing.assert_array_equal(np.stack(out.values), caption_hash([f"a {i}" for i in (5, 2, 9, 0)]).numpy())


def marked(pixels: np.ndarray) -> np.ndarray:
    pixels = pixels.copy()
    pixels[0, 0, 0] = 255
    return pixels


def test_a_model_raising_fails_the_inputs_of_that_batch_only():
    seen: list[tuple[int, ...]] = []

    def model(pixels: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(pixels.shape))
        if (pixels[:, 0, 0, 0] == 255).any():
            raise RuntimeError("CUDA out of memory")
        return torch.zeros(len(pixels), 2)

    spec = ModelSpec(name="latent", fn="m:make", batch_size=2, device="cpu")
    runner = ModelRunner(spec, model)
    plain = np.zeros((16, 24, 3), np.uint8)
    tall = np.zeros((24, 16, 3), np.uint8)
    runner.add("a.tar", 0, tall, bucket=1)  # waits in bucket 1's queue
    runner.add("a.tar", 1, marked(plain), bucket=0)
    runner.add("b.tar", 0, plain, bucket=0)  # bucket 0 is full: the batch of a and b fails
    runner.add("b.tar", 1, plain, bucket=0)  # b failed: never run
    runner.add("c.tar", 0, tall, bucket=1)
    outputs = runner.finish()
    assert seen == [(2, 16, 24, 3), (1, 24, 16, 3)]  # a's sample of bucket 1 was dropped, c's ran alone
    for name in ("a.tar", "b.tar"):
        failure = outputs[name].failure
        assert isinstance(failure, InputError) and failure.input == name and not failure.lasting
        assert failure.reason == ("model output 'latent' (m:make) raised RuntimeError: CUDA out of memory on a batch "
                                  "of 2 samples of the inputs a.tar, b.tar")
        assert isinstance(failure.__cause__, RuntimeError)
        assert outputs[name].values == []
    assert outputs["c.tar"].failure is None and outputs["c.tar"].indices == [0]


def test_a_later_batch_of_another_shape_in_a_bucket_is_refused_naming_both_shapes():
    sides = iter([4, 4, 5])

    def model(pixels: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(pixels), next(sides))

    runner = ModelRunner(ModelSpec(name="latent", fn="m:make", batch_size=1, device="cpu"), model)
    runner.add("a.tar", 0, np.zeros((16, 24, 3), np.uint8), bucket=2)
    runner.add("a.tar", 1, np.zeros((24, 16, 3), np.uint8), bucket=1)  # another bucket: a shape of its own
    with pytest.raises(ConfigError) as caught:
        runner.add("a.tar", 2, np.zeros((16, 24, 3), np.uint8), bucket=2)
    assert str(caught.value) == ("models: latent: bucket 2: the model returned samples of [5], its first batch [4]: "
                                 "an output has one shape per bucket")


@pytest.mark.parametrize(("returned", "words"), [
    (lambda b: np.zeros((len(b), 2)), "models: latent: bucket 0: the model returned ndarray, not a tensor [B, ...]"),
    (lambda b: torch.zeros(len(b) - 1, 2), "the model returned [1, 2] for a batch of 2 samples: the first "
                                           "dimension must be 2"),
    (lambda b: torch.tensor(1.0), "the model returned [] for a batch of 2 samples"),
])
def test_what_is_no_batch_of_tensors_is_refused(returned, words):
    runner = ModelRunner(ModelSpec(name="latent", fn="m:make", batch_size=2, device="cpu"), returned)
    runner.add("a.tar", 0, np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(ConfigError) as caught:
        runner.add("a.tar", 1, np.zeros((8, 8, 3), np.uint8))
    assert words in str(caught.value)


def test_a_floating_output_is_cast_to_the_configured_dtype():
    spec = ModelSpec(name="text", fn="m:make", input="text", batch_size=2, dtype="float16", device="cpu")
    runner = ModelRunner(spec, caption_hash)
    runner.add("a.tar", 0, "x")
    runner.add("a.tar", 1, "y")
    values = np.stack(runner.finish()["a.tar"].values)
    assert values.dtype == np.float16
    np.testing.assert_array_equal(values, caption_hash(["x", "y"]).half().numpy())


def test_an_integer_output_is_not_cast_to_a_floating_dtype():
    spec = ModelSpec(name="text", fn="m:make", input="text", batch_size=1, dtype="float16", device="cpu")
    runner = ModelRunner(spec, lambda captions: torch.zeros(len(captions), 3, dtype=torch.int64))
    with pytest.raises(ConfigError, match="models: text: the model returned int64, dtype is float16 "
                                          r"\(only a floating output is cast to a floating dtype\)"):
        runner.add("a.tar", 0, "x")


@pytest.mark.parametrize("dtype", [torch.uint16, torch.complex64, torch.uint32])
def test_a_dtype_no_output_stores_is_refused(dtype):
    """Stored as it is, a uint16 output would read back as bfloat16 (both are ``<u2`` bits)."""
    runner = ModelRunner(ModelSpec(name="text", fn="m:make", input="text", batch_size=1, device="cpu"),
                         lambda captions: torch.zeros(len(captions), 3, dtype=dtype))
    with pytest.raises(ConfigError, match=f"models: text: the model returned {str(dtype)[6:]}, which no output "
                                          "stores"):
        runner.add("a.tar", 0, "x")


def test_a_dtype_that_changes_between_batches_is_refused_without_a_dtype_configured():
    dtypes = iter([torch.float32, torch.float16])
    runner = ModelRunner(ModelSpec(name="text", fn="m:make", input="text", batch_size=1, device="cpu"),
                         lambda captions: torch.zeros(len(captions), 3, dtype=next(dtypes)))
    runner.add("a.tar", 0, "x")
    with pytest.raises(ConfigError, match="models: text: the model returned float16, its first batch float32"):
        runner.add("a.tar", 1, "y")


def test_a_bfloat16_output_comes_back_as_its_raw_bits():
    spec = ModelSpec(name="text", fn="m:make", input="text", batch_size=2, dtype="bfloat16", device="cpu")
    runner = ModelRunner(spec, caption_hash)
    runner.add("a.tar", 0, "x")
    values = runner.finish()["a.tar"].values[0]
    assert values.dtype == np.uint16
    want = caption_hash(["x"]).to(torch.bfloat16)[0]
    assert torch.equal(torch.from_numpy(values.view(np.int16)).view(torch.bfloat16), want)


def test_the_model_runs_in_inference_mode_in_eval_mode_and_its_outputs_are_kept_apart():
    class Reused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dropout = torch.nn.Dropout(0.5)
            self.register_buffer("out", torch.zeros(1, 2))
            self.calls = 0

        def forward(self, captions):
            assert torch.is_inference_mode_enabled() and not self.training
            self.calls += 1
            self.out.fill_(self.calls)
            return self.out  # the same buffer every call

    model = Reused().train()
    runner = ModelRunner(ModelSpec(name="text", fn="m:make", input="text", batch_size=1, device="cpu"), model)
    runner.add("a.tar", 0, "x")
    runner.add("a.tar", 1, "y")
    assert [v.tolist() for v in runner.finish()["a.tar"].values] == [[1.0, 1.0], [2.0, 2.0]]


def test_misuse_is_a_value_error():
    runner = ModelRunner(LATENT, LatentNet())
    with pytest.raises(ValueError, match="an image model takes uint8 pixels"):
        runner.add("a.tar", 0, np.zeros((8, 8, 3), np.float32))
    runner.add("a.tar", 0, np.zeros((8, 8, 3), np.uint8), bucket=0)
    with pytest.raises(ValueError, match="bucket 0 holds pixels of \\[8, 8, 3\\], got \\[8, 16, 3\\]"):
        runner.add("a.tar", 1, np.zeros((8, 16, 3), np.uint8), bucket=0)
    with pytest.raises(ValueError, match="a.tar: sample 0 added twice"):
        runner.add("a.tar", 0, np.zeros((8, 8, 3), np.uint8))
    runner.end_input("a.tar")
    with pytest.raises(ValueError, match="added after end_input"):
        runner.add("a.tar", 2, np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(ValueError, match="a text model takes captions"):
        ModelRunner(TEXT, caption_hash).add("a.tar", 0, b"bytes")


def test_the_device():
    assert resolve_device(LATENT) == torch.device("cpu")
    auto = ModelSpec(name="latent", fn="m:make")
    assert resolve_device(auto).type == ("cuda" if torch.cuda.is_available() else "cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError, match=f"models: latent: device cuda:{count} asked for, but this machine has "
                                          f"{count} CUDA device"):
        resolve_device(ModelSpec(name="latent", fn="m:make", device=f"cuda:{count}"))


def test_the_text_model_hashes_caption_bytes():
    want = np.frombuffer(hashlib.sha256("é".encode()).digest(), np.uint8)[:8] / 255
    np.testing.assert_allclose(caption_hash(["é"]).numpy()[0], want.astype(np.float32))
