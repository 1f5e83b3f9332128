"""The reference table: BERT-Large, GPT-2 XL and Llama-7B-like on an A100 with PCIe 4.0.

    python benchmarks/paper_table.py [--json PATH] [--sweep] [--budgets 0.3,0.4]

Per model and budget: the seed's reported figure, the optimal (CP-SAT) and heuristic retention,
the LP bound, and the baselines, all simulated; with step time, peak and stall per planner.
"""

from reference_table import main

if __name__ == "__main__":
    raise SystemExit(main())
