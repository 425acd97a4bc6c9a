"""Training side of an RL node: the iteration loop, torch.distributed plumbing, checkpoints."""
