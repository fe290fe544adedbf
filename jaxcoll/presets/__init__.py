"""Measured profiles shipped with jaxcoll (``Profile.preset`` loads them)."""
