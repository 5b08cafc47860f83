"""The inference runtime: the engine over explicit caches, their bytes, batching, sampling, speculation.

``engine`` runs the pools' work (CED prefill, bounded replays, batched decode,
speculative verify and rollback, restore) over the byte-exact caches of ``cache``;
``serialize`` turns a cache into stored chunks and window state; ``batcher`` batches
requests continuously; ``sampling`` picks tokens; ``speculative`` drafts with DSpark
and verifies losslessly.
"""
