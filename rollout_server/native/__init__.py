"""vLLM's RL routes (pause/resume, weight transfer) on this server."""
