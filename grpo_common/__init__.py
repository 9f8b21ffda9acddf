"""Helpers shared by the learner, the rollout server and the rewards: the bottom layer, importing none of them."""
