"""Generated stubs of the kubelet's PodResources API v1 (``make proto``)."""
