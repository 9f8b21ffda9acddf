"""Weight transfer from a trainer over vLLM's RL wire (``gloo``: the CPU twin of its NCCL engine)."""
