"""Inter-process messages (typed msgspec structs) and the ZeroMQ channels that carry them."""
