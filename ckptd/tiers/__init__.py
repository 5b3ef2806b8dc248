"""The storage tiers, one module each, behind the Tier interface in base.py."""
