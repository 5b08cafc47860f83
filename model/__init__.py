"""DeepSeek V4.1-Flash in plain PyTorch: configuration, number formats and modules.

This package is math only: no Ray, no network, no file I/O outside ``loader.py``,
and no cache buffers hidden inside modules (caches are explicit objects that the
engine owns and passes in).
"""
