"""Inference-time steering: raise a reward at sampling time, with no training.

One file per method (best_of_n, fk, svdd, guidance, reno), each running on the model-agnostic core in `core.py`.
"""
