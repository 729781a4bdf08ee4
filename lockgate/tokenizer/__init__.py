"""Tokenizers (no torch) and incremental detokenization with stop strings."""
