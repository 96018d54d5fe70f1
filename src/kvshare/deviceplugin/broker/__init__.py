"""The memory broker: the books of every GPU's memory and the pools leasing it, the policy
that decides who gets what, the unix-socket server that speaks to pools, start-up turns
and admin requests, the checks of who a pool is and what its pod may hold, and lease
enforcement. Knows nothing of Kubernetes: what it knows of pods it is handed."""
