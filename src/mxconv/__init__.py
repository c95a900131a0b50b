"""mxconv: turn MoE checkpoints into kernel-ready MX-format weights, offline, and verify them."""

__version__ = "0.1.0"
