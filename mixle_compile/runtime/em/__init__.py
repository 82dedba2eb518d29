"""Expectation-maximisation for distribution models: the runtime's second path.

- :mod:`.model`: the model tree, its parameters, scoring and the M-step (torch-free numpy);
- :mod:`.plan`: what a plan asks of an EM rank (its statistics updates and their groups);
- :mod:`.fit`: the rank job the runtime's one skeleton (``runtime/rank.py``) runs, the data, and
  the single-process reference fit.
"""
