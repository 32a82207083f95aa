"""Scale-out launchers: confirmation shards (`confirm_shard.py`) and the Ray launcher (`ray.py`).

They sit above the jobs they launch (`retention.runs.jobs`); a run's shards (`retention.runs.shard`)
and their merge (`retention.runs.merge`) are the runs' own, below them.
"""
