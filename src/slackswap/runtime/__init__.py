"""torch in the loop: the profiler (one step to an ActivationGraph, real or fake), the executor
that runs a closed plan, the host pool and copy lanes, and the checkpoint policies. torch is
imported here only, never by the planning core."""
