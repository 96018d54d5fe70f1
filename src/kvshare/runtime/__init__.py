"""The per-worker KV pool that lives inside every model-server process."""
