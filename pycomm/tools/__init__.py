"""Tools that are neither the library nor a benchmark: the GPU check
(:mod:`pycomm.tools.gpu_check`, ``pycomm-bench gpu-check``), which builds
pycomm with CUDA, runs the GPU tests and the benchmarks, and reports."""
