"""The run layer: build a job from its config, train it, checkpoint it, keep its directory.

Nothing is imported here: the CLI imports :mod:`hookexp.run.rundir` before composing the config, and
``python -m hookexp --help`` must not import torch.
"""
