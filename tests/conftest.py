"""Property tests draw the same examples on every run: a suite that passes or fails by chance
tells nothing (the fuzzer, benchmarks/fuzz.py, is where new graphs are explored)."""

from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.load_profile("deterministic")


def pytest_configure(config) -> None:
    """Under pytest-xdist each worker runs torch with one thread: two workers with a thread per
    core each would oversubscribe the cores and slow every test (results do not change)."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("MKL_NUM_THREADS", "1")
