"""Data preparation: sources, chat-template loss masks, the prepared-data format, and the
token-budget batching that capture and train both use."""
