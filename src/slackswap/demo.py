"""`make demo`: the reference workloads on an A100 with PCIe 4.0 at a 50% activation budget."""

from __future__ import annotations

from .reference_table import main

if __name__ == "__main__":
    raise SystemExit(main(["--demo"]))
