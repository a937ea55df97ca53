"""The reader's order, length and resume states, pinned for both layouts (one shape, aspect-ratio buckets).

For a single-shape and a bucketed dataset and a spread of (seed, epoch, rank, world size, workers,
drop_last, shuffle, window, block, order version), ``layout_golden.json`` holds what the reader gives: the
keys (and bucket) of every batch of an epoch, ``len(ds)``, ``state_dict()`` before, during and after it,
and the batches a resume from each of those states yields, at the same world size and at another. The
sequences are stored as sha256 digests of their JSON, the states whole (the dataset's random identity
written as ``"<identity>"``). A change to how the reader chooses its order must leave every value equal.

``SHARDIO_WRITE_LAYOUT_GOLDEN=1`` writes the file from the code under test instead of checking it: only
for a change that means to alter the order, with the reason in its commit.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import pytest
from bucket_fixtures import make_bucketed_dataset
from dataset_fixtures import make_dataset

from shardio import ShardDataset, ShardLoader
from shardio.read.mixing import MixedDataset
from shardio.read.selection import SampleSelection

GOLDEN = os.path.join(os.path.dirname(__file__), "layout_golden.json")
WRITE = os.environ.get("SHARDIO_WRITE_LAYOUT_GOLDEN") == "1"
BATCH = 4

# (seed, epoch, rank, world_size, num_workers, drop_last, shuffle, shuffle_window, shuffle_block, order_version)
COMBOS = [
    (0, 0, 0, 1, 0, False, False, None, None, None),
    (7, 0, 0, 1, 0, False, True, None, None, None),
    (7, 2, 1, 3, 0, False, True, None, None, None),
    (3, 1, 2, 4, 0, True, True, None, None, None),
    (5, 0, 1, 2, 0, False, True, 2, 3, None),
    (5, 1, 0, 2, 0, True, False, None, None, None),
    (9, 3, 1, 2, 0, False, True, 2, 2, 1),
    (11, 1, 1, 2, 2, False, True, 2, None, None),
]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("layouts")
    single = str(root / "single")
    make_dataset(single)
    bucketed = make_bucketed_dataset(str(root / "bucketed"))
    return {"single": single, "bucketed": bucketed}


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    if WRITE or not os.path.exists(GOLDEN):
        return {}
    with open(GOLDEN, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def recorded() -> Any:
    found: dict[str, Any] = {}
    yield found
    if WRITE:
        with open(GOLDEN, "w", encoding="utf-8") as f:
            json.dump(found, f, indent=1, sort_keys=True)
            f.write("\n")


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:24]


def batch_of(batch: dict[str, Any]) -> list[Any]:
    return [list(batch["__key__"]), batch.get("bucket"), list(batch["image"].shape)]


def plain_state(state: dict[str, Any], identity: str) -> dict[str, Any]:
    state = dict(state)
    if "dataset" in state:
        assert state["dataset"] == identity
        state["dataset"] = "<identity>"
    return state


def open_ds(path: str, combo: tuple, **changes: Any) -> ShardDataset:
    seed, _, rank, world_size, _, drop_last, shuffle, window, block, version = combo
    settings = {"rank": rank, "world_size": world_size, **changes}
    return ShardDataset(path, BATCH, shuffle=shuffle, seed=seed, drop_last=drop_last, shuffle_window=window,
                        shuffle_block=block, order_version=version, prefetch=0, **settings)


def an_epoch(ds: ShardDataset, workers: int) -> list[list[Any]]:
    source = ShardLoader(ds, num_workers=workers) if workers else ds
    return [batch_of(b) for b in source]


def characterise(path: str, combo: tuple) -> dict[str, Any]:
    _, epoch, rank, world_size, workers, *_ = combo
    ds = open_ds(path, combo)
    identity = ds.snapshot.identity
    out: dict[str, Any] = {"len": len(ds), "num_samples": ds.num_samples, "buckets": ds.buckets,
                           "bucket_sizes": ds.bucket_sizes, "shuffle_window": ds.shuffle_window,
                           "state_new": plain_state(ds.state_dict(), identity)}
    ds.set_epoch(epoch)
    out["state_pinned"] = plain_state(ds.state_dict(), identity)
    out["runs"] = digest(ds.runs().tolist())
    out["sample_order"] = digest(ds.sample_order().tolist())
    out["first_batch_positions"] = [ds.batch_positions(1).start, ds.batch_positions(1).stop] if len(ds) else None
    # The epoch whole, with states on the way (a loader with workers counts in the main process too).
    source = ShardLoader(ds, num_workers=workers) if workers else ds
    batches, states = [], {}
    cuts = {1, len(ds) // 2}
    for number, batch in enumerate(source, start=1):
        batches.append(batch_of(batch))
        if number in cuts:
            states[number] = ds.state_dict()
    assert len(batches) == len(ds)
    out["epoch"] = digest(batches)
    out["epoch_head"] = batches[0][0] if batches else None
    out["state_end"] = plain_state(ds.state_dict(), identity)
    out["states"] = {str(k): plain_state(s, identity) for k, s in sorted(states.items())}
    # The next epoch, counted on by itself.
    out["next_epoch"] = digest(an_epoch(ds, 0))
    out["state_next_end"] = plain_state(ds.state_dict(), identity)
    # Resumed from each state: the same world size, then one rank more (the state's rest dealt again).
    resumed = {}
    for number, state in sorted(states.items()):
        same = open_ds(path, combo)
        same.load_state_dict(state)
        after_load = plain_state(same.state_dict(), identity)
        same_batches = an_epoch(same, workers)
        wider = open_ds(path, combo, rank=rank, world_size=world_size + 1)
        wider.load_state_dict(state)
        wider_len = len(wider)
        wider_batches = an_epoch(wider, 0)
        resumed[str(number)] = {"after_load": after_load, "same": digest(same_batches),
                                "same_count": len(same_batches), "same_end": plain_state(same.state_dict(), identity),
                                "wider": digest(wider_batches), "wider_count": len(wider_batches),
                                "wider_len": wider_len, "wider_end": plain_state(wider.state_dict(), identity)}
        assert same_batches == batches[number:]  # at the same world size: the rest of the epoch exactly
    out["resumed"] = resumed
    # Placed by seek, as a mixer does.
    sought = open_ds(path, combo)
    sought.seek(epoch, len(ds) // 2)
    out["seek_state"] = plain_state(sought.state_dict(), identity)
    out["seek"] = digest(an_epoch(sought, 0))
    return out


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("layout", ["single", "bucketed"])
def test_order_length_and_states_are_pinned(datasets: dict[str, str], golden: dict[str, Any], recorded: Any,
                                            layout: str, combo: tuple) -> None:
    name = f"{layout}:" + "-".join(map(str, combo))
    found = json.loads(json.dumps(characterise(datasets[layout], combo)))
    recorded[name] = found
    if WRITE:
        return
    assert name in golden, f"{name} has no recorded values in {GOLDEN}"
    expected = golden[name]
    for key in sorted(set(expected) | set(found)):
        assert found.get(key) == expected.get(key), f"{name}: {key} changed"


@pytest.mark.parametrize("layout", ["single", "bucketed"])
def test_mixing_is_pinned(datasets: dict[str, str], golden: dict[str, Any], recorded: Any, layout: str) -> None:
    path = datasets[layout]
    parts = [ShardDataset(path, BATCH, shuffle=True, seed=s, rank=1, world_size=2, prefetch=0) for s in (1, 2)]
    mixed = MixedDataset(parts, [0.7, 0.3], seed=4, batches_per_epoch=25)
    mixed.set_epoch(1)
    batches, state = [], None
    for number, batch in enumerate(mixed, start=1):
        batches.append([*batch_of(batch), batch["__source__"]])
        if number == 9:
            state = mixed.state_dict()
    assert state is not None
    identity = parts[0].snapshot.identity
    again = MixedDataset([ShardDataset(path, BATCH, shuffle=True, seed=s, rank=1, world_size=2, prefetch=0)
                          for s in (1, 2)], [0.7, 0.3], seed=4, batches_per_epoch=25)
    again.load_state_dict(state)
    rest = [[*batch_of(b), b["__source__"]] for b in again]
    assert rest == batches[9:]
    found = json.loads(json.dumps({
        "epoch": digest(batches), "rest": digest(rest),
        "state": {**state, "sources": [plain_state(s, identity) for s in state["sources"]]},
        "next": digest([[*batch_of(b), b["__source__"]] for b in mixed]),
    }))
    name = f"mixed:{layout}"
    recorded[name] = found
    if not WRITE:
        assert found == golden[name], f"{name} changed"


@pytest.mark.parametrize("layout", ["single", "bucketed"])
def test_subset_is_pinned(datasets: dict[str, str], golden: dict[str, Any], recorded: Any, layout: str) -> None:
    path = datasets[layout]
    ds = ShardDataset(path, BATCH, shuffle=True, seed=6, rank=0, world_size=2, prefetch=0,
                      selection=SampleSelection(fraction=0.6, fraction_seed=3))
    identity = ds.snapshot.identity
    batches, state = [], None
    for number, batch in enumerate(ds, start=1):
        batches.append(batch_of(batch))
        if number == 3:
            state = ds.state_dict()
    again = ShardDataset(path, BATCH, shuffle=True, seed=6, rank=0, world_size=2, prefetch=0,
                         selection=ds.selection)
    again.load_state_dict(state)
    rest = [batch_of(b) for b in again]
    assert rest == batches[3:]
    found = json.loads(json.dumps({"len": len(ds), "bucket_sizes": ds.bucket_sizes, "epoch": digest(batches),
                                   "state": plain_state(state, identity)}))
    name = f"subset:{layout}"
    recorded[name] = found
    if not WRITE:
        assert found == golden[name], f"{name} changed"
