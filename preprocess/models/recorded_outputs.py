"""The job's side of model outputs: each model identified against what the dataset records for its output before
anything is touched, a finished input's outputs checked against the driver's models, and its dtypes and per-bucket
shapes folded into the root's ``outputs`` (spec "Model outputs"). ``preprocess.job`` asks these; the models
themselves run in the tasks or in replicas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from preprocess.models.loading import load_model
from preprocess.models.model_config import ModelSpec
from shardio.errors import ConfigError
from shardio.format.model_outputs import OutputSpec
from shardio.write.directory import Committer

if TYPE_CHECKING:
    from preprocess.worker import InputResult

__all__ = ["check_worker_models", "fold_outputs", "identify_models", "made_by"]


def identify_models(specs: Sequence[ModelSpec], recorded: Sequence[OutputSpec], rewrite_output: str | None,
                    where: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Each model of ``models:`` loaded once here and identified (``preprocess.models.identity``): returns each
    output's identity as a root records it, and a warning per model with neither weights nor version (another
    model under the same name would go unnoticed). A model whose identity differs from the one ``recorded`` for
    its output (the dataset at ``where``) is refused (ConfigError naming the output and both identities), unless
    it is ``rewrite_output``'s: its outputs would mix with the other model's."""
    if not specs:
        return {}, []
    from preprocess.models.identity import ModelIdentity, model_identity  # torch: a run with models only

    found_by_name = {o.name: o.identity for o in recorded}
    identities: dict[str, dict[str, Any]] = {}
    warnings: list[str] = []
    for spec in specs:
        identity = model_identity(spec, load_model(spec))
        found = found_by_name.get(spec.name)
        if found is not None and spec.name != rewrite_output and ModelIdentity.from_dict(found) != identity:
            raise ConfigError(
                f"{where}: models: {spec.name}: the dataset's outputs were made by {ModelIdentity.from_dict(found)}, "
                f"this run's model is {identity}; outputs of two models never mix in one dataset: use the dataset's "
                "model, or a new --output")
        if identity.unversioned:
            warnings.append(f"models: {spec.name}: {spec.fn} has no weights digest nor version string: a changed "
                            "model under the same name would go unnoticed (give the callable a `version` attribute)")
        identities[spec.name] = identity.to_dict()
    return identities, warnings


def made_by(recorded: Sequence[OutputSpec], name: str, identity: dict[str, Any]) -> bool:
    """Whether the recorded output ``name`` is the model of ``identity``'s."""
    from preprocess.models.identity import ModelIdentity  # torch: a run with models only

    wanted = ModelIdentity.from_dict(identity)
    return any(o.name == name and ModelIdentity.from_dict(o.identity) == wanted for o in recorded)


def check_worker_models(result: InputResult, identities: dict[str, dict[str, Any]]) -> None:
    """An input whose models were not the ones the driver identified (a node
    with another copy of a model's code or weights) fails instead of being committed: its outputs would mix two
    models."""
    if result.error is not None:
        return
    for output in result.outputs:
        expected = identities.get(output["name"])
        if expected is not None and output.get("identity") != expected:
            result.error = (f"processed on node {result.node} with another model for output {output['name']!r} "
                            f"({output.get('identity')}) than the run's ({expected}); not committed: install the "
                            "same model on every node and rerun")
            result.shards, result.failures = [], []
            return


def fold_outputs(committer: Committer, result: InputResult, identities: dict[str, dict[str, Any]]) -> None:
    """An input's output dtypes and per-bucket shapes into the root's ``outputs``: a bucket's first shape is
    recorded; another dtype, or another shape for a bucket that has one, is a ConfigError naming the output (the
    model returns one per dataset and bucket). A new dataset's outputs are made from the first input with
    samples (its dtypes are the models' own)."""
    index = committer.index
    buckets = len(index.buckets)
    current = {o.name: o for o in index.outputs}
    made: list[OutputSpec | None] = []
    for info in result.outputs:
        name, dtype = info["name"], info["dtype"]
        output = current.get(name)
        if output is not None and name in identities and output.identity != identities[name]:
            # Only a rewrite's output gets here (any other model of another identity is refused first): its
            # record starts anew from the new model's first input with samples (its dtype, its shapes).
            output = None
        if output is None and dtype is not None:
            identity = identities.get(name) or info["identity"]  # the driver's; else what the worker ran
            output = OutputSpec(name, info["input"], dtype, (None,) * buckets, identity)
        if output is not None:
            if dtype is not None and dtype != output.dtype:
                raise ConfigError(f"models: {name}: the model returned {dtype} for {result.input}, the dataset's "
                                  f"output is {output.dtype}: an output has one dtype (set dtype: to cast to one)")
            for bucket, shape in info["shapes"]:
                try:
                    output = output.with_shape(bucket, shape)
                except ValueError as e:
                    raise ConfigError(f"models: {name}: {result.input}: {e}") from e
        made.append(output)
    if all(o is not None for o in made) and tuple(made) != index.outputs:
        index.set_outputs(tuple(o for o in made if o is not None))
