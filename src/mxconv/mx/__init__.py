"""MX numerics: element codes, scale rules and FP4 packing (``formats``), quantize / dequantize and
the exact error sums (``numerics``), the fast torch chunk path (``fast``) and INT4 packing
(``int4``). torch is imported by the functions that compute, never at import time of ``formats``."""
