"""The OpenAI-compatible ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``."""
