"""The mechanism wing: the five families of a retention policy and their one registry.

    scoring/    which tokens are kept (`Scorer`; one module per scorer)
    cadence/    when a compaction happens (`Cadence`: `fixed`; `newline`)
    routing/    which kept set each layer follows and how many tokens each keeps (`Routing`:
                `native`; `shared`, `per-layer`, `pyramidkv`, `adakv`; allocation.py: their math)
    state/      what a kept token is stored as (`State`: `full`; `merge`, `quant`)
    decoding/   how generation behaves on the cache (`Decoding`: `none`; `loop-guard`)
    registry.py the one lookup of every family: a name -> `MechanismSpec` (class, parameters, identity)
    composite.py `RetentionPolicy`: the five together, what the runtime's engine calls
                 (`retention.runtime.protocol.StepPolicy`); guard.py: `GuardedPolicy` for plugins

The wing imports the runtime below it (the cache a scorer reads) and the models (calibration);
nothing in the runtime imports the wing.
"""
