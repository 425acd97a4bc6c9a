"""The RL math of elasticrl: toy tasks and their rewards, group-normalized advantages, losses.

``tasks`` is pure Python; ``advantages`` and ``loss`` are small torch functions with no state.
"""
