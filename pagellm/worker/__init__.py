"""One model replica: the paged KV tensors (``CacheEngine``) and the forward pass (``ModelRunner``)."""
