"""Sleep: ``POST /sleep`` and ``POST /wake_up`` (admin routes)."""
