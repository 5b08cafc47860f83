"""The tiered KV store: named, checksummed byte objects in host RAM, Redis and SSD.

It knows nothing of the model's math: it stores what the engine serialises.
"""
