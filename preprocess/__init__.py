"""preprocess: the offline job that turns WebDataset image tars into shardio shards (Ray, Pillow-SIMD)."""
