"""Test-only shims that let Megatron-Core's MoE code run on CPU ranks (gloo).

Nothing here is imported by the package; see cpu_cuda.py.
"""
