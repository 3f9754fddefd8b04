"""Response caches: an exact cache and a semantic cache in front of the upstreams.

`ResponseCache` (cache.py) is the one object the proxy talks to; the rest are its parts.
"""
