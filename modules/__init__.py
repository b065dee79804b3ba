"""The DiTs (Wan2.2, HunyuanVideo-1.5) as plain torch modules with a staged API.

Knows nothing of caching, sharding or device placement. Arrives with the modules issue.
"""
