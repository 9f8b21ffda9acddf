"""Reward functions and multi-turn environments, found through Python entry points.

- ``rewards.registry``: ``load_reward(name)``, ``load_environment(name)``, ``list_registered()``.
- ``rewards.scoring``: ``RewardRunner`` scores completions with a weighted mix of reward functions
  under timeouts and an explicit failure policy.
- ``rewards.env``: the ``Environment`` base class, the ``@tool`` decorator, ``ToolResult``.
- ``rewards.episode``: ``run_episodes`` plays multi-turn tool-using episodes on token ids.
- ``rewards.chat``: ``HFChatFormat`` turns messages into token ids with a chat template.
- ``rewards.openreward_adapter``: environments served over the Open Reward Standard.
- ``rewards.errors``: ``PluginError``, the base of the errors the learner reports in one line.

Importing this package imports nothing heavy; each module imports what it needs.
"""
