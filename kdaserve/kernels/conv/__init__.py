"""Depthwise causal short convolution (KDA q/k/v conv) kernels."""
