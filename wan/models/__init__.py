"""The Flax NNX modules of the WAN models and what only they use. `wan.programs` builds the
programs from them and `aot` lowers those; the runtime never imports this package (it reads
weights and runs executables by name), which `tests/test_boundaries.py` checks."""
