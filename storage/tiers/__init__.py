"""Storage tiers, each behind the small ``Tier`` interface of ``base.py``."""
