"""The store's state: the KVState pytree, its buckets (the flat layout), keys paired with
values, and values placed on devices."""
