"""The engine: ``core.EngineCore`` (one scheduler + one runner = the step) and ``process``, the
scheduler process that drives it for the server. The server reaches it only through ``ipc``."""
