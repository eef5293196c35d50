"""Op implementations: `reference` (pure MLX, runs everywhere), `metal`, `cuda`.

Every backend module has the same shape: the ops of mlx_fastops.ops with the reference
signatures (a backend may lack some: the reference runs them), optional `unsupported_<op>(**info)`
checks naming why a static shape class falls back, and `DECODE_PATH`: None, or the backend's
whole-model decode path, which the patcher reaches only through the protocol below.
"""


class DecodePath:
    """Protocol of a backend's whole-model decode path (CUDA: backends/cuda/step.py).

    block(fused_block, disabled) -> (fast, None) or (None, reason)
        Per modules.FusedBlock, at patch time. fast(x, cache) returns the block's output, or None
        where it does not take this call (the FusedBlock then composes its ops); it is only
        called for caches of the types fast.cache_types.
    install(model, fasts, disabled) -> (installed or None, [(fusion, status, note)])
        Once, after every block was offered (fasts: block() results, None where refused): what
        the path needs on the model (its cache class through model.make_cache, a compiled
        step). The rows go into the patch report (where "model"). installed.remove() undoes the
        changes on unpatch, installed.restore() redoes them when the parked fused modules are
        swapped back in.
    `disabled` is the set of fusion names switched off for this patch (config.FUSIONS); for install
    `prefill` only where the user switched it off (the tuner judges it by prompt chunks: its verdict
    does not reach the decode path).
    parts: the fusions the path fuses, each of which switched off refuses every block (the tuner
    keeps them on wherever it keeps fast_decode).
    """

    parts = ()

    def block(self, fused_block, disabled):
        raise NotImplementedError

    def install(self, model, fasts, disabled):
        raise NotImplementedError
