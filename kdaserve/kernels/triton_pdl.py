"""Programmatic dependent launch (PDL) inside Triton kernels (imports triton: load it lazily,
from the kernel modules only)."""

import triton
import triton.language as tl


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """With USE_PDL: wait for the previous kernel's writes (griddepcontrol.wait), then let the
    next PDL kernel start its preamble (launch_dependents). Nothing without it. Kernels that
    read a weight early load it before calling this."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
