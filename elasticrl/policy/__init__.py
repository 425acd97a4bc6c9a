"""Policies trained by elasticrl: the tiny from-scratch transformer used by the demo and tests.

Importing this package does not import torch; ``elasticrl.policy.tiny`` does.
"""
