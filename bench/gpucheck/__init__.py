"""The steps of ``make gpu-check`` (``bench/gpu_check.py``), one module each."""
