"""A resume state names the dataset it was taken on (the identity its roots carry: ``shardio.format.spec``,
"Identity"): another dataset refuses it naming both identities, whatever its content or generations; a
copy or a move of the same directory resumes it exactly; a bucketed dataset's state is refused by a single-shape
dataset."""

from __future__ import annotations

import shutil

import pytest
from tests.bucket_fixtures import make_bucketed_dataset
from tests.dataset_fixtures import indices, make_dataset, set_root_field
from tests.layout_fixtures import READ_BUCKET_SIZES, READ_BUCKETS
from tests.legacy_format import as_legacy
from tests.read.test_dataset_generations import add_input

from shardio import ShardDataset, ShardFormatError, open_dataset
from shardio.format.manifests import list_generations, read_root

STOP_AFTER = 5


def make(directory: str, **kwargs) -> ShardDataset:
    return ShardDataset(directory, 6, shuffle=True, seed=7, **kwargs)


def state_after(directory: str, batches: int = STOP_AFTER) -> tuple[dict, list[list[int]]]:
    """A state taken after ``batches`` batches, and the batches the rest of that epoch holds."""
    dataset = make(directory)
    iterator = iter(dataset)
    for _ in range(batches):
        next(iterator)
    state = dataset.state_dict()
    return state, [indices(b).tolist() for b in iterator]


@pytest.fixture
def taken(tmp_path) -> tuple[str, dict, list[list[int]]]:
    directory = str(tmp_path / "a")
    make_dataset(directory)
    state, rest = state_after(directory)
    return directory, state, rest


def test_every_generation_of_a_dataset_names_the_one_identity_of_its_first_commit(tmp_path) -> None:
    directory = str(tmp_path / "a")
    make_dataset(directory)
    add_input(directory, "more.tar", 117, 10)
    add_input(directory, "again.tar", 127, 10)
    identities = {read_root(directory, g)["dataset"] for g in list_generations(directory)}
    assert len(identities) == 1 and len(identities.pop()) == 32
    other = str(tmp_path / "b")
    make_dataset(other)
    assert read_root(other)["dataset"] != read_root(directory)["dataset"]


@pytest.mark.parametrize("other", ["same inputs", "jpeg"])
def test_a_state_of_another_dataset_is_refused_naming_both(taken, tmp_path, other) -> None:
    directory, state, _ = taken
    elsewhere = str(tmp_path / "b")
    make_dataset(elsewhere, encoding="jpeg" if other == "jpeg" else "raw")  # same samples, counts, generation
    dataset = make(elsewhere)
    with pytest.raises(ValueError, match=rf"state was taken on dataset {state['dataset']} \(generation 1\), and "
                                         rf"{elsewhere} is dataset {read_root(elsewhere)['dataset']}"):
        dataset.load_state_dict(state)


@pytest.mark.parametrize("written", ["now", "before identities"])
def test_a_state_of_another_dataset_is_not_said_to_name_a_collected_generation(tmp_path, written) -> None:
    directory = str(tmp_path / "a")
    make_dataset(directory)
    add_input(directory, "more.tar", 117, 10)
    add_input(directory, "again.tar", 127, 10)
    state, _ = state_after(directory)
    assert state["generation"] == 3
    elsewhere = str(tmp_path / "b")
    make_dataset(elsewhere)  # generation 1 only
    if written == "before identities":
        as_legacy(elsewhere)  # named by its config, the same as the state's dataset's
    with pytest.raises(ValueError, match=r"state was taken on dataset \w+ \(generation 3\)"):
        make(elsewhere).load_state_dict(state)


@pytest.mark.parametrize("how", ["copy", "move"])
def test_a_copy_or_a_move_of_the_directory_resumes_exactly(taken, tmp_path, how) -> None:
    directory, state, rest = taken
    there = str(tmp_path / "elsewhere" / "a")
    (shutil.copytree if how == "copy" else shutil.move)(directory, there)
    dataset = make(there)
    dataset.load_state_dict(state)
    assert [indices(b).tolist() for b in dataset] == rest
    assert dataset.state_dict()["dataset"] == state["dataset"]


def test_a_state_saved_before_identities_still_resumes(taken) -> None:
    directory, state, rest = taken
    older = {k: v for k, v in state.items() if k != "dataset"}
    dataset = make(directory)
    dataset.load_state_dict(older)
    assert [indices(b).tolist() for b in dataset] == rest


def test_a_dataset_written_before_identities_is_named_by_its_config_until_its_next_commit(tmp_path) -> None:
    directory = str(tmp_path / "a")
    make_dataset(directory)
    as_legacy(directory)  # a version 1/2 manifest: no identity of its own
    state, rest = state_after(directory)
    assert state["dataset"].startswith("config:")
    jpeg = str(tmp_path / "jpeg")
    make_dataset(jpeg, encoding="jpeg")
    jpeg_dataset = make(jpeg)
    with pytest.raises(ValueError, match=r"state was taken on dataset config:"):
        jpeg_dataset.load_state_dict(state)

    add_input(directory, "more.tar", 117, 10)  # the upgrade commit draws the identity
    drawn = read_root(directory)["dataset"]
    assert len(drawn) == 32
    resumed = make(directory)
    resumed.load_state_dict(state)  # its generation is kept, and names the config identity it was taken on
    assert [indices(b).tolist() for b in resumed] == rest
    assert make(directory).state_dict()["dataset"] == drawn


def test_a_forged_identity_is_refused_at_load(taken) -> None:
    directory = taken[0]
    set_root_field(directory, "dataset", "../../not-an-identity")
    with pytest.raises(ShardFormatError, match=r"manifest\.json: \"dataset\" is '\.\./\.\./not-an-identity', not "
                                               r"an identity"):
        open_dataset(directory)


@pytest.mark.parametrize("fence", ["ABCDEF0123456789", "0123", 12345])
def test_a_forged_names_fence_is_refused_at_load(taken, fence) -> None:
    """Spec, "Fencing names": a root's ``fence`` is 16 lower-case hex digits or absent."""
    directory = taken[0]
    set_root_field(directory, "fence", fence)
    with pytest.raises(ShardFormatError, match=r"manifest\.json: \"fence\" is .*, not a fence \(16 lower-case hex"):
        open_dataset(directory)


def test_the_state_names_the_generation_it_pins_not_the_newest(taken) -> None:
    directory, state, _ = taken
    add_input(directory, "more.tar", 117, 10)
    dataset = make(directory)
    dataset.load_state_dict(state)
    assert dataset.state_dict()["dataset"] == state["dataset"]


def test_a_bucketed_state_is_refused_by_a_single_shape_dataset(tmp_path) -> None:
    """A state of the other layout (its identity removed, its counts made to fit) is refused by its kind."""
    make_dataset(str(tmp_path / "single"))
    bucketed = make_bucketed_dataset(str(tmp_path / "buckets"), buckets=READ_BUCKETS, samples=READ_BUCKET_SIZES,
                                     samples_per_shard=6)
    single = ShardDataset(str(tmp_path / "single"), 4)
    state = ShardDataset(bucketed, 4).state_dict()
    state.pop("dataset", None)
    state["samples"] = single.num_samples
    state["generation"] = single.snapshot.generation
    with pytest.raises(ValueError, match="bucketed"):
        single.load_state_dict(state)
