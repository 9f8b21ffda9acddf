"""Weight updates: HTTP, file, NCCL and CUDA IPC transports, and the weights' checksum (admin
routes)."""
