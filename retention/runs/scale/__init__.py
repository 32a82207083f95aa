"""Scale-out: shards of a run, merging shard records, confirmation shards and the Ray launcher."""
