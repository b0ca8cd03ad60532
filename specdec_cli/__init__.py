"""specdec: run and measure exact speculative decoding."""

__version__ = "0.1.0"
