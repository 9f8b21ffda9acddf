"""Thin routers, one per feature: parse the request, call ``RolloutService``, return a model."""
