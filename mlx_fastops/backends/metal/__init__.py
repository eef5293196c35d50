"""Metal backend: mx.fast.metal_kernel wrappers around metal/*.metal, one kernel family a module.

Each op function has the reference signature (mlx_fastops.backends.reference); an optional
`unsupported_<op>(**info)` returns why a static shape class must fall back to the reference.
"""
