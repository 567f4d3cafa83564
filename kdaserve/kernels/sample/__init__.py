"""Sampling kernels: the sort-free top-k / top-p threshold."""

from kdaserve.kernels.sample.top_p import top_k_top_p_threshold

__all__ = ["top_k_top_p_threshold"]
