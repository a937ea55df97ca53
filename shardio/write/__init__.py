"""The write side of a dataset directory: its one protocol (lock, staging, the commit, retention, restore)
and the shard writer that stages files for it."""
