"""Process groups and collectives: the rank's ParallelState (parallel_state.py) and the small
communication interface the layers call (comm.py). A leaf beside kernels: imports only config."""
