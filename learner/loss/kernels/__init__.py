"""GPU kernels of the learner (Triton). Import lazily: triton is optional on CPU machines."""
