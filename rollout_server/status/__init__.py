"""Status: liveness, readiness, ``/info``, ``/is_sleeping`` and Prometheus metrics."""
