"""HTTP API process: OpenAI-compatible and TGI-native endpoints."""
