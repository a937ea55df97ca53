"""Rewriting one model output for every input (``preprocess run ... --rewrite-output NAME``): a new model for
an existing dataset (a new VAE, say) without mixing two models' outputs in one generation.

Why a rerun of every input rather than the model alone over the stored shards: an ``encoding: none`` dataset
keeps no pixels to run an image model on, and the job already knows how to replace an input's shards in one
commit and keep the old ones for the generations that list them (retention). So the rewrite lists every
committed input again and runs the job over all of them, with:

- **New names**: a fence (spec, "Fencing names") none of the dataset's files carries, drawn from the
  committed generation and the new model (``new_fence``), for every file it writes, so no file a current
  generation lists is written again: a reader mid-epoch on the old generation reads it whole, old outputs
  included, until retention collects them.
- **One commit, at the end**: a generation with some inputs' outputs from the new model and some from the
  old would mix two models; an input failing, a stop or a kill commits nothing (the files written are a
  dead run's, which the next run's cleaning removes), and the dataset stays as it was.
- **The output's record replaced**: the root records the new model's identity, dtype and shapes, and the
  config its ``models:`` entry; every other output must keep its model (checked as in any run).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from shardio.errors import ConfigError
from preprocess.inputs.resolve import InputFingerprint, ResolvedInputs
from preprocess.plan import largest_first_key

__all__ = ["check_rewrite", "rewrite_todo", "config_to_compare", "new_fence", "MISSING_NAMED"]

MISSING_NAMED = 5  # committed inputs a refused rewrite names (and how many more)


def check_rewrite(name: str, model_names: list[str], outputs: list[str], committed_inputs: Mapping[str, Any],
                  listed: set[str], prune: bool, where: str) -> None:
    """Refuse (ConfigError, exit 2, before anything is touched) a rewrite of ``name`` that the run cannot do
    whole: no such model in ``models:``, no such output in the dataset (``outputs``), ``--prune`` beside it,
    or a committed input not listed (its outputs would stay the old model's)."""
    if name not in model_names:
        raise ConfigError(f"--rewrite-output {name}: models: has no output {name!r} (it has "
                          f"{', '.join(model_names) or 'none'}): give the new model under that name")
    if name not in outputs:
        raise ConfigError(f"{where}: --rewrite-output {name}: the dataset has no output {name!r} (its outputs: "
                          f"{', '.join(outputs) or 'none'})")
    if prune:
        raise ConfigError(f"--rewrite-output {name}: not with --prune (prune first, then rewrite)")
    missing = sorted(set(committed_inputs) - listed)
    if missing:
        more = f" and {len(missing) - MISSING_NAMED} more" if len(missing) > MISSING_NAMED else ""
        raise ConfigError(f"{where}: --rewrite-output {name} runs the new model over every committed input, and "
                          f"{len(missing)} of them are not among the inputs: {', '.join(missing[:MISSING_NAMED])}"
                          f"{more}; list them all (their outputs would stay the old model's)")


def rewrite_todo(resolved: ResolvedInputs) -> list[tuple[str, InputFingerprint]]:
    """Every listed input, committed or not, largest first: all of them get the new model's output."""
    return sorted(((path, resolved.listed[path]) for path in resolved.paths), key=largest_first_key)


def config_to_compare(stored: dict[str, Any], wanted: dict[str, Any], name: str) -> dict[str, Any]:
    """The dataset's config as a rewrite of ``name`` compares it with the run's: that output's ``models:``
    entry taken from the run (it is what changes), every other key as stored."""
    models = stored.get("models")
    if not isinstance(models, dict) or name not in models or name not in (wanted.get("models") or {}):
        return stored
    return {**stored, "models": {**models, name: wanted["models"][name]}}


def new_fence(dataset: str, generation: int, name: str, identity: Mapping[str, Any]) -> str:
    """The fence of a rewrite of output ``name`` by the model of ``identity`` over generation ``generation`` of
    dataset ``dataset``: 16 lower-case hex digits (as a lease token), none of the dataset's files carries yet (a
    committed rewrite moves the generation on), and the same for a rerun of a rewrite that was killed, so that
    rerun writes what the uninterrupted one would have, byte for byte and name for name."""
    text = json.dumps([dataset, generation, name, dict(identity)], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
