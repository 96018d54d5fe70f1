"""The node agent: inventory, broker/, kubelet/, cluster/ and admin/, wired by agent.py."""
