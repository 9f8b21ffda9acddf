"""The built-in reward functions and the example environment.

They are registered through this project's own entry points (``pyproject.toml``), exactly like a
third-party plugin, so ``load_reward("math_accuracy")`` finds them the same way it finds yours.
"""
