"""What the tests and the benchmarks share: real processes and servers to drive (kernels,
Jupyter servers, an S3 server, Unix users), the scripted CUDA driver that stands in for the
GPU on machines without one, fault points for the kill scenarios, and the GPU results file.

Not part of the package; importable from the repository's root, as pytest and the
benchmarks run.
"""
