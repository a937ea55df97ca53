"""The format: what a dataset directory holds and how its files are laid out. The spec (``spec``: its prose
and constants) and the modules of its ideas (``raw_shard``, ``version_rule``, ``buckets``, ``root_fields``,
``dataset_config``, ``names``, ``entries``, ``dataset_manifest``) are re-exported here, so
``from shardio.format import Manifest`` reads as the spec; the index (``index``), manifests on storage
(``manifests``) and the run report (``run_report``) are imported by name. The shard checksums the spec names
are storage's (``shardio.store.checksum``)."""

from shardio.format import (buckets, dataset_config, dataset_manifest, entries, names, raw_shard, root_fields,
                            spec, version_rule)
from shardio.format.buckets import *  # noqa: F403
from shardio.format.dataset_config import *  # noqa: F403
from shardio.format.dataset_manifest import *  # noqa: F403
from shardio.format.entries import *  # noqa: F403
from shardio.format.names import *  # noqa: F403
from shardio.format.raw_shard import *  # noqa: F403
from shardio.format.root_fields import *  # noqa: F403
from shardio.format.spec import *  # noqa: F403
from shardio.format.version_rule import *  # noqa: F403

# The spec's names and every idea's, as one public face.
__all__: list[str] = []
__all__ += spec.__all__
__all__ += raw_shard.__all__
__all__ += version_rule.__all__
__all__ += buckets.__all__
__all__ += root_fields.__all__
__all__ += dataset_config.__all__
__all__ += names.__all__
__all__ += entries.__all__
__all__ += dataset_manifest.__all__
