"""protocol: what makes a KV-retention result believable.

Data loading, frozen splits, grading, paired statistics, pre-registration and reports. This package
never imports `retention` so that it can grade and test the outputs of any engine.
"""
