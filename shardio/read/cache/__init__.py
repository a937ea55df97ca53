"""A local cache of remote shards: its folder, its units of eviction, how a reader fills and reads it."""
