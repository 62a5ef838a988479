"""CUDA twins of the kernels in Triton, writing the same bytes as the CPU paths, and the dispatch that picks
them (route.py). Imported only where a GPU path is chosen."""
