"""The cluster operator: ModelServer resources placed onto shared GPUs."""
