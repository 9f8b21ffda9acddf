"""Generation: ``POST /generate``, the native batch API the learner uses."""
