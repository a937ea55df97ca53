"""The read side: a committed snapshot, epoch order and resume, batches, the shard cache, selections and
mixing; ``ShardDataset`` ties them together."""
