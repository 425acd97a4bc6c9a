"""elasticrl: elastic, Ray-free RL post-training of LLMs across many nodes with torch.distributed.

Importing the package is cheap: torch, grpc and the engines are imported by the modules that
need them, so ``elasticrl --help`` and the coordinator start fast.
"""

__version__ = "0.1.0"
