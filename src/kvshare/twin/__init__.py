"""The GPU twin: co-located engines on one simulated GPU of a named kind, running
kvshare's real books, policy and pools on a simulated clock, and the capacity at a
latency SLO that each way of sharing the GPU's memory reaches on a workload."""
