"""The memory broker: the books of every GPU's memory and the pools leasing it, the policy
that decides who gets what, and the unix-socket server that speaks to pools, start-up
turns and admin requests. Knows nothing of Kubernetes."""
