"""The node agent: GPU inventory, kubelet device plugin, memory broker, metrics."""
