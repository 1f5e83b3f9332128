"""Property tests draw the same examples on every run: a suite that passes or fails by chance
tells nothing (the fuzzer, benchmarks/fuzz.py, is where new graphs are explored)."""

from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.load_profile("deterministic")
