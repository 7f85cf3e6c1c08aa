"""Attention of each request's last query rows (a verify pass) over its paged KV cache, each row
causal, the request's rows folded into one query group so the cache is read once for all of them."""
from .naive import causal_rows_naive
from .native import causal_rows_native, supports_causal_rows

__all__ = ["causal_rows_naive", "causal_rows_native", "supports_causal_rows"]
