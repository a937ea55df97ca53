"""Storage behind one small interface: the protocol, its backends (local files, S3-compatible object
storage) chosen by URL scheme, and what they share (the shard checksums, the one-writer lease, local
scratch)."""
