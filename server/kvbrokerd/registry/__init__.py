"""The registry: the caches this daemon serves (host segments and imported device memory) and the leases of the
model servers that own them."""
