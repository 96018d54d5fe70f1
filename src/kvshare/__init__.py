"""kvshare: elastic GPU memory sharing for LLM model servers on Kubernetes."""

__version__ = "0.1.0"
